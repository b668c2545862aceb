"""Fast unit tests of the NumPy reference against hand-computed values and ml_dtypes.

Every expected number below is worked out by hand in its comment from the bit layouts:
  bf16  = 1 sign | 8 exponent (bias 127) | 7 mantissa;   fp16 = 1 | 5 (bias 15) | 10
  e4m3fn = 1 | 4 (bias 7) | 3, no inf, max 448 = 0 1111 110, NaN = S 1111 111; subnormal step 2**-9
  e5m2  = 1 | 5 (bias 15) | 2, max 57344 = 0 11110 11;  subnormal step 2**-16
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import ml_dtypes
import numpy as np
import pytest

from kvgen import reference as R
from kvgen.codegen.loader import load_spec
from kvgen.codegen.spec import FormatSpec

SPECS = Path(__file__).resolve().parent.parent / "specs"
SHIPPED = ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp8_per_token_head", "int8_per_token_head"]


def shipped(name: str) -> FormatSpec:
    return load_spec(SPECS / f"{name}.yaml")


def make_spec(key: dict[str, Any], value: Optional[dict[str, Any]] = None, **cache: Any) -> FormatSpec:
    """A format from side dicts (value defaults to key)."""
    return FormatSpec.model_validate({"name": "t", "key": key, "value": value or key, "cache": cache})


def encode_one(spec: FormatSpec, values: list[float], static_scale: Any = None) -> np.ndarray:
    """Encode one (token, head) vector with the key side: its data bytes."""
    x = np.array(values, dtype=np.float32).reshape(1, 1, -1)
    return R.encode_side(spec.key, x, static_scale).data[0, 0]


# --- layout ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, expected, page", [
    # bf16/fp16: K 128 x 2 B at 0, V at 256; cell 512; page 16 * 8 * 512
    ("bf16", {"k_data": 0, "v_data": 256, "cell_bytes": 512}, 65536),
    ("fp16", {"k_data": 0, "v_data": 256, "cell_bytes": 512}, 65536),
    # fp8 static: K 128 B, V 128 B; page 16 * 8 * 256
    ("fp8_e4m3", {"k_data": 0, "v_data": 128, "cell_bytes": 256}, 32768),
    ("fp8_e5m2", {"k_data": 0, "v_data": 128, "cell_bytes": 256}, 32768),
    # K 0..127, K scale 128..131, V 132..259, V scale 260..263; page 16 * 8 * 264
    ("fp8_per_token_head", {"k_data": 0, "k_scale": 128, "v_data": 132, "v_scale": 260, "cell_bytes": 264}, 33792),
    ("int8_per_token_head", {"k_data": 0, "k_scale": 128, "v_data": 132, "v_scale": 260, "cell_bytes": 264}, 33792),
])
def test_shipped_layouts_at_d128(name: str, expected: dict[str, int], page: int) -> None:
    spec = shipped(name)
    assert R.cell_layout(spec, 128) == expected
    assert R.page_bytes(spec, 16, 8, 128) == page


def test_mixed_sides_align_each_field() -> None:
    fp8_dyn = {"element": "fp8_e4m3", "scale": {"granularity": "per_token_head"}}
    spec = make_spec(fp8_dyn, {"element": "bf16"})
    # K data 0..127, K scale (align 4) 128..131, V bf16 (align 2) 132..387; end 388 is a multiple of 4
    assert R.cell_layout(spec, 128) == {"k_data": 0, "k_scale": 128, "v_data": 132, "cell_bytes": 388}
    int8_a16 = {"element": "int8", "scale": {"granularity": "per_token_head", "align": 16}}
    spec = make_spec(int8_a16)
    # K 0..127, K scale at 128 (16 | 128), V 132..259, V scale at 272 (next multiple of 16), end 276 -> 288
    assert R.cell_layout(spec, 128) == {"k_data": 0, "k_scale": 128, "v_data": 132, "v_scale": 272,
                                        "cell_bytes": 288}
    # an odd head size pads: K 0..32, scale at 36, V 40..72, V scale at 76, end 80 (already a multiple of 4)
    assert R.cell_layout(shipped("int8_per_token_head"), 33) == {
        "k_data": 0, "k_scale": 36, "v_data": 40, "v_scale": 76, "cell_bytes": 80}


def test_unsupported_features_raise() -> None:
    # what the schema can express but SEMANTICS.md does not define: a float zero point under a global scale
    fp16_zp_global = {"element": "uint8", "zero_point": {"dtype": "fp16"},
                      "scale": {"granularity": "per_token_head", "global_scale": True}}
    spec = make_spec(fp16_zp_global)
    with pytest.raises(NotImplementedError, match="reference:"):
        R.encode_side(spec.key, np.zeros((1, 1, 128), np.float32), 1.0)
    # several tensors or regions: cell_layout / new_cache_bytes are for one-region kv_cache formats only
    with pytest.raises(ValueError):
        R.cell_layout(make_spec({"element": "bf16"}, layout="split"), 128)


def test_nan_counts_as_zero_in_a_float_zero_point_range() -> None:
    """SEMANTICS.md "NaN": integer codes store a NaN as 0.0 would be, and the 0.0 replaces the NaN before the scale is
    taken, so a float zero point's range (which need not hold 0) takes it in; +-inf stays out of every range."""
    spec = make_spec({"element": "uint4", "packing": "lsb_first", "zero_point": {"storage": "beside_scale",
                      "dtype": "fp16"}, "scale": {"granularity": "per_token_head", "dtype": "fp16"}})

    def encoded(special: float) -> tuple:
        x = np.linspace(5, 7, 16, dtype=np.float32).reshape(1, 1, 16)
        x[0, 0, 3] = special
        enc = R.encode_side(spec.key, x)
        return enc.data.tobytes(), enc.scale.tobytes(), enc.zp.tobytes()

    assert encoded(np.nan) == encoded(0.0)
    assert encoded(np.inf)[1:] == encoded(5.0)[1:]  # inf: the scale and minimum of the finite values
    assert encoded(np.nan)[2] != encoded(np.inf)[2]


