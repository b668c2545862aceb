"""Test setup: kernels run in the CPU Triton interpreter unless TRITON_INTERPRET=0 is set (a GPU machine).

Tests import the installed package (`pip install -e .[test]`), always as `kvgen.*`.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when @triton.jit decorates: before any kernel is imported

import dataclasses  # noqa: E402

from hypothesis import settings  # noqa: E402

# CI: no deadline (the interpreter's first call of a kernel is slow); examples scale with KVGEN_EXAMPLES_SCALE
settings.register_profile("kvgen", deadline=None, print_blob=True)
settings.load_profile("kvgen")


def _skip_discarded_overflow_checks():
    """The interpreter widens every int32 add, sub and mul to int64 to check it for overflow, then drops the check
    unless Triton's debug mode is on (its device_assert returns at once): about a third of an interpreted kernel's
    time for nothing. Off here, where debug is off; results do not change (the checks never ran)."""
    if os.environ.get("TRITON_INTERPRET") in ("", "0"):
        return
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is not None and not options.debug and getattr(options, "sanitize_overflow", False):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


_skip_discarded_overflow_checks()
