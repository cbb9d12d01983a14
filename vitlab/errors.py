"""`UserError`: the base of errors caused by what the user asked for, not by a bug in vitlab.

Its message says what is wrong and how to fix it; the `vitlab` command prints only that message
and exits non-zero (`VITLAB_DEBUG=1` shows the traceback too).
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input (data, checkpoint, recipe, folder, option), with the fix in the message."""