# --- element codes --------------------------------------------------------------------------------------------------

def test_fp8_e4m3_codes_by_hand() -> None:
    spec = shipped("fp8_e4m3")  # static per_tensor, divide; scale 1.0
    values = [
        1.0,           # 0 0111 000 = 0x38
        1.0625,        # tie of 1.0 (m=000) and 1.125 (m=001): even -> 1.0 = 0x38
        17.0,          # [16, 32) step 2: tie of 16 (m=000) and 18 (m=001) -> 16 = 0 1011 000 = 0x58
        21.0,          # tie of 20 (m=010) and 22 (m=011) -> 20 = 0 1011 010 = 0x5A
        464.0,         # clipped to 448 = 1.75 * 2**8 = 0 1111 110 = 0x7E
        -448.0,        # 0x80 | 0x7E = 0xFE
        3 * 2.0**-10,  # subnormal tie of 2**-9 (m=001) and 2**-8 (m=010) -> m=010 = 0x02
        2.0**-10,      # tie of 0 and 2**-9 -> 0 = 0x00
        -1.5,          # 1 0111 100 = 0xBC
        1000.0,        # clipped to 448 -> 0x7E (unclipped ml_dtypes would give NaN 0x7F)
        -math.inf,     # clipped to -448 -> 0xFE
        2.0**-9,       # smallest subnormal 0 0000 001 = 0x01
    ]
    expected = [0x38, 0x38, 0x58, 0x5A, 0x7E, 0xFE, 0x02, 0x00, 0xBC, 0x7E, 0xFE, 0x01]
    assert encode_one(spec, values).tolist() == expected
    assert encode_one(spec, [math.nan])[0] & 0x7F == 0x7F  # NaN stays NaN: S 1111 111


