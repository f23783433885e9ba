"""The prepared GPU run (``profiles/gpu_run.sh``) rehearsed end to end on the CPU with the tiny pair (``TINY=1``):
every stage runs and exits 0, the outputs are the files the device machine can send back (at most 8, flat), the
pass profiles say they were made with the optimized forward, and the rest is packed in ``bundle.tgz``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.conftest import REPO  # noqa: E402

pytestmark = pytest.mark.torch


def test_the_prepared_gpu_run_rehearses_every_stage_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "TINY": "1", "OUT": str(out), "PYTHON": sys.executable, "TOTAL_SECONDS": "240"}
    done = subprocess.run(["bash", "profiles/gpu_run.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    log = (out / "gpu_run.log").read_text()
    assert done.returncode == 0, done.stderr[-2000:]
    statuses = [line for line in log.splitlines() if "exit status" in line]
    assert len(statuses) == 6 and all("exit status 0:" in line for line in statuses), log[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all(p.is_file() for p in out.iterdir())
    assert files == ["bundle.tgz", "gpu_run.log"] + sorted(f"tiny{i}-optimized__tiny-target__tiny-draft.{ext}"
                                                            for i in (0, 1) for ext in ("csv", "meta.json"))
    meta = json.loads((out / "tiny0-optimized__tiny-target__tiny-draft.meta.json").read_text())
    assert meta["forward"] == "optimized" and meta["complete"] and meta["optimized_forward"]["fused_projections"]
    with tarfile.open(out / "bundle.tgz") as bundle:
        assert sorted(bundle.getnames()) == ["forward_check.json", "single_request_7b.csv",
                                             "tiny-optimized-engine__tiny.csv", "tiny-optimized-engine__tiny.meta.json",
                                             "validate_7b.tgz"]
