"""One side (keys or values): rotation, scales, zero points, encode, decode and the quantization error bound.

Rules, per side, for an input ``x`` float32 ``[T, H, D]`` (T tokens, H KV heads, D head size), from
docs/SEMANTICS.md; all arithmetic float32 round-to-nearest-even unless said otherwise:
  * Rotation (optional) first: ``x' = FWHT_b(x * signs)`` (:mod:`.rotation`); everything below works on ``x'``.
  * Unquantized (bf16/fp16/fp32): the code is ``x'`` rounded into the element type; no scale.
  * Static scale ``s`` (fp32, owned by the cache object): ``per_tensor`` one value, ``per_head`` one per KV head;
    ``s_eff = s``. ``None`` means 1.0.
  * Dynamic scale per group (``per_token_head``: the head vector; ``per_block`` with ``block: N``: N consecutive
    elements of it):
      1. symmetric ``s = amax / qmax``; asymmetric ``s = (hi - lo) / qmax`` with ``lo = min(min x, 0)``, ``hi = max(max x, 0)`` (``hi - lo`` in float32);
      2. ``global_scale: true``: ``s = s / g`` with ``g`` the side's per-layer fp32 global scale (passed where a
         static scale goes: ``k_scale`` / ``v_scale``; ``None`` = 1.0);
      3. floor ``s = max(s, min, tiny)`` (``min`` from the spec, rounded to float32; ``tiny`` of the scale dtype);
      4. round to the scale dtype (:func:`.codes.encode_scale`) -> ``s_q``; with ``zero_point: scale_low_bits``
         (fp32 only) ``s_q = float(bits(s) & ~(2^B - 1))``, B the element's bits;
      5. ``s_eff = s_q`` (``fp32(s_q * g)`` with a global scale).
  * Zero point (asymmetric, uintB): ``zp = clamp(round(-lo / s_eff), 0, 2^B - 1)`` (the side's rounding, float32
    division), stored as one uint8 per group (``beside_scale``) or in the low B bits of the fp32 scale.
  * Float zero point (``zero_point: {dtype: fp16 | fp32}``, KIVI; SEMANTICS.md "Float zero points"): ``lo = min x``,
    ``hi = max x`` (no 0 in the range); ``s = (hi - lo) / qmax`` floored and rounded as above -> ``s_q``; ``m`` =
    ``lo`` rounded to the zero-point dtype (fp16 saturates at +-65504, then rounds half to even); encode
    ``v = (x' - m) / s_q`` (or ``(x' - m) * (1 / s_q)``), code ``clamp(round(v), 0, qmax)``; decode
    ``code * s_q + m``. ``m`` is stored beside its scale, ``groups * 2`` (fp16) or ``* 4`` (fp32) bytes,
    little-endian, aligned to its size. Not combined with a global scale (undefined).
  * Encode: ``v = x' / s_eff`` (divide) or ``x' * (1 / s_eff)`` (reciprocal_multiply), ``+ zp`` (float32 add);
    then the element code (:mod:`.codes`).
  * Decode: ``(code - zp) * s_eff`` in float64 (exact), then the inverse rotation in float64.
Anything SEMANTICS.md leaves out raises ``NotImplementedError("reference: ...")``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import numpy as np

from . import rotation as rot
from ._schema import ApplyScale, ElementType, Granularity, ScaleDType, SideSpec
from .codes import (CODE_RANGE, ELEMENT_BITS, FLOAT_DTYPES, INTEGERS, LOWBIT_FLOATS, QMAX, SCALE_BYTES, SCALE_TINY,
                    decode_codes, decode_scale, element_bytes_ceil, encode_codes, encode_scale, from_little_endian,
                    half_ulp, little_endian_bytes, overflow_threshold, round_int)

StaticScale = Union[float, np.ndarray, list, None]

#: numpy dtype of each zero-point dtype (uint8: an integer code offset; fp16 / fp32: a float offset, the group min).
ZP_DTYPES: dict[str, type] = {"uint8": np.uint8, "fp16": np.float16, "fp32": np.float32}

#: Slack, in code units per unit of ``|x' / s| + zp + 1``, for the float32 roundings between the ideal code value
#: ``x' / s_eff + zp`` and the value that is rounded to a code: the division (or the reciprocal and the product: two
#: roundings), the ``+ zp`` addition, the ``+-0.5`` addition of half_away_from_zero, each at most 2**-24 relative;
#: then doubled, because a low-bit float code's half step is taken at the ideal value, which may sit in the binade
#: below the computed one. 2**-21 is sound with margin.
CODE_SLACK = 2.0**-21
#: float32 rounding of the forward FWHT, per stage, relative to the block's L1 norm (2**-24, doubled).
FWHT_SLACK = 2.0**-23
#: float64 rounding of the inverse FWHT, per stage and one more, relative to the rotated block's L1 norm / b.
INVERSE_SLACK = 2.0**-50


# --- support checks -------------------------------------------------------------------------------------------------



# elements without a NaN code: NaN inputs are treated as 0.0
NAN_AS_ZERO = frozenset({ElementType.int8, ElementType.int4, ElementType.int2, ElementType.uint8, ElementType.uint4,
                         ElementType.uint2, ElementType.fp4_e2m1})

def require_side(side: SideSpec) -> None:
    """Raise NotImplementedError for side features SEMANTICS.md does not define."""
    if side.residual is not None:
        raise NotImplementedError("reference: a full-precision residual window is not defined in SEMANTICS.md")
    if side.rotation is not None and side.rotation.kind != "hadamard":
        raise NotImplementedError(f"reference: rotation {side.rotation.kind} is not supported")
    scale = side.scale
    if scale is None:
        if side.element not in FLOAT_DTYPES:
            raise ValueError(f"element {side.element.value} needs a scale")
        return
    g = scale.granularity
    if g not in (Granularity.per_tensor, Granularity.per_head, Granularity.per_token_head, Granularity.per_block):
        raise NotImplementedError(f"reference: granularity {g.value} is not defined in SEMANTICS.md")
    if g == Granularity.per_block:
        assert scale.block is not None
        if scale.block & (scale.block - 1):
            raise NotImplementedError(f"reference: per_block block {scale.block} is not a power of two")
    if g.is_static and scale.global_scale:
        raise NotImplementedError("reference: a global scale with a static scale is not defined in SEMANTICS.md")
    zp = side.zero_point
    if zp is not None:
        if g.is_static:
            raise NotImplementedError("reference: a zero point with a static scale is not defined in SEMANTICS.md")
        if zp.dtype not in ZP_DTYPES:
            raise NotImplementedError(f"reference: zero point dtype {zp.dtype} is not defined in SEMANTICS.md")
        if zp.dtype != "uint8":
            if zp.storage != "beside_scale":
                raise NotImplementedError(f"reference: a float ({zp.dtype}) zero point is stored beside_scale")
            if scale.global_scale:
                raise NotImplementedError("reference: a float zero point with a global scale is not defined in "
                                          "SEMANTICS.md")
        if zp.storage == "scale_low_bits" and scale.dtype != ScaleDType.fp32:
            raise NotImplementedError(f"reference: zero point in the low bits of a {scale.dtype.value} scale "
                                      "(SEMANTICS.md: fp32 only)")


def is_dynamic(side: SideSpec) -> bool:
    """True when the side's scale is computed on write (and stored with the data)."""
    return side.scale is not None and not side.scale.granularity.is_static


