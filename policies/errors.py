"""User-facing errors: the one error type of every layer, here in the bottom layer (policies) so that all may import it,
and the command lines' parser that reports a bad flag as one.

A :class:`UserError` is a problem with something the user gave us (a file, a flag, a config value).
The command line prints its message as one line and exits with status 2; it never shows a traceback.
Messages name the input (file, field) and the offending value.

An :class:`InputWarning` (:func:`warn_user`) is a doubt about such an input that does not stop the run: the command
line prints it as one line, ``warning: MESSAGE`` (:func:`one_line_warnings`), the message naming the flag or file,
never the project's source file and line that raised it. It is a ``UserWarning``, so ``pytest.warns(UserWarning)``
and warning filters catch it as any other.
"""
from __future__ import annotations

import argparse
import sys
import typing
import warnings
from collections.abc import Callable

EXIT_USER_ERROR = 2
"""Exit status of a command stopped by a :class:`UserError`."""


class UserError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


def require(condition: bool, message: str) -> None:
    """Raise :class:`UserError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise UserError(message)


class InputWarning(UserWarning):
    """A doubt about something the user gave (a flag, a file) that does not stop the run: printed by the command line
    as one line naming that input (:func:`one_line_warnings`)."""


def warn_user(message: str) -> None:
    """Warn about an input: ``message`` names the flag or file (``--profile X: ...``) and says what is doubtful."""
    warnings.warn(message, InputWarning, stacklevel=2)


def one_line_warnings() -> None:
    """Print every :class:`InputWarning` as ``warning: MESSAGE`` (one line, no source file and line); other warnings
    (a user's policy file's own, Python's) as Python formats them. The command lines call it first; calling it again
    changes nothing."""
    original = warnings.formatwarning
    if getattr(original, "one_line", False):
        return

    def formatwarning(message, category, filename, lineno, line=None):  # noqa: ANN001 - the warnings module's hook
        if isinstance(category, type) and issubclass(category, InputWarning):
            return f"warning: {' '.join(str(message).split())}\n"
        return original(message, category, filename, lineno, line)

    formatwarning.one_line = True  # type: ignore[attr-defined]
    warnings.formatwarning = formatwarning


class FlagParser(argparse.ArgumentParser):
    """The command lines' argparse: a bad flag is one :class:`UserError` line (exit status 2 at the command line)
    instead of usage and an error, and a flag is never taken by an abbreviation (``--num-request`` is an unknown
    flag, not ``--num-requests``). Its subparsers are FlagParsers too (argparse makes them of the parser's class)."""

    def __init__(self, *args: typing.Any, **kwargs: typing.Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> typing.NoReturn:  # noqa: D401 - argparse hook
        raise UserError(f"{self.prog}: {message}")


def exit_on_user_error(main: Callable[[list[str]], int], argv: list[str]) -> None:
    """A module's ``__main__``: exit with ``main(argv)``'s status, or print a :class:`UserError` as one line and exit
    with :data:`EXIT_USER_ERROR`."""
    one_line_warnings()
    try:
        status = main(argv)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        status = EXIT_USER_ERROR
    sys.exit(status)