def test_fp8_e5m2_codes_by_hand() -> None:
    spec = shipped("fp8_e5m2")
    values = [
        1.0,       # 0 01111 00 = 0x3C
        1.125,     # tie of 1.0 (m=00) and 1.25 (m=01) -> 1.0 = 0x3C
        1.375,     # tie of 1.25 (m=01) and 1.5 (m=10) -> 1.5 = 0 01111 10 = 0x3E
        57344.0,   # 1.75 * 2**15 = 0 11110 11 = 0x7B
        100000.0,  # clipped to 57344 = 0x7B
        -2.0,      # 1 10000 00 = 0xC0
        2.0**-16,  # smallest subnormal 0 00000 01 = 0x01
        6.0,       # 1.5 * 2**2 = 0 10001 10 = 0x46
        math.inf,  # clipped to 57344 = 0x7B (not the inf code 0x7C)
    ]
    assert encode_one(spec, values).tolist() == [0x3C, 0x3C, 0x3E, 0x7B, 0x7B, 0xC0, 0x01, 0x46, 0x7B]


@pytest.mark.parametrize("name, dtype", [("fp8_e4m3", ml_dtypes.float8_e4m3fn), ("fp8_e5m2", ml_dtypes.float8_e5m2)])
def test_fp8_matches_ml_dtypes_in_range(name: str, dtype: type) -> None:
    spec = shipped(name)
    top = float(ml_dtypes.finfo(dtype).max)
    rng = np.random.default_rng(1)
    x = (rng.uniform(-1, 1, 4096) * np.exp2(rng.uniform(-20, math.log2(top), 4096))).astype(np.float32)
    assert np.array_equal(encode_one(spec, list(x)), x.astype(dtype).view(np.uint8))
    # every finite code survives decode -> encode
    codes = np.arange(256, dtype=np.uint8)
    finite = np.isfinite(codes.view(dtype).astype(np.float32))
    values = R.decode_side(spec.key, codes[finite].reshape(1, 1, -1), static_scale=1.0)[0, 0]
    assert np.array_equal(encode_one(spec, list(values)), codes[finite])


def test_unquantized_codes_by_hand() -> None:
    # bf16: 1.0 = 0x3F80; 1 + 3 * 2**-8 is the tie of 1 + 2**-7 (m=1) and 1 + 2**-6 (m=2) -> 0x3F82;
    # 1 + 2**-8 + 2**-10 is above the tie of 1.0 and 1 + 2**-7 -> 0x3F81; -2.0 = 1 10000000 0000000 = 0xC000
    bf16 = encode_one(shipped("bf16"), [1.0, 1 + 3 * 2.0**-8, 1 + 2.0**-8 + 2.0**-10, -2.0])
    assert bf16.tolist() == [0x80, 0x3F, 0x82, 0x3F, 0x81, 0x3F, 0x00, 0xC0]  # little-endian
    # fp16: 1.0 = 0x3C00; 1 + 3 * 2**-11 ties to m=2 -> 0x3C02; 65504 = 0 11110 1111111111 = 0x7BFF;
    # -0.5 = 1 01110 0 = 0xB800; 2**-24 = smallest subnormal 0x0001
    fp16 = encode_one(shipped("fp16"), [1.0, 1 + 3 * 2.0**-11, 65504.0, -0.5, 2.0**-24])
    assert fp16.tolist() == [0x00, 0x3C, 0x02, 0x3C, 0xFF, 0x7B, 0x00, 0xB8, 0x01, 0x00]
    # fp32: 1.5 = 0x3FC00000
    fp32 = encode_one(make_spec({"element": "fp32"}), [1.5])
    assert fp32.tolist() == [0x00, 0x00, 0xC0, 0x3F]


