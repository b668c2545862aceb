"""Element codecs: one class per element family, each rendering two Triton helpers for a side.

A codec renders ``{prefix}encode(v)`` (fp32 already scaled -> integer code, rounding and saturation included) and
``{prefix}decode(code)`` (integer code -> fp32). Templates never look inside a codec: they load and store codes of
``codec.unit`` (the Triton integer type holding one element's bits) and call these two helpers. Adding an element
type means adding one codec here and one template under ``templates/codecs/``.

Every helper uses only integer and fp32 operations that the Triton interpreter and compiled GPU code evaluate
identically (../shared/TRITON_NOTES.md): no fp8 or bf16 casts, no fp32 division.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from .spec import ElementType, Rounding, SideSpec

# 1.5 * 2**23: adding and subtracting it rounds an fp32 |x| < 2**22 to the nearest integer, ties to even.
RNE_MAGIC = 12582912.0


@dataclasses.dataclass(frozen=True)
class Codec:
    """What a template needs to know about one side's element codec."""

    element: ElementType
    template: str  # file under templates/codecs/
    bits: int
    unit: str  # Triton integer type of one stored element: tl.uint8 / tl.uint16 / tl.uint32
    params: dict  # extra template variables (exponent bias, rounding, ...)
    summary: str  # one line for the generated header

    @property
    def unit_bytes(self) -> int:
        return self.bits // 8


def _float_codec(e: ElementType, side: SideSpec) -> Codec:
    bits = {ElementType.fp32: 32, ElementType.fp16: 16, ElementType.bf16: 16}[e]
    unit = {32: "tl.uint32", 16: "tl.uint16"}[bits]
    return Codec(e, f"{e.value}.py.jinja", bits, unit, {}, f"{e.value}, stored as its bits, rounded to nearest even")


def _fp8_codec(e: ElementType, side: SideSpec) -> Codec:
    if e == ElementType.fp8_e4m3:
        # e4m3fn: bias 7, 3 mantissa bits, no infinities, 0x7F / 0xFF are NaN, max finite 448
        p = dict(mant=3, bias=7, emin=-6, max_finite=448.0, nan_code=0x7F, exp_mask=0xF, has_inf=False)
    else:
        # e5m2: bias 15, 2 mantissa bits, IEEE-like infinities (0x7C) and NaNs (0x7D..0x7F), max finite 57344
        p = dict(mant=2, bias=15, emin=-14, max_finite=57344.0, nan_code=0x7E, exp_mask=0x1F, has_inf=True)
    p["rne_magic"] = RNE_MAGIC
    return Codec(e, "fp8.py.jinja", 8, "tl.uint8", p,
                 f"{e.value} by bit manipulation: saturate to +-{p['max_finite']:g}, round half to even")


def _int_codec(e: ElementType, side: SideSpec) -> Codec:
    info = side.info
    rounding = side.rounding or Rounding.half_even
    p = dict(qmin=info.qmin, qmax=info.qmax, rounding=rounding.value, rne_magic=RNE_MAGIC,
             mask=(1 << info.bits) - 1, half=1 << (info.bits - 1))
    return Codec(e, "int.py.jinja", info.bits, "tl.uint8", p,
                 f"{e.value}, round {rounding.value.replace('_', ' ')}, clamp to [{info.qmin:g}, {info.qmax:g}]")


_FACTORIES: dict[ElementType, Callable[[ElementType, SideSpec], Codec]] = {
    ElementType.fp32: _float_codec,
    ElementType.fp16: _float_codec,
    ElementType.bf16: _float_codec,
    ElementType.fp8_e4m3: _fp8_codec,
    ElementType.fp8_e5m2: _fp8_codec,
    ElementType.int8: _int_codec,
}


def codec_for(side: SideSpec) -> Codec:
    """The codec of a side's element; codegen.support has already rejected elements without one."""
    return _FACTORIES[side.element](side.element, side)


def has_codec(element: ElementType) -> bool:
    return element in _FACTORIES
