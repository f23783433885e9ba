"""The notebooks in notebooks/ run from top to bottom (small settings: SPECSIM_SMALL=1) and are stored clean."""
from __future__ import annotations

import pytest

from tests.conftest import REPO

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def test_the_what_if_studies_are_there():
    assert {p.stem for p in NOTEBOOKS} >= {"latency_vs_rate", "tune_policy", "bursty_traffic"}


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
    client = nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if any cell fails
    assert list(tmp_path.rglob("summary.csv"))  # the sweep ran and wrote its results where it was told


def test_bursty_traffic_falls_back_to_a_synthetic_workload_without_the_traces(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSIM_SMALL", "1")
    monkeypatch.setenv("SPECSIM_RESULTS", str(tmp_path))
    path = REPO / "notebooks" / "bursty_traffic.ipynb"
    notebook = nbformat.read(path, as_version=4)
    traces_line = 'TRACES = REPO.parent / "shared" / "traces" / "azure_llm_2023"'
    [cell] = [cell for cell in notebook.cells if traces_line in cell.source]
    cell.source = cell.source.replace(traces_line, f'TRACES = Path({str(tmp_path / "no-traces")!r})')
    nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    assert sorted(p.name for p in (tmp_path / "bursty_traffic").glob("synthetic_*.csv")) == [
        "synthetic_code_80.csv", "synthetic_conv_80.csv"]
    assert len(list((tmp_path / "bursty_traffic").rglob("summary.csv"))) == 2
