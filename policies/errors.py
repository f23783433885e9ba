"""User-facing errors: the one error type of every layer, here in the bottom layer (policies) so that all may import it.

A :class:`UserError` is a problem with something the user gave us (a file, a flag, a config value).
The command line prints its message as one line and exits with status 2; it never shows a traceback.
Messages name the input (file, field) and the offending value.
"""


class UserError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


def require(condition: bool, message: str) -> None:
    """Raise :class:`UserError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise UserError(message)