def test_decode_by_hand() -> None:
    fp8 = shipped("fp8_e4m3").key
    # 0x7E = 448, 0x01 = 2**-9, 0xBC = -1.5; times the static scale 2
    got = R.decode_side(fp8, np.array([[[0x7E, 0x01, 0xBC]]], np.uint8), static_scale=2.0)
    assert got.tolist() == [[[896.0, 2.0**-8, -3.0]]]
    e5 = shipped("fp8_e5m2").key
    got = R.decode_side(e5, np.array([[[0x7B, 0x01]]], np.uint8), static_scale=1.0)
    assert got.tolist() == [[[57344.0, 2.0**-16]]]
    # bf16 bytes 82 3F = 0x3F82 = 1 + 2 * 2**-7 = 1.015625
    assert R.decode_side(shipped("bf16").key, np.array([[[0x82, 0x3F]]], np.uint8)).tolist() == [[[1.015625]]]
    # int8 0xFD = -3, 0x7F = 127, times a stored per (token, head) scale 0.5 = 0x3F000000 (bytes 00 00 00 3F)
    i8 = shipped("int8_per_token_head").key
    got = R.decode_side(i8, np.array([[[0xFD, 0x7F]]], np.uint8), np.array([[[0, 0, 0, 0x3F]]], np.uint8))
    assert got.tolist() == [[[-1.5, 63.5]]]


# --- scales and integer rounding ------------------------------------------------------------------------------------

def test_int8_per_token_head_rounds_half_away_from_zero() -> None:
    spec = shipped("int8_per_token_head")
    x = np.array([127.0, 2.5, -2.5, 0.5, -0.5, 0.5 - 2.0**-25, 1.4, -127.0], np.float32).reshape(1, 1, -1)
    enc = R.encode_side(spec.key, x)
    data = enc.data
    # absmax 127 -> scale 127 / 127 = 1.0, 1 / scale = 1.0 (stored 00 00 80 3F)
    assert enc.scale.tolist() == [[[0x00, 0x00, 0x80, 0x3F]]]
    # 2.5 -> trunc(3.0) = 3; -2.5 -> -3; 0.5 -> trunc(1.0) = 1; -0.5 -> -1;
    # 0.5 - 2**-25: (0.5 - 2**-25) + 0.5 = 1 - 2**-25 is the float32 tie of 1 - 2**-24 (odd) and 1.0 (even) -> 1.0,
    #   trunc -> 1 (exact rounding would give 0: this is vLLM's float32 addition);
    # 1.4 -> trunc(1.9) = 1; -127 -> -127 = 0x81
    assert data[0, 0].view(np.int8).tolist() == [127, 3, -3, 1, -1, 1, 1, -127]


def test_int8_half_even_and_clipping() -> None:
    spec = make_spec({"element": "int8", "rounding": "half_even", "scale": {"granularity": "per_tensor"}})
    # scale 1: rint 2.5 -> 2, -2.5 -> -2, 3.5 -> 4, 0.5 -> 0; 200 -> 127; -200 -> -128; -128.5 -> -128 (even)
    got = encode_one(spec, [2.5, -2.5, 3.5, 0.5, 200.0, -200.0, -128.5], 1.0).view(np.int8)
    assert got.tolist() == [2, -2, 4, 0, 127, -128, -128]
    away = make_spec({"element": "int8", "rounding": "half_away_from_zero", "scale": {"granularity": "per_tensor"}})
    # -128.5 -> trunc(-129.0) = -129 -> clipped to -128; 127.5 -> 128 -> 127
    assert encode_one(away, [-128.5, 127.5], 1.0).view(np.int8).tolist() == [-128, 127]


