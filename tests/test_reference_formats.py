"""The reference on the whole format space of docs/SEMANTICS.md, against hand-computed values.

Covers what the first milestone did not: fp4 e2m1 / int4 / int2 / uint8 / uint4 / uint2 codes and their packing,
the scale dtypes (fp16, bf16, fp8_e4m3, e8m0) with the floor, per_block scales, global scales, zero points (beside the
scale and in its low bits), the Hadamard rotation, split / page_end / separate layouts with their tensors and shapes,
the dict cache API, and the error bound on random data with outliers, all-zero, constant and one-signed groups.

Bit layouts: e2m1 = sign | 2 exponent (bias 1) | 1 mantissa, codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6 and 8..15 the
negatives; e4m3fn = 1 | 4 (bias 7) | 3, max 448 = 0x7E; e8m0 = the byte E + 127 of 2**E; fp16 = 1 | 5 (bias 15) |
10; bf16 = 1 | 8 (bias 127) | 7. Multi-byte values are little-endian.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest

from kvgen import reference as R
from kvgen.codegen.loader import load_spec
from kvgen.codegen.spec import ElementType, FormatSpec

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = (ROOT / "specs", Path("/work/pending_specs"))
NEW_FORMATS = ["fp8_e4m3_per_head", "int4_per_token_head", "nvfp4", "nvfp4_separate", "mxfp8", "mxfp4",
               "int8_asym_per_token_head", "q8_0", "q4_0", "mixed_k8_v4", "int8_per_token_head_separate"]


def spec_of(name: str) -> FormatSpec:
    for folder in FOLDERS:
        if (folder / f"{name}.yaml").is_file():
            return load_spec(folder / f"{name}.yaml", supported=False)
    pytest.skip(f"no spec file for {name}")


def make_spec(key: dict[str, Any], value: Optional[dict[str, Any]] = None, **cache: Any) -> FormatSpec:
    return FormatSpec.model_validate({"name": "t", "key": key, "value": value or key, "cache": cache})


def enc1(side_dict: dict[str, Any], values: list[float], static: Any = None) -> R.SideEncoding:
    """Encode one (token, head) vector with a side built from a dict."""
    spec = make_spec(side_dict)
    return R.encode_side(spec.key, np.array(values, np.float32).reshape(1, 1, -1), static)


def hexes(a: np.ndarray) -> str:
    return " ".join(f"{b:02X}" for b in np.asarray(a, np.uint8).reshape(-1))


def static_scale(side, num_heads: int, value: float) -> Any:
    sc = side.scale
    if sc is None:
        return None
    if sc.granularity.value == "per_head":
        return np.linspace(0.5, 2.0, num_heads).astype(np.float32) * value
    if sc.granularity.is_static or sc.global_scale:
        return value
    return None


PER_TENSOR = {"granularity": "per_tensor"}


# --- element codes --------------------------------------------------------------------------------------------------

def test_fp4_codes_by_hand() -> None:
    side = {"element": "fp4_e2m1", "scale": PER_TENSOR}
    values = [
        0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,  # the 8 codes 0..7
        0.25,   # tie of 0 (code 0) and 0.5 (code 1) -> code 0
        0.75,   # tie of 0.5 (1) and 1 (2) -> 2
        1.25,   # tie of 1 (2) and 1.5 (3) -> 2
        1.75,   # tie of 1.5 (3) and 2 (4) -> 4
        2.5,    # tie of 2 (4) and 3 (5) -> 4
        3.5,    # tie of 3 (5) and 4 (6) -> 6
        5.0,    # tie of 4 (6) and 6 (7) -> 6
        5.01,   # above the tie -> 6 = code 7
        7.0,    # clipped to 6 -> 7
        1e30,   # clipped -> 7
        -math.inf,  # clipped to -6 -> 0xF
        -0.2,   # rounds to -0: the sign bit stays -> 0x8
        -0.0,   # 0x8
        -2.9,   # -3 = 0xD
        0.2500001,  # above the tie -> 0.5 = code 1
    ]
    codes = [0, 1, 2, 3, 4, 5, 6, 7, 0, 2, 2, 4, 4, 6, 6, 7, 7, 7, 0xF, 0x8, 0x8, 0xD, 1]
    data = enc1(side, values + [0.0], 1.0).data[0, 0]  # one more 0 to fill the last byte
    packed = [c | (d << 4) for c, d in zip((codes + [0])[0::2], (codes + [0])[1::2])]  # element 2i low nibble
    assert data.tolist() == packed
    # NaN has no fp4 code: the reference stores 0 (SEMANTICS.md leaves it open)
    assert enc1(side, [math.nan, 1.0], 1.0).data[0, 0].tolist() == [0x20]


def test_fp4_ties_match_ml_dtypes_round_to_even() -> None:
    # every midpoint between neighbouring fp4 values and a cloud of random values: the reference (clip, then
    # ml_dtypes) equals "nearest, ties to the even code" computed from the value table
    table = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    rng = np.random.default_rng(3)
    mids = (table[1:] + table[:-1]) / 2
    x = np.concatenate([mids, -mids, rng.uniform(-6, 6, 500)]).astype(np.float32)
    dist = np.abs(np.abs(x)[:, None].astype(np.float64) - table[None, :])
    best = dist.min(axis=1, keepdims=True)
    candidates = np.where(dist == best, np.arange(8), 99)
    even = np.where((candidates % 2 == 0) & (candidates < 99), candidates, 99).min(axis=1)
    magnitude = np.where(even < 99, even, candidates.min(axis=1))
    want = np.where(np.signbit(x), 8, 0) | magnitude
    data = enc1({"element": "fp4_e2m1", "scale": PER_TENSOR}, list(x), 1.0).data[0, 0]
    codes = np.stack([data & 0xF, data >> 4], axis=-1).reshape(-1)[:len(x)]
    assert codes.tolist() == want.tolist()
    values = R.decode_codes(ElementType.fp4_e2m1, data, len(x))
    assert np.array_equal(np.abs(values), table[magnitude])


def test_int_codes_and_packing_by_hand() -> None:
    int4 = {"element": "int4", "rounding": "half_even", "scale": PER_TENSOR}
    # codes 1, -1 = 0xF, 7, -8 = 0x8 (9 clamps to 7; -8.5 rounds to -8, the even neighbour)
    assert hexes(enc1(int4, [1.0, -1.0, 9.0, -8.5], 1.0).data) == "F1 87"  # lsb_first: element 0 low nibble
    assert hexes(enc1({**int4, "packing": "msb_first"}, [1.0, -1.0, 9.0, -8.5], 1.0).data) == "1F 78"
    # int2 in [-2, 1]: 1; -1 = 0b11; -2.5 -> -2 (even) = 0b10; 0.4 -> 0
    int2 = {"element": "int2", "rounding": "half_even", "scale": PER_TENSOR}
    # lsb_first: 01 | 11 << 2 | 10 << 4 | 00 << 6 = 0b00101101 = 0x2D; msb_first: 01 << 6 | 11 << 4 | 10 << 2 = 0x78
    assert hexes(enc1(int2, [1.0, -1.0, -2.5, 0.4], 1.0).data) == "2D"
    assert hexes(enc1({**int2, "packing": "msb_first"}, [1.0, -1.0, -2.5, 0.4], 1.0).data) == "78"
    # half away from zero: 1.5 -> 2 -> clamped to 1; -1.5 -> -2; 0.5 -> 1: 01 | 10 << 2 | 01 << 4 = 0x19
    away = {**int2, "rounding": "half_away_from_zero"}
    assert hexes(enc1(away, [1.5, -1.5, 0.5, 0.0], 1.0).data) == "19"
    # a head of 5 int4 elements ends in a partial byte whose high nibble is 0: [1, 2, 3, 4, 5] -> 21 43 05
    assert hexes(enc1(int4, [1, 2, 3, 4, 5], 1.0).data) == "21 43 05"
    decoded = R.decode_side(make_spec(int4).key, np.array([[[0x21, 0x43, 0x05]]], np.uint8), static_scale=2.0,
                            head_size=5)
    assert decoded.tolist() == [[[2.0, 4.0, 6.0, 8.0, 10.0]]]
    # sign extension on decode: 0xF1 = [1, -1], 0x87 = [7, -8]
    assert R.decode_side(make_spec(int4).key, np.array([[[0xF1, 0x87]]], np.uint8),
                         static_scale=1.0).tolist() == [[[1.0, -1.0, 7.0, -8.0]]]


# --- scales ---------------------------------------------------------------------------------------------------------

def scale_of(side: dict[str, Any], values: list[float], static: Any = None) -> str:
    return hexes(enc1(side, values, static).scale)


def test_e8m0_scales_by_hand() -> None:
    mx = {"element": "fp8_e4m3", "scale": {"granularity": "per_token_head", "dtype": "e8m0"}}
    # amax 896: s = 896 / 448 = 2 exactly, E = 1 -> 0x80 (a power of two is not rounded up)
    assert scale_of(mx, [896.0]) == "80"
    # amax 897: s > 2 -> E = 2, byte 0x81, s = 4: 897 / 4 = 224.25 -> 224 = 0x76
    e = enc1(mx, [897.0])
    assert hexes(e.scale) == "81" and hexes(e.data) == "76"
    # amax 672 = 448 * 1.5: E = ceil(log2 1.5) = 1 -> 0x80; amax 336: s = 0.75 -> E = 0 -> 0x7F
    assert scale_of(mx, [672.0]) == "80" and scale_of(mx, [336.0]) == "7F"
    # all zero: floor max(0, 1e-6, 2**-127) = float32(1e-6): ceil(log2) = ceil(-19.93) = -19 -> 108 = 0x6C
    assert scale_of(mx, [0.0]) == "6C"
    # with a smaller min the dtype's tiny 2**-127 is the floor -> byte 0
    assert scale_of({**mx, "scale": {**mx["scale"], "min": 1e-40}}, [0.0]) == "00"
    # the top clamp: int2 (qmax 1), amax 3e38 > 2**127: E = 128 clamped to 127 -> 0xFE; s = 2**127, so
    # 3e38 / 2**127 = 1.76 -> 2 -> saturates at 1
    big = {"element": "int2", "rounding": "half_even", "scale": {"granularity": "per_token_head", "dtype": "e8m0"}}
    e = enc1(big, [3e38, 0.0, 0.0, 0.0])
    assert hexes(e.scale) == "FE" and hexes(e.data) == "01"


def test_fp8_fp16_bf16_scales_by_hand() -> None:
    i8 = {"element": "int8", "rounding": "half_even"}
    fp8 = {**i8, "scale": {"granularity": "per_token_head", "dtype": "fp8_e4m3"}}
    # amax 127 * 1.0625: s = 1.0625, the tie of 1.0 (m=000) and 1.125 (m=001) -> 1.0 = 0x38
    assert scale_of(fp8, [127 * 1.0625]) == "38"
    # amax 127000: s = 1000 saturates to 448 = 0x7E; 127000 * (1 / 448) = 283.5 -> clamped to 127
    e = enc1(fp8, [127000.0])
    assert hexes(e.scale) == "7E" and hexes(e.data) == "7F"
    # all zero with min 1e-9: the floor is e4m3's tiny 2**-9 = 0x01
    assert scale_of({**fp8, "scale": {**fp8["scale"], "min": 1e-9}}, [0.0]) == "01"
    bf16 = {**i8, "scale": {"granularity": "per_token_head", "dtype": "bf16"}}
    # amax 127 * (1 + 3 * 2**-8): s = 1 + 3 * 2**-8, the tie of 1 + 2**-7 (m=1) and 1 + 2**-6 (m=2) -> 0x3F82
    assert scale_of(bf16, [127 * (1 + 3 * 2.0**-8)]) == "82 3F"
    fp16 = {**i8, "scale": {"granularity": "per_token_head", "dtype": "fp16"}}
    # s = 1 + 3 * 2**-11: the tie of m=1 and m=2 -> 0x3C02; all zero: fp16(float32(1e-6)) = 17 * 2**-24 = 0x0011;
    # with min 1e-9 the floor is 2**-24 = 0x0001
    assert scale_of(fp16, [127 * (1 + 3 * 2.0**-11)]) == "02 3C"
    assert scale_of(fp16, [0.0]) == "11 00"
    assert scale_of({**fp16, "scale": {**fp16["scale"], "min": 1e-9}}, [0.0]) == "01 00"


def test_per_block_scales_and_global_scale() -> None:
    # per_block 4 over a head of 8, fp16 scales, divide: block 0 amax 14 -> s 2 (00 40): 7, -4 (0xC) -> 0xC7, 0x00;
    # block 1 amax 3.5 -> s 0.5 (00 38): 7, -7 (0x9), 1, 0 -> 0x97, 0x01
    q = {"element": "int4", "rounding": "half_even",
         "scale": {"granularity": "per_block", "block": 4, "dtype": "fp16", "apply": "divide"}}
    e = enc1(q, [14.0, -8.0, 0.0, 0.0, 3.5, -3.5, 0.5, 0.0])
    assert hexes(e.data) == "C7 00 97 01" and hexes(e.scale) == "00 40 00 38"
    # a global scale g = 0.25 (NVFP4 rule): block amax 12: s = 12 / 6 / 0.25 = 8 -> e4m3 0 1010 000 = 0x50;
    # s_eff = 8 * 0.25 = 2: 12 -> 6 = code 7; 3 -> 1.5 = code 3: byte 0x37
    nv = {"element": "fp4_e2m1",
          "scale": {"granularity": "per_block", "block": 2, "dtype": "fp8_e4m3", "global_scale": True,
                    "apply": "divide"}}
    e = enc1(nv, [12.0, 3.0], 0.25)
    assert hexes(e.scale) == "50" and hexes(e.data) == "37"
    dec = R.decode_side(make_spec(nv).key, e.data, e.scale, static_scale=0.25)
    assert dec.tolist() == [[[12.0, 3.0]]]
    # a block size that does not divide the head size is an error
    with pytest.raises(ValueError):
        enc1(q, [1.0] * 6)


def test_fp16_scale_saturates() -> None:
    # SEMANTICS.md: fp16 / bf16 scales saturate at their largest finite value before rounding. q8_0-like side with
    # amax 1e7: s = 1e7 / 127 = 78740 > 65504, stored as 65504 = 0x7BFF (bytes FF 7B); codes x * (1 / 65504):
    # 1e7 -> 152.7 -> clamped to 127 (0x7F); 5.0 -> 7.6e-5 -> 0. Decode 127 * 65504 = 8,319,008: finite, and the
    # error bound (which counts saturation) is finite too.
    q8 = {"element": "int8", "rounding": "half_away_from_zero",
          "scale": {"granularity": "per_block", "block": 2, "dtype": "fp16"}}
    e = enc1(q8, [1e7, 5.0])
    assert hexes(e.scale) == "FF 7B" and hexes(e.data) == "7F 00"
    side = make_spec(q8).key
    assert R.decode_side(side, e.data, e.scale).ravel().tolist() == [127 * 65504.0, 0.0]
    assert np.isfinite(R.error_bound(side, np.array([[[1e7, 5.0]]], np.float32))).all()


def test_zero_points_by_hand() -> None:
    # uint4 beside_scale, half_even: lo -1, hi 2: s = 3 / 15 = 0.2 (fp32 0x3E4CCCCD); zp = rint(1 / s) = 5;
    # codes 1 / s + 5: -1 -> 0; 2 -> 15; 0 -> 5; 0.5 -> rint(7.5) = 8 (even): bytes F0 85, scale CD CC 4C 3E, zp 05
    u4 = {"element": "uint4", "rounding": "half_even", "zero_point": {"storage": "beside_scale"},
          "scale": {"granularity": "per_token_head", "apply": "divide"}}
    e = enc1(u4, [-1.0, 2.0, 0.0, 0.5])
    assert (hexes(e.data), hexes(e.scale), hexes(e.zp)) == ("F0 85", "CD CC 4C 3E", "05")
    # uint2 in the scale's low 2 bits: lo -1, hi 2: s = 1.0 = 0x3F800000, zp = 1 -> stored 0x3F800001;
    # codes: -1 -> 0; 2 -> 3; 0 -> 1; 1 -> 2: 00 | 11 << 2 | 01 << 4 | 10 << 6 = 0x9C
    u2 = {"element": "uint2", "rounding": "half_even", "zero_point": {"storage": "scale_low_bits"},
          "scale": {"granularity": "per_token_head", "apply": "divide"}}
    e = enc1(u2, [-1.0, 2.0, 0.0, 1.0])
    assert (hexes(e.scale), hexes(e.data), e.zp) == ("01 00 80 3F", "9C", None)
    # the low bits are cleared before the zero point is computed: s = float32(0.1) / 15 has bits b; s_q has b & ~0xF
    u4_low = {**u4, "zero_point": {"storage": "scale_low_bits"}}
    e = enc1(u4_low, [-0.1, 0.0])
    s = np.float32(np.float32(0.1) / np.float32(15))
    s_q = (s.view(np.uint32) & ~np.uint32(0xF)).view(np.float32)
    zp = int(np.rint(np.float32(0.1) / s_q))  # 15.0000x -> 15
    assert zp == 15
    assert e.scale.view("<u4").item() == int((s.view(np.uint32) & ~np.uint32(0xF)) | zp)
    # a constant group: the range includes 0, so lo = 0, hi = 5: s = fp32(5 / 15) = 0.33333334, zp = 0,
    # codes rint(5 / s) = rint(14.9999995) = 15 -> FF; decode 15 * 0.33333334 = 5.0000001 (no saturation)
    e = enc1(u4, [5.0, 5.0])
    assert hexes(e.data) == "FF" and hexes(e.zp) == "00"
    side = make_spec(u4).key
    x = np.full((1, 1, 2), 5.0, np.float32)
    dec = R.decode_side(side, e.data, e.scale, e.zp)
    assert np.allclose(dec, 15 * float(np.float32(5.0) / np.float32(15.0)), rtol=0, atol=1e-12)
    assert np.all(np.abs(dec - 5.0) <= R.error_bound(side, x))


# --- rotation -------------------------------------------------------------------------------------------------------

def test_rotation_order_by_hand() -> None:
    # head size 4, seed 0: signs = 1 - 2 * default_rng(0).integers(0, 2, 4) = [-1, -1, -1, 1]
    assert R.hadamard_signs(0, 4).tolist() == [-1.0, -1.0, -1.0, 1.0]
    # x * signs = u = [1, 2**-24, 2**-24, 0]. Stage h = 1, pairs (0,1) (2,3): 1 + 2**-24 ties to 1.0 (even);
    # 1 - 2**-24; 2**-24; 2**-24. Stage h = 2, pairs (0,2) (1,3): 1.0 + 2**-24 -> 1.0; (1 - 2**-24) + 2**-24 = 1.0;
    # 1.0 - 2**-24 = 0x3F7FFFFF; (1 - 2**-24) - 2**-24 = 1 - 2**-23 = 0x3F7FFFFE.
    # (Exact: [1 + 2**-23, 1, 1, 1 - 2**-23]; the stages in the other order give [1, 1 - 2**-24, 1, 1 - 2**-23].)
    spec = make_spec({"element": "fp32", "rotation": {"seed": 0}})
    x = np.array([-1.0, -(2.0**-24), -(2.0**-24), 0.0], np.float32).reshape(1, 1, 4)
    data = R.encode_side(spec.key, x).data[0, 0]
    assert data.view("<u4").tolist() == [0x3F800000, 0x3F800000, 0x3F7FFFFF, 0x3F7FFFFE]
    # read() undoes the rotation (float64): back within the fp32 transform's rounding
    back = R.decode_side(spec.key, data.reshape(1, 1, -1))
    assert np.all(np.abs(back - x) <= R.error_bound(spec.key, x))
    # b is the largest power of two dividing the head size: 12 -> 3 blocks of 4, transformed independently
    x12 = np.zeros((1, 1, 12), np.float32)
    signs12 = R.hadamard_signs(5, 12)
    x12[0, 0, 4] = 2.0 * signs12[4]  # u[4] = 2: block 1 becomes [2, 2, 2, 2], blocks 0 and 2 stay 0
    got = R.encode_side(make_spec({"element": "fp32", "rotation": {"seed": 5}}).key, x12).data[0, 0].view("<f4")
    assert got.tolist() == [0.0] * 4 + [2.0] * 4 + [0.0] * 4


def test_rotation_roundtrip_unquantized() -> None:
    rng = np.random.default_rng(0)
    for d in (16, 48, 64, 6):
        x = rng.standard_normal((3, 2, d)).astype(np.float32)
        side = make_spec({"element": "fp32", "rotation": {"seed": 7}}).key
        enc = R.encode_side(side, x)
        assert np.max(np.abs(R.decode_side(side, enc.data) - x)) < 1e-5
        assert np.all(np.abs(R.decode_side(side, enc.data) - x) <= R.error_bound(side, x))


# --- layout ---------------------------------------------------------------------------------------------------------

def regions(spec: FormatSpec, d: int) -> dict[str, list[tuple[dict[str, int], int]]]:
    """{tensor: [({field: offset}, cell), ...]}"""
    return {n: [({f.name: f.offset for f in r.fields}, r.cell) for r in t.regions]
            for n, t in R.layout(spec, d).items()}


def test_layouts_by_hand() -> None:
    fp8_dyn = {"element": "fp8_e4m3", "scale": {"granularity": "per_token_head", "placement": "page_end"}}
    inline = {"element": "int8", "scale": {"granularity": "per_token_head"}}
    # key page_end, value inline: [K data 64][K scale 4][V data 64, V scale at 64] -> cells 64, 4, 68
    spec = make_spec(fp8_dyn, inline)
    assert regions(spec, 64) == {"kv_cache": [({"k_data": 0}, 64), ({"k_scale": 0}, 4),
                                              ({"v_data": 0, "v_scale": 64}, 68)]}
    # key inline, value page_end: [K data, K scale][V data][V scale]
    spec = make_spec(inline, fp8_dyn)
    assert regions(spec, 64) == {"kv_cache": [({"k_data": 0, "k_scale": 64}, 68), ({"v_data": 0}, 64),
                                              ({"v_scale": 0}, 4)]}
    # block 16, 8 heads: regions at 0, 16 * 8 * 68 = 8704, 8704 + 8192 = 16896; page 16896 + 512 = 17408;
    # two or more regions -> shape [blocks, page]
    assert R.tensor_shapes(spec, 3, 16, 8, 64) == {"kv_cache": ((3, 17408), "uint8")}
    # separate scales with zero points: uint8 storage; per_block 16 at head size 64 = 4 fp16 scales (0..7) then 4
    # zero points (8..11), cell 12 (a multiple of 2)
    asym = {"element": "uint4", "zero_point": {}, "scale": {"granularity": "per_block", "block": 16, "dtype": "fp16",
                                                            "placement": "separate"}}
    spec = make_spec(asym, {"element": "bf16"}, layout="split")
    assert regions(spec, 64) == {"k_cache": [({"k_data": 0}, 32)],
                                 "k_scale_cache": [({"k_scale": 0, "k_zp": 8}, 12)],
                                 "v_cache": [({"v_data": 0}, 128)]}
    # storage: data uint8 (default: the sides differ), the scale tensor uint8 (zero points), v_cache uint8 too
    assert R.tensor_shapes(spec, 2, 4, 3, 64) == {"k_cache": ((2, 4, 3, 32), "uint8"),
                                                  "k_scale_cache": ((2, 4, 3, 12), "uint8"),
                                                  "v_cache": ((2, 4, 3, 128), "uint8")}
    assert R.bytes_per_token_head(spec, 64) == {"key": 32 + 8 + 4, "value": 128, "total": 32 + 12 + 128}
    # scale tensors without zero points keep the scale dtype: fp16 [.., 4 / 2], bf16, fp32
    for dtype, size, name in (("fp16", 2, "fp16"), ("bf16", 2, "bf16"), ("fp32", 4, "fp32"), ("e8m0", 1, "uint8")):
        sep = {"element": "int8", "scale": {"granularity": "per_block", "block": 32, "dtype": dtype,
                                            "placement": "separate"}}
        shapes = R.tensor_shapes(make_spec(sep), 2, 4, 3, 64)
        assert shapes["k_scale_cache"] == ((2, 4, 3, 2), name)  # 2 scales per (slot, head), in storage elements
        assert shapes["kv_cache"] == ((2, 4, 3, 128), "int8")
    # split unquantized: k_cache / v_cache in the element dtype
    assert R.tensor_shapes(make_spec({"element": "bf16"}, layout="split"), 2, 4, 3, 64) == {
        "k_cache": ((2, 4, 3, 64), "bf16"), "v_cache": ((2, 4, 3, 64), "bf16")}


def test_region_padding_and_page_end_rounding() -> None:
    # key fp8 with a page_end fp32 scale, value bf16 inline, head size 1, 1 slot, 1 head:
    # [K data 1 B] at 0; [K scale 4 B] at 4 (its 4-byte alignment: 3 bytes of padding); [V data 2 B] at 8; end 10;
    # the page ends at a multiple of the largest region alignment (4): 12. Summing the cells would give 7.
    fp8 = {"element": "fp8_e4m3", "scale": {"granularity": "per_token_head", "placement": "page_end"}}
    spec = make_spec(fp8, {"element": "bf16"})
    t = R.layout(spec, 1)["kv_cache"]
    assert t.region_offsets(1, 1) == [0, 4, 8] and t.page_bytes(1, 1) == 12
    assert R.bytes_per_token_head(spec, 1)["total"] == 7
    # with 16 slots x 8 heads every region size is a multiple of 4: no padding, page = 128 * 7
    assert R.page_bytes(spec, 16, 8, 1) == 128 * 7


# --- the dict cache API ---------------------------------------------------------------------------------------------

def test_dict_cache_write_read() -> None:
    spec = spec_of("nvfp4")
    cache = R.new_cache(spec, 3, 4, 2, 32)
    assert {n: a.shape for n, a in cache.items()} == {"kv_cache": (3, 4 * 2 * (16 + 2 + 16 + 2))}
    rng = np.random.default_rng(1)
    key = rng.standard_normal((5, 2, 32)).astype(np.float32)
    value = rng.standard_normal((5, 2, 32)).astype(np.float32)
    slots = np.array([11, -1, 0, 5, 4])
    R.write(spec, cache, key, value, slots, k_scale=0.5, v_scale=2.0)  # block size inferred: 4
    k, v = R.read(spec, cache, 0.5, 2.0, head_size=32, block_size=4, num_kv_heads=2)
    written = slots >= 0
    blk, off = slots[written] // 4, slots[written] % 4
    assert np.all(np.abs(k[blk, off] - key[written]) <= R.error_bound(spec.key, key[written], 0.5))
    assert np.all(np.abs(v[blk, off] - value[written]) <= R.error_bound(spec.value, value[written], 2.0))
    untouched = np.ones((3, 4), bool)
    untouched[blk, off] = False
    assert not k[untouched].any() and not v[untouched].any()
    with pytest.raises(ValueError):  # [blocks, page] arrays do not tell the block size and head count
        R.read(spec, cache, 0.5, 2.0, head_size=32)
    with pytest.raises(ValueError):  # missing tensor
        R.write(spec, {}, key, value, slots)
    with pytest.raises(IndexError):
        R.write(spec, cache, key, value, np.array([12, 0, 1, 2, 3]), k_scale=0.5, v_scale=2.0)
    # arrays in the runtime's shapes and storage dtypes work too (views, writes go through)
    sep = spec_of("int8_per_token_head_separate")
    shapes = R.tensor_shapes(sep, 2, 4, 2, 32)
    arrays = {n: np.zeros(shape, {"int8": np.int8, "fp32": np.float32}[dt]) for n, (shape, dt) in shapes.items()}
    R.write(sep, arrays, key[:1], value[:1], np.array([6]))
    k, _ = R.read(sep, arrays)  # 4-D one-region arrays give block size, heads and (the only fit) head size
    assert arrays["k_scale_cache"][1, 2, 0, 0] == np.max(np.abs(key[0, 0])) / np.float32(127)
    assert np.all(np.abs(k[1, 2] - key[0]) <= R.error_bound(sep.key, key[:1])[0])


# --- every new format: roundtrip and error bound --------------------------------------------------------------------

def hard_data(rng: np.random.Generator, shape: tuple[int, int, int], magnitude: float, block: int) -> np.ndarray:
    """Normal data with an outlier channel, exact zeros, an all-zero token, an all-zero block, a constant block, a
    one-signed (all positive) token and one all negative, huge and tiny tokens."""
    t, h, d = shape
    x = rng.standard_normal(shape).astype(np.float32) * magnitude
    x[..., rng.integers(0, d)] *= 40.0
    x[rng.random(shape) < 0.05] = 0.0
    x[0] = 0.0
    x[1, :, :block] = 0.0
    x[2, :, :block] = np.float32(1.5 * magnitude)  # constant block (hi == lo)
    x[3] = np.abs(x[3]) + magnitude  # all positive: lo > 0
    x[4] = -np.abs(x[4])
    x[5] *= 1e4
    x[6] *= 1e-4
    return x


def _block(side) -> int:
    sc = side.scale
    return sc.block if sc is not None and sc.block else 4


SYNTHETIC = {
    "uint2_msb_lowbits": {"element": "uint2", "packing": "msb_first", "rounding": "half_away_from_zero",
                          "zero_point": {"storage": "scale_low_bits"}, "scale": {"granularity": "per_token_head"}},
    "uint8_e8m0_block": {"element": "uint8", "zero_point": {}, "scale": {"granularity": "per_block", "block": 8,
                                                                         "dtype": "e8m0"}},
    "int2_bf16_block": {"element": "int2", "scale": {"granularity": "per_block", "block": 16, "dtype": "bf16"}},
    "fp4_fp16_global": {"element": "fp4_e2m1", "scale": {"granularity": "per_block", "block": 8, "dtype": "fp16",
                                                         "global_scale": True}},
    "uint4_global_rot": {"element": "uint4", "zero_point": {}, "rotation": {"seed": 3},
                         "scale": {"granularity": "per_block", "block": 16, "dtype": "fp8_e4m3",
                                   "global_scale": True}},
    "fp8_e5m2_rot_static": {"element": "fp8_e5m2", "rotation": {"seed": 1}, "scale": {"granularity": "per_head"}},
    "bf16_rot": {"element": "bf16", "rotation": {"seed": 2}},
    "int8_rot_block": {"element": "int8", "rotation": {"seed": 4}, "rounding": "half_away_from_zero",
                       "scale": {"granularity": "per_block", "block": 16}},
}
CASES = [(n, None) for n in NEW_FORMATS] + [(n, s) for n, s in SYNTHETIC.items()]


@pytest.mark.parametrize("name, side_dict", CASES, ids=[c[0] for c in CASES])
def test_error_bound_holds_and_is_tight(name: str, side_dict: Optional[dict]) -> None:
    spec = spec_of(name) if side_dict is None else make_spec(side_dict)
    rng = np.random.default_rng(11)
    worst = 0.0
    for side_name in ("key", "value"):
        side = spec.side(side_name)
        for d in (32, 64):
            for magnitude, layer in ((1.0, 1.0), (30.0, 0.037), (1e-3, 7.25)):
                x = hard_data(rng, (40, 3, d), magnitude, min(_block(side), d))
                s = static_scale(side, 3, layer)
                enc = R.encode_side(side, x, s)
                decoded = R.decode_side(side, enc.data, enc.scale, enc.zp, s, head_size=d)
                err = np.abs(decoded - x.astype(np.float64))
                bound = R.error_bound(side, x, s)
                # inf bound: an fp16 scale that overflows (|x| > qmax * 65504, see test_fp16_scale_overflow_is_ieee)
                bad = ~((err <= bound) | np.isinf(bound))
                assert not bad.any(), (f"{side_name} d={d} mag={magnitude}: error {err[bad].max():.3g} above its "
                                       f"bound {bound[bad].min():.3g}")
                ok = np.isfinite(bound) & (bound > 0)
                worst = max(worst, float((err[ok] / bound[ok]).max()))
    rotated = spec.key.rotation is not None or spec.value.rotation is not None
    # not vacuous: some element comes close to its bound (with a rotation the bound is the worst case of a sum of
    # b errors, a random sum stays well below it)
    assert worst > (0.2 if rotated else 0.9), worst


@pytest.mark.filterwarnings("ignore:kvgen format .* no k_scale")  # static formats allocated without their scales
@pytest.mark.parametrize("name", [n for n in __import__("kvgen").shipped_names() if not n.startswith("kivi")])
def test_reference_tensors_are_what_allocate_gives(name):
    # the reference derives each cache tensor's shape and dtype from the spec; the runtime allocates from the
    # generated layout: the two must agree tensor by tensor (same bytes alone would hide a dtype that differs).
    # KIVI's pages have their own reference layout (reference/kivi.py, tests/test_kivi_reference.py)
    import torch

    import kvgen

    fmt = kvgen.load(name)
    block = 16
    cache = fmt.allocate(2, block, 3, 64)
    names = {torch.uint8: "uint8", torch.int8: "int8", torch.float16: "fp16", torch.bfloat16: "bf16",
             torch.float32: "fp32"}
    got = {t: (tuple(cache.tensors[t].shape), names[cache.tensors[t].dtype])
           for t in cache.tensors if t not in ("k_scale", "v_scale")}
    want = {t: (tuple(shape), dtype) for t, (shape, dtype) in R.tensor_shapes(fmt.spec, 2, block, 3, 64).items()}
    assert got == want
