"""Shared fixtures: hand-written cost models, a user policy file, the tiny model pair, one torch thread per module,
denormal floats kept between modules, and the location of the shipped traces."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from simulator.inputs import TRACES  # the shipped traces (re-exported for the tests)

REPO = Path(__file__).resolve().parents[1]


def _flushes_denormals(torch) -> bool:  # noqa: ANN001 - the torch module, imported by a test or not at all
    """Whether torch flushes subnormal floats to zero (``torch.set_flush_denormal``, which has no getter): a subnormal
    times 1 comes out 0."""
    return (torch.tensor([1e-40]) * 1.0).item() == 0.0


@pytest.fixture(autouse=True)
def _torch_flush_denormal_off():
    """Every test ends with torch's flush-denormal setting (process-wide) off, as torch starts: the real engine and the
    profiler turn it on on the CPU (``profiles.models.forward``, a module fixture loading the tiny pair too), and a later
    test (hypothesis drawing subnormal floats) must not depend on whether one of them ran before it. Torch is not
    imported here: a test that never imports it costs nothing."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and _flushes_denormals(torch):
        torch.set_flush_denormal(False)


def write_cost_json(path: Path, target: float = 0.01, draft: float = 0.001, prefill: float = 0.0,
                    per_prompt_token: float = 0.0, per_batched_token: float = 0.0, per_context_token: float = 0.0,
                    overhead: float = 0.0, memory: dict | None = None, per_prompt_token_sq: float = 0.0) -> str:
    """A coefficient JSON (seconds): constant passes unless per-token terms are given."""
    data = {
        "target": {"base": target, "per_batched_token": per_batched_token, "per_context_token": per_context_token},
        "draft": {"base": draft, "per_batched_token": 0.0, "per_context_token": 0.0},
        "prefill": {"base": prefill, "per_prompt_token": per_prompt_token, "per_prompt_token_sq": per_prompt_token_sq},
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


@pytest.fixture
def every_other_policy(tmp_path) -> Path:
    """A user policy file registering ``every-other``: k for even request ids, 0 for odd ones."""
    path = tmp_path / "every_other.py"
    path.write_text(
        "import numpy as np\n"
        "from policies import Policy, register\n\n"
        "@register\n"
        "class EveryOther(Policy):\n"
        "    name = 'every-other'\n"
        "    def propose(self, view):\n"
        "        return np.where(view.request_ids % 2 == 0, self.k, 0)\n")
    return path


@pytest.fixture(scope="module", autouse=True)
def denormals_kept():
    """After each module, the CPU keeps denormal floats again: the profiler and the real engine flush them
    (:func:`profiles.models.forward.setup_device`), a process-wide setting that would break a later module's exact
    float checks (hypothesis refuses to run without subnormals)."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_flush_denormal(False)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests, as the tiny pair's fixture sets (threads fight over a shared machine's
    cores); the count before is restored after the module."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair():
    """The tiny random-weight draft/target pair (:func:`profiles.models.pairs.load_pair`), on one CPU thread."""
    torch = pytest.importorskip("torch")
    from profiles.models.pairs import load_pair

    torch.set_num_threads(1)
    return load_pair("tiny")
