"""The tensor-core operand rule (codegen.render.dot_operand) checked by enumeration, not by restating it.

For a side the rule accepts, every operand the attention kernel can form (a code value minus an integer zero point,
times for block scales the block's scale divided by a power of two of the token's largest block scale: a ratio below
2) must be within fp16's range and exactly equal to the sum of the rule's number of fp16 terms (hi = fp16(x),
lo = fp16(x - hi)) as long as the products stay in fp16's normal range (ratio >= 2**-14 / smallest code). Blocks
far smaller than their token's largest (below that ratio) may lose bits in fp16's subnormal range: by at most
2**-25 of the token's largest block scale, which is the documented limit of "exact".
"""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest
from pydantic import ValidationError

from kvgen.codegen.codecs import element_codec
from kvgen.codegen.render import RATIOS_IN_FP16, dot_operand, fixed_block_shift, pow2_ratio_split, side_context
from kvgen.codegen.spec import ELEMENTS as SCHEMA_ELEMENTS
from kvgen.codegen.spec import FormatSpec

ELEMENT_VALUES = {
    "fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2, "fp4_e2m1": ml_dtypes.float4_e2m1fn,
    "fp8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
}
SCALE_VALUES = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "fp8_e4m3": ml_dtypes.float8_e4m3fn}


def finite_values(dtype, bits: int) -> np.ndarray:
    codes = np.arange(1 << bits, dtype=np.uint16 if bits > 8 else np.uint8)
    x = codes.view(dtype).astype(np.float64)
    return x[np.isfinite(x)]


def code_values(element: str) -> np.ndarray:
    if element in ELEMENT_VALUES:
        bits = 4 if element == "fp4_e2m1" else 8
        if bits == 4:  # ml_dtypes stores fp4 one per byte: the low 4 bits
            return np.arange(16, dtype=np.uint8).view(ELEMENT_VALUES[element]).astype(np.float64)
        return finite_values(ELEMENT_VALUES[element], bits)
    bits = int(element.lstrip("uint"))
    return np.arange(-(1 << bits) + 1, 1 << bits, dtype=np.float64)  # code - zero point, any zero point


def ratio_values(dtype: str, smallest: float = 1.0) -> np.ndarray:
    """Scale values divided by a power of two, in [smallest, 2): every significand at every exponent in that range."""
    if dtype == "e8m0":
        sig = np.array([1.0])
    else:
        s = finite_values(SCALE_VALUES[dtype], 16 if dtype in ("fp16", "bf16") else 8)
        m, _ = np.frexp(s[s > 0])
        sig = np.unique(m * 2.0)
    exps = 2.0 ** -np.arange(0, int(-np.log2(smallest)) + 1)
    r = np.multiply.outer(exps, sig).ravel()
    return np.unique(r[(r >= smallest) & (r < 2)])


def side_of(element: str, scale: dict | None) -> tuple:
    side = {"element": element}
    if element.startswith("uint"):
        side["zero_point"] = {"storage": "beside_scale"}
    if scale:
        side["scale"] = scale
    spec = FormatSpec.model_validate({"name": "t", "key": side, "value": side,
                                      "cache": {"layout": "interleaved", "storage_dtype": "uint8"}})
    sc = spec.key.scale
    kind = "none" if sc is None else (sc.granularity.value if sc.granularity.is_static else "dynamic")
    zp = "beside" if spec.key.zero_point is not None else "none"
    return dot_operand(spec.key, kind, zp, bool(sc is not None and sc.block))


def exact_in_fp16_terms(x: np.ndarray, terms: int) -> bool:
    hi = x.astype(np.float16).astype(np.float64)
    if terms == 1:
        return bool(np.all(hi == x))
    lo = (x - hi).astype(np.float16).astype(np.float64)
    return bool(np.all(hi + lo == x))


ELEMENTS = [e.value for e, info in SCHEMA_ELEMENTS.items() if info.is_quantized]  # every quantized element
SCALES = [{"granularity": "per_tensor"}, {"granularity": "per_token_head", "dtype": "fp32"}] + [
    {"granularity": "per_block", "block": 16, "dtype": d} for d in ("e8m0", "fp8_e4m3", "bf16", "fp16", "fp32")]


