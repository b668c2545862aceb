"""Test setup: kernels run in the CPU Triton interpreter unless TRITON_INTERPRET=0 is set (a GPU machine).

Tests import the installed package (`pip install -e .[test]`), always as `kvgen.*`.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when @triton.jit decorates: before any kernel is imported

from hypothesis import settings  # noqa: E402

# CI: no deadline (the interpreter's first call of a kernel is slow); examples scale with KVGEN_EXAMPLES_SCALE
settings.register_profile("kvgen", deadline=None, print_blob=True)
settings.load_profile("kvgen")
