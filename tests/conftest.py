"""Shared fixtures: hand-written cost models and the location of the shared traces."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "traces"


def write_cost_json(path: Path, target: float = 0.01, draft: float = 0.001, prefill: float = 0.0,
                    per_prompt_token: float = 0.0, per_batched_token: float = 0.0, per_context_token: float = 0.0,
                    overhead: float = 0.0, memory: dict | None = None) -> str:
    """A coefficient JSON (seconds): constant passes unless per-token terms are given."""
    data = {
        "target": {"base": target, "per_batched_token": per_batched_token, "per_context_token": per_context_token},
        "draft": {"base": draft, "per_batched_token": 0.0, "per_context_token": 0.0},
        "prefill": {"base": prefill, "per_prompt_token": per_prompt_token},
        "overhead": {"base": overhead},
        "method": "hand-written",
    }
    if memory is not None:
        data["memory"] = memory
    path.write_text(json.dumps(data))
    return str(path)


@pytest.fixture
def cost_json(tmp_path):
    """Factory: ``cost_json(**coefficients)`` -> path of a coefficient JSON in tmp_path."""
    counter = iter(range(1_000_000))

    def make(**kwargs) -> str:
        return write_cost_json(tmp_path / f"cost{next(counter)}.json", **kwargs)

    return make


def trace(name: str) -> Path:
    """A shared trace file, or skip the test when the shared folder is absent."""
    path = TRACES / name
    if not path.exists():
        pytest.skip(f"shared trace {path} not present")
    return path