@pytest.mark.parametrize("element,scale", list(itertools.product(ELEMENTS, SCALES)))
def test_accepted_operands_are_exact_and_in_range(element, scale):
    try:
        dtype, terms, tok = side_of(element, scale)
    except ValidationError as exc:  # combinations the schema rejects are not this test's business (dot_operand's
        # own errors are)
        pytest.skip("not a valid side: " + str(exc).splitlines()[2].strip()[:80])
    if not dtype:
        # rejected: there must be a reason, i.e. an operand that one or two fp16 terms cannot hold, or range
        block = bool(scale and scale.get("block"))
        if block and scale["dtype"] == "fp32":
            return  # 24-bit ratios: the rule does not try
        ops = np.multiply.outer(code_values(element), ratio_values(scale["dtype"]) if block else [1.0]).ravel()
        assert not (np.abs(ops).max() <= 65504 and exact_in_fp16_terms(ops, 2)), "rejected an operand fp16 holds"
        return
    assert dtype == "fp16"
    block = tok == "block"
    codes = code_values(element)
    smallest_code = np.abs(codes[codes != 0]).min()
    normal = 2.0 ** -14 / smallest_code  # from this ratio up, every nonzero product is a normal fp16 number
    ratios = ratio_values(scale["dtype"], smallest=2.0 ** np.floor(np.log2(normal))) if block else np.array([1.0])
    ratios = ratios[ratios >= normal] if block else ratios
    ops = np.multiply.outer(codes, ratios).ravel()
    largest = np.multiply.outer(codes, ratio_values(scale["dtype"])).ravel() if block else ops
    assert np.abs(largest).max() <= 65504.0
    assert exact_in_fp16_terms(ops, terms), f"{terms} fp16 term(s) do not hold every operand"
    if terms == 2:  # and one would not: the rule does not ask for more than needed
        assert not exact_in_fp16_terms(ops, 1)
    if block:  # far smaller blocks: within 2**-25 of the token's largest scale (the ratio's unit)
        tiny = np.multiply.outer(codes, ratio_values(scale["dtype"], smallest=2.0 ** -40)).ravel()
        hi = tiny.astype(np.float16).astype(np.float64)
        got = hi if terms == 1 else hi + (tiny - hi).astype(np.float16).astype(np.float64)
        assert np.abs(got - tiny).max() <= 2.0 ** -25


def test_sides_without_a_factorable_scale_keep_exact_dots():
    assert side_of("fp8_e5m2", {"granularity": "per_block", "block": 16, "dtype": "fp16"})[0] == ""  # range
    assert side_of("fp8_e5m2", {"granularity": "per_tensor"})[:2] == ("fp16", 1)
    assert side_of("fp8_e4m3", {"granularity": "per_block", "block": 16, "dtype": "fp32"})[0] == ""  # 24-bit ratios


@pytest.mark.parametrize("name", ["kivi_2bit", "kivi_4bit"])
def test_kivi_operands_are_exact(name):
    """KIVI keys (a scale and a float minimum per channel and token group): the operand is the code times the
    channel's scale over a power of two per attention step (whole groups per step); values (a float minimum per block)
    take the block-ratio operand, their minima a second dot. Both must hold every operand exactly in the rule's
    terms, from the ratio where products are normal fp16 numbers up."""
    import kvgen

    spec = kvgen.load(name).spec
    k = dot_operand(spec.key, "channel_group", "float", False, "key")
    v = dot_operand(spec.value, "dynamic", "float", True, "value")
    assert k[0] == "fp16" and k[2] == "channel" and v[0] == "fp16" and v[2] == "block"
    for side, (_, terms, _) in ((spec.key, k), (spec.value, v)):
        codes = np.arange(1 << side.bits, dtype=np.float64)  # unsigned codes: the minimum is added apart
        normal = 2.0 ** -14  # the smallest nonzero code is 1
        ratios = ratio_values(side.scale.dtype.value, smallest=normal)
        ops = np.multiply.outer(codes, ratios).ravel()
        assert np.abs(ops).max() <= 65504.0
        assert terms == 2 and exact_in_fp16_terms(ops, 2) and not exact_in_fp16_terms(ops, 1)
    # a float minimum anywhere else keeps exact dots (keys with token or block scales, fp32 minima)
    assert dot_operand(spec.value, "dynamic", "float", True, "key")[0] == ""


