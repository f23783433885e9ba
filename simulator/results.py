"""Writing results atomically: a file appears complete or not at all; a folder is wholly one run or visibly
incomplete.

Each file is written to a temporary name in the same folder (``.<name>.<random>.tmp``), flushed and fsynced,
given ordinary permissions (0666 less the umask, 0644 by default; not mkstemp's 0600), then renamed over the
final name (``os.replace`` is atomic on POSIX). A run directory is complete when ``summary.json`` exists: it
is written last, and removed first when a run starts writing into a folder that holds an older one.

Output folders: :func:`prepare_out_dir` checks one before any work (``--out ""``, a file, a folder that cannot
be made or written, a folder holding another kind of result), takes its lock (:class:`FolderLock`: two commands
writing into one folder at once are refused, naming the other's process) and removes the temporary files a killed run
left behind. Each command writes one kind of result (:data:`RESULT_KINDS`: a run, a sweep, a tune, ...) and records it
in the folder (``.specsim-kind``); a folder that holds another kind (recorded, or told by its files when it was
written before kinds were recorded) is refused, so that a run's ``summary.json`` never lands among a sweep's files,
nor a sweep's ``summary.csv`` beside a run's.
"""
from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import tempfile
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable

from policies.errors import UserError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import pandas as pd


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


#: Permissions of every result file: what ``open()`` would give (0644 under the usual umask 022).
FILE_MODE = 0o666 & ~_umask()
#: The lock file of an output folder.
LOCK_NAME = ".specsim.lock"
#: The file that records which kind of result a folder holds (:func:`folder_kind`).
KIND_NAME = ".specsim-kind"
#: Each kind of result a command writes into its folder -> (what it is called, the files that tell it in a folder
#: written before kinds were recorded). Tried in this order: a replay also holds a run's files and a compare's, a tune
#: a sweep's.
RESULT_KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "replay": ("compare's replay of a vLLM result", ("replayed_workload.csv",)),
    "tune": ("tune", ("tune.csv",)),
    "advise": ("advise study", ("advice.json", "ranking.csv")),
    "run": ("simulate run", ("summary.json", "requests.csv", "requests.parquet")),
    "sweep": ("sweep", ("summary.csv", "runs")),
    "compare": ("compare", ("compare.csv",)),
    "disagg": ("disagg study", ("cells.csv", "goodput.csv")),
    "demo": ("demo", ("crossover.png",)),
    "validate": ("validate run", ("validate.csv",)),
}


def atomic_write(path: str | Path, write: Callable[[IO[str]], None]) -> None:
    """Call ``write(f)`` on a temporary text file beside ``path``, then rename it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "w", newline="") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: str | Path, data: Any) -> None:
    """Atomic JSON (NaN written as null, keys in insertion order)."""
    atomic_write(path, lambda f: json.dump(_clean(data), f, indent=2))


def write_csv(path: str | Path, frame: pd.DataFrame) -> None:
    """Atomic CSV without the index; floats written with full precision (round-trips bit for bit)."""
    atomic_write(path, lambda f: frame.to_csv(f, index=False, float_format="%.17g"))


def _clean(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


# -- output folders ------------------------------------------------------------------------------------------
def folder_kind(folder: Path) -> tuple[str, str] | None:
    """The kind of result ``folder`` holds (:data:`RESULT_KINDS`) and what tells it (its record, or a file of that
    kind); None for a folder that holds none."""
    try:
        recorded = (folder / KIND_NAME).read_text().strip()
    except OSError:
        recorded = ""
    if recorded in RESULT_KINDS:
        return recorded, KIND_NAME
    for kind, (_, files) in RESULT_KINDS.items():
        for name in files:
            if (folder / name).exists():
                return kind, name
    return None


def check_out_dir(out: str | Path | None, flag: str = "--out", kind: str | None = None) -> Path:
    """The output folder ``out``, made if missing, after checking that results can be written there; any problem
    (empty name, a file, cannot be made, not writable, another ``kind`` of result there: :func:`folder_kind`) is a
    one-line :class:`UserError` before any work. ``kind``: what the command writes, recorded in the folder."""
    if out is None or not str(out).strip():
        raise UserError(f"{flag}: an output folder is required (got {str(out or '')!r})")
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {out}: exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{flag} {out}: cannot create the output folder ({exc.strerror or exc})") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".specsim-probe.", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UserError(f"{flag} {out}: cannot write into the output folder ({exc.strerror or exc})") from None
    if kind is not None:
        held = folder_kind(path)
        if held is not None and held[0] != kind:
            told = f"recorded in {KIND_NAME}" if held[1] == KIND_NAME else f"its {held[1]}"
            raise UserError(f"{flag} {out}: holds a {RESULT_KINDS[held[0]][0]}'s results ({told}); a "
                            f"{RESULT_KINDS[kind][0]} would mix its files with them: choose another folder")
        if held is None:
            atomic_write(path / KIND_NAME, lambda f: f.write(kind + "\n"))
    return path


class FolderLock:
    """An exclusive lock on an output folder (``flock`` on the folder itself, released when the process ends,
    however it ends); while held, ``<folder>/.specsim.lock`` names the holding process, and is removed on release.
    A second command into the same folder is refused with a line naming the holder."""

    def __init__(self, folder: Path, flag: str = "--out") -> None:
        self.folder, self.flag = folder, flag
        self.fd: int | None = None

    def __enter__(self) -> "FolderLock":
        if self.fd is not None:  # already held (prepare_out_dir took it): ``with lock:`` releases it at the end
            return self
        fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                try:
                    holder = (self.folder / LOCK_NAME).read_text().strip() or "?"
                except OSError:
                    holder = "?"
                raise UserError(f"{self.flag} {self.folder}: another run (process {holder}) is writing into this "
                                "folder; wait for it to finish or choose another folder") from None
            raise
        self.fd = fd
        try:
            (self.folder / LOCK_NAME).write_text(f"{os.getpid()}\n")
        except OSError:
            pass
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            (self.folder / LOCK_NAME).unlink(missing_ok=True)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def remove_stale_temporaries(*folders: Path) -> int:
    """Delete the temporary files (``.NAME.*.tmp``, ``.NAME.tmp.EXT``) a killed run left in ``folders``; call it
    holding the folder's lock, so that no live writer owns them. Returns how many were removed."""
    removed = 0
    for folder in folders:
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            if p.name.startswith(".") and (p.name.endswith(".tmp") or ".tmp." in p.name) and p.is_file():
                p.unlink(missing_ok=True)
                removed += 1
    return removed


def prepare_out_dir(out: str | Path | None, kind: str, flag: str = "--out") -> tuple[Path, FolderLock]:
    """Check ``out`` for a result of ``kind`` (:func:`check_out_dir`), lock it and clean a killed run's temporaries;
    returns the folder and the lock, held until released (``with lock:`` or ``lock.__exit__()``; the process's end
    releases it too)."""
    path = check_out_dir(out, flag, kind)
    lock = FolderLock(path, flag).__enter__()
    remove_stale_temporaries(path, path / "runs")
    return path, lock
