"""One side (keys or values): scales, encode, decode and the quantization error bound.

Rules, per side, for an input ``x`` float32 ``[T, H, D]`` (T tokens, H KV heads, D head size):
  * Unquantized (bf16/fp16/fp32): the code is ``x`` rounded into the element type; no scale.
  * Static scale ``s`` (fp32): ``per_tensor`` one value, ``per_head`` one per KV head. Not stored in the page.
  * Dynamic ``per_token_head`` scale, per (token, head): ``absmax = max |x|`` over D (float32);
    ``scale = max(absmax / qmax, min)`` in float32 (qmax 127 int8, 448 e4m3, 57344 e5m2; ``min`` from the spec
    as float32). A NaN in the vector makes its scale NaN.
  * ``apply: divide`` -> ``v = x / s``; ``apply: reciprocal_multiply`` -> ``v = x * (1 / s)``; all float32.
  * ``v`` becomes a code by :func:`reference.codes.encode_codes` (fp8: clip then round half even; int8: the
    rounding rule, then clip).
  * Decode: ``code * scale``, computed in float64 (exact: at most 24 x 11 significant bits).
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np

from ._schema import ApplyScale, ElementType, Granularity, Placement, ScaleDType, SideSpec
from .codes import CODE_RANGE, FP8_DTYPES, decode_codes, encode_codes, half_ulp, overflow_threshold
from .codes import require_element

StaticScale = Union[float, np.ndarray, list, None]

#: fp32 slack, in units of |x|, for the two float32 roundings of ``x * (1 / s)`` (at most 2 * 2**-24 relative,
#: doubled for margin; it also covers a kernel that decodes ``code * scale`` in float32, one more 2**-24).
RELATIVE_SLACK = 2.0**-22
#: int8 half_away_from_zero slack, in code units: ``v + 0.5`` is rounded to float32 before the truncation, which can
#: move it by half an ulp at |v + 0.5| <= 128.5, i.e. at most 2**-17 (example: 0.5 - 2**-25 -> 1). Doubled.
INT_ROUNDING_SLACK = 2.0**-16


# --- support checks -------------------------------------------------------------------------------------------------


def require_side(side: SideSpec) -> None:
    """Raise NotImplementedError for side features outside the first milestone."""
    require_element(side.element)
    if side.zero_point is not None:
        raise NotImplementedError("reference: zero points are not supported yet")
    if side.rotation is not None:
        raise NotImplementedError("reference: rotation is not supported yet")
    if side.residual is not None:
        raise NotImplementedError("reference: a full-precision residual is not supported yet")
    scale = side.scale
    if scale is None:
        return
    if scale.granularity not in (Granularity.per_tensor, Granularity.per_head, Granularity.per_token_head):
        raise NotImplementedError(f"reference: granularity {scale.granularity.value} is not supported yet")
    if scale.global_scale:
        raise NotImplementedError("reference: a global scale is not supported yet")
    if scale.granularity == Granularity.per_token_head:
        if scale.placement != Placement.inline:
            raise NotImplementedError(f"reference: scale placement {scale.placement.value} is not supported yet")
        if scale.dtype != ScaleDType.fp32:
            raise NotImplementedError(f"reference: scale dtype {scale.dtype.value} is not supported yet")


def is_dynamic(side: SideSpec) -> bool:
    """True when the side's scale is computed on write (and stored in the page)."""
    return side.scale is not None and not side.scale.granularity.is_static


def is_static(side: SideSpec) -> bool:
    """True when the side has a per-layer scale owned by the cache object (per_tensor / per_head)."""
    return side.scale is not None and side.scale.granularity.is_static


# --- inputs ---------------------------------------------------------------------------------------------------------


def as_float32(x: np.ndarray) -> np.ndarray:
    """Convert an input to float32 exactly (fp32/fp16/bf16, or float64 holding float32 values); refuse rounding."""
    a = np.asarray(x)
    out = a.astype(np.float32)
    if a.dtype.itemsize > 4 and not np.array_equal(out.astype(a.dtype), a, equal_nan=True):
        raise ValueError("input is not exactly representable in float32: pass float32 (or bf16/fp16) values")
    return out


def static_scale_array(side: SideSpec, static_scale: StaticScale, num_heads: int) -> np.ndarray:
    """The static scale as float32 shaped to broadcast over ``[T, H, D]``: ``()`` or ``[H, 1]``.

    ``None`` means 1.0 (vLLM's value when the checkpoint has no scale). per_tensor takes one value, per_head one per
    KV head (any shape with H elements, e.g. the checkpoint's ``(H, 1, 1)``). A scale must be finite and > 0.
    """
    assert side.scale is not None
    s = np.float32(1.0) if static_scale is None else np.asarray(static_scale, dtype=np.float32)
    if not np.all(np.isfinite(s) & (s > 0)):
        raise ValueError(f"a static scale must be finite and > 0, got {static_scale!r}")
    if side.scale.granularity == Granularity.per_tensor:
        if s.size != 1:
            raise ValueError(f"a per_tensor scale is one value, got shape {s.shape}")
        return s.reshape(())
    if s.size == 1 and static_scale is None:
        return s.reshape(())
    if s.size != num_heads:
        raise ValueError(f"a per_head scale has one value per KV head ({num_heads}), got shape {s.shape}")
    return s.reshape(num_heads, 1)