def test_block_ratios_in_fp16():
    """RATIOS_IN_FP16 names exactly the block-scale dtypes whose ratios (a scale over the power of two at or below its
    token's largest scale: in (0, 2)) are all fp16 values; for those, every code a one-term side holds times a ratio
    rounds to fp16 the same whether the ratio is fp16 first or not (the kernel multiplies in fp16)."""
    qualifying = []
    for dtype in ("fp8_e4m3", "e8m0", "fp16", "bf16"):
        if dtype == "e8m0":
            ratios = 2.0 ** -np.arange(0, 255)  # 2**-127 over 2**127 at the extremes
        else:
            s = finite_values(SCALE_VALUES[dtype], 16 if dtype in ("fp16", "bf16") else 8)
            s = s[s > 0]
            tops = np.unique(2.0 ** np.floor(np.log2(s)))
            ratios = np.divide.outer(s, tops).ravel()
            ratios = np.unique(ratios[ratios < 2])
        if np.all(ratios.astype(np.float16).astype(np.float64) == ratios):
            qualifying.append(dtype)
            for element in ELEMENTS:
                try:
                    dot, terms, _ = side_of(element, {"granularity": "per_block", "block": 16, "dtype": dtype})
                except ValidationError:
                    continue
                if dot != "fp16" or terms != 1:
                    continue
                codes = code_values(element)
                exact = np.multiply.outer(codes, ratios)
                in_fp16 = np.multiply.outer(codes.astype(np.float16), ratios.astype(np.float16))  # one rounding
                assert np.array_equal(in_fp16, exact.astype(np.float16)), (dtype, element)
    assert tuple(qualifying) == RATIOS_IN_FP16


def all_scale_values(dtype: str) -> np.ndarray:
    """Every finite non-negative value of a block-scale dtype (zero and subnormals included; e8m0: its powers of two,
    2**-127 .. 2**127)."""
    if dtype == "e8m0":
        return np.ldexp(1.0, np.arange(-127, 128))
    s = finite_values(SCALE_VALUES[dtype], 16 if dtype in ("fp16", "bf16") else 8)
    return np.unique(s[s >= 0])


def block_side(element: str, scale: dict):
    """The key side of a spec with these codes and block scales (skipping combinations the schema rejects), its
    tensor-core operand rule and its codec."""
    try:
        spec = FormatSpec.model_validate({"name": "t", "key": {"element": element, "scale": scale},
                                          "value": {"element": element, "scale": scale},
                                          "cache": {"layout": "interleaved", "storage_dtype": "uint8"}})
    except ValidationError as exc:
        pytest.skip("not a valid side: " + str(exc).splitlines()[2].strip()[:80])
    return spec.key, dot_operand(spec.key, "dynamic", "none", True), element_codec(spec.key)


# unsigned elements need a zero point, which rules the fixed ratios out before any range question
@pytest.mark.parametrize("element,dtype", list(itertools.product([e for e in ELEMENTS if not e.startswith("uint")],
                                                                  ["fp8_e4m3", "e8m0", "fp16", "bf16"])))