def test_divide_and_reciprocal_multiply_differ() -> None:
    side = {"element": "int8", "rounding": "half_away_from_zero"}
    divide = make_spec({**side, "scale": {"granularity": "per_tensor", "apply": "divide"}})
    recip = make_spec({**side, "scale": {"granularity": "per_tensor", "apply": "reciprocal_multiply"}})
    # 91.5 / 61 = 1.5 exactly -> trunc(2.0) = 2.
    # float32(1/61): 64/61 * 2**23 = 2**23 + 25165824/61 = 2**23 + 412554 + 30/61 -> rounds down, so
    # 1/61 ~ 8801162 * 2**-29. 91.5 * 8801162 = 805306323 = 1.5 * 2**29 - 45, i.e. 1.5 - 45 * 2**-29; the float32
    # step at 1.5 is 2**-23 = 64 * 2**-29, nearest is 1.5 - 2**-23; + 0.5 = 2 - 2**-23 (exact) -> trunc 1.
    assert encode_one(divide, [91.5], 61.0).view(np.int8).tolist() == [2]
    assert encode_one(recip, [91.5], 61.0).view(np.int8).tolist() == [1]


def test_dynamic_scale_floor_and_values() -> None:
    spec = shipped("fp8_per_token_head")
    x = np.zeros((1, 3, 4), np.float32)
    x[0, 1] = [896.0, 34.0, -3.0, 0.0]  # absmax 896 -> scale 896 / 448 = 2.0, 1 / 2 = 0.5
    x[0, 2] = [112.0, 0.25, -0.5, 0.0]  # absmax 112 -> scale 0.25, 1 / 0.25 = 4
    enc = R.encode_side(spec.key, x)
    data = enc.data
    # all zeros: max(0 / 448, 1e-6) = float32(1e-6), bits 0x358637BD
    assert enc.scale[0].view("<u4")[:, 0].tolist() == [0x358637BD, 0x40000000, 0x3E800000]
    assert data[0, 0].tolist() == [0, 0, 0, 0]
    # 896 * 0.5 = 448 -> 0x7E; 17 -> 0x58 (tie to 16); -1.5 -> 0xBC
    assert data[0, 1].tolist() == [0x7E, 0x58, 0xBC, 0x00]
    # 112 * 4 = 448 -> 0x7E; 1.0 -> 0x38; -2.0 = 1 1000 000 = 0xC0
    assert data[0, 2].tolist() == [0x7E, 0x38, 0xC0, 0x00]


def test_static_per_head_scales() -> None:
    spec = make_spec({"element": "fp8_e4m3", "scale": {"granularity": "per_head"}})
    x = np.full((1, 2, 1), 2.0, np.float32)
    enc = R.encode_side(spec.key, x, [1.0, 4.0])
    # head 0: 2 / 1 = 2 = 0 1000 000 = 0x40; head 1: 2 / 4 = 0.5 = 0 0110 000 = 0x30
    assert enc.scale is None and enc.data[0, :, 0].tolist() == [0x40, 0x30]
    with pytest.raises(ValueError):
        R.encode_side(spec.key, x, [1.0, 2.0, 3.0])
    # one value is broadcast to every head
    assert R.encode_side(spec.key, x, 4.0).data[0, :, 0].tolist() == [0x30, 0x30]


# --- error bound ----------------------------------------------------------------------------------------------------

def test_error_bound_by_hand() -> None:
    one = np.float32(1.0)
    slack = 2.0**-21  # float32 slack per unit of |x / s| + zp + 1, in code units (reference.quant.CODE_SLACK)
    # e4m3 at 17 (scale 1): step 2 in [16, 32) -> half ulp 1, plus (17 + 1) * slack
    b = R.error_bound(shipped("fp8_e4m3").key, np.array([[[17.0, 0.001]]], np.float32), one)
    # below 2**-6 the subnormal step 2**-9 -> 2**-10
    assert b[0, 0].tolist() == [1.0 + 18 * slack, 2.0**-10 + (float(np.float32(0.001)) + 1) * slack]
    # bf16 at 1.0: step 2**-7 -> 2**-8; fp16 at 70000: beyond 65504 + 16 it overflows to inf
    assert R.error_bound(shipped("bf16").key, np.array([[[1.0]]], np.float32)).item() == 2.0**-8
    assert R.error_bound(shipped("fp16").key, np.array([[[70000.0]]], np.float32)).item() == math.inf
    # int8 saturation: scale 1, 200 -> code 127: excess 200 - 127 = 73; bound = 0.5 + 73 + (200 + 1) * slack
    spec = make_spec({"element": "int8", "scale": {"granularity": "per_tensor"}})
    assert R.error_bound(spec.key, np.array([[[200.0]]], np.float32), 1.0).item() == 0.5 + 73.0 + 201 * slack


