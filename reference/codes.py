"""Element codes and scale dtypes: how one already-scaled float32 value becomes stored bits, and back.

Rules (the oracle's definition, from docs/SEMANTICS.md, independent of any kernel):
  * bf16 / fp16 / fp32 (unquantized): round to nearest, ties to even, into the type (IEEE: a value at or beyond
    ``max + ulp(max) / 2`` becomes +-inf). Stored little-endian. A NaN becomes bf16 0x7FC0 / fp16 0x7E00 with its
    sign, whatever its payload (fp32 keeps its bits).
  * fp8_e4m3 (OCP e4m3fn, max 448, no inf) / fp8_e5m2 (max finite 57344): first clip to [-max, max], then round to
    nearest, ties to even. NaN -> 0x7F (e4m3) / 0x7E (e5m2), positive (a scaled NaN has no defined sign).
  * fp8_e4m3fnuz (AMD MI300: bias 8, max 240, no inf, no negative zero): clip to [-240, 240], round half to even;
    a value that rounds to zero is 0x00 whatever its sign; NaN -> 0x80 (its only NaN).
  * fp4_e2m1 (1 sign | 2 exponent, bias 1 | 1 mantissa; values 0, 0.5, 1, 1.5, 2, 3, 4, 6): clip to [-6, 6], round
    to nearest with ties to the even code (= even mantissa bit). The sign bit is kept, so -0.2 -> -0 = code 0x8.
    NaN has no fp4 code: code 0 (a fallback at the code level; the side encoders have already replaced a NaN
    input by 0.0, SEMANTICS.md "NaN", which the kernels match).
  * int8 / int4 / int2 (two's complement) and uint8 / uint4 / uint2: round by the side's rule (``half_even`` = rint
    in float32; ``half_away_from_zero`` = ``trunc(v + copysign(0.5, v))`` with the addition in float32, vLLM), then
    clip to [-2^(b-1), 2^(b-1) - 1] resp. [0, 2^b - 1]. NaN -> code 0 (the code-level fallback; a NaN input is
    0.0 by then, as for fp4).
  * Sub-byte packing: element ``i`` sits in byte ``i // (8 / b)``, at bit ``(i mod (8/b)) * b`` (lsb_first) or
    ``(8/b - 1 - i mod (8/b)) * b`` (msb_first). A head whose ``D * b`` is not a multiple of 8 ends in a partial
    byte whose unused bits are 0.

Scale dtypes (the stored form of a dynamic scale ``s > 0`` after its floor):
  * fp32 as is; fp16 / bf16 round half to even (IEEE: overflow -> inf); fp8_e4m3 clips to 448 then rounds half to
    even; e8m0 rounds **up** to a power of two: ``E = ceil(log2 s)`` clamped to [-127, 127], byte ``E + 127``
    (byte 255 reads as NaN).
"""

from __future__ import annotations

from typing import Optional

import ml_dtypes
import numpy as np

from ._schema import ElementType, Rounding, ScaleDType

# --- facts about the element types, stated here (not taken from the schema) ---------------------------------------

#: numpy dtype of the unquantized float elements.
FLOAT_DTYPES: dict[ElementType, type] = {
    ElementType.bf16: ml_dtypes.bfloat16,
    ElementType.fp16: np.float16,
    ElementType.fp32: np.float32,
}
#: numpy dtype of the low-bit float codes.
FP8_DTYPES: dict[ElementType, type] = {
    ElementType.fp8_e4m3: ml_dtypes.float8_e4m3fn,
    ElementType.fp8_e5m2: ml_dtypes.float8_e5m2,
    ElementType.fp8_e4m3fnuz: ml_dtypes.float8_e4m3fnuz,
}
#: the positive NaN code of the low-bit floats that have one (the others, and integers, store NaN as 0 would be).
NAN_CODES: dict[ElementType, int] = {ElementType.fp8_e4m3: 0x7F, ElementType.fp8_e5m2: 0x7E,
                                     ElementType.fp8_e4m3fnuz: 0x80}