def test_fixed_block_shift_is_exact(element, dtype):
    """Where fixed_block_shift gives 2**s, attention multiplies every (unscaled) code by scale * 2**s * F in fp16
    (F: the unscaled decoders' factor) with no per-position power of two. Enumerated: every ratio is an fp16 value,
    and every fp16 product of a decoded code and a ratio equals code * scale * 2**s exactly."""
    scale = {"granularity": "per_block", "block": 16, "dtype": dtype}
    side, dot, codec = block_side(element, scale)
    factor = codec.dot_factor if codec.byte_decode else None
    shift = fixed_block_shift(side, dot, factor)
    codes = code_values(element)

    def exact_at(s: int) -> bool:
        """Every ratio scale * 2**s * F an fp16 value and every fp16 product with a decoded code exact."""
        for f in {1.0, factor or 1.0}:  # exact fp32 dots decode the codes' values (F = 1); tensor-core ones unscaled
            ratios = all_scale_values(dtype) * 2.0 ** s * f
            decoded = codes / f
            if not (np.array_equal(ratios.astype(np.float16).astype(np.float64), ratios)
                    and np.array_equal(decoded.astype(np.float16).astype(np.float64), decoded)):
                return False
            with np.errstate(over="ignore"):
                in_fp16 = np.multiply.outer(decoded.astype(np.float16), ratios.astype(np.float16)).astype(np.float64)
            if not np.array_equal(in_fp16, np.multiply.outer(codes, all_scale_values(dtype)) * 2.0 ** s):
                return False
        return True

    if shift is None:
        if dot[:3] != ("fp16", 1, "block"):
            return  # no one-term fp16 block operand: nothing to shift
        # None means no power of two works: none in the range the rule searches
        assert not any(exact_at(s) for s in range(-64, 65)), "fixed_block_shift missed an exact shift"
        return
    assert dtype in RATIOS_IN_FP16 and dot[:3] == ("fp16", 1, "block")
    assert exact_at(shift), f"a ratio or a product is not exact in fp16 at 2**{shift}"


