"""A user's policy file, kept at arm's length: whatever its code does, the run ends with one line naming the
file and the line, never a traceback, a silently wrong k, an exit from inside it or a hang.

:func:`guarded` wraps a policy from a ``--policy-file`` (built-in policies are trusted and run bare, so their
results and speed are untouched). Every call (construction, ``propose``, ``observe``, ``finish``) that raises,
calls ``sys.exit`` or runs longer than :func:`time_limit` seconds (``SPECSIM_POLICY_TIMEOUT``, default 10; an
endless loop) becomes a :class:`UserError` naming the file and the line; ``propose`` must return an integer numpy
array (bool, float, NaN, text or a list are refused, not rounded). The time limit is watched by a SIGALRM interval
timer in the main thread (off the main thread, on a Dask worker, there is no watchdog).
"""
from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from policies.base import Policy
from policies.errors import UserError

#: Seconds one call of a user's policy may take before it is stopped (env ``SPECSIM_POLICY_TIMEOUT``).
DEFAULT_TIME_LIMIT = 10.0


def time_limit() -> float:
    raw = os.environ.get("SPECSIM_POLICY_TIMEOUT", "")
    try:
        value = float(raw) if raw else DEFAULT_TIME_LIMIT
    except ValueError:
        raise UserError(f"SPECSIM_POLICY_TIMEOUT: not a number of seconds: {raw!r}") from None
    if not value > 0:
        raise UserError(f"SPECSIM_POLICY_TIMEOUT: must be > 0 seconds, got {raw!r}")
    return value


class _Timeout(BaseException):
    """Raised by the watchdog inside user code (a BaseException, so the user's ``except Exception`` cannot
    swallow it)."""


def _line_in(path: str, tb: Any) -> str:
    """``line N`` of the deepest frame of ``tb`` in file ``path`` (else the deepest frame anywhere)."""
    frames = traceback.extract_tb(tb) if tb is not None else []
    target = str(Path(path).resolve())
    for frame in reversed(frames):
        if str(Path(frame.filename).resolve()) == target:
            return f"line {frame.lineno}"
    return f"{Path(frames[-1].filename).name} line {frames[-1].lineno}" if frames else "?"


class Watch:
    """The watchdog of one run: an interval timer that stops a user call running longer than the limit."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.limit = time_limit()
        self.since: float | None = None
        self.active = False

    @contextmanager
    def armed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
            yield
            return

        def alarm(signum: int, frame: Any) -> None:
            if self.since is not None and time.monotonic() - self.since > self.limit:
                self.since = None
                raise _Timeout()

        previous = signal.signal(signal.SIGALRM, alarm)
        tick = min(1.0, self.limit / 4)
        signal.setitimer(signal.ITIMER_REAL, tick, tick)
        self.active = True
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            self.active = False

    def call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        self.since = time.monotonic()
        try:
            return fn(*args)
        except _Timeout as exc:
            raise UserError(f"--policy-file {self.path}: {_line_in(self.path, exc.__traceback__)}: {what} did not "
                            f"return within {self.limit:g} s (an endless loop?); SPECSIM_POLICY_TIMEOUT sets the "
                            "limit") from None
        except UserError:
            raise
        except (Exception, SystemExit) as exc:
            kind = "called sys.exit" if isinstance(exc, SystemExit) else f"raised {type(exc).__name__}: {exc}"
            raise UserError(f"--policy-file {self.path}: {_line_in(self.path, exc.__traceback__)}: {what} "
                            f"{kind}".splitlines()[0]) from None
        finally:
            self.since = None


class GuardedPolicy(Policy):
    """A user's policy behind the :class:`Watch`; ``propose`` results checked for type."""

    def __init__(self, inner: Policy, watch: Watch) -> None:  # noqa: D107 - no Policy.__init__: not a policy's k
        self.inner, self.watch = inner, watch
        self.name = inner.name  # type: ignore[misc]
        self.k = getattr(inner, "k", 0)
        self.stationary = bool(getattr(inner, "stationary", False))

    def propose(self, view: Any) -> np.ndarray:
        what = f"policy {self.name}: propose()"
        k = self.watch.call(what, self.inner.propose, view)
        if not isinstance(k, np.ndarray):
            raise UserError(f"--policy-file {self.watch.path}: {what} must return a numpy integer array, got "
                            f"{type(k).__name__}")
        if k.dtype.kind not in "iu":
            raise UserError(f"--policy-file {self.watch.path}: {what} must return integers, got an array of "
                            f"{k.dtype} ({np.array2string(k.ravel()[:4], separator=',')}...)")
        return k

    def observe(self, outcome: Any) -> None:
        self.watch.call(f"policy {self.name}: observe()", self.inner.observe, outcome)

    def finish(self, request_id: int) -> None:
        self.watch.call(f"policy {self.name}: finish()", self.inner.finish, request_id)


def guarded(path: str, make: Callable[[], Policy], watch: Watch) -> Policy:
    """Build a user's policy with ``make()`` under ``watch`` and wrap it."""
    policy = watch.call("the policy's constructor", make)
    return GuardedPolicy(policy, watch)