LOWBIT_FLOATS = frozenset({ElementType.fp8_e4m3, ElementType.fp8_e5m2, ElementType.fp8_e4m3fnuz,
                           ElementType.fp4_e2m1})
SIGNED_INTS = frozenset({ElementType.int8, ElementType.int4, ElementType.int2})
UNSIGNED_INTS = frozenset({ElementType.uint8, ElementType.uint4, ElementType.uint2})
INTEGERS = SIGNED_INTS | UNSIGNED_INTS

#: bits per stored element.
ELEMENT_BITS: dict[ElementType, int] = {
    ElementType.fp32: 32,
    ElementType.bf16: 16,
    ElementType.fp16: 16,
    ElementType.fp8_e4m3: 8,
    ElementType.fp8_e5m2: 8,
    ElementType.fp8_e4m3fnuz: 8,
    ElementType.fp4_e2m1: 4,
    ElementType.int8: 8,
    ElementType.int4: 4,
    ElementType.int2: 2,
    ElementType.uint8: 8,
    ElementType.uint4: 4,
    ElementType.uint2: 2,
}
#: (explicit mantissa bits, exponent of the smallest normal) of every float-like element.
FLOAT_FORMAT: dict[ElementType, tuple[int, int]] = {
    ElementType.fp32: (23, -126),
    ElementType.bf16: (7, -126),
    ElementType.fp16: (10, -14),
    ElementType.fp8_e4m3: (3, -6),
    ElementType.fp8_e5m2: (2, -14),
    ElementType.fp8_e4m3fnuz: (3, -7),
    ElementType.fp4_e2m1: (1, 0),
}
#: largest finite value of every float-like element.
FLOAT_MAX: dict[ElementType, float] = {
    ElementType.fp32: float(np.finfo(np.float32).max),
    ElementType.bf16: (2.0 - 2.0**-7) * 2.0**127,
    ElementType.fp16: 65504.0,
    ElementType.fp8_e4m3: 448.0,
    ElementType.fp8_e5m2: 57344.0,
    ElementType.fp8_e4m3fnuz: 240.0,
    ElementType.fp4_e2m1: 6.0,
}
#: code range [qmin, qmax] of the quantized elements (low-bit floats: the clip range).
CODE_RANGE: dict[ElementType, tuple[float, float]] = {
    ElementType.fp8_e4m3: (-448.0, 448.0),
    ElementType.fp8_e5m2: (-57344.0, 57344.0),
    ElementType.fp8_e4m3fnuz: (-240.0, 240.0),
    ElementType.fp4_e2m1: (-6.0, 6.0),
    ElementType.int8: (-128.0, 127.0),
    ElementType.int4: (-8.0, 7.0),
    ElementType.int2: (-2.0, 1.0),
    ElementType.uint8: (0.0, 255.0),
    ElementType.uint4: (0.0, 15.0),
    ElementType.uint2: (0.0, 3.0),
}
#: ``qmax`` of a dynamic scale: ``s = amax / qmax`` (symmetric) or ``(hi - lo) / qmax`` (asymmetric).
QMAX: dict[ElementType, float] = {
    ElementType.int8: 127.0,
    ElementType.int4: 7.0,
    ElementType.int2: 1.0,
    ElementType.fp8_e4m3: 448.0,
    ElementType.fp8_e5m2: 57344.0,
    ElementType.fp8_e4m3fnuz: 240.0,
    ElementType.fp4_e2m1: 6.0,
    ElementType.uint8: 255.0,
    ElementType.uint4: 15.0,
    ElementType.uint2: 3.0,
}
#: the 16 values of the fp4 e2m1 codes: code = sign << 3 | exponent << 1 | mantissa.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float64)

# --- scale dtypes ---------------------------------------------------------------------------------------------------