@pytest.mark.parametrize("name", SHIPPED)
def test_error_bound_holds_and_is_tight(name: str) -> None:
    spec = shipped(name)
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((64, 2, 32)) * np.exp2(rng.uniform(-12, 12, (64, 2, 1)))).astype(np.float32)
    x[0] = 0.0
    static = 0.75 if spec.key.scale is not None and spec.key.scale.granularity.is_static else None
    enc = R.encode_side(spec.key, x, static)
    decoded = R.decode_side(spec.key, enc.data, enc.scale, enc.zp, static)
    err = np.abs(decoded - x.astype(np.float64))
    bound = R.error_bound(spec.key, x, static)
    assert np.all(err <= bound)
    assert (err / bound).max() > 0.9  # not a vacuous bound


@pytest.mark.parametrize("side", [
    {"element": "int8", "scale": {"granularity": "per_token_head", "dtype": "fp32", "min": 1.0e-40}},
    {"element": "fp8_e4m3", "scale": {"granularity": "per_block", "block": 16, "dtype": "bf16", "min": 1.0e-45}},
    {"element": "uint4", "packing": "lsb_first", "zero_point": {"storage": "beside_scale", "dtype": "fp32"},
     "scale": {"granularity": "per_token_head", "dtype": "fp32", "min": 1.0e-40}},
], ids=["int8", "fp8_bf16_scale", "uint4_float_zp"])
def test_error_bound_holds_where_the_reciprocal_overflows(side) -> None:
    """A floor below 2**-128 under reciprocal_multiply: div(1, s) is inf, so a tiny nonzero value scales to +-inf and
    takes the end code of its sign (SEMANTICS.md, "Encode"); decoded it is qmax times the floor, far from the value.
    The bound must say so (it took the ideal x / s before), and stay a bound for the finite group beside it."""
    spec = make_spec(side)
    assert spec.key.scale.apply.value == "reciprocal_multiply"
    x = np.zeros((2, 1, 16), np.float32)
    x[0, 0, :4] = [1e-45, -3e-42, 0.0, 2e-41]  # a group under the floor: its scale is the floor, 1 / s = inf
    x[1, 0] = np.linspace(-1, 1, 16, dtype=np.float32)
    enc = R.encode_side(spec.key, x)
    decoded = R.decode_side(spec.key, enc.data, enc.scale, enc.zp)
    err = np.abs(decoded - x.astype(np.float64))
    bound = R.error_bound(spec.key, x)
    assert err[0, 0, 0] > 100 * abs(float(x[0, 0, 0]))  # the premise: the tiny value saturated
    assert np.all(err <= bound), (err[0, 0, :4], bound[0, 0, :4])
    assert np.all(bound[1] < 0.1)  # a finite scale: an ordinary bound


# --- whole cache ----------------------------------------------------------------------------------------------------

