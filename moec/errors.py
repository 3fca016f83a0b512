"""Errors that reach the user as one line and a non-zero exit (see moec/cli/app.py).

`UserError` is for bad input: a path that does not exist, a recipe key we do not know, a checkpoint
whose bytes changed. The CLI prints its message and exits 2. Anything else is a bug and exits 1.
"""


class UserError(Exception):
    """Bad usage or input; the message names the bad value and what was expected."""


class FormatError(UserError):
    """A packed checkpoint that fails a check (version, hash, shape, dtype, missing file)."""
