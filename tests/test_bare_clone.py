"""A clone with nothing beside it runs everything: the repository copied (its tracked and unignored files) to a
temporary folder, where ``disagg``, ``bench`` and a Mooncake prefix-caching run read only what the repository
ships (the traces under simulator/inputs/traces, the profiles under profiles/data)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def repository_files() -> list[str]:
    """The files a clone holds: git's tracked and untracked-but-not-ignored files (what the next commit can hold)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                         capture_output=True, check=True).stdout.decode()
    return sorted({name for name in out.split("\0") if name and (REPO / name).is_file()})


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The repository's files in ``<tmp>/alone/specsim``: nothing beside it (no ``../shared``)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the clone's file list comes from git")
    root = tmp_path_factory.mktemp("alone") / "specsim"
    for name in repository_files():
        target = root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)
    assert sorted(p.name for p in root.parent.iterdir()) == ["specsim"]
    return root


def run(clone: Path, *args: str) -> subprocess.CompletedProcess:
    """``python run_sim.py ARGS`` in the clone, its own packages first on the path (not this checkout's)."""
    env = {**os.environ, "PYTHONPATH": str(clone), "MPLBACKEND": "Agg"}
    result = subprocess.run([sys.executable, "run_sim.py", *args], cwd=clone, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_the_clone_imports_its_own_packages(clone):
    env = {**os.environ, "PYTHONPATH": str(clone)}
    out = subprocess.run([sys.executable, "-c", "import simulator, policies, profiles; "
                          "print(simulator.__file__, policies.__file__, profiles.__file__)"],
                         cwd=clone, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert all(Path(path).is_relative_to(clone) for path in out)


def test_disagg_runs_on_the_shipped_azure_trace(clone):
    out = clone / "results" / "disagg"
    run(clone, "disagg", "--num-requests", "150", "--splits", "4:4", "--rates-per-gpu", "4",
        "--policies", "no-spec", "--workers", "1", "--quiet", "--out", str(out))
    goodput = (out / "goodput.csv").read_text()
    assert "co-located" in goodput and "4P:4D" in goodput


def test_bench_runs_on_the_shipped_azure_lengths(clone):
    result = run(clone, "bench", "--sizes", "300", "--policies", "no-spec", "--calls", "0")
    assert "Azure conv trace lengths" in result.stdout


def test_a_mooncake_prefix_caching_run_reads_the_shipped_hash_ids(clone):
    out = clone / "results" / "mooncake"
    run(clone, "simulate", "--trace", "simulator/inputs/traces/mooncake/conversation_trace.jsonl",
        "--num-requests", "300", "--enable-prefix-caching", "--replicas", "2", "--router", "prefix-aware",
        "--scheduler", "chunked-prefill",
        "--profile", "profiles/data/h200-vllm__llama-3.1-8b__llama-3.2-1b.csv", "--out", str(out))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == 300 and summary["prefix_cache_hit_rate"] > 0