SCALE_BYTES: dict[ScaleDType, int] = {
    ScaleDType.fp32: 4,
    ScaleDType.fp16: 2,
    ScaleDType.bf16: 2,
    ScaleDType.fp8_e4m3: 1,
    ScaleDType.e8m0: 1,
}
#: the smallest positive value of each scale dtype: the last term of the floor ``max(s, min, tiny)``.
SCALE_TINY: dict[ScaleDType, float] = {
    ScaleDType.fp32: 2.0**-149,
    ScaleDType.fp16: 2.0**-24,
    ScaleDType.bf16: 2.0**-133,
    ScaleDType.fp8_e4m3: 2.0**-9,
    ScaleDType.e8m0: 2.0**-127,
}


def element_bytes_ceil(element: ElementType, count: int) -> int:
    """Bytes of ``count`` packed elements (a partial last byte counts as one)."""
    return -(-count * ELEMENT_BITS[element] // 8)


# --- little-endian helpers ------------------------------------------------------------------------------------------


def little_endian_bytes(a: np.ndarray) -> np.ndarray:
    """``[..., D]`` array of 1/2/4-byte values -> uint8 ``[..., D * size]`` in little-endian byte order."""
    a = np.ascontiguousarray(a)
    size = a.dtype.itemsize
    if size == 1:
        return a.view(np.uint8)
    as_uint = a.view(f"u{size}").astype(f"<u{size}", copy=False)
    return np.ascontiguousarray(as_uint).view(np.uint8)


def from_little_endian(data: np.ndarray, dtype: type) -> np.ndarray:
    """uint8 ``[..., D * size]`` -> ``[..., D]`` of ``dtype`` (1/2/4 bytes), reading little-endian."""
    data = np.ascontiguousarray(np.asarray(data, dtype=np.uint8))
    size = np.dtype(dtype).itemsize
    if size == 1:
        return data.view(dtype)
    return data.view(f"<u{size}").astype(f"u{size}").view(dtype)


# --- rounding -------------------------------------------------------------------------------------------------------


def round_int(v: np.ndarray, rounding: Optional[Rounding]) -> np.ndarray:
    """Round float32 ``v`` to integers (still float32) by the spec's integer rounding rule."""
    v = np.asarray(v, dtype=np.float32)
    if rounding == Rounding.half_away_from_zero:
        half = np.copysign(np.float32(0.5), v).astype(np.float32)
        return np.trunc((v + half).astype(np.float32))  # float32 addition, then truncation (vLLM)
    if rounding == Rounding.half_even:
        return np.rint(v)
    raise ValueError(f"integer elements need a rounding rule, got {rounding!r}")


# --- packing --------------------------------------------------------------------------------------------------------


def pack(codes: np.ndarray, bits: int, packing: str = "lsb_first") -> np.ndarray:
    """b-bit codes (uint8 ``[..., D]``, values < 2**b) -> uint8 ``[..., ceil(D * b / 8)]``."""
    codes = np.asarray(codes, dtype=np.uint8)
    if packing not in ("lsb_first", "msb_first"):
        raise ValueError(f"unknown packing {packing!r}")
    if bits == 8:
        return np.ascontiguousarray(codes)
    per = 8 // bits
    d = codes.shape[-1]
    nbytes = -(-d // per)
    padded = np.zeros(codes.shape[:-1] + (nbytes * per,), np.uint8)
    padded[..., :d] = codes
    grouped = padded.reshape(codes.shape[:-1] + (nbytes, per)).astype(np.uint16)
    j = np.arange(per)
    shifts = j * bits if packing == "lsb_first" else (per - 1 - j) * bits
    return np.bitwise_or.reduce(grouped << shifts, axis=-1).astype(np.uint8)


def unpack(data: np.ndarray, bits: int, count: int, packing: str = "lsb_first") -> np.ndarray:
    """uint8 ``[..., nbytes]`` -> the first ``count`` b-bit codes, uint8 ``[..., count]``."""
    data = np.asarray(data, dtype=np.uint8)
    if bits == 8:
        return data[..., :count]
    per = 8 // bits
    j = np.arange(per)
    shifts = j * bits if packing == "lsb_first" else (per - 1 - j) * bits
    codes = (data[..., None] >> shifts.astype(np.uint8)) & np.uint8((1 << bits) - 1)
    return codes.reshape(data.shape[:-1] + (data.shape[-1] * per,))[..., :count]


# --- element encoding -----------------------------------------------------------------------------------------------


def _fp8_codes(element: ElementType, v: np.ndarray) -> np.ndarray:
    lo, hi = (np.float32(b) for b in CODE_RANGE[element])
    codes = np.clip(v, lo, hi).astype(FP8_DTYPES[element]).view(np.uint8).copy()
    # NaN -> the positive NaN code: the sign of a NaN that went through scaling arithmetic is not defined by IEEE
    # (the GPU's division returns a canonical positive NaN)
    # (e4m3fnuz: its one NaN 0x80; ml_dtypes already stores its zeros, -0 included, as 0x00)
    codes[np.isnan(v)] = np.uint8(NAN_CODES[element])
    return codes


def _fp4_codes(v: np.ndarray) -> np.ndarray:
    clipped = np.clip(v, np.float32(-6.0), np.float32(6.0))
    # ml_dtypes rounds to nearest with ties to the even code (checked by the tests against a table)
    codes = clipped.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & np.uint8(0x0F)
    return np.where(np.isnan(v), np.uint8(0), codes).astype(np.uint8)


def element_codes(element: ElementType, v: np.ndarray, rounding: Optional[Rounding] = None) -> np.ndarray:
    """The code of every float32 value of a quantized element: uint8 ``[..., D]`` holding ``bits`` bits each."""
    v = np.asarray(v, dtype=np.float32)
    if element in FP8_DTYPES:
        return _fp8_codes(element, v)
    if element == ElementType.fp4_e2m1:
        return _fp4_codes(v)
    if element in INTEGERS:
        lo, hi = (np.float32(b) for b in CODE_RANGE[element])
        r = np.clip(round_int(v, rounding), lo, hi)
        r = np.where(np.isnan(r), np.float32(0), r).astype(np.int16)
        return (r & ((1 << ELEMENT_BITS[element]) - 1)).astype(np.uint8)
    raise ValueError(f"{element.value} is not a quantized element")


def code_values(element: ElementType, codes: np.ndarray) -> np.ndarray:
    """uint8 codes ``[..., D]`` (``bits`` bits each) -> their float64 values, exactly."""
    codes = np.asarray(codes, dtype=np.uint8)
    if element in FP8_DTYPES:
        return codes.view(FP8_DTYPES[element]).astype(np.float64)
    if element == ElementType.fp4_e2m1:
        return FP4_VALUES[codes & 0x0F]
    bits = ELEMENT_BITS[element]
    c = codes.astype(np.int64)
    if element in SIGNED_INTS:
        c = np.where(c >= 1 << (bits - 1), c - (1 << bits), c)
    return c.astype(np.float64)


#: the stored NaN of the 16-bit float elements (docs/SEMANTICS.md): bf16 0x7FC0, fp16 0x7E00, with the input's sign
CANONICAL_NAN = {ElementType.bf16: 0x7FC0, ElementType.fp16: 0x7E00}


def encode_codes(element: ElementType, v: np.ndarray, rounding: Optional[Rounding] = None,
                 packing: str = "lsb_first") -> np.ndarray:
    """Float32 ``[..., D]`` values (already scaled and shifted for quantized elements) -> the side's data bytes,
    uint8 ``[..., ceil(D * bits / 8)]``."""
    v = np.asarray(v, dtype=np.float32)
    if element in FLOAT_DTYPES:
        with np.errstate(over="ignore", invalid="ignore"):  # IEEE: beyond the largest finite value rounds to inf
            q = v.astype(FLOAT_DTYPES[element])
        if element in CANONICAL_NAN:  # a NaN is the type's quiet NaN with the input's sign, whatever its payload
            sign = (v.view(np.uint32) >> 16).astype(np.uint16) & np.uint16(0x8000)
            q = np.where(np.isnan(v), (sign | np.uint16(CANONICAL_NAN[element])).view(q.dtype), q)
        return little_endian_bytes(q)
    return pack(element_codes(element, v, rounding), ELEMENT_BITS[element], packing)


def decode_codes(element: ElementType, data: np.ndarray, count: Optional[int] = None,
                 packing: str = "lsb_first") -> np.ndarray:
    """Data bytes uint8 ``[..., nbytes]`` -> float64 ``[..., count]``: each code's value (unscaled), exactly.

    ``count`` (the head size) is needed only when sub-byte codes leave a partial last byte; default: all codes.
    """
    data = np.ascontiguousarray(np.asarray(data, dtype=np.uint8))
    if element in FLOAT_DTYPES:
        return from_little_endian(data, FLOAT_DTYPES[element]).astype(np.float64)
    bits = ELEMENT_BITS[element]
    if count is None:
        count = data.shape[-1] * 8 // bits
    return code_values(element, unpack(data, bits, count, packing))


# --- scale dtypes ---------------------------------------------------------------------------------------------------


def e8m0_exponent(s: np.ndarray) -> np.ndarray:
    """``ceil(log2 s)`` of positive float32 ``s``, exactly (int64), clamped to [-127, 127]."""
    m, e = np.frexp(np.asarray(s, dtype=np.float64))  # s = m * 2**e, m in [0.5, 1)
    exp = np.where(m == 0.5, e - 1, e).astype(np.int64)
    exp = np.where(np.isinf(s), 127, exp)
    return np.clip(exp, -127, 127)


def encode_scale(dtype: ScaleDType, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Round float32 scales (``> 0``, already floored) to ``dtype``.

    Returns ``(s_q, stored)``: ``s_q`` the stored value decoded (float32, exact) and ``stored`` the little-endian
    bytes, uint8 ``[..., G * scale_bytes]`` for ``s`` of shape ``[..., G]``.
    """
    s = np.asarray(s, dtype=np.float32)
    if dtype == ScaleDType.fp32:
        return s.copy(), little_endian_bytes(s)
    if dtype == ScaleDType.fp16:  # saturate at the largest finite fp16, then round
        q = np.minimum(s, np.float32(65504.0)).astype(np.float16)
        return q.astype(np.float32), little_endian_bytes(q)
    if dtype == ScaleDType.bf16:  # saturate at the largest finite bf16, then round
        q = np.minimum(s, np.float32(ml_dtypes.finfo(ml_dtypes.bfloat16).max)).astype(ml_dtypes.bfloat16)
        return q.astype(np.float32), little_endian_bytes(q)
    if dtype == ScaleDType.fp8_e4m3:
        q = np.minimum(s, np.float32(448.0)).astype(ml_dtypes.float8_e4m3fn)
        return q.astype(np.float32), q.view(np.uint8).copy()
    if dtype == ScaleDType.e8m0:
        exp = e8m0_exponent(s)
        stored = np.where(np.isnan(s), 255, exp + 127).astype(np.uint8)
        return decode_scale(dtype, stored), stored
    raise ValueError(f"unknown scale dtype {dtype!r}")


def decode_scale(dtype: ScaleDType, stored: np.ndarray) -> np.ndarray:
    """Stored scale bytes uint8 ``[..., G * scale_bytes]`` -> float32 ``[..., G]``."""
    stored = np.asarray(stored, dtype=np.uint8)
    if dtype == ScaleDType.fp32:
        return from_little_endian(stored, np.float32).astype(np.float32)
    if dtype == ScaleDType.fp16:
        return from_little_endian(stored, np.float16).astype(np.float32)
    if dtype == ScaleDType.bf16:
        return from_little_endian(stored, ml_dtypes.bfloat16).astype(np.float32)
    if dtype == ScaleDType.fp8_e4m3:
        return stored.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    if dtype == ScaleDType.e8m0:
        out = np.ldexp(np.float64(1.0), stored.astype(np.int64) - 127).astype(np.float32)
        return np.where(stored == 255, np.float32(np.nan), out).astype(np.float32)
    raise ValueError(f"unknown scale dtype {dtype!r}")


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
