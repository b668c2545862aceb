"""Codecs: one per number format, each rendering two Triton helpers used for elements and for scales alike.

A codec renders ``{prefix}encode(v)`` (fp32, already scaled -> integer code, rounding and saturation included) and
``{prefix}decode(code)`` (integer code -> fp32). Templates never look inside a codec: they load and store codes of
``codec.unit`` (the Triton integer type holding one code; sub-byte codes travel in ``tl.uint8`` and are packed by
the template) and call these two helpers. Adding a number format means adding one entry here and one template
under ``templates/codecs/``.

Every helper uses only integer and fp32 operations that the Triton interpreter and compiled GPU code evaluate
identically (../shared/TRITON_NOTES.md): no fp8, fp4 or bf16 casts, no fp32 division. The exceptions take a
``NATIVE`` constexpr and use hardware conversions or inline PTX only when it is set (compiled code on sm_89 or
newer): ``decode_dot``, ``decode_dot_bytes`` and ``encode_native``; tests/test_native_decode.py checks each against
its portable path on a GPU.
"""

from __future__ import annotations

import dataclasses
from .spec import ELEMENTS, ElementType, Rounding, ScaleDType, SideSpec

# 1.5 * 2**23: adding and subtracting it rounds an fp32 |x| < 2**22 to the nearest integer, ties to even.
RNE_MAGIC = 12582912.0


