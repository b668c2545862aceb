"""Render a validated spec into the source files of its generated package (strings; writing is build.py's job)."""

from __future__ import annotations

import dataclasses
import json
import math
import pprint
import re
from pathlib import Path

import jinja2

from . import layout as layout_mod
from .codecs import SCALE_MAX, SCALE_TINY, Codec, element_codec, scale_codec
from .spec import (ELEMENTS, FP32_MAX, GLOBAL_SCALE_RANGE, ApplyScale, FormatSpec, Granularity, Placement,
                   ScaleDType, SideSpec)
from .support import check_supported
from .version import KVGEN_VERSION

TEMPLATES = Path(__file__).parent / "templates"

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(TEMPLATES)),
    undefined=jinja2.StrictUndefined,  # a missing variable is a bug in kvgen, never silent
    keep_trailing_newline=True,
    autoescape=False,
)
# `{{ macro(...) | at(n) }}`: a macro's lines (written at 4 spaces) shifted right by n, surrounding blank lines dropped
_ENV.filters["at"] = lambda text, n: "\n".join((" " * n + line) if line.strip() else "" for line in str(text).strip("\n").splitlines())


@dataclasses.dataclass(frozen=True)
class SideContext:
    """Everything the templates know about one side: validated values only, never raw spec text."""

    name: str  # key / value
    p: str  # k / v
    P: str  # K / V
    bits: int
    unit: str  # Triton integer type of one (unpacked) code
    unit_bytes: int
    packed: bool  # sub-byte codes, several per byte
    per_byte: int
    msb_first: bool
    code_mask: int
    scale: str  # none / per_tensor / per_head / dynamic
    group: str  # elements per dynamic scale along the head dimension ("HEAD_PAD" = the whole head)
    group_tokens: int  # KIVI keys: tokens per channel group
    ngroups: str  # scales per head vector (expression)
    asym: bool
    zp: str  # none / beside / low_bits / float (the group minimum as offset)
    zunit: str
    zbytes: int
    zp_max: str  # saturation of an fp16 minimum before rounding ("" for none)
    zp_clear: str  # mask that clears the zero point bits of an fp32 scale
    global_scale: bool
    qmax: str  # fp32 literal: the code range a dynamic scale maps the group's range to
    scale_floor: str
    scale_max: str  # saturation of fp16 / bf16 scales ("" when the codec saturates itself)
    apply: str
    fp64: bool  # write divisions through fp64 (fp64_quotient) instead of tl.math.div_rn
    rcp_overflow: bool  # reciprocal_multiply whose 1 / s can overflow to inf (rcp_can_overflow)
    sunit: str
    sunit_bytes: int
    meta_ptr: str
    rotate: bool
    rotation_seed: Optional[int]  # the rotation's sign seed (None without rotation): equal seeds, the same rotation
    rotate_dot: bool  # rotated, one scale factor per row, codes fp16 values: dequantize rotates back by a dot with R
    nan_as_zero: bool  # integer and fp4 codes have no NaN: NaN inputs are stored as 0.0
    native_nan_zero: bool  # ... which compiled writes leave to encode_native (NaN -> code 0): sides without zero point
    cast_input: bool  # the write's input cast to fp32 as is: unrotated fp64 divisions (ptxas fuses bf16 -> fp64)
    widen_nan: bool  # ... else widen() may clear NaN as it widens (nan_as_zero, no encode_native or rotation to wait for)
    range_first: bool  # dynamic absmax: the write reduces every value first, the finite ones only where needed
    finite_first: str  # guarded asymmetric sides: the largest range (hi - lo) of a tile that divides unguarded, else ""
    fast_div: str  # x / s through the group's reciprocal and one correction, compiled (FAST_DIV): fast_division
    fast_range: list  # [low, high] literals: a guarded side's scales take div_fast inside them (FAST_SCALE_RANGE)
    scale_rule: str
    codec_summary: str
    scale_summary: str
    dot: str  # tensor-core type whose values hold the attention operand exactly ("" = exact fp32 dots only)
    op_terms: int  # how many values of that type sum to one operand element (hi + lo)
    ratio_in_tile: bool  # block ratios multiply the codes in the tile's (fp16) type: every ratio is an fp16 value
    ratio_factors: int  # power-of-two ratios reaching below fp16 (e8m0; pow2_ratio_split): multiplied in fp16 as
    #                     one factor (1) or two (2, the first at least 2**-A); 0: not such a side
    ratio_split: str  # fp32 literal 2**-A
    ratio_split_inv: str  # 2**A
    ratio_split_exp: int  # A
    ratio_shift: str  # tok "fixed": fp32 literal 2**s, the block ratio is scale * 2**s for every block ("" otherwise)
    fixed_factor: str  # tok "fixed": fp32 literal 2**-s, what the dot's result takes back (times a global scale)
    byte_decode: bool  # compiled attention decodes all codes of a byte at once ({p}_decode_dot_bytes)
    dot_factor: str  # fp32 literal: what the unscaled decoders leave out of the codes, folded into the block ratios
    dot_bias: str  # integer literal the biased decoder leaves in the codes, taken away with the zero point ("" none)
    tok: str  # how the scale leaves the dot: none / const (one scalar) / token (one per row) / block / channel /
    #           fixed (block scales whose ratios need no per-row power of two: one constant, see fixed_block_shift)
    block_dots: bool  # tok "block" in two terms: decode (BLOCK_DOTS) takes one dot per block on the codes instead
    qdot: str  # quantized compute domain: "int8" dots on the codes themselves ("" = not offered)
    qdot_max: str  # fp32 literal: the largest code value of that type (127), what a row's largest maps to
    native_encode: bool  # compiled writes encode codes with the hardware's conversion ({p}_encode_native)
    native_scale_encode: bool  # ... and dynamic scales ({p}_scale_encode_native)
    native_scale_decode: bool  # compiled attention decodes block scales with the hardware's conversion ({p}_scale_decode_native)
    exact_reciprocal: bool  # dynamic power-of-two scales without a global scale: x / s == x * {p}_scale_reciprocal(code)
    fold_pow2: bool  # the power of two x / s is multiplied by goes into the encode's lines (fold_power_of_two)

    def shift_expr(self, i: str) -> str:
        """Bit position of sub-byte element ``i`` inside its byte."""
        pos = f"({i} % {self.per_byte})"
        if self.msb_first:
            pos = f"({self.per_byte - 1} - {pos})"
        return f"{pos} * {self.bits}"


