"""kvgen's own exceptions: what users see instead of pydantic, Jinja or Triton tracebacks."""

from __future__ import annotations

from typing import Optional


class KvgenError(Exception):
    """Base class of every error kvgen raises on purpose."""

    exit_code = 1  # what the command line exits with


class OptionError(KvgenError):
    """A command-line option's value the command cannot take (a usage error: the command line exits with 2)."""

    exit_code = 2


class UnknownFormat(KvgenError):
    """A format name that is neither shipped nor a generated directory nor a spec file (on the command line: a
    usage error, exit 2)."""

    exit_code = 2


class SpecError(KvgenError, ValueError):
    """A spec that cannot be built: names the file, the line and column, and the field."""

    def __init__(
        self,
        message: str,
        *,
        path: Optional[str] = None,
        line: Optional[int] = None,
        column: Optional[int] = None,
        field: Optional[str] = None,
    ):
        self.message = message
        self.path = path
        self.line = line
        self.column = column
        self.field = field
        super().__init__(self._render())

    def _render(self) -> str:
        where = self.path or "<spec>"
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        field = f" {self.field}:" if self.field else ""
        return f"{where}:{field} {self.message}"


class MissingSpecFile(SpecError):
    """A spec path that names no file or directory (on the command line: a usage error, exit 2)."""

    exit_code = 2


class NotSupportedYet(SpecError):
    """A valid spec asking for something the code generator does not implement yet."""


class BuildError(KvgenError):
    """A build that could not complete (nothing was written)."""


class StaleError(KvgenError):
    """Generated code does not match its spec (``kvgen build --check``, or the runtime's hash check)."""