def test_write_read_slots() -> None:
    spec = shipped("int8_per_token_head")
    cache = R.new_cache_bytes(spec, 2, 16, 2, 32)
    assert cache.shape == (2, 16, 2, 72)  # K 0..31, K scale 32..35, V 36..67, V scale 68..71
    key = np.zeros((3, 2, 32), np.float32)
    key[:, :, 0] = 127.0  # scale 1.0 for every (token, head)
    key[0, 1, 1] = 2.5  # -> 3
    key[1] = 7.0  # slot -1: never written
    value = -key
    R.write(spec, cache, key, value, np.array([17, -1, 3]))
    # slot 17 = block 1, offset 1; slot 3 = block 0, offset 3
    assert cache[1, 1, 1, :2].view(np.int8).tolist() == [127, 3]
    assert cache[1, 1, 1, 32:36].tolist() == [0x00, 0x00, 0x80, 0x3F]  # 1.0f little-endian
    assert cache[1, 1, 1, 36:38].view(np.int8).tolist() == [-127, -3]
    assert cache[0, 3, 0, 68:72].tolist() == [0x00, 0x00, 0x80, 0x3F]
    written = np.zeros((2, 16), bool)
    written[1, 1] = written[0, 3] = True
    assert not cache[~written].any()
    k, v = R.read(spec, cache, head_size=32)
    assert k[1, 1, 1, :2].tolist() == [127.0, 3.0] and v[0, 3, 0, 0] == -127.0
    with pytest.raises(IndexError):
        R.write(spec, cache, key, value, np.array([32, 0, 1]))
    with pytest.raises(ValueError):
        R.read(spec, cache)  # 72-byte cells fit head sizes 29..32


def test_read_static_scales_and_storage_views() -> None:
    spec = shipped("fp8_e4m3")
    cache = R.new_cache_bytes(spec, 1, 16, 2, 32)
    x = np.full((1, 2, 32), 3.0, np.float32)
    R.write(spec, cache, x, x, np.array([5]), k_scale=2.0, v_scale=0.5)
    # K: 3 / 2 = 1.5 -> 0x3C; V: 3 / 0.5 = 6 = 1.5 * 4 = 0 1001 100 = 0x4C
    assert cache[0, 5, 0, 0] == 0x3C and cache[0, 5, 0, 32] == 0x4C
    k, v = R.read(spec, cache, k_scale=2.0, v_scale=0.5)  # head size 32 is the only fit for 64-byte cells
    assert k[0, 5, 1, 0] == 3.0 and v[0, 5, 1, 31] == 3.0
    bf = shipped("bf16")
    store = np.zeros((1, 16, 2, 64), ml_dtypes.bfloat16)  # the storage-dtype tensor, C = 64 elements
    R.write(bf, store, x, x, np.array([0]))
    assert store[0, 0, 0, 0] == 3.0 and store[0, 0, 1, 63] == 3.0


def test_read_and_write_take_the_caches_own_static_scales() -> None:
    """A cache dict with ``k_scale`` / ``v_scale`` entries (as KVCache.tensors holds them) is read and written with
    those scales when no argument overrides them; per-head scales the same way."""
    spec = shipped("fp8_e4m3")
    x = np.full((1, 2, 32), 3.0, np.float32)
    cache = {"kv_cache": R.new_cache_bytes(spec, 1, 16, 2, 32),
             "k_scale": np.array([2.0], np.float32), "v_scale": np.array([0.5], np.float32)}
    R.write(spec, cache, x, x, np.array([5]))
    # the bytes of the test above: K 3 / 2 = 1.5 -> 0x3C; V 3 / 0.5 = 6 -> 0x4C
    assert cache["kv_cache"][0, 5, 0, 0] == 0x3C and cache["kv_cache"][0, 5, 0, 32] == 0x4C
    k, v = R.read(spec, cache)
    assert k[0, 5, 1, 0] == 3.0 and v[0, 5, 1, 31] == 3.0
    k1, _ = R.read(spec, cache, k_scale=1.0)  # an argument wins: 1.5 read back as 1.5
    assert k1[0, 5, 1, 0] == 1.5
    per_head = shipped("fp8_e4m3_per_head")
    cache = {"kv_cache": R.new_cache_bytes(per_head, 1, 16, 2, 32),
             "k_scale": np.array([2.0, 4.0], np.float32), "v_scale": np.array([1.0, 1.0], np.float32)}
    R.write(per_head, cache, x, x, np.array([0]))
    k, _ = R.read(per_head, cache)
    # head 1: 3 / 4 = 0.75 = 1.5 * 2**-1 = 0 0110 100 = 0x34 -> 3.0 back
    assert cache["kv_cache"][0, 0, 1, 0] == 0x34 and k[0, 0, 1, 0] == 3.0 and k[0, 0, 0, 0] == 3.0


