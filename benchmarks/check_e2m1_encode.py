"""Every fp32 bit pattern through the e2m1 encode's lines (codegen/codecs.py `_envelope`, rendered by
codegen/templates/codecs/minifloat.py.jinja: the least of one fma per binade, saturated) against the reference's
codes (ml_dtypes), in NumPy: the fma's exact product and sum in fp64, rounded once to fp32 as the GPU's fma rounds
(the product is a power-of-two multiple of |v|, so below 2**-29 the sum is 1.5 * 2**23 itself either way).
NaN is left out: the writes never encode one (widen() stores NaN as 0.0).

    python benchmarks/check_e2m1_encode.py      # about 200 s on two cores; prints the mismatches (0 expected)

The fortieth session ran it: 0 mismatches. tests/test_minifloat_encode.py runs the generated kernel code itself
on the values near every grid point and tie.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from kvgen.codegen.codecs import RNE_MAGIC, _minifloat
from kvgen.codegen.spec import ElementType
from kvgen.reference.codes import element_codes

CHUNK = 1 << 24


def encode(v: np.ndarray, lines: list, max_code: int, sign_shift: int, sign_bit: int) -> np.ndarray:
    a = np.abs(v).astype(np.float64)
    m = None
    for k, c in lines:
        line = (a * k + c).astype(np.float32)
        m = line if m is None else np.fmin(m, line)
    m = np.fmin(m, np.float32(RNE_MAGIC + max_code))
    sign = (v.view(np.uint32) >> sign_shift) & sign_bit
    return ((m.view(np.uint32) | sign) & 0xFF).astype(np.uint8)


def main() -> int:
    p = _minifloat("fp4_e2m1").params
    lines = p["envelope"]
    print(f"lines (factor, constant): {lines}, saturated at code {p['max_code']}")
    bad, start_time = 0, time.time()
    for n, start in enumerate(range(0, 1 << 32, CHUNK)):
        v = np.arange(start, start + CHUNK, dtype=np.uint64).astype(np.uint32).view(np.float32)
        v = v[~np.isnan(v)]
        with np.errstate(all="ignore"):
            got = encode(v, lines, p["max_code"], 32 - p["nbits"], p["sign_bit"])
            want = element_codes(ElementType.fp4_e2m1, v)
        differ = np.flatnonzero(got != want)
        if differ.size and bad < 10:
            print(f"  differ: {v[differ[:5]].tolist()} -> {got[differ[:5]].tolist()}, reference "
                  f"{want[differ[:5]].tolist()}")
        bad += differ.size
        if n % 32 == 31:
            print(f"  {(n + 1) * CHUNK / 2 ** 32:.0%} of the fp32 patterns, {bad} mismatches, "
                  f"{time.time() - start_time:.0f} s", flush=True)
    print(f"mismatches: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