def _float_literal(x: float) -> str:
    return repr(float(x))


def _fp32_constant(x: float) -> str:
    """An fp32 constant for Triton code: a literal, or for a value below fp32's normal range (a scale floor of 2**-149
    or 2**-133) a typed constant, since Triton takes such a literal as fp64 and would widen the tensor it meets. A
    value just above fp32's largest that rounds to it (a floor of 3.402823466385289e38; the schema rejects what rounds
    to infinity) is written as that largest value, which Triton takes as fp32."""
    if abs(x) > FP32_MAX:
        x = math.copysign(FP32_MAX, x)
    if x == 0 or abs(x) >= 2.0 ** -126:
        return _float_literal(x)
    return f"tl.full([], {_float_literal(x)}, tl.float32)"


def render_codec(codec: Codec, prefix: str, dot: bool = False, qdot: str = "", biased: bool = False,
                 times: bool = False) -> str:
    """``dot``: also render ``{prefix}decode_dot`` (code -> the attention dot operand: fp16 or bf16, exactly);
    ``qdot``: also ``{prefix}as_qdot`` (code -> itself as that tensor-core type: the quantized compute domain);
    ``biased`` (with ``dot``; unsigned integer codecs): also ``{prefix}decode_dot_biased``, which leaves
    ``codec.dot_bias`` in the values; ``times`` (envelope codecs): also ``{prefix}encode_signed_times``, the encode
    of a quotient times a power of two (fold_power_of_two)."""
    template = _ENV.get_template(f"codecs/{codec.template}")
    source = template.render(prefix=prefix, element=codec.name, bits=codec.bits, dot=dot, biased=biased,
                             times=times, **codec.params).strip()
    if qdot:
        source += "\n\n\n" + _ENV.get_template("codecs/as_qdot.py.jinja").render(prefix=prefix, qdot=qdot).strip()
    return source


def _float_codec_for(dtype: str) -> Codec:
    return scale_codec(ScaleDType(dtype))


# Block-scale dtypes whose every ratio to a power of two at or above the token's largest scale (in [2**-17, 2) for
# fp8_e4m3: 4 significant bits, smallest 2**-9 over at most 2**8) is an fp16 value, normal or subnormal. With one
# dot term the attention kernel multiplies the codes by such ratios in fp16 (one rounding of the exact product, as
# the fp32 product's conversion to the dot's fp16 would give). e8m0 ratios reach 2**-254, fp16 / bf16 ones 2**-39:
# they stay fp32. tests/test_dot_operand.py enumerates the claim.
RATIOS_IN_FP16 = ("fp8_e4m3",)


def fp64_quotient(side: SideSpec) -> bool:
    """Whether the write divides through fp64 (side.jinja's ``quotient`` / ``div64``: IEEE fp32 division's result,
    without ``tl.math.div_rn``'s long sequence) or keeps ``div_rn``. Both give the same bytes; the choice is speed.
    Measured on the H200 (writes of 32768 tokens as graph replays, benchmarks/RESULTS.md, eighth session): fp64 wins
    where the per-element quotient x / s is most of the work, static scales (fp8_e4m3 64 -> 59 us) and rotated sides
    (int4_per_token_head 141 -> 128 us); it loses where the per-group reciprocal and range divisions dominate
    (per-token-head reciprocal_multiply: int8 / fp8 85 / 82 -> 90 / 87 us, q8_0 80 -> 88, int8 asym 108 -> 115) and
    ties on the per-block divide formats (nvfp4, q4_0, mxfp8, mxfp4), which keep div_rn. Rotated sides of integer
    codes take fast_division's reciprocal instead (thirty-ninth session, static: int4 per token-head's write 90 -> 78
    registers, 21 -> 25 programs per SM; H100, fortieth session: its write of 256 tokens 8.2 -> 7.5 us, of 32768
    unchanged); rotated float codes keep fp64."""
    sc = side.scale
    if sc is None or sc.apply != ApplyScale.divide:
        return False
    return sc.granularity.is_static or (side.rotation is not None
                                        and ELEMENTS[side.element].kind not in ("int", "uint"))