# --- attention ------------------------------------------------------------------------------------------------------

def test_paged_attention_by_hand() -> None:
    # block_size 2; the sequence's one block is physical block 1; block 0 is NaN to catch a wrong gather
    k_cache = np.full((2, 2, 1, 2), np.nan)
    v_cache = np.full((2, 2, 1, 2), np.nan)
    k_cache[1, 0, 0] = [0.0, 0.0]
    k_cache[1, 1, 0] = [math.log(3.0), 0.0]
    v_cache[1, 0, 0] = [4.0, 0.0]
    v_cache[1, 1, 0] = [0.0, 8.0]
    q = np.zeros((2, 2, 2))  # 2 queries (positions 0 and 1), 2 query heads sharing KV head 0
    q[:, :, 0] = 1.0
    args = (k_cache, v_cache, np.array([[1]]), np.array([2]), np.array([0, 2]), 1.0)
    out = R.paged_attention(q, *args)
    # query 0 (position 0) sees only j=0 -> v0 = [4, 0]
    # query 1 sees j=0 (score 0) and j=1 (score ln 3): weights 1/4, 3/4 -> [1, 6]
    np.testing.assert_allclose(out[0], [[4.0, 0.0], [4.0, 0.0]])
    np.testing.assert_allclose(out[1], [[1.0, 6.0], [1.0, 6.0]])
    # sliding window 1: each query sees only itself
    out = R.paged_attention(q, *args, sliding_window=1)
    np.testing.assert_allclose(out[1], [[0.0, 8.0], [0.0, 8.0]])
    # decode: one query of a 2-token sequence sits at position 1
    out = R.paged_attention(q[1:], k_cache, v_cache, np.array([[1]]), np.array([2]), np.array([0, 1]), 1.0)
    np.testing.assert_allclose(out[0], [[1.0, 6.0], [1.0, 6.0]])


def test_fp8_e4m3fnuz_codes_by_hand() -> None:
    from kvgen.codegen.loader import load_spec_text
    spec = load_spec_text("name: fnuz_static\nkey: &s\n  element: fp8_e4m3fnuz\n  scale: {granularity: per_tensor}\n"
                          "value: *s\n")
    values = [
        1.0,        # bias 8: 0 1000 000 = 0x40
        1.0625,     # tie of 1.0 (m=000) and 1.125 (m=001) -> 1.0 = 0x40
        1.1875,     # tie of 1.125 (m=001) and 1.25 (m=010) -> 1.25 = 0 1000 010 = 0x42
        240.0,      # 1.875 * 2**7 = 0 1111 111 = 0x7F (the exponent 1111 is finite in fnuz)
        448.0,      # e4m3fn's max, clipped to 240 = 0x7F
        -2.0,       # 1 1001 000 = 0xC8
        2.0**-10,   # smallest subnormal 0 0000 001 = 0x01
        -2.0**-12,  # rounds to zero: 0x00, never 0x80 (no negative zero: 0x80 is NaN)
        -0.0,       # 0x00
        math.inf,   # clipped to 240 = 0x7F
        -math.inf,  # clipped to -240 = 0xFF
        math.nan,   # the one NaN, 0x80
    ]
    assert encode_one(spec, values, 1.0).tolist() == [0x40, 0x40, 0x42, 0x7F, 0x7F, 0xC8, 0x01, 0x00, 0x00, 0x7F,
                                                      0xFF, 0x80]
    codes = np.arange(256, dtype=np.uint8)
    values = R.decode_side(spec.key, codes.reshape(1, 1, -1), static_scale=1.0)[0, 0]
    assert np.isnan(values[0x80]) and np.isfinite(np.delete(values, 0x80)).all()
    finite = codes != 0x80
    assert np.array_equal(encode_one(spec, list(values[finite]), 1.0), codes[finite])
