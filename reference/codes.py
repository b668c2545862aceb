"""Element codes: how one already-scaled float32 value becomes stored bytes, and back.

Rules (the oracle's definition, independent of any kernel):
  * bf16 / fp16 / fp32 (unquantized): round to nearest, ties to even, into the type (IEEE: a value at or beyond
    ``max + ulp(max) / 2`` becomes +-inf). Stored little-endian.
  * fp8_e4m3 (OCP e4m3fn, max 448, no inf) / fp8_e5m2 (max finite 57344): first clip to [-max, max] (NaN stays
    NaN), then round to nearest, ties to even (ml_dtypes). The stored byte is the bit pattern.
  * int8: ``half_away_from_zero`` is vLLM's ``trunc(v + copysign(0.5, v))`` with the addition done in float32;
    ``half_even`` is ``rint`` in float32. Then clip to [-128, 127]; stored as the two's complement byte.
    A NaN has no int8 code: the reference stores 0 for it (kernels are not required to match).
"""

from __future__ import annotations

from typing import Optional

import ml_dtypes
import numpy as np

from ._schema import ElementType, Rounding

# --- facts about the supported element types, stated here (not taken from the schema) ---------------------------

#: numpy dtype of the unquantized float elements and of the fp8 codes.
FLOAT_DTYPES: dict[ElementType, type] = {
    ElementType.bf16: ml_dtypes.bfloat16,
    ElementType.fp16: np.float16,
    ElementType.fp32: np.float32,
}
FP8_DTYPES: dict[ElementType, type] = {
    ElementType.fp8_e4m3: ml_dtypes.float8_e4m3fn,
    ElementType.fp8_e5m2: ml_dtypes.float8_e5m2,
}
#: (explicit mantissa bits, exponent of the smallest normal) of every float-like element.
FLOAT_FORMAT: dict[ElementType, tuple[int, int]] = {
    ElementType.fp32: (23, -126),
    ElementType.bf16: (7, -126),
    ElementType.fp16: (10, -14),
    ElementType.fp8_e4m3: (3, -6),
    ElementType.fp8_e5m2: (2, -14),
}
#: largest finite value of every float-like element.
FLOAT_MAX: dict[ElementType, float] = {
    ElementType.fp32: float(np.finfo(np.float32).max),
    ElementType.bf16: (2.0 - 2.0**-7) * 2.0**127,
    ElementType.fp16: 65504.0,
    ElementType.fp8_e4m3: 448.0,
    ElementType.fp8_e5m2: 57344.0,
}
#: code range [qmin, qmax] of the quantized elements (fp8: the clip range).
CODE_RANGE: dict[ElementType, tuple[float, float]] = {
    ElementType.int8: (-128.0, 127.0),
    ElementType.fp8_e4m3: (-448.0, 448.0),
    ElementType.fp8_e5m2: (-57344.0, 57344.0),
}
#: bytes per stored element.
ELEMENT_BYTES: dict[ElementType, int] = {
    ElementType.fp32: 4,
    ElementType.bf16: 2,
    ElementType.fp16: 2,
    ElementType.fp8_e4m3: 1,
    ElementType.fp8_e5m2: 1,
    ElementType.int8: 1,
}
SUPPORTED_ELEMENTS = frozenset(ELEMENT_BYTES)


def require_element(element: ElementType) -> None:
    """Raise NotImplementedError for an element type the reference does not cover yet."""
    if element not in SUPPORTED_ELEMENTS:
        raise NotImplementedError(f"reference: element {element.value} is not supported yet")


# --- encoding -------------------------------------------------------------------------------------------------------


def _little_endian_bytes(a: np.ndarray) -> np.ndarray:
    """``[..., D]`` array of 1/2/4-byte values -> uint8 ``[..., D * size]`` in little-endian byte order."""
    size = a.dtype.itemsize
    if size == 1:
        return np.ascontiguousarray(a).view(np.uint8)
    as_uint = np.ascontiguousarray(a).view(f"u{size}").astype(f"<u{size}", copy=False)
    return np.ascontiguousarray(as_uint).view(np.uint8)


def round_int(v: np.ndarray, rounding: Rounding) -> np.ndarray:
    """Round float32 ``v`` to integers (still float32) by the spec's integer rounding rule."""
    v = np.asarray(v, dtype=np.float32)
    if rounding == Rounding.half_away_from_zero:
        half = np.copysign(np.float32(0.5), v).astype(np.float32)
        return np.trunc(v + half)  # float32 + float32: rounded to float32 before the truncation (vLLM)
    if rounding == Rounding.half_even:
        return np.rint(v)
    raise NotImplementedError(f"reference: rounding {rounding} is not supported yet")


def encode_codes(element: ElementType, v: np.ndarray, rounding: Optional[Rounding] = None) -> np.ndarray:
    """Float32 ``[..., D]`` values (already scaled for quantized elements) -> uint8 ``[..., D * bytes]``."""
    require_element(element)
    v = np.asarray(v, dtype=np.float32)
    if element in FLOAT_DTYPES:
        return _little_endian_bytes(v.astype(FLOAT_DTYPES[element]))
    lo, hi = (np.float32(b) for b in CODE_RANGE[element])
    if element in FP8_DTYPES:
        clipped = np.clip(v, lo, hi)  # NaN stays NaN
        return clipped.astype(FP8_DTYPES[element]).view(np.uint8)
    # int8
    if rounding is None:
        raise ValueError("an int8 element needs a rounding rule")
    r = np.clip(round_int(v, rounding), lo, hi)
    r = np.where(np.isnan(r), np.float32(0), r)
    return r.astype(np.int8).view(np.uint8)


# --- decoding -------------------------------------------------------------------------------------------------------


def decode_codes(element: ElementType, data: np.ndarray) -> np.ndarray:
    """uint8 ``[..., D * bytes]`` -> float64 ``[..., D]``: the code's value (unscaled), exactly."""
    require_element(element)
    data = np.ascontiguousarray(np.asarray(data, dtype=np.uint8))
    if element in FLOAT_DTYPES:
        dtype = FLOAT_DTYPES[element]
        size = np.dtype(dtype).itemsize
        bits = data.view(f"<u{size}").astype(f"u{size}")
        return bits.view(dtype).astype(np.float64)
    if element in FP8_DTYPES:
        return data.view(FP8_DTYPES[element]).astype(np.float64)
    return data.view(np.int8).astype(np.float64)


# --- rounding steps -------------------------------------------------------------------------------------------------


def half_ulp(element: ElementType, magnitude: np.ndarray) -> np.ndarray:
    """Half the spacing of ``element``'s values at ``magnitude`` (float64, >= 0).

    For ``2**e <= m < 2**(e+1)`` the spacing is ``2**(e - mantissa_bits)``; below the smallest normal ``2**emin``
    it is the subnormal step ``2**(emin - mantissa_bits)``. Round-to-nearest moves a value by at most this much.
    """
    mant, emin = FLOAT_FORMAT[element]
    m = np.abs(np.asarray(magnitude, dtype=np.float64))
    _, k = np.frexp(m)  # m = f * 2**k with f in [0.5, 1)
    e = np.where(m > 0, k - 1, emin)
    e = np.maximum(e, emin)
    return np.ldexp(np.ones_like(m), (e - mant - 1).astype(np.int64))


def overflow_threshold(element: ElementType) -> float:
    """Smallest magnitude that round-to-nearest-even sends to infinity (``max + ulp(max) / 2``: the tie goes to
    infinity because the largest finite value has an odd, all-ones mantissa)."""
    top = FLOAT_MAX[element]
    return top + float(half_ulp(element, np.float64(top)))