def range_first(side: SideSpec) -> bool:
    """Whether the write of a dynamic side reduces its groups over every value first (one max per element; NaN and
    infinities propagate) and takes the masked reduction over the finite values only in a tile that holds one (a
    branch on the whole tile: side.jinja; compiled code only). Both give the same bytes; the choice is speed.
    Measured on the H200 (writes of 32768 tokens as graph replays, benchmarks/RESULTS.md, twelfth session): it gains
    where each element's own work is shortest, a hardware encode after a multiply by an exact reciprocal (mxfp8:
    69 -> 65 us), and loses 4-6% where the elements take more (int8 / fp8 per token-head, int8 asym, q4_0,
    mixed_k8_v4: the branch's tile-wide reduction lengthens each program, and its registers grow)."""
    sc = side.scale
    if sc is None or sc.granularity.is_static or sc.global_scale or side.zero_point is not None:
        return False
    minifloat = ELEMENTS[side.element].kind == "fp"  # int8 with the same scales: not measured
    return minifloat and element_codec(side).native_encode and scale_codec(sc.dtype).exact_reciprocal


# fast_division's verdicts: the scales always lie where div_fast gives div_rn's codes, or a runtime test of the tile's
# scales picks div_fast or div_rn
FAST_ALWAYS, FAST_GUARDED, FAST_SCALED = "always", "guarded", "scaled"
FAST_SCALE_RANGE = (2.0 ** -30, 2.0 ** 17)  # the scales for which div_fast's codes are div_rn's


def fast_division(side: SideSpec) -> str:
    """Whether a compiled write (FAST_DIV) may divide x / s for codes through the group's reciprocal, refined as
    ptxas refines div.rn's, and div.rn's own correction step (kernels.py.jinja's recip_fast / div_fast): scales
    divided per element (not through fp64), integer codes, and scales in FAST_SCALE_RANGE. Then the codes are
    div_rn's (benchmarks/check_fast_div.py checks it on a GPU). FAST_ALWAYS where the scale dtype confines them there
    (fp16 scales, floored: q4_0, KIVI), FAST_GUARDED where a test of each tile's scales picks the path at run time
    (fp32 scales, global scales: int8 asym); '' where it does not apply. The runtime's FAST_DIV turns it on for
    compiled writes. e2m1 codes would take it too (check_fast_div.py: the same e2m1 codes), but nvfp4's write
    measured 96 -> 97-98 us with the tile's test (H200, thirteenth session run 4: its branch and both paths cost
    what the division saved). FAST_SCALED (nvfp4: e2m1 codes, bounded scales times a global scale) needs no test:
    each group's scale is split into s' in [1, 2) and a power of two (side.jinja), and GLOBAL_SCALE_RANGE keeps the
    scales within [2**-60, 2**60], where every case div_corrected does not round as div_rn gives the same code: a
    quotient below 2**-59 (code 0) or, from |x| = 2**64 on, one that saturates (even as inf or NaN: the e2m1 encode
    saturates NaN, and takes the sign from x)."""
    sc = side.scale
    if sc is None or sc.granularity.is_static or sc.apply != ApplyScale.divide or fp64_quotient(side):
        return ""
    largest = SCALE_MAX.get(sc.dtype, scale_codec(sc.dtype).params.get("max_finite"))  # fp16, fp8: bounded
    if sc.global_scale and element_codec(side).params.get("envelope") and largest:
        # e2m1 codes (their encode saturates a NaN quotient) of bounded scales times a global one
        lo, hi = GLOBAL_SCALE_RANGE
        if max(sc.min, SCALE_TINY[sc.dtype]) * lo >= 2.0 ** -60 and largest * hi <= 2.0 ** 60:
            return FAST_SCALED
    if ELEMENTS[side.element].kind not in ("int", "uint"):
        return ""
    if scale_codec(sc.dtype).exact_reciprocal and not sc.global_scale:  # power-of-two scales multiply instead
        return ""
    lo, hi = FAST_SCALE_RANGE
    bounded = (not sc.global_scale and sc.dtype in SCALE_MAX and SCALE_MAX[sc.dtype] <= hi
               and max(sc.min, SCALE_TINY[sc.dtype]) >= lo)
    return FAST_ALWAYS if bounded else FAST_GUARDED


def fold_power_of_two(side: SideSpec) -> bool:
    """Whether a write's codes take the power of two that x / s is multiplied by (FAST_SCALED's 2**-E) inside the
    encode's lines (minifloat.py.jinja's encode_signed_times: each line's factor times it, once per group), one
    fp32 multiply per element less, the same codes: envelope codecs (e2m1) without a zero point, where every factor
    times the power of two is a normal fp32 (then exact): FAST_SCALED's 2**-E lies in [2**-61, 2**61]
    (GLOBAL_SCALE_RANGE, fast_division). Not for exact reciprocals of power-of-two scales (mxfp4): the same fold
    there compiled to more instructions and registers (sm_90, bf16 input: 150 -> 158 warp instructions per
    token-head, 96 -> 168 registers, 21 -> 12 programs per SM)."""
    sc = side.scale
    if not element_codec(side).params.get("envelope") or sc is None or side.zero_point is not None:
        return False
    return fast_division(side) == FAST_SCALED


