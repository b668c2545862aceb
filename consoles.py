"""The rich consoles the command-line tools print through.

Output that is not a terminal (a pipe, a log file, ``make demo``'s output) gets 160 columns instead of rich's default
80, so the tables keep their columns; a terminal keeps its own width, and ``COLUMNS`` in the environment wins over
both. Decided at each print, not at import (a test runner may set ``COLUMNS`` or swap the streams later).
"""

from __future__ import annotations

import os

from rich.console import Console, ConsoleDimensions

PIPE_WIDTH = 160


class _Console(Console):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if kwargs.get("width") is None:
            # rich reads COLUMNS once, here, and keeps it; size (below) reads it at each print instead
            self._width = None
        if kwargs.get("height") is None:
            self._height = None

    @property
    def size(self) -> ConsoleDimensions:
        size = Console.size.fget(self)
        if self._width is None and "COLUMNS" not in os.environ and not self.is_terminal:
            return ConsoleDimensions(PIPE_WIDTH, size.height)
        return size

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)


console = _Console(soft_wrap=True)
err_console = _Console(stderr=True, soft_wrap=True)
