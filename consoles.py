"""The rich consoles the command-line tools print through.

Output that is not a terminal (a pipe, a log file, ``make demo``'s output) gets 160 columns instead of rich's default
80, so the tables keep their columns; a terminal keeps its own width.
"""

from __future__ import annotations

import sys

from rich.console import Console

PIPE_WIDTH = 160


def _console(stderr: bool) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    tty = getattr(stream, "isatty", lambda: False)()
    return Console(stderr=stderr, soft_wrap=True, width=None if tty else PIPE_WIDTH)


console = _console(stderr=False)
err_console = _console(stderr=True)