def finite_first(side: SideSpec) -> float:
    """The largest range hi - lo a tile of a rotated FAST_GUARDED side with an integer zero point (int4 per token-head)
    may have to take the unguarded fast division (0.0: the side does not take it); rotated sides clear NaN per element
    after the rotation (unrotated ones as they widen), which this skips too. Compiled, such a write
    reduces its groups' minima and maxima over every value first (min.NaN / max.NaN: NaN and infinities propagate)
    and tests the whole tile once: where every group's range is finite and at most this, every value is finite (so the
    per-element NaN select, the finite filter of the range and div_fast's |x| < 2**64 guard change nothing) and every
    scale lies in FAST_SCALE_RANGE: below it by the floor (checked here), above it since range / qmax <= 2**16 and
    the scale's encode rounds by less than a factor of 2. Other tiles take the finite range and div_rn, as before.
    Static (sm_90, bf16 input, the taken path): int4 per token-head 315.5 -> 280.2 warp instructions per token-head
    (77 -> 79 registers, 25 programs per SM both), with separate scales 302.5 -> 266.8. int8 asym (unrotated) would
    take 178.5 -> 157.8 but 64 -> 67 registers, 32 -> 28 programs per SM, on a write that waits on memory: left out
    until a GPU times it."""
    sc = side.scale
    if (fast_division(side) != FAST_GUARDED or side.zero_point is None or sc.global_scale
            or side.zero_point.dtype != "uint8" or side.rotation is None):
        return 0.0
    lo, hi = FAST_SCALE_RANGE
    if max(sc.min, SCALE_TINY[sc.dtype]) * (1.0 - 2.0 ** -8) < lo:  # the floor, less the zero point's low bits
        return 0.0
    info = ELEMENTS[side.element]
    return float(info.qmax - info.qmin) * hi / 2.0


def rcp_can_overflow(side: SideSpec) -> bool:
    """Whether a reciprocal_multiply side's 1 / s can be inf in fp32 (s at or below 2**-128), where the write must keep
    zeros at zero (0 * inf is NaN): a runtime scale (static, or times a global scale), or a floor below fp32's normal
    range. The floor is tested before it is stored: a bf16 scale rounds, and zero points in a scale's low bits mask
    it, down to 2**-128 from floors just above it; a floor at or above 2**-126 stays there."""
    sc = side.scale
    if sc is None or sc.apply != ApplyScale.reciprocal_multiply:
        return False
    if sc.granularity.is_static or sc.global_scale:
        return True
    return max(sc.min, SCALE_TINY[sc.dtype]) < 2.0 ** -126


# Block-scaled sides whose operand (code times block ratio) needs two fp16 terms (q8_0, q4_0: fp16 scales) can take
# one tensor-core dot per block on the codes alone (one term), each block's result times its scales: in decode only
# (the runtime's BLOCK_DOTS), for blocks of at least BLOCK_DOT_MIN elements (fewer would mean more dots per head
# than the registers hold). H200, eighth session (benchmarks/RESULTS.md): decode q4_0 1206 -> 772 us at 64 x 8192,
# q8_0 at head size 64 607 -> 484; but chunked prefill 3-14x slower (byte permutes per block, spills) and the
# one-term block formats (mxfp8, mxfp4) slower, so prefill and those keep the block ratios. Only fp16 scales without
# a global scale: the keys' block results meet their scales unnormalised, q' . codes * scale, which stays far from
# fp32's top for scales up to 65504 but could overflow with bf16 / fp32 scales or a global scale where the
# dequantized values do not (a review found NaN scores at 1e37 with bf16 scales).
BLOCK_DOT_MIN = 32


def takes_block_dots(side: SideSpec, dot: tuple, zp: str) -> bool:
    """Whether decode attention takes one dot per block on this side's codes (see BLOCK_DOT_MIN). A float zero point
    (KIVI's values: fp16 minima) stays a dot of its own, as with the block ratios."""
    sc = side.scale
    return (dot == ("fp16", 2, "block") and zp in ("none", "float") and sc is not None
            and (sc.block or 0) >= BLOCK_DOT_MIN and sc.dtype == ScaleDType.fp16 and not sc.global_scale)