def dynamic_scale(side: SideSpec, x: np.ndarray) -> np.ndarray:
    """Per (token, head) scale, float32 ``[T, H]``: ``max(absmax / qmax, min)`` in float32."""
    assert side.scale is not None
    x = as_float32(x)
    qmax = np.float32(CODE_RANGE[side.element][1])
    absmax = np.max(np.abs(x), axis=-1)
    return np.maximum(absmax / qmax, np.float32(side.scale.min))


def apply_scale(side: SideSpec, x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``v = x / s`` (divide) or ``v = x * (1 / s)`` (reciprocal_multiply), all float32; ``scale`` broadcasts."""
    assert side.scale is not None
    s = np.asarray(scale, dtype=np.float32)
    if side.scale.apply == ApplyScale.divide:
        return (x / s).astype(np.float32)
    inv = (np.float32(1.0) / s).astype(np.float32)
    return (x * inv).astype(np.float32)


def element_scales(side: SideSpec, shape: tuple[int, ...], scale: StaticScale) -> np.ndarray:
    """The float32 scale of every element of an ``[..., H, D]`` array, broadcastable to ``shape``.

    ``scale`` is the stored ``[..., H]`` array for a dynamic side, the per-layer value(s) for a static one.
    """
    if is_dynamic(side):
        if scale is None:
            raise ValueError("a dynamic side needs its per (token, head) scales")
        return np.asarray(scale, dtype=np.float32)[..., None]
    return static_scale_array(side, scale, shape[-2])


# --- public API -----------------------------------------------------------------------------------------------------


def encode_side(side: SideSpec, x: np.ndarray, static_scale: StaticScale = None
                ) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """Encode ``x`` float32 ``[T, H, D]``.

    Returns ``(data, scale)``: data uint8 ``[T, H, D * bytes]`` (the side's data bytes of each cell) and, for a
    dynamic side, the float32 ``[T, H]`` scale stored beside it (``None`` otherwise).
    """
    require_side(side)
    x = as_float32(x)
    if x.ndim != 3:
        raise ValueError(f"x must be [T, H, D], got shape {x.shape}")
    if side.scale is None:
        if static_scale is not None:
            raise ValueError(f"an unquantized {side.element.value} side has no scale")
        return encode_codes(side.element, x), None
    if is_dynamic(side):
        if static_scale is not None:
            raise ValueError("a dynamic side computes its scale; do not pass a static one")
        scale = dynamic_scale(side, x)
        v = apply_scale(side, x, scale[..., None])
        return encode_codes(side.element, v, side.rounding), scale
    s = static_scale_array(side, static_scale, x.shape[1])
    return encode_codes(side.element, apply_scale(side, x, s), side.rounding), None


def decode_side(side: SideSpec, data: np.ndarray, scale: StaticScale = None) -> np.ndarray:
    """Decode data bytes ``[..., H, D * bytes]`` to float64 ``[..., H, D]``: ``code * scale``.

    ``scale``: for a dynamic side the stored float32 ``[..., H]`` scales; for a static side the per-layer scale
    (float, or H values; ``None`` = 1.0); for an unquantized side ``None``.
    """
    require_side(side)
    codes = decode_codes(side.element, data)
    if side.scale is None:
        if scale is not None:
            raise ValueError(f"an unquantized {side.element.value} side has no scale")
        return codes
    return codes * element_scales(side, codes.shape, scale).astype(np.float64)


def error_bound(side: SideSpec, x: np.ndarray, static_scale: StaticScale = None) -> np.ndarray:
    """Per-element bound, float64 like ``x``, on ``|decode(encode(x)) - x|`` for finite ``x``.

    * unquantized: half an ulp of the stored type at |x| (0 for fp32); ``inf`` where the value overflows to inf.
    * int8: ``scale * (0.5 + 2**-16 + excess) + |x| * 2**-22``;
    * fp8: ``scale * (half_ulp_fp8(|v|) + excess) + |x| * 2**-22``,
    where ``v = x / scale`` (float64) is the ideal code value, ``excess`` how far ``v`` lies outside the code range
    (saturation: the code is then the range end) and the fp8 half ulp is taken at ``v`` clipped to the range (the
    subnormal step below the smallest normal). The slack terms are :data:`RELATIVE_SLACK` (float32 products) and
    :data:`INT_ROUNDING_SLACK` (the float32 ``v + 0.5`` of half_away_from_zero).
    """
    require_side(side)
    x32 = as_float32(x)
    ax = np.abs(x32.astype(np.float64))
    if side.scale is None:
        # fp32 input stored as fp32 is exact; bf16/fp16 round to nearest
        bound = np.zeros_like(ax) if side.element == ElementType.fp32 else half_ulp(side.element, ax)
        return np.where(ax >= overflow_threshold(side.element), np.inf, bound)
    scale = dynamic_scale(side, x32) if is_dynamic(side) else static_scale
    s = np.broadcast_to(element_scales(side, x32.shape, scale).astype(np.float64), x32.shape)
    v = x32.astype(np.float64) / s
    lo, hi = CODE_RANGE[side.element]
    excess = np.maximum(np.maximum(lo - v, v - hi), 0.0)
    if side.element in FP8_DTYPES:
        step = half_ulp(side.element, np.clip(v, lo, hi))
    else:  # int8: 0.5 step (plus the float32 v + 0.5 slack)
        step = np.full_like(v, 0.5 + INT_ROUNDING_SLACK)
    return s * (step + excess) + ax * RELATIVE_SLACK

