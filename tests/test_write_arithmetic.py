"""The write kernels divide without an fp32 division (codegen/templates/side.jinja `quotient`): a group's range over
its code range qmax is a times the fp64 reciprocal of qmax, rounded to fp32. That equals IEEE fp32 division for
normal quotients by the 2**-52 / 2**-49 argument in the template; where the quotient is an fp32 subnormal the
argument does not hold, so every such input is checked here, for every code range an element type gives.

These tests check the arithmetic the templates rely on, not the kernels: that the kernels' bytes equal the
reference's is checked by the conformance, golden and tie tests (tests/test_static_scale_ties.py for static scales
whose reciprocal is not exact)."""

from __future__ import annotations

import numpy as np
import pytest

from kvgen.codegen.spec import ELEMENTS

CODE_RANGES = sorted({r for info in ELEMENTS.values() if info.is_quantized
                      for r in (info.qmax, info.qmax - info.qmin)})


@pytest.mark.parametrize("qmax", CODE_RANGES)
def test_range_over_qmax_through_the_reciprocal_is_division(qmax):
    """Every non-negative fp32 a whose a / qmax is below fp32's normal range (and a binade above it)."""
    rcp = 1.0 / np.float64(qmax)
    q32 = np.float32(qmax)
    top = np.float32(qmax * 2.0 ** -125).view(np.uint32)  # a / qmax < 2**-125
    for start in range(0, int(top) + 1, 1 << 24):
        a = np.arange(start, min(start + (1 << 24), int(top) + 1), dtype=np.uint32).view(np.float32)
        ieee = a / q32
        via_rcp = (a.astype(np.float64) * rcp).astype(np.float32)
        bad = np.flatnonzero(ieee.view(np.uint32) != via_rcp.view(np.uint32))
        assert bad.size == 0, f"qmax {qmax}: a = {a[bad[0]]!r} gives {via_rcp[bad[0]]!r}, division {ieee[bad[0]]!r}"


def test_a_runtime_divisor_needs_the_fp64_division():
    """Why the global scale takes div64: through a rounded reciprocal, a quotient on a subnormal midpoint rounds
    the wrong way (147 * 2**-149 / 98 = 1.5 * 2**-149: division gives 2 * 2**-149), fp64 division does not."""
    a, b = np.float32(147 * 2.0 ** -149), np.float32(98.0)
    ieee = a / b
    assert ieee.view(np.uint32) == 2
    assert (np.float64(a) * (1.0 / np.float64(b))).astype(np.float32).view(np.uint32) != 2
    assert (np.float64(a) / np.float64(b)).astype(np.float32).view(np.uint32) == 2
