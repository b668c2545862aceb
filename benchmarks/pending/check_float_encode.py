"""float-encode.patch's minifloat encode emulated in NumPy fp32 (IEEE round to nearest even, subnormals kept, as the
compiled FADD / FMUL without .FTZ are) against the reference's codes, for every fp32 bit pattern (NaN excluded: the
writes clear NaN first). `python benchmarks/pending/check_float_encode.py fp4_e2m1` (or fp8_e4m3, fp8_e5m2), with
kvgen importable; about 100 s per element type."""

import sys
import time

import numpy as np

from kvgen.codegen.spec import ElementType
from kvgen.reference.codes import element_codes

# bits, exponent bias, mantissa bits, largest finite value
PARAMS = {"fp4_e2m1": (4, 1, 1, 6.0), "fp8_e4m3": (8, 7, 3, 448.0), "fp8_e5m2": (8, 15, 2, 57344.0)}
F32 = np.float32


def patched_encode(v: np.ndarray, nbits: int, bias: int, mant: int, max_finite: float) -> np.ndarray:
    """The patch's template, operation for operation (tl.minimum / tl.maximum keep the non-NaN operand: fmin / fmax)."""
    bits = v.view(np.uint32)
    sign = (bits >> np.uint32(32 - nbits)) & np.uint32(1 << (nbits - 1))
    a = np.fmin(np.abs(v), F32(max_finite))
    binade = np.fmax(a, F32(2.0 ** (1 - bias))).view(np.uint32) & np.uint32(0x7F800000)
    c = binade.view(np.float32) * F32(1.5 * 2.0 ** (23 - mant))
    rounded = (a + c) - c
    code = (rounded * F32(2.0 ** (bias - 127))).view(np.uint32) >> np.uint32(23 - mant)
    return (code | sign).astype(np.uint8)


def main(name: str) -> int:
    element, step, bad, start_time = ElementType(name), 1 << 26, 0, time.time()
    for start in range(0, 1 << 32, step):
        v = np.arange(start, start + step, dtype=np.uint64).astype(np.uint32).view(np.float32)
        with np.errstate(all="ignore"):
            ok = (patched_encode(v, *PARAMS[name]) == element_codes(element, v)) | np.isnan(v)
        if not ok.all():
            first = np.flatnonzero(~ok)[0]
            if not bad:
                print(f"{name}: first mismatch at {int(v.view(np.uint32)[first]):#010x} ({v[first]!r})")
            bad += int((~ok).sum())
    print(f"{name}: {bad} codes differ from the reference (NaN excluded), {time.time() - start_time:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