def is_static(side: SideSpec) -> bool:
    """True when the side has a per-layer scale owned by the cache object (per_tensor / per_head)."""
    return side.scale is not None and side.scale.granularity.is_static


def is_asymmetric(side: SideSpec) -> bool:
    return side.zero_point is not None


def has_float_zp(side: SideSpec) -> bool:
    """True for a float zero point (``zero_point.dtype`` fp16 / fp32: the group minimum is the offset)."""
    return side.zero_point is not None and side.zero_point.dtype != "uint8"


def zp_bytes(side: SideSpec) -> int:
    """Bytes of one stored zero point: 1 (uint8) or 2 / 4 (fp16 / fp32); 0 without a beside_scale zero point."""
    if side.zero_point is None or side.zero_point.storage != "beside_scale":
        return 0
    return np.dtype(ZP_DTYPES[side.zero_point.dtype]).itemsize


def encode_zero(side: SideSpec, lo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float zero point: ``m`` = float32 ``lo`` rounded to the zero-point dtype (fp16: clamp to +-65504 first, then
    round half to even). Returns ``(m as float32, stored little-endian bytes [..., G * size])``."""
    assert side.zero_point is not None
    lo = np.asarray(lo, dtype=np.float32)
    if side.zero_point.dtype == "fp16":
        q = np.clip(lo, np.float32(-65504.0), np.float32(65504.0)).astype(np.float16)
    elif side.zero_point.dtype == "fp32":
        q = lo.copy()
    else:
        raise ValueError(f"zero point dtype {side.zero_point.dtype} is not a float")
    return q.astype(np.float32), little_endian_bytes(q)


def decode_zero(side: SideSpec, stored: np.ndarray) -> np.ndarray:
    """Stored float zero-point bytes uint8 ``[..., G * size]`` -> float32 ``[..., G]``."""
    assert side.zero_point is not None
    return from_little_endian(stored, ZP_DTYPES[side.zero_point.dtype]).astype(np.float32)


def finite_range(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Min and max over the finite values along ``axis`` (SEMANTICS.md "Non-finite inputs": NaN and +-inf do not
    set scales); a group with no finite value gets (0, 0). A zero minimum or maximum is +0 (SEMANTICS.md "Float zero
    points": -0 and +0 compare equal, so which one a reduction returns depends on its order)."""
    x = np.asarray(x, dtype=np.float32)
    fin = np.isfinite(x)
    lo = np.min(np.where(fin, x, np.float32(np.inf)), axis=axis)
    hi = np.max(np.where(fin, x, np.float32(-np.inf)), axis=axis)
    empty = lo > hi
    lo = np.where(empty | (lo == 0), np.float32(0), lo).astype(np.float32)
    hi = np.where(empty | (hi == 0), np.float32(0), hi).astype(np.float32)
    return lo, hi


def sanitize_nan(side: SideSpec, x: np.ndarray) -> np.ndarray:
    """Integer and fp4 codes have no NaN: a NaN input is stored as 0.0 would be (before scaling). An unquantized
    rotated side stores a NaN of the rotation as the positive quiet NaN (its sign and payload are the arithmetic's,
    undefined)."""
    if side.element in NAN_AS_ZERO:
        return np.where(np.isnan(x), np.float32(0), x).astype(np.float32)
    if side.rotation is not None and side.scale is None:
        return np.where(np.isnan(x), np.float32(np.nan), x).astype(np.float32)
    return x


def float_zp_scale(side: SideSpec, lo: np.ndarray, hi: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Scale and float zero point of groups with float32 minimum ``lo`` and maximum ``hi`` (any shape ``[..., G]``).

    ``s = (hi - lo) / qmax`` (float32), floor ``max(s, min, tiny)``, rounded to the scale dtype -> ``s_q``; ``m`` =
    ``lo`` in the zero-point dtype. Returns ``(s_q, m, scale bytes [..., G * scale_bytes], zp bytes [..., G * size])``.
    """
    scale = side.scale
    assert scale is not None and has_float_zp(side)
    qmax = np.float32(QMAX[side.element])
    lo = np.asarray(lo, dtype=np.float32)
    hi = np.asarray(hi, dtype=np.float32)
    with np.errstate(over="ignore"):
        s = ((hi - lo).astype(np.float32) / qmax).astype(np.float32)
    s = np.maximum(np.maximum(s, np.float32(scale.min)), np.float32(SCALE_TINY[scale.dtype])).astype(np.float32)
    s_q, stored = encode_scale(scale.dtype, s)
    m, zp_stored = encode_zero(side, lo)
    return s_q, m, stored, zp_stored


def float_zp_values(side: SideSpec, x: np.ndarray, s_q: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``v = (x - m) / s_q`` or ``(x - m) * (1 / s_q)`` (per ``apply``), float32; ``s_q`` / ``m`` broadcast."""
    d = (np.asarray(x, dtype=np.float32) - np.asarray(m, dtype=np.float32)).astype(np.float32)
    return apply_scale(side, d, s_q)


def has_global_scale(side: SideSpec) -> bool:
    return side.scale is not None and side.scale.global_scale


def takes_layer_scale(side: SideSpec) -> bool:
    """True when ``k_scale`` / ``v_scale`` means something for this side (a static or a global scale)."""
    return is_static(side) or has_global_scale(side)


def groups(side: SideSpec, head_size: int) -> tuple[int, int]:
    """``(G, N)``: scale groups per head vector and elements per group of a dynamic side."""
    assert side.scale is not None
    if side.scale.granularity == Granularity.per_block:
        n = side.scale.block
        assert n is not None
        if head_size % n:
            raise ValueError(f"per_block block {n} does not divide head size {head_size}")
        return head_size // n, n
    return 1, head_size


def data_bytes(side: SideSpec, head_size: int) -> int:
    """Bytes of one side's data per (slot, head): ``ceil(D * bits / 8)``."""
    return element_bytes_ceil(side.element, head_size)


def scale_field_bytes(side: SideSpec, head_size: int) -> int:
    """Bytes of the scale field (all groups) of a dynamic side per (slot, head); 0 otherwise."""
    if not is_dynamic(side):
        return 0
    assert side.scale is not None
    return groups(side, head_size)[0] * SCALE_BYTES[side.scale.dtype]


def zp_field_bytes(side: SideSpec, head_size: int) -> int:
    """Bytes of the zero-point field (``beside_scale``: one uint8, fp16 or fp32 per group) per (slot, head); 0
    otherwise."""
    if side.zero_point is None or side.zero_point.storage != "beside_scale":
        return 0
    return groups(side, head_size)[0] * zp_bytes(side)


# --- inputs ---------------------------------------------------------------------------------------------------------


def as_float32(x: np.ndarray) -> np.ndarray:
    """Convert an input to float32 exactly (fp32/fp16/bf16, or float64 holding float32 values); refuse rounding."""
    a = np.asarray(x)
    out = a.astype(np.float32)
    if a.dtype.itemsize > 4 and not np.array_equal(out.astype(a.dtype), a, equal_nan=True):
        raise ValueError("input is not exactly representable in float32: pass float32 (or bf16/fp16) values")
    return out


def _positive_finite(value: StaticScale, what: str) -> np.ndarray:
    s = np.float32(1.0) if value is None else np.asarray(value, dtype=np.float32)
    if not np.all(np.isfinite(s) & (s > 0)):
        raise ValueError(f"a {what} must be finite and > 0, got {value!r}")
    return np.asarray(s, dtype=np.float32)


def static_scale_array(side: SideSpec, static_scale: StaticScale, num_heads: int) -> np.ndarray:
    """The static scale as float32 shaped to broadcast over ``[..., H, D]``: ``()`` or ``[H, 1]``.

    ``None`` means 1.0 (vLLM's value when the checkpoint has no scale). per_tensor takes one value, per_head one per
    KV head (any shape with H elements, e.g. the checkpoint's ``(H, 1, 1)``) or one value for all heads. A scale must
    be finite and > 0.
    """
    assert side.scale is not None
    s = _positive_finite(static_scale, "static scale")
    if side.scale.granularity == Granularity.per_tensor:
        if s.size != 1:
            raise ValueError(f"a per_tensor scale is one value, got shape {s.shape}")
        return s.reshape(())
    if s.size == 1:  # one value for every KV head (as the runtime accepts it)
        return s.reshape(())
    if s.size != num_heads:
        raise ValueError(f"a per_head scale has one value per KV head ({num_heads}), got shape {s.shape}")
    return s.reshape(num_heads, 1)


def global_scale_value(side: SideSpec, g: StaticScale) -> np.float32:
    """The side's per-layer fp32 global scale (``None`` = 1.0)."""
    s = _positive_finite(g, "global scale")
    if s.size != 1:
        raise ValueError(f"a global scale is one value per layer, got shape {s.shape}")
    return np.float32(s.reshape(()))


def _check_layer_scale(side: SideSpec, value: StaticScale) -> None:
    if value is not None and not takes_layer_scale(side):
        kind = "unquantized" if side.scale is None else "dynamic"
        raise ValueError(f"a {kind} {side.element.value} side without a global scale takes no k_scale / v_scale")


def apply_scale(side: SideSpec, x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``v = x / s`` (divide) or ``v = x * (1 / s)`` (reciprocal_multiply), all float32; ``scale`` broadcasts."""
    assert side.scale is not None
    s = np.asarray(scale, dtype=np.float32)
    if side.scale.apply == ApplyScale.divide:
        return (x / s).astype(np.float32)
    with np.errstate(divide="ignore", over="ignore"):
        inv = (np.float32(1.0) / s).astype(np.float32)
    # a reciprocal that overflowed to inf (a scale at or below 2**-128) leaves zeros as they are: 0 * inf would be NaN
    with np.errstate(invalid="ignore"):
        return np.where(x == 0, x, x * inv).astype(np.float32)


def rotate_side(side: SideSpec, x: np.ndarray) -> np.ndarray:
    """The values the side scales and encodes: ``x`` (float32), rotated when the side has a rotation."""
    x = as_float32(x)
    return rot.rotate(side.rotation.seed, x) if side.rotation is not None else x


def unrotate_side(side: SideSpec, x: np.ndarray) -> np.ndarray:
    """Float64 values back in the input's basis (identity without rotation)."""
    x = np.asarray(x, dtype=np.float64)
    return rot.unrotate(side.rotation.seed, x) if side.rotation is not None else x


# --- encoding -------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SideEncoding:
    """What one side stores for ``x`` ``[T, H, D]``, and the numbers behind it.

    ``data``: uint8 ``[T, H, ceil(D * bits / 8)]``; ``scale``: the stored scale field, uint8
    ``[T, H, G * scale_bytes]`` (dynamic sides; with ``scale_low_bits`` the zero points are inside), else None;
    ``zp``: the ``beside_scale`` zero-point field, uint8 ``[T, H, G * zp bytes]``, else None. ``rotated``: the
    float32 values that were scaled (``x`` itself without rotation); ``s_eff`` / ``zero_point``: float32 per element
    ``[T, H, D]`` (None for an unquantized side / a symmetric one); with a float zero point ``zero_point`` is ``m``,
    the offset in value units (decode ``code * s_eff + m``), else the integer code offset.
    """

    data: np.ndarray
    scale: Optional[np.ndarray]
    zp: Optional[np.ndarray]
    rotated: np.ndarray
    s_eff: Optional[np.ndarray]
    zero_point: Optional[np.ndarray]


def dynamic_scale(side: SideSpec, xr: np.ndarray, global_scale: StaticScale = None
                  ) -> tuple[np.ndarray, Optional[np.ndarray], np.ndarray, Optional[np.ndarray]]:
    """Scales of already-rotated float32 ``xr`` ``[T, H, D]``.

    Returns ``(s_eff, zp, scale_field, zp_field)``: float32 ``[T, H, G]``, float32 ``[T, H, G]`` or None (symmetric),
    the stored scale bytes uint8 ``[T, H, G * scale_bytes]``, the beside_scale zero-point bytes uint8
    ``[T, H, G * zp bytes]`` or None. With a float zero point, ``zp`` is ``m`` (float32, value units).
    """
    scale = side.scale
    assert scale is not None and is_dynamic(side)
    t, h, d = xr.shape
    g_count, n = groups(side, d)
    xg = xr.reshape(t, h, g_count, n)
    qmax = np.float32(QMAX[side.element])
    if has_float_zp(side):  # the group's min is the offset; no 0 in the range
        s_q, m, stored, zp_stored = float_zp_scale(side, *finite_range(xg, axis=-1))
        return s_q, m, stored, zp_stored
    if is_asymmetric(side):
        # the range always includes 0, so 0 is exactly representable and one-signed groups do not clip
        lo, hi = finite_range(xg, axis=-1)
        lo, hi = np.minimum(lo, np.float32(0)), np.maximum(hi, np.float32(0))
        s = ((hi - lo).astype(np.float32) / qmax).astype(np.float32)
    else:
        lo = None
        finite_abs = np.where(np.isfinite(xg), np.abs(xg), np.float32(0))  # non-finite values do not set scales
        s = (np.max(finite_abs, axis=-1) / qmax).astype(np.float32)
    g = global_scale_value(side, global_scale) if scale.global_scale else None
    if g is not None:
        s = (s / g).astype(np.float32)
    s = np.maximum(np.maximum(s, np.float32(scale.min)), np.float32(SCALE_TINY[scale.dtype])).astype(np.float32)
    s_q, stored = encode_scale(scale.dtype, s)
    low_bits = side.zero_point is not None and side.zero_point.storage == "scale_low_bits"
    mask = np.uint32((1 << ELEMENT_BITS[side.element]) - 1)
    if low_bits:
        s_q = (s_q.view(np.uint32) & ~mask).view(np.float32)
    s_eff = s_q if g is None else (s_q * g).astype(np.float32)
    zp = zp_field = None
    if lo is not None:
        zp = round_int((-lo).astype(np.float32) / s_eff, side.rounding)
        zp = np.clip(np.where(np.isnan(zp), np.float32(0), zp), np.float32(0), qmax).astype(np.float32)
        if low_bits:
            stored = little_endian_bytes(s_q.view(np.uint32) | zp.astype(np.uint32))
        else:
            zp_field = zp.astype(np.uint8)
    return s_eff, zp, stored, zp_field


def encode_side(side: SideSpec, x: np.ndarray, static_scale: StaticScale = None) -> SideEncoding:
    """Encode ``x`` float32 ``[T, H, D]`` (see :class:`SideEncoding`).

    ``static_scale``: the static scale of a per_tensor / per_head side, or the global scale ``g`` of a
    ``global_scale`` side (``None`` = 1.0); it must be None for other sides.
    """
    require_side(side)
    x = as_float32(x)
    if x.ndim != 3:
        raise ValueError(f"x must be [T, H, D], got shape {x.shape}")
    _check_layer_scale(side, static_scale)
    xr = sanitize_nan(side, rotate_side(side, x))
    if side.scale is None:
        return SideEncoding(encode_codes(side.element, xr), None, None, xr, None, None)
    if is_static(side):
        s = np.broadcast_to(static_scale_array(side, static_scale, x.shape[1]), x.shape).astype(np.float32)
        data = encode_codes(side.element, apply_scale(side, xr, s), side.rounding, side.packing)
        return SideEncoding(data, None, None, xr, s, None)
    t, h, d = x.shape
    g_count, n = groups(side, d)
    s_eff, zp, stored, zp_field = dynamic_scale(side, xr, static_scale)
    if has_float_zp(side):
        assert zp is not None
        v = float_zp_values(side, xr.reshape(t, h, g_count, n), s_eff[..., None], zp[..., None])
    else:
        v = apply_scale(side, xr.reshape(t, h, g_count, n), s_eff[..., None])
        if zp is not None:
            v = (v + zp[..., None]).astype(np.float32)
    data = encode_codes(side.element, v.reshape(t, h, d), side.rounding, side.packing)
    per_element = np.repeat(s_eff, n, axis=-1)
    zp_element = None if zp is None else np.repeat(zp, n, axis=-1)
    return SideEncoding(data, stored, zp_field, xr, per_element, zp_element)


# --- decoding -------------------------------------------------------------------------------------------------------


def stored_scales(side: SideSpec, scale: np.ndarray, zp: Optional[np.ndarray] = None,
                  global_scale: StaticScale = None) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """Stored fields -> ``(s_eff, zero point)`` float32 ``[..., G]`` (zero point None for a symmetric side; ``m``
    in value units for a float zero point)."""
    sc = side.scale
    assert sc is not None and is_dynamic(side)
    s_q = decode_scale(sc.dtype, scale)
    zero = None
    if side.zero_point is not None:
        if side.zero_point.storage == "scale_low_bits":
            mask = np.uint32((1 << ELEMENT_BITS[side.element]) - 1)
            bits = s_q.view(np.uint32)
            zero = (bits & mask).astype(np.float32)
            s_q = (bits & ~mask).view(np.float32)
        else:
            if zp is None:
                raise ValueError("an asymmetric side with beside_scale zero points needs its zero-point bytes")
            if has_float_zp(side):
                zero = decode_zero(side, zp)
            else:
                zero = np.asarray(zp, dtype=np.uint8).astype(np.float32)
    if sc.global_scale:
        s_q = (s_q * global_scale_value(side, global_scale)).astype(np.float32)
    return s_q, zero


def decode_side(side: SideSpec, data: np.ndarray, scale: Optional[np.ndarray] = None,
                zp: Optional[np.ndarray] = None, static_scale: StaticScale = None,
                head_size: Optional[int] = None) -> np.ndarray:
    """Decode a side's stored fields to float64 ``[..., H, D]`` values in the input's basis (unrotated).

    ``data`` uint8 ``[..., H, data bytes]``; ``scale`` the stored scale field ``[..., H, G * scale_bytes]`` and
    ``zp`` the beside_scale zero-point field ``[..., H, G * zp bytes]`` of a dynamic side; ``static_scale`` the
    static scale (per_tensor / per_head) or the global scale; ``head_size`` only when sub-byte codes end in a
    partial byte.
    """
    require_side(side)
    _check_layer_scale(side, static_scale)
    codes = decode_codes(side.element, data, head_size, side.packing)
    if side.scale is None:
        if scale is not None:
            raise ValueError(f"an unquantized {side.element.value} side has no scale")
        return unrotate_side(side, codes)
    if is_static(side):
        s = static_scale_array(side, static_scale, codes.shape[-2]).astype(np.float64)
        return unrotate_side(side, codes * s)
    if scale is None:
        raise ValueError("a dynamic side needs its stored scales")
    d = codes.shape[-1]
    g_count, n = groups(side, d)
    s_eff, zero = stored_scales(side, scale, zp, static_scale)
    c = codes.reshape(codes.shape[:-1] + (g_count, n))
    if has_float_zp(side):  # code * s_q + m
        assert zero is not None
        values = (c * s_eff[..., None].astype(np.float64) + zero[..., None].astype(np.float64)).reshape(codes.shape)
        return unrotate_side(side, values)
    if zero is not None:
        c = c - zero[..., None].astype(np.float64)
    with np.errstate(invalid="ignore"):  # 0 * inf = NaN where an fp16 / bf16 scale overflowed
        values = (c * s_eff[..., None].astype(np.float64)).reshape(codes.shape)
    return unrotate_side(side, values)


# --- error bound ----------------------------------------------------------------------------------------------------


def reciprocal_overflows(side: SideSpec, s: np.ndarray) -> np.ndarray:
    """Where a ``reciprocal_multiply`` side's ``div(1, s)`` is inf in float32 (``s`` at or below 2**-128): there
    every nonzero value scales to +-inf and takes the code at the end of the range of its sign (SEMANTICS.md,
    "Encode"); False everywhere for ``divide``."""
    s = np.asarray(s, dtype=np.float32)
    if side.scale is None or side.scale.apply != ApplyScale.reciprocal_multiply:
        return np.zeros(s.shape, dtype=bool)
    with np.errstate(divide="ignore", over="ignore"):
        return np.isinf(np.float32(1.0) / s)


def _rotated_bound(side: SideSpec, enc: SideEncoding) -> np.ndarray:
    """Bound on ``|decoded - x'|`` per element in the rotated basis (``x'`` the float32 values that were encoded)."""
    xr = enc.rotated.astype(np.float64)
    ax = np.abs(xr)
    if side.scale is None:
        bound = np.zeros_like(ax) if side.element == ElementType.fp32 else half_ulp(side.element, ax)
        return np.where(ax >= overflow_threshold(side.element), np.inf, bound)
    assert enc.s_eff is not None
    s = enc.s_eff.astype(np.float64)
    if has_float_zp(side):
        return float_zp_bound(side, xr, s, enc.zero_point)
    zp = np.zeros_like(s) if enc.zero_point is None else enc.zero_point.astype(np.float64)
    u = xr / s  # the ideal scaled value, exact in float64 up to 2**-53 relative
    v = u + zp
    lo, hi = CODE_RANGE[side.element]
    excess = np.maximum(np.maximum(lo - v, v - hi), 0.0)
    # a reciprocal that overflowed sends every nonzero value to the end of the code range of its sign
    saturated = reciprocal_overflows(side, enc.s_eff) & (xr != 0)
    excess = np.where(saturated, np.abs(np.where(xr > 0, hi, lo) - v), excess)
    if side.element in LOWBIT_FLOATS:
        step = half_ulp(side.element, np.clip(v, lo, hi))
    else:
        assert side.element in INTEGERS
        step = np.full_like(v, 0.5)
    slack = (np.abs(u) + zp + 1.0) * CODE_SLACK
    return s * (step + excess + slack)


def float_zp_bound(side: SideSpec, x: np.ndarray, s_q: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Bound on ``|code * s_q + m - x|`` per element (float64, shapes broadcast) for a float zero point.

    ``u = (x - m) / s_q`` is the ideal code value (float64); the code is ``clamp(round(u'), 0, qmax)`` with ``u'``
    the float32 value (``x - m``, then the division or the reciprocal and the product: at most 3 roundings of
    2**-24 relative, inside ``CODE_SLACK``). So ``|code - u| <= 0.5 + excess + slack`` with ``excess`` how far ``u``
    lies outside ``[0, qmax]`` (``m`` rounded above ``lo``, ``s_q`` rounded below ``s``, saturation). The float64
    decode adds at most ``2**-52 * (|m| + qmax * s_q)``.
    """
    x = np.asarray(x, dtype=np.float64)
    s = np.asarray(s_q, dtype=np.float64)
    m = np.asarray(m, dtype=np.float64)
    qmax = float(QMAX[side.element])
    u = (x - m) / s
    excess = np.maximum(np.maximum(-u, u - qmax), 0.0)
    # a reciprocal that overflowed sends every x other than m to code 0 or qmax (x - m is exact in float32 near 0)
    saturated = reciprocal_overflows(side, s) & (x != m)
    excess = np.where(saturated, np.abs(np.where(x > m, qmax, 0.0) - u), excess)
    slack = (np.abs(u) + 1.0) * CODE_SLACK
    return s * (0.5 + excess + slack) + 2.0**-52 * (np.abs(m) + qmax * s)


def error_bound(side: SideSpec, x: np.ndarray, static_scale: StaticScale = None) -> np.ndarray:
    """Per-element bound, float64 ``[T, H, D]``, on ``|decode(encode(x)) - x|`` for finite ``x``.

    In the rotated basis (``x'`` = ``x`` without rotation), for the scale ``s_eff`` and zero point ``zp`` the encoder
    really uses (so the scale dtype's rounding, e8m0's rounding up, the floor and the global scale are all in):
      * unquantized: half an ulp of the stored type at ``|x'|`` (0 for fp32); ``inf`` where it overflows to inf;
      * integers: ``s_eff * (0.5 + excess + slack)``; low-bit floats: ``s_eff * (half_ulp(clip(v)) + excess +
        slack)``, where ``v = x' / s_eff + zp`` is the ideal code value, ``excess`` how far it lies outside the code
        range (saturation), and ``slack = (|x' / s_eff| + zp + 1) * CODE_SLACK`` the float32 roundings.
    With a rotation, the unrotated error ``signs * H (e') / b`` of a block is at most ``sum(bound') / b`` per element,
    plus the float32 rounding of the forward transform (``log2(b) * FWHT_SLACK * |x_block|_1``) and the float64
    rounding of the inverse.
    """
    enc = encode_side(side, x, static_scale)
    bound = _rotated_bound(side, enc)
    if side.rotation is None:
        return bound
    t, h, d = bound.shape
    b = rot.block_size(d)
    stages = b.bit_length() - 1
    blocks = (t, h, d // b, b)
    l1_x = np.abs(as_float32(x).astype(np.float64)).reshape(blocks).sum(axis=-1)
    l1_rot = np.abs(enc.rotated.astype(np.float64)).reshape(blocks).sum(axis=-1)
    summed = bound.reshape(blocks).sum(axis=-1)
    per_block = (summed / b + stages * FWHT_SLACK * l1_x
                 + (stages + 1) * INVERSE_SLACK * (l1_rot + summed) / b)
    return np.repeat(per_block, b, axis=-1)


__all__ = [
    "SideEncoding", "StaticScale", "ZP_DTYPES", "apply_scale", "as_float32", "data_bytes", "decode_side",
    "decode_zero", "dynamic_scale", "encode_side", "encode_zero", "error_bound", "float_zp_bound", "float_zp_scale",
    "float_zp_values", "global_scale_value", "groups", "has_float_zp", "has_global_scale", "is_asymmetric",
    "is_dynamic", "is_static", "require_side", "rotate_side", "scale_field_bytes", "static_scale_array",
    "stored_scales", "takes_layer_scale", "unrotate_side", "zp_bytes", "zp_field_bytes",
]