def split_products(codes: np.ndarray, factor: float, a: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every code times every ratio an e8m0 block can have against its token's largest scale, three ways: as the
    kernel's two fp16 multiplies (max(ratio, 2**-a), then min(ratio * 2**a, 1)), as the fp32 product converted to
    fp16 (the path without the split), and as the exact product rounded once to fp16."""
    # the kernel's fp32 ratio: scale 2**(b - 127) over the token's largest, 2**-254 .. 2 (pow2_inv stops at 2**-126
    # for a largest of 2**127), fp32 subnormals and zero below 2**-126 and 2**-149; times the decoders' factor F
    ratio = np.ldexp(np.float32(1.0), np.arange(-254, 2)).astype(np.float32) * np.float32(factor)
    tile = (codes / factor).astype(np.float16)
    assert np.array_equal(tile.astype(np.float64), codes / factor), "a decoded code is not an fp16 value"
    r1 = np.maximum(ratio, np.float32(2.0 ** -a)).astype(np.float16)
    r2 = np.minimum(ratio * np.float32(2.0 ** a), np.float32(1.0)).astype(np.float16)
    split = (tile[:, None] * r1[None, :]) * r2[None, :]  # numpy's fp16 products round once each, as HMUL2's
    via_fp32 = (tile.astype(np.float32)[:, None] * ratio[None, :]).astype(np.float16)
    exact = np.multiply.outer(codes, ratio.astype(np.float64) / factor).astype(np.float16)
    return split, via_fp32, exact


@pytest.mark.parametrize("element", [e for e in ELEMENTS if not e.startswith("uint")])
def test_pow2_ratio_split_is_exact(element):
    """Where pow2_ratio_split gives A (e8m0 block scales, one fp16 term), attention multiplies the codes by each
    block's ratio as two fp16 factors (A = 0: the ratio alone). Enumerated for every code and every ratio (2 ..
    2**-254): the result is the exact product rounded once to fp16, bit for bit with signed zeros, and what the
    unsplit fp32 path gives."""
    scale = {"granularity": "per_block", "block": 32, "dtype": "e8m0"}
    side, dot, codec = block_side(element, scale)
    a = pow2_ratio_split(side, dot, codec.dot_factor)
    codes = code_values(element)
    factor = codec.dot_factor or 1.0
    if a is None:  # then no floor would do (fp8_e5m2: 2**-16 steps up to 57344 need more than fp16 spans)
        if dot[:3] == ("fp16", 1, "block"):
            for a in range(25):
                split, _, exact = split_products(codes, factor, a)
                assert not np.array_equal(split.view(np.uint16), exact.view(np.uint16)), (element, a)
        return
    split, via_fp32, exact = split_products(codes, factor, a)
    assert np.array_equal(split.view(np.uint16), exact.view(np.uint16)), element
    assert np.array_equal(split.view(np.uint16), via_fp32.view(np.uint16)), element
    # A = 0 is one factor, the ratio itself (max(ratio, 1) * min(ratio, 1)); two factors only where one would not do
    ratio = np.ldexp(np.float32(1.0), np.arange(-254, 2)).astype(np.float32) * np.float32(factor)
    one = (codes / factor).astype(np.float16)[:, None] * ratio.astype(np.float16)[None, :]
    assert np.array_equal(one.view(np.uint16), exact.view(np.uint16)) == (a == 0), element


def test_mx_formats_split_their_ratios():
    """The shipped MX formats (e8m0 block scales, one fp16 term) multiply their ratios in fp16: two factors for
    e4m3 codes (up to 448), one for e2m1 codes (decoded without their factor 2**14: at most 6 * 2**-14)."""
    import kvgen

    for name in ("mxfp8", "mxfp4"):
        spec = kvgen.load(name).spec
        for side_name, side in (("key", spec.key), ("value", spec.value)):
            assert side_context(side_name, side)[0].ratio_factors == (2 if name == "mxfp8" else 1), (name, side_name)


def test_nvfp4_takes_fixed_block_ratios():
    """The shipped NVFP4 formats (e2m1 codes, e4m3 block scales) take the fixed ratios; e8m0 (MX) and fp16 (q4_0)
    block scales span more than fp16 next to their codes and keep a power of two per position."""
    import kvgen

    for name, tok in (("nvfp4", "fixed"), ("nvfp4_separate", "fixed"), ("mxfp4", "block"), ("mxfp8", "block"),
                      ("q4_0", "block"), ("q8_0", "block")):
        spec = kvgen.load(name).spec
        assert side_context("key", spec.key)[0].tok == tok, name
        assert side_context("value", spec.value)[0].tok == tok, name


def test_block_dots_only_for_two_term_block_sides():
    """Decode takes one dot per block on the codes (BLOCK_DOTS) only where the block ratios would need two fp16 terms
    (fp16 scales: q8_0, q4_0 in either layout, KIVI's values with their fp16 minima) and blocks hold 32+ elements; one-term block
    formats (MX), fixed ratios (NVFP4), KIVI's keys (per channel) and per-token scales keep their operand."""
    import kvgen

    for name in kvgen.shipped_names():
        spec = kvgen.load(name).spec
        for side_name, side in (("key", spec.key), ("value", spec.value)):
            ctx = side_context(side_name, side)[0]
            want = name in ("q8_0", "q4_0", "q8_0_separate", "q4_0_separate") or (
                name.startswith("kivi") and side_name == "value")
            assert ctx.block_dots == want, (name, side_name)
            if ctx.block_dots:
                assert (ctx.dot, ctx.op_terms, ctx.tok) == ("fp16", 2, "block") and ctx.zp in ("none", "float"), name


def test_block_dots_take_exact_codes_and_bounded_scales():
    """Over element x scale dtype x block x global scale: a side that takes per-block dots in decode has codes exact
    in one fp16 term (the dots' operand is the codes alone) and fp16 scales without a global scale (the keys' block
    results meet their scales unnormalised: wider scales could overflow fp32 where the values do not)."""
    taken = []
    for element, dtype, block, global_scale in itertools.product(
            ELEMENTS, ("fp16", "bf16", "fp8_e4m3", "e8m0", "fp32"), (16, 32, 64), (False, True)):
        side = {"element": element, "scale": {"granularity": "per_block", "block": block, "dtype": dtype,
                                               "global_scale": global_scale}}
        try:
            spec = FormatSpec.model_validate({"name": "t", "key": side, "value": side,
                                              "cache": {"layout": "interleaved", "storage_dtype": "uint8"}})
        except ValueError:
            continue
        for name, s in (("key", spec.key), ("value", spec.value)):
            ctx = side_context(name, s)[0]
            if ctx.block_dots:
                taken.append((element, dtype, block, global_scale))
                assert exact_in_fp16_terms(code_values(element), 1), element
                assert dtype == "fp16" and not global_scale and block >= 32, (element, dtype, block)
    assert {(e, b) for e, _, b, _ in taken} >= {("int8", 32), ("int4", 32), ("int8", 64)}, taken