def dot_operand(side: SideSpec, scale: str, zp: str, block: bool, name: str = "key") -> tuple[str, int, str]:
    """How attention can feed this side to tensor-core dots without rounding it: (type, terms, scale factoring).

    The dot operand is the stored code minus its integer zero point, times (block scales only) the ratio of the
    block's scale to a power of two per token; the rest of the scale multiplies the scores per token (keys) or the
    probabilities per token (values). Such an operand has at most code bits + ratio bits significant bits, so it is a
    sum of one or two fp16 values exactly (hi + lo), provided it stays within fp16's range (e5m2 codes up to 57344
    times a block ratio up to 2 do not). One limit: a block whose scale is far below its token's largest (by more
    than 2**14 / the smallest code) lands in fp16's subnormal range and may lose bits, at most 2**-25 of the token's
    largest block scale per element (tests/test_dot_operand.py); an exact path for such tiles waits for GPU time. KIVI's
    keys (scales per channel and token group) and values with fp16 minima per block factor as described below; other
    float zero points and fp32 elements keep exact fp32 dots ("").
    """
    info = side.info
    if side.element.value == "fp32":
        return "", 0, "none"
    if scale == "channel_group":
        # KIVI keys: one scale and minimum per channel for a group of tokens. Attention steps hold whole groups, so
        # the operand is the code times the channel's scale over a power of two per step (like a block ratio along
        # the head), the power of two multiplies the scores, and the minima (fp16 values) add a second dot. Groups
        # of fewer than 16 tokens keep exact fp32 dots (with 64 positions per step); several of them per step
        # could take tensor cores too (not done).
        if side.scale.group_tokens < 16:
            return "", 0, "none"
        code_bits = side.bits
        ratio_bits = scale_codec(side.scale.dtype).significand
        terms = -(-(code_bits + ratio_bits) // 11)
        largest = 2.0 ** side.bits * (1.0 if side.scale.dtype.value == "e8m0" else 2.0)
        return ("fp16", terms, "channel") if terms <= 2 and largest <= 65504.0 else ("", 0, "none")
    if zp == "float" and not (name == "value" and block and side.zero_point.dtype == "fp16"):
        # a float minimum per group: values add p @ minima as a second fp16 dot (exact for fp16 minima); keys and
        # other minima keep exact fp32 dots
        return "", 0, "none"
    tok = {"none": "none", "per_tensor": "const", "per_head": "const"}.get(scale, "block" if block else "token")
    if info.kind == "float":  # bf16 / fp16 elements: their own type, unless a block scale must enter the operand
        return ("", 0, "none") if tok == "block" else (side.element.value, 1, tok)
    code_bits = side.bits if info.kind in ("int", "uint") else element_codec(side).significand
    ratio_bits = scale_codec(side.scale.dtype).significand if tok == "block" else 0
    terms = -(-(code_bits + ratio_bits) // 11)  # fp16 carries 11 significant bits
    # the largest operand: a code (integer codes minus a zero point: below 2**bits) times a ratio below 2 (at most 1
    # for power-of-two e8m0 scales)
    ratio_max = 2.0 if tok == "block" and side.scale.dtype.value != "e8m0" else 1.0
    largest = (2.0 ** side.bits if info.kind in ("int", "uint") else info.qmax) * ratio_max
    return ("fp16", terms, tok) if terms <= 2 and largest <= 65504.0 else ("", 0, "none")


_FP16_MAX, _FP16_STEP = 65504.0, 2.0 ** -24


def fixed_block_shift(side: SideSpec, dot: tuple[str, int, str], dot_factor: float | None) -> int | None:
    """For block scales: a power of two 2**s such that every block's ratio scale * 2**s (times the unscaled codes'
    factor) and every product of a code with it are fp16 values, or None.

    Then the attention operand is code * scale * 2**s for every block of every position, exact in one fp16 term
    with no per-position power of two (no row maximum of the scales, no factor per position on the scores or the
    probabilities): the dot's result takes 2**-s back once, as a static scale would. Holds where the scale dtype's
    whole range fits fp16 next to the codes': fp8_e4m3 scales (2**-9 .. 448, 4 significant bits) with fp4 e2m1 codes
    (NVFP4: s = -7, products 2**-17 .. 21). Only range and lowest bits are checked here: significand width (code
    bits + scale bits within fp16's 11) is dot_operand's one-term condition, required below. tests/test_dot_operand.py
    enumerates every code and scale.
    """
    if dot[:3] != ("fp16", 1, "block") or side.zero_point is not None:
        return None
    scale_dtype = side.scale.dtype.value
    # (smallest step, largest value) of a minifloat scale dtype whose ratios enter the tile in fp16 (RATIOS_IN_FP16)
    scodec = scale_codec(side.scale.dtype)
    if scale_dtype not in RATIOS_IN_FP16 or scodec.max_value is None:
        return None
    info = side.info
    codec = element_codec(side)
    if info.kind in ("int", "uint"):
        code_step, code_max = 1.0, 2.0 ** side.bits  # as dot_operand: below 2**bits, whatever the code range
    elif codec.code_step is not None:
        code_step, code_max = codec.code_step, float(info.qmax)
    else:
        return None
    scale_step, scale_max = scodec.code_step, scodec.max_value
    factor = dot_factor or 1.0
    s = 0
    while s > -64 and (code_max * scale_max * 2.0 ** s > _FP16_MAX or scale_max * factor * 2.0 ** s > _FP16_MAX):
        s -= 1
    while s < 64 and (code_max * scale_max * 2.0 ** (s + 1) <= _FP16_MAX
                      and scale_max * factor * 2.0 ** (s + 1) <= _FP16_MAX):
        s += 1
    if code_step * scale_step * 2.0 ** s < _FP16_STEP or scale_step * factor * 2.0 ** s < _FP16_STEP:
        return None
    return s


def pow2_ratio_split(side: SideSpec, dot: tuple[str, int, str], dot_factor: float | None) -> int | None:
    """For power-of-two block scales (e8m0) in one fp16 term: an exponent A such that attention may multiply the
    codes by each block's ratio in fp16 as two factors, max(ratio, 2**-A) and then min(ratio * 2**A, 1), and get
    the fp16 rounding of the exact product, as converting the fp32 product would; 0 where one fp16 factor, the
    ratio itself, does; None otherwise.

    e8m0 ratios (a block's scale over its token's largest) reach 2**-254, far below fp16. A ratio below fp16's
    smallest value (2**-24) becomes 0 in fp16, which is harmless when every code times it rounds to 0 anyway: codes
    of at most 1 (fp4 e2m1 decoded without its factor 2**14) need one factor. Larger codes take two: with 2**-A =
    2**-24 over the codes' smallest step, the first multiply is exact for every code (its few significant bits, the
    lowest at 2**-24 or above), and the second rounds once. Where the second factor is below 2**-24 and becomes 0,
    every exact product is at most the largest code times 2**-A times 2**-25, so it rounds to 0 too while the largest
    code times 2**-A is at most 1. The codes are the decoded tile's values (codes over the unscaled decoders' factor
    F), the ratios carry F. tests/test_dot_operand.py enumerates every code and every ratio (2 .. 2**-254). That
    covers every scale byte a write stores (0 .. 254); a corrupt byte 255 (NaN in OCP MX and in the reference)
    decodes to inf in the kernel and makes its token's operands inf or NaN here, where the fp32 path could give
    finite values.
    """
    if dot[:3] != ("fp16", 1, "block") or side.zero_point is not None or side.scale.dtype.value != "e8m0":
        return None
    info = side.info
    codec = element_codec(side)
    if info.kind == "int":
        code_step, code_max = 1.0, float(max(abs(info.qmin), info.qmax))
    elif info.kind == "fp" and codec.code_step is not None:
        code_step, code_max = codec.code_step, float(info.qmax)
    else:
        return None
    factor = dot_factor or 1.0
    step, top = code_step / factor, code_max / factor
    if 2.0 * factor > _FP16_MAX:  # ratios reach 2 (a token's largest scale 2**127: pow2_inv stops at 2**-126)
        return None
    if top <= 1.0:
        return 0
    a = round(math.log2(step)) + 24
    if 2.0 ** (a - 24) != step or not 0 < a <= 24 or top * 2.0 ** -a > 1.0:
        return None
    return a


def quantized_dot(codec: Codec, tok: str, asym: bool) -> str:
    """The type of the quantized compute domain for one side (``dot_precision="quantized"``), or "".

    Offered where the stored code itself is the dot operand: int8 codes without a zero point, whose scale is absent,
    static or one per token (it leaves the dot as a factor per position); block scales would enter the operand.
    Keys: the query is quantized per row to int8; values: the probabilities per row.
    """
    kind = codec.quantized_dot
    if not kind or asym or tok not in ("none", "const", "token"):
        return ""
    return kind


def side_context(name: str, side: SideSpec) -> tuple[SideContext, list[str]]:
    """The render context of a side and the codec sources it needs."""
    p = name[0]
    codec = element_codec(side)
    sc = side.scale
    info = side.info
    if sc is None:
        scale = "none"
    elif sc.granularity.is_static:
        scale = sc.granularity.value
    elif sc.granularity == Granularity.per_channel_group:
        scale = "channel_group"  # KIVI keys: quantized by the flush kernel, per channel over G tokens
    else:
        scale = "dynamic"
    dynamic = scale in ("dynamic", "channel_group")
    scodec = scale_codec(sc.dtype) if dynamic else None
    asym = side.zero_point is not None
    zp = "none" if not asym else ("low_bits" if side.zero_point.storage == "scale_low_bits" else "beside")
    float_zp = asym and side.zero_point.dtype != "uint8"
    if float_zp:
        zp = "float"
    dot = dot_operand(side, scale, zp, bool(dynamic and sc.block), name)
    shift = fixed_block_shift(side, dot, codec.dot_factor) if dot[0] else None
    if shift is not None:
        dot = (dot[0], dot[1], "fixed")
    split = pow2_ratio_split(side, dot, codec.dot_factor) if dot[0] else None
    qdot = quantized_dot(codec, dot[2], asym)
    nan_as_zero = codec.nan_as_zero
    native_nan_zero = info.kind in ("int", "uint") and codec.native_encode and not asym
    fp64 = fp64_quotient(side)
    # one zero point per row, stored as a code, on byte codes: the dot operand's decode leaves its fp16 bias in (code +
    # 1024, exact), and one subtraction per element takes the bias and the zero point away together (a second one
    # otherwise). H100 (benchmarks/RESULTS.md, forty-fifth session): int8 asym's decode 0.5-4.8% faster (12.6 -> 11.8
    # instructions per position); on int4 per token-head's packed codes 2-3% slower at head size 128 (more spills)
    # (never with the quantized domain, whose operand is the code itself: zero_point_off's bias goes with fp16 dots)
    biased = (bool(dot[0]) and dot[2] == "token" and zp in ("beside", "low_bits") and codec.dot_bias is not None
              and side.bits == 8 and not qdot)
    fold_pow2 = bool(dynamic and fold_power_of_two(side))
    sources = [render_codec(codec, f"{p}_", dot=bool(dot[0]), qdot=qdot, biased=biased, times=fold_pow2)]
    if scodec is not None:
        sources.append(render_codec(scodec, f"{p}_scale_"))
    if float_zp:
        sources.append(render_codec(_float_codec_for(side.zero_point.dtype), f"{p}_zp_"))
    qmax = info.qmax - info.qmin if asym else info.qmax
    group = str(sc.block) if dynamic and sc.block else "HEAD_PAD"
    rule = ("(max - min) / " if asym else "absmax / ") + f"{qmax:g}" + (" / global" if dynamic and sc.global_scale else "")
    if zp == "float":
        rule += f" with the {side.zero_point.dtype} minimum as offset"
    ctx = SideContext(
        name=name, p=p, P=p.upper(), bits=side.bits, unit=codec.unit, unit_bytes=codec.unit_bytes,
        packed=side.bits < 8, per_byte=max(8 // side.bits, 1), msb_first=side.packing == "msb_first",
        code_mask=(1 << side.bits) - 1 if side.bits < 32 else 0xFFFFFFFF,
        scale=scale, group=group, group_tokens=sc.group_tokens if sc is not None and sc.group_tokens else 1, ngroups=f"HEAD_SIZE // {sc.block}" if dynamic and sc.block else "1",
        asym=asym, zp=zp,
        zunit={"fp16": "tl.uint16", "fp32": "tl.uint32"}.get(side.zero_point.dtype, "tl.uint8") if asym else "tl.uint8",
        zbytes={"fp16": 2, "fp32": 4}.get(side.zero_point.dtype, 1) if asym else 1,
        zp_max="65504.0" if float_zp and side.zero_point.dtype == "fp16" else "", zp_clear=hex(0xFFFFFFFF ^ ((1 << side.bits) - 1)),
        global_scale=bool(dynamic and sc.global_scale), qmax=_float_literal(qmax),
        scale_floor=_fp32_constant(max(sc.min, SCALE_TINY[sc.dtype])) if dynamic else "0.0",
        scale_max=_float_literal(SCALE_MAX[sc.dtype]) if dynamic and sc.dtype in SCALE_MAX else "",
        apply="none" if sc is None else sc.apply.value,
        fp64=fp64,
        rcp_overflow=rcp_can_overflow(side),
        sunit=scodec.unit if scodec else "tl.uint8", sunit_bytes=scodec.unit_bytes if scodec else 1,
        meta_ptr=f"{p}_meta_ptr" if dynamic and sc.placement == Placement.separate else f"{p}_cache_ptr",
        rotate=side.rotation is not None,
        rotation_seed=side.rotation.seed if side.rotation is not None else None,
        rotate_dot=side.rotation is not None and dot[:2] == ("fp16", 1) and dot[2] in ("token", "const"),
        nan_as_zero=nan_as_zero,
        native_nan_zero=native_nan_zero,
        cast_input=fp64 and side.rotation is None,
        widen_nan=nan_as_zero and not native_nan_zero and side.rotation is None and not fp64,
        range_first=dynamic and range_first(side),
        finite_first=_float_literal(finite_first(side)) if dynamic and finite_first(side) else "",
        fast_div=fast_division(side) if dynamic else "",
        fast_range=[_float_literal(b) for b in FAST_SCALE_RANGE],
        scale_rule=f"scale = max({rule.split(' with ')[0]}, {sc.min:g}) stored as {sc.dtype.value}"
        + (f", the {side.zero_point.dtype} minimum as offset" if zp == "float" else "") if dynamic else "",
        codec_summary=codec.summary,
        **dict(zip(("dot", "op_terms", "tok"), dot)),
        block_dots=takes_block_dots(side, dot, zp),
        ratio_in_tile=bool(dot[0]) and dot[1] == 1 and dot[2] in ("block", "fixed") and sc.dtype.value in RATIOS_IN_FP16,
        ratio_factors=0 if split is None else (1 if split == 0 else 2),
        ratio_split=_float_literal(2.0 ** -split) if split else "",
        ratio_split_inv=_float_literal(2.0 ** split) if split else "",
        ratio_split_exp=split or 0,
        ratio_shift=_float_literal(2.0 ** shift) if shift is not None else "",
        fixed_factor=_float_literal(2.0 ** -shift) if shift is not None else "",
        byte_decode=bool(dot[0]) and codec.byte_decode,
        # block ratios multiply every code anyway: they carry the codec's factor (no zero point between the two)
        dot_factor=_float_literal(codec.dot_factor) if dot[0] and dot[2] in ("block", "fixed") and codec.dot_factor
        and not asym else "",
        dot_bias=str(codec.dot_bias) if biased else "",
        qdot=qdot, qdot_max={"int8": "127.0"}.get(qdot, "0.0"),
        native_encode=codec.native_encode, native_scale_encode=bool(scodec and scodec.native_encode),
        native_scale_decode=bool(scodec and scodec.native_encode),
        exact_reciprocal=bool(dynamic and scodec and scodec.exact_reciprocal and not sc.global_scale),
        fold_pow2=fold_pow2,
        scale_summary=(f"{sc.dtype.value} per " + (f"{sc.block} elements" if sc.block else (
            f"channel over {sc.group_tokens} tokens" if sc.group_tokens else "token and head"))
            + f", {sc.placement.value}") if dynamic else "",
    )
    return ctx, sources


def header(spec: FormatSpec, part: str) -> str:
    lines = [
        f"# Generated by kvgen {KVGEN_VERSION} from spec '{spec.name}' (hash {spec.spec_hash()}): {part}.",
        "# Do not edit: change the spec and run `kvgen build`.",
    ]
    if spec.description:
        lines.append("#")
        lines += ["# " + line for line in _wrap(spec.description, 110)]
    if spec.origin:
        origin = _wrap("Origin: " + spec.origin, 110)
        lines += ["# " + origin[0]] + ["#   " + line for line in origin[1:]]
    return "\n".join(lines)


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    # spec text is validated free text; keep it on comment lines only (no line breaks can escape the comment)
    return textwrap.wrap(" ".join(text.split()), width) or [""]


def _tidy(source: str) -> str:
    source = "\n".join(line.rstrip() for line in source.splitlines())
    source = re.sub(r"\n{4,}", "\n\n\n", source)
    return source.strip() + "\n"


def _row_fold(k_ctx, v_ctx) -> str:
    """The kernel's kind of FOLD_ROWS (decode's paged steps on the query rows a launch fills): "key" (keys scaled
    per channel and token group with tensor-core dots: KEY_FOLD), "blocks" (one dot per block on both sides:
    BLOCK_DOTS), "live" (one dot per side, no blocks on either), "" (neither: every row)."""
    if k_ctx.tok == "channel" and bool(k_ctx.dot):
        return "key"
    if k_ctx.block_dots and v_ctx.block_dots:
        return "blocks"
    if not (k_ctx.block_dots or v_ctx.block_dots):
        return "live"
    return ""


def _value_split(v_ctx, streaming: bool, row_fold: str) -> str:
    """How decode's P x V dot may split the value tile's columns into 2 or 4 dots (the kernel's V_SPLIT, value_dot):
    "halves" (codes narrower than a byte: their decode keeps a byte's codes, adjacent columns, apart; parts of even /
    odd columns), "pairs" (the column pairs a 32-bit register of 16-bit values holds stay together), or "" where a
    value step may take another dot (minima, KIVI's groups and ring) or the kernel has no row fold (value_dot is the
    row folds' helper: one side's block dots alone). Value blocks (block dots) split where their paged steps stack
    every block in one dot (row_fold "blocks": stacked_pv) and carry no minima."""
    stacked_blocks = v_ctx.block_dots and row_fold == "blocks"
    if (not row_fold or streaming or v_ctx.bits >= 16 or (v_ctx.block_dots and not stacked_blocks)
            or v_ctx.zp == "float" or v_ctx.tok == "channel"):
        return ""
    return "halves" if v_ctx.bits < 8 else "pairs"


def render_files(spec: FormatSpec) -> dict[str, str]:
    """File name -> text of the generated package of ``spec``."""
    check_supported(spec)
    plan = layout_mod.plan(spec)
    k_ctx, k_src = side_context("key", spec.key)
    v_ctx, v_src = side_context("value", spec.value)
    # KIVI: the residual buffers' dtype codec (prefix r_)
    r_codec = _float_codec_for(spec.key.residual.dtype) if spec.streaming else None
    r_src = [render_codec(r_codec, "r_")] if r_codec else []
    row_fold = _row_fold(k_ctx, v_ctx)
    files = {
        "__init__.py": _ENV.get_template("init.py.jinja").render(
            header=header(spec, "package"),
            name=spec.name,
            spec_hash=spec.spec_hash(),
            kvgen_version=KVGEN_VERSION,
            spec_json=pprint.pformat(json.loads(spec.canonical_json()), width=110, sort_dicts=True),
        ),
        "layout.py": _ENV.get_template("layout.py.jinja").render(
            header=header(spec, "page-size calculator"),
            tensors=repr(layout_mod.tensor_storage(spec)),
            fields=plan,
            rows_per=repr({(f.tensor, f.region): f.rows_per for f in plan if f.rows_per != 1}),
            residual=repr(None if not spec.streaming else {
                "tokens": spec.key.residual.tokens, "ring": spec.key.residual.tokens + spec.group_tokens,
                "group": spec.group_tokens, "dtype": spec.key.residual.dtype}),
        ),
        "kernels.py": _ENV.get_template("kernels.py.jinja").render(
            header=header(spec, "Triton kernels"),
            k=k_ctx,
            v=v_ctx,
            codec_sources=k_src + v_src + r_src,
            streaming=spec.streaming,
            r_unit=r_codec.unit if r_codec else "tl.uint16",
            r_unit_bytes=r_codec.unit_bytes if r_codec else 2,
            residual_dot={"bf16": "bf16", "fp16": "fp16"}.get(spec.key.residual.dtype, "") if spec.streaming else "",
            # keys scaled per channel and token group with tensor-core dots: decode may fold the scales into the
            # query (the kernel's KEY_FOLD, group_scores)
            key_fold=k_ctx.tok == "channel" and bool(k_ctx.dot),
            # decode's paged steps may carry only the query rows a launch fills (the kernel's FOLD_ROWS), by kind:
            # "key" with the key fold (KIVI: group_scores, stacked_pv), "blocks" where both sides take one dot per
            # block (BLOCK_DOTS, q8_0 / q4_0: their blocks' rows stack, stacked_scores / stacked_pv), "live" for one
            # dot per side without blocks (the dots on every row, the steps' state on FOLD_ROWS: live_rows); "" none
            row_fold=row_fold,
            # decode's value dot in 2 or 4 dots over parts of the columns (the kernel's V_SPLIT), by how the columns part
            value_split=_value_split(v_ctx, spec.streaming, row_fold),
        ),
    }
    out = {name: _tidy(text) for name, text in files.items()}
    for name, text in out.items():
        compile(text, f"<generated {spec.name}/{name}>", "exec")  # a template bug fails here, not at import
    return out
