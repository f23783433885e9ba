"""Executors: where a sweep's cells run. One interface, ``map_unordered(fn, items)``, two implementations.

- :class:`LocalExecutor` — worker processes on this machine (``--workers N``; 1 runs in this process); they die
  with the sweep's process, however it dies (:func:`die_with_parent`).
- :class:`DaskExecutor` — an existing Dask distributed cluster (``--cluster tcp://HOST:8786``, or the same address
  given as ``--scheduler``; the ``dist`` extra). Each item is one ``client.submit``; results come back with
  ``as_completed``.

Both yield results in completion order, so the caller can write each one as soon as it is done, and both
are context managers (the Dask client is closed on exit). :func:`make_executor` is the one place that
picks an executor from the flags.

Running on a cluster: every worker needs specsim installed (the same version) and must read the files a
config names (``profile``, ``trace``, ``length_file``, ``acceptance_trace``, ``policy_file``) at the same
paths, e.g. on a shared file system; each run loads them by path on the worker that runs it.
"""
from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, Callable, Iterable, Iterator, Protocol, TypeVar

from policies.errors import UserError

T = TypeVar("T")

#: Seconds to wait for a Dask scheduler before giving up (an unreachable address fails this fast).
CONNECT_TIMEOUT = 5.0
#: Address schemes a command-line client can reach (``inproc`` lives inside one process only).
NETWORK_SCHEMES = ("tcp", "tls", "ws", "wss")


class Executor(Protocol):
    """Runs ``fn`` on every item, yielding the results in the order they finish."""

    def map_unordered(self, fn: Callable[[T], Any], items: Iterable[T]) -> Iterator[Any]: ...


class LocalExecutor:
    """Worker processes on this machine; with 1 worker, everything runs in this process. Inside ``with``, one pool of
    workers serves every :meth:`map_unordered` call (a study of several stages starts its workers, and they load
    their cost models, once), shut down on exit; outside, each call has its own."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise UserError(f"--workers must be >= 1, got {workers}")
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None
        self._entered = False

    def __enter__(self) -> "LocalExecutor":
        self._entered = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._entered = False
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def map_unordered(self, fn: Callable[[T], Any], items: Iterable[T]) -> Iterator[Any]:
        if self.workers == 1:
            yield from (fn(item) for item in items)
            return
        pool = self._pool or ProcessPoolExecutor(max_workers=self.workers, initializer=die_with_parent,
                                                 initargs=(os.getpid(),))
        if self._entered:
            self._pool = pool
        futures = [pool.submit(fn, item) for item in items]
        try:
            for future in as_completed(futures):
                yield future.result()
        finally:
            for future in futures:
                future.cancel()
            if not self._entered:
                pool.shutdown(cancel_futures=True)


class DaskExecutor:
    """A client of an existing Dask distributed scheduler at ``address`` (``tcp://HOST:PORT``).

    Connects on construction and fails within ``connect_timeout`` seconds with a one-line
    :class:`UserError` when the scheduler cannot be reached or the address is malformed.
    """

    def __init__(self, address: str, connect_timeout: float = CONNECT_TIMEOUT, flag: str = "--cluster") -> None:
        try:
            from distributed import Client
            from distributed.comm import parse_address, resolve_address
        except ImportError:
            raise UserError(f"{flag} {address}: needs Dask distributed (pip install -e '.[dist]')") from None
        # Check the address before making a Client: a Client whose constructor fails on a malformed
        # address stalls the interpreter's exit and prints a traceback when it is collected.
        try:
            scheme, _ = parse_address(resolve_address(address))
        except ValueError as exc:
            raise UserError(f"{flag}: not a scheduler address, expected tcp://HOST:PORT (got {address!r}: "
                            f"{exc})") from None
        except OSError as exc:
            raise UserError(f"{flag}: cannot reach a Dask scheduler at {address} ({exc})") from None
        if scheme not in NETWORK_SCHEMES:
            raise UserError(f"{flag}: scheme {scheme!r} is not a network address (got {address!r}; "
                            f"use tcp://HOST:PORT)")
        try:
            self.client = Client(address, timeout=connect_timeout, set_as_default=False)
        except (OSError, TimeoutError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UserError(f"{flag}: cannot reach a Dask scheduler at {address} ({reason})") from None

    def __enter__(self) -> "DaskExecutor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()

    def map_unordered(self, fn: Callable[[T], Any], items: Iterable[T]) -> Iterator[Any]:
        from distributed import as_completed as dask_as_completed

        futures = [self.client.submit(fn, item, pure=False) for item in items]
        try:
            for future in dask_as_completed(futures, loop=self.client.loop):
                yield future.result()
        finally:
            self.client.cancel(futures)


def die_with_parent(parent: int) -> None:
    """In a worker process: ask the kernel to kill this process when its parent dies, however it dies (SIGTERM,
    SIGKILL by the OOM killer), so no worker outlives the sweep (Linux ``prctl(PR_SET_PDEATHSIG)``; elsewhere a
    no-op). A parent already gone by now: exit at once."""
    import signal
    import sys

    if sys.platform.startswith("linux"):
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(1)


def default_workers() -> int:
    """Local worker processes by default: the CPUs this process may use, at most 8."""
    return max(1, min(len(os.sched_getaffinity(0)), 8))


def make_executor(workers: int, cluster: str | None = None, flag: str = "--cluster") -> LocalExecutor | DaskExecutor:
    """The executor the flags ask for: a Dask cluster when ``cluster`` is given (by ``flag``, named in errors),
    else local workers."""
    return DaskExecutor(cluster, flag=flag) if cluster else LocalExecutor(workers)