@dataclasses.dataclass(frozen=True)
class Codec:
    """What a template needs to know about one number format."""

    name: str
    template: str  # file under templates/codecs/
    bits: int
    params: dict  # template variables (exponent bias, rounding, ...)
    summary: str  # one line for the generated header

    @property
    def quantized_dot(self) -> str:
        """The tensor-core type the codes themselves are, for attention in the quantized domain (the query and the
        probabilities quantized to it): "int8", or "" when the codes are not such a type. fp8 e4m3 codes would
        qualify too, but on the H200 that path was slower than the exact default (fp8 dots of 16 query rows,
        swapped or not) and fp8 tensor cores accumulate with too few bits for large scores (benchmarks/RESULTS.md)."""
        if self.params.get("signed") and self.bits == 8:
            return "int8"
        return ""

    @property
    def byte_decode(self) -> bool:
        """Whether the codec renders ``{prefix}decode_dot_bytes(byte)``: compiled code's decode of all codes of each
        byte straight to fp16 (inline PTX; 2- and 4-bit integers, 4-bit minifloats without special values)."""
        if self.template == "int.py.jinja":
            return self.bits in (2, 4)
        return self.template == "minifloat.py.jinja" and self.bits == 4 and self.params.get("special") == "none"

    @property
    def dot_factor(self) -> float | None:
        """The power of two that ``{prefix}decode_dot_unscaled`` and ``{prefix}decode_dot_bytes_unscaled`` leave out
        of the codes' values (their fp16 bits read with fp16's exponent bias), for a template to fold into a factor it
        applies anyway (block ratios); None where the codec renders no unscaled decoders."""
        if self.byte_decode and self.template == "minifloat.py.jinja":
            return 2.0 ** (15 - self.params["bias"])
        return None

    @property
    def dot_bias(self) -> int | None:
        """The integer that ``{prefix}decode_dot_biased`` leaves in every code's value (fp16 1024 + the code), for a
        template to take away together with a zero point in one subtraction; None where the codec renders no biased
        decoder: it is for unsigned integers, the elements a zero point goes with."""
        if self.template == "int.py.jinja" and not self.params["signed"]:
            return 1024
        return None

    @property
    def native_encode(self) -> bool:
        """Whether the codec renders ``{prefix}encode_native(v, NATIVE)``: with ``NATIVE`` (compiled for sm_89 or
        newer) the hardware's conversion, which gives encode's bytes (rounding, saturating; NaN gets the codec's NaN
        code, or code 0 for integers); without it encode itself. fp8 e4m3 and e5m2, and 8-bit integers whose range
        is the whole byte (int8, uint8)."""
        return bool(self.params.get("native"))

    @property
    def exact_reciprocal(self) -> bool:
        """Whether the codec renders ``{prefix}reciprocal(code)``: 1 / decode(code) exactly, for every code (power-of-two
        values: e8m0). Dividing by such a value and multiplying by its reciprocal round the same real number."""
        return self.template == "e8m0.py.jinja"

    @property
    def significand(self) -> int:
        """Significant bits of any code's value (the product of two values needs at most the sum): a minifloat's
        mantissa bits and its implicit one, an integer's bits, a float's own precision; 0 for powers of two (e8m0)."""
        if self.template == "minifloat.py.jinja":
            return self.params["mant"] + 1
        if self.template == "int.py.jinja":
            return self.bits
        return {"fp32.py.jinja": 24, "fp16.py.jinja": 11, "bf16.py.jinja": 8}.get(self.template, 0)

    @property
    def code_step(self) -> float | None:
        """The smallest step between code values (every code's value is a multiple of it): a minifloat's smallest
        subnormal, 1 for integers; None for the unquantized floats and e8m0."""
        if self.template == "minifloat.py.jinja":
            return 2.0 ** (self.params["emin"] - self.params["mant"])
        if self.template == "int.py.jinja":
            return 1.0
        return None

    @property
    def max_value(self) -> float | None:
        """A minifloat's largest finite value (what encode saturates to); None for the other codecs."""
        return self.params["max_finite"] if self.template == "minifloat.py.jinja" else None

    @property
    def nan_as_zero(self) -> bool:
        """Whether the codes have no NaN, so that a NaN input is stored as the code of 0 (docs/SEMANTICS.md):
        integers, and minifloats without a NaN code (fp4 e2m1)."""
        return self.template in ("int.py.jinja", "minifloat.py.jinja") and self.params.get("nan_code") is None

    @property
    def unit(self) -> str:
        return {32: "tl.uint32", 16: "tl.uint16"}.get(self.bits, "tl.uint8")

    @property
    def unit_bytes(self) -> int:
        return max(self.bits // 8, 1)


# exponent bias, mantissa bits, exponent bits, largest finite value, NaN code, special values, Triton's own type
_MINIFLOATS = {
    "fp8_e4m3": dict(nbits=8, bias=7, mant=3, ebits=4, max_finite=448.0, nan_code=0x7F, special="fn",
                     native="tl.float8e4nv"),
    "fp8_e5m2": dict(nbits=8, bias=15, mant=2, ebits=5, max_finite=57344.0, nan_code=0x7E, special="ieee",
                     native="tl.float8e5"),
    # "fnuz" (AMD / Graphcore): no infinities, no negative zero; the negative-zero pattern 0x80 is the one NaN. Triton's
    # float8e4b8 exists on AMD only, so no native conversion here.
    "fp8_e4m3fnuz": dict(nbits=8, bias=8, mant=3, ebits=4, max_finite=240.0, nan_code=0x80, special="fnuz",
                         native=""),
    "fp4_e2m1": dict(nbits=4, bias=1, mant=1, ebits=2, max_finite=6.0, nan_code=None, special="none", native=""),
}


def _envelope(p: dict) -> list:
    """The lines (factor, constant) of a minifloat's encode as the least of one fma per binade (minifloat.py.jinja):
    binade e's code is (e - emin) * 2**mant + round(|v| * 2**(mant - e)), rounded by adding 1.5 * 2**23 plus the
    offset. For codes without special values whose binades are few (e2m1: 3); [] keeps the bit encoder, whose
    integer work does not grow with the binades. The offsets must be even for the sum's rounding to keep the code's
    parity, so at least one mantissa bit."""
    emin, emax = 1 - p["bias"], (1 << p["ebits"]) - 1 - p["bias"]
    if p["special"] != "none" or p["mant"] < 1 or emax - emin + 1 > 3:
        return []
    return [(2.0 ** (p["mant"] - e), RNE_MAGIC + (e - emin) * 2 ** p["mant"]) for e in range(emin, emax + 1)]


def _minifloat(name: str) -> Codec:
    p = dict(_MINIFLOATS[name])
    p.update(emin=1 - p["bias"], exp_mask=(1 << p["ebits"]) - 1, sign_bit=1 << (p["nbits"] - 1),
             rne_magic=RNE_MAGIC, max_code=(1 << (p["nbits"] - 1)) - 1, envelope=_envelope(p))
    how = "the least of one fma per binade" if p["envelope"] else "bit manipulation"
    return Codec(name, "minifloat.py.jinja", p["nbits"], p,
                 f"{name} by {how}: saturate to +-{p['max_finite']:g}, round half to even")


def _float(name: str) -> Codec:
    bits = {"fp32": 32, "fp16": 16, "bf16": 16}[name]
    return Codec(name, f"{name}.py.jinja", bits, {}, f"{name}, stored as its bits, rounded to nearest even")


def _int(element: ElementType, rounding: Rounding, zero_point: bool = False) -> Codec:
    info = ELEMENTS[element]
    signed = info.kind == "int"
    # 8-bit codes whose range is the whole byte: the hardware's saturating conversion to s8 / u8 is encode's clamp.
    native = {(-128.0, 127.0): "s8", (0.0, 255.0): "u8"}.get((info.qmin, info.qmax), "") if info.bits == 8 else ""
    # Narrower codes rounded half to even, on sides without a zero point: a NaN-keeping clamp, then one conversion
    # to s32 rounds and maps NaN to 0, which also replaces the writes' NaN select there. Static counts (python
    # benchmarks/sass_count.py --write): q4_0 228 -> 200 warp instructions per token-head (registers 87 -> 64),
    # mixed_k8_v4 210 -> 202. H200 (benchmarks/RESULTS.md, fourteenth session), writes of 32768 tokens: q4_0 80 ->
    # 67-68 us, mixed_k8_v4 77 -> 74. With a zero point (KIVI's flush, which keeps its NaN select) it would cost
    # more: 2240 -> 2408 instructions.
    if info.bits < 8 and rounding == Rounding.half_even and not zero_point:
        native = "s32"
    p = dict(qmin=info.qmin, qmax=info.qmax, rounding=rounding.value, rne_magic=RNE_MAGIC, signed=signed,
             mask=(1 << info.bits) - 1, half=1 << (info.bits - 1), native=native)
    return Codec(element.value, "int.py.jinja", info.bits, p,
                 f"{element.value}, round {rounding.value.replace('_', ' ')}, clamp to [{info.qmin:g}, {info.qmax:g}]")


def element_codec(side: SideSpec) -> Codec:
    """The codec of a side's element (codegen.support has already rejected elements without one)."""
    e = side.element
    if e.value in _MINIFLOATS:
        return _minifloat(e.value)
    if e in (ElementType.fp32, ElementType.fp16, ElementType.bf16):
        return _float(e.value)
    return _int(e, side.rounding or Rounding.half_even, side.zero_point is not None)


def scale_codec(dtype: ScaleDType) -> Codec:
    """The codec a dynamic scale is stored with."""
    if dtype == ScaleDType.e8m0:
        return Codec("e8m0", "e8m0.py.jinja", 8, {}, "e8m0: power of two, exponent rounded up")
    if dtype == ScaleDType.fp8_e4m3:
        return _minifloat("fp8_e4m3")
    return _float(dtype.value)


# smallest positive value of each scale dtype: the floor of a stored dynamic scale
SCALE_TINY = {
    ScaleDType.fp32: 2.0 ** -149,
    ScaleDType.fp16: 2.0 ** -24,
    ScaleDType.bf16: 2.0 ** -133,
    ScaleDType.fp8_e4m3: 2.0 ** -9,
    ScaleDType.e8m0: 2.0 ** -127,
}

# scale dtypes whose encoding does not saturate by itself (IEEE overflow to inf): clamp to these first
SCALE_MAX = {
    ScaleDType.fp16: 65504.0,
    ScaleDType.bf16: 3.3895313892515355e38,
}

# code widths the templates pack: whole bytes, or 2 / 4 codes per byte (a width that does not divide 8, as FP6's or a
# 3-bit integer's, would need codes that straddle bytes)
PACKED_BITS = (2, 4)


def has_codec(element: ElementType) -> bool:
    """Whether kvgen can render this element: a codec for its kind and a code width the templates store."""
    info = ELEMENTS.get(element)
    if info is None:
        return False
    if info.kind == "float":
        return element in (ElementType.fp32, ElementType.fp16, ElementType.bf16)
    if info.bits not in PACKED_BITS + (8,):
        return False
    if info.kind == "fp":
        return element.value in _MINIFLOATS and _MINIFLOATS[element.value]["nbits"] == info.bits
    return info.kind in ("int", "uint")

