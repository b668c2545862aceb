"""Numerics at the edges, per shipped format (docs/SEMANTICS.md "Non-finite and extreme inputs"): all-zero tokens,
NaN, +-inf, fp32 subnormals and values far beyond the element range. The kernel's bytes must equal the reference's,
and the documented behaviour must hold on the decoded values."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

import kvgen
from kvgen import reference as R
from kvgen.codegen.spec import FormatSpec

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
FORMATS = [n for n in kvgen.shipped_names() if not kvgen.load(n).spec.streaming]
H, D, BS = 2, 64, 4


def edge_tokens() -> np.ndarray:
    """[8, H, D] float32: token 0 all zero, 1 with NaN, 2 with +-inf, 3 subnormals, 4 huge, 5 all NaN, 6-7 normal."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, H, D)).astype(np.float32)
    x[0] = 0.0
    x[1, :, 5] = np.nan
    x[1, 1, 9] = -np.nan
    x[2, :, 3] = np.inf
    x[2, :, 4] = -np.inf
    x[3] = rng.standard_normal((H, D)).astype(np.float32) * np.float32(1e-40)  # fp32 subnormals
    x[4] *= np.float32(1e30)
    x[5] = np.nan
    return x


def as_input(x: np.ndarray, dtype: str, fmt) -> tuple[np.ndarray, torch.Tensor]:
    """The tokens as the write's input of ``dtype`` and, for the reference, that input's values in float32 (bf16
    keeps NaN, +-inf and fp32's exponent range; the writes widen it by bits, so bf16 subnormals stay exact in the
    interpreter too, whose bf16 cast mangles them: ../shared/TRITON_NOTES.md)."""
    xt = torch.from_numpy(x).to(getattr(torch, dtype))
    return xt.float().numpy(), xt.to(DEVICE)


def assert_reference_bytes(cache, expected: dict, blocks: int) -> None:
    """Every byte of the kernel-written cache equals the reference's encoding (``expected``, per tensor)."""
    for t, want in expected.items():
        got = cache.tensors[t].view(torch.uint8).reshape(blocks, -1).cpu().numpy()
        assert np.array_equal(got, want), f"{t}: bytes differ at {np.argwhere(got != want)[:3].tolist()}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", FORMATS)
def test_edge_values_bytes_and_behaviour(name, dtype):
    fmt = kvgen.load(name)
    spec = fmt.spec
    x, xt = as_input(edge_tokens(), dtype, fmt)
    slots = np.arange(8, dtype=np.int64)
    scales = {}
    for side, key in (("key", "k_scale"), ("value", "v_scale")):
        if fmt.static_scale_kind(side) is not None:
            scales[key] = 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(2, BS, H, D, device=DEVICE, **scales)
    fmt.write(cache, xt, xt.clone(), torch.from_numpy(slots).to(DEVICE))
    expected = R.new_cache(spec, 2, BS, H, D)
    R.write(spec, expected, x, x, slots, k_scale=scales.get("k_scale"), v_scale=scales.get("v_scale"))
    assert_reference_bytes(cache, expected, 2)

    k, _ = R.read(spec, expected, scales.get("k_scale"), scales.get("v_scale"), head_size=D, block_size=BS,
                  num_kv_heads=H)
    k = k.reshape(8, H, D)
    side = spec.key
    quantized = side.scale is not None
    # an all-zero token: a finite scale and zeros back
    assert np.all(k[0] == 0.0)
    # subnormal inputs decode to finite values (zero or the format's tiny values), never NaN
    assert np.all(np.isfinite(k[3]))
    if side.rotation is not None:
        return  # a non-finite input spreads over its rotation block (documented); the bytes above still match
    if not quantized:  # unquantized: IEEE behaviour
        assert np.isnan(k[1, :, 5]).all() and np.isposinf(k[2, :, 3]).all() and np.isneginf(k[2, :, 4]).all()
        return
    # quantized: +-inf saturates to the largest finite code, of the right sign
    assert np.all(np.isfinite(k[2, :, 3])) and np.all(k[2, :, 3] > 0) and np.all(k[2, :, 4] < 0)
    # the rest of a token with NaN keeps its precision: NaN does not set the scale
    rows = [d for d in range(D) if d not in (5, 9)]
    err = np.abs(k[1][:, rows] - x[1][:, rows])
    assert np.all(err <= np.abs(x[1][:, rows]).max() * 0.6), "a NaN must not wreck its token's scale"
    if side.element in R.codes.NAN_CODES:
        assert np.isnan(k[1, :, 5]).all()  # codes with a NaN keep it (fp8: 0x7F / 0x7E with the sign)
    else:
        assert np.all(np.isfinite(k[1])) and np.all(np.isfinite(k[5]))  # integers and fp4 store NaN as 0.0 would be
    # huge values: finite codes, saturated at worst
    assert np.all(np.isfinite(k[4]))


def no_finite_tokens() -> np.ndarray:
    """[8, H, D] float32 with groups that hold no finite value: token 0 all +inf, 1 +-inf alternating, 2 NaN and
    +-inf, 3 its first 32 elements +-inf (whole blocks of up to 32) and the rest normal, 4 all -inf, 5 +inf and
    -0.0, 6-7 normal. Compiled, the writes reduce x + x * 0 (NaN for each of these), whose min / max drop NaN."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, H, D)).astype(np.float32)
    sign = np.where(np.arange(D) % 2 == 0, 1.0, -1.0).astype(np.float32)
    x[0] = np.inf
    x[1] = np.inf * sign
    x[2] = np.where(np.arange(D) % 3 == 0, np.nan, np.inf * sign).astype(np.float32)
    x[3, :, :32] = np.inf * sign[:32]
    x[4] = -np.inf
    x[5] = np.where(np.arange(D) % 2 == 0, np.inf, -0.0).astype(np.float32)
    return x


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", FORMATS)
def test_groups_without_finite_values_bytes(name, dtype):
    """Every group (a token and head, a block, a rotation block) with only NaN / +-inf, or +inf and -0: the bytes
    equal the reference's (the scale is the floor, zero points and minima those of an empty range)."""
    fmt = kvgen.load(name)
    x, xt = as_input(no_finite_tokens(), dtype, fmt)
    write_like_reference(fmt, x, xt, np.arange(8, dtype=np.int64), 2)


@pytest.mark.parametrize("name", FORMATS)
def test_every_bf16_subnormal_input_bytes(name):
    """All 254 bf16 subnormal bit patterns (both signs), alone in their tokens and beside normal values: the bytes equal
    the reference's (the interpreter's own bf16 cast turned 0x0003 into 0x0040 and 0x0001 into 0)."""
    fmt = kvgen.load(name)
    bits = np.concatenate([np.arange(1, 128), np.arange(1, 128) | 0x8000]).astype(np.uint16)
    x = np.zeros((8, H, D), dtype=np.uint16)
    x.reshape(-1)[: 4 * H * D] = np.resize(bits, 4 * H * D)  # tokens 0-3: subnormals only
    x[4:] = np.resize(bits[::-1], (4, H, D))
    x[4:, :, ::5] = 0x3F80  # tokens 4-7: subnormals beside 1.0
    xt = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    xt, x32 = xt.to(DEVICE), (x.astype(np.uint32) << 16).view(np.float32)
    write_like_reference(fmt, x32, xt, np.arange(8, dtype=np.int64), 2)


def write_like_reference(fmt, x: np.ndarray, xt: torch.Tensor, slots: np.ndarray, blocks: int) -> dict:
    """Write ``xt`` (the kernel's input; ``x`` the same values in fp32) as keys and values at ``slots`` into a fresh
    cache of ``blocks`` blocks (static scales 0.5), and check its bytes against the reference's, which it returns."""
    scales = {key: 0.5 for side, key in (("key", "k_scale"), ("value", "v_scale"))
              if fmt.static_scale_kind(side) is not None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(blocks, BS, H, D, device=DEVICE, **scales)
        fmt.write(cache, xt, xt.clone(), torch.from_numpy(slots).to(DEVICE))
        expected = R.new_cache(fmt.spec, blocks, BS, H, D)
        R.write(fmt.spec, expected, x, x, slots, k_scale=scales.get("k_scale"), v_scale=scales.get("v_scale"))
    assert_reference_bytes(cache, expected, blocks)
    return expected


@pytest.mark.parametrize("name", FORMATS)
def test_skipped_tokens_of_any_value_store_nothing(name):
    """Tokens of slot -1 are read with the rest (their loads do not wait for the slot's) and quantized, never stored:
    with NaN, +-inf, huge values and subnormals at slot -1 in every token tile, the cache holds the reference's
    bytes of the other tokens alone, and the bytes a fresh cache starts with elsewhere."""
    fmt = kvgen.load(name)
    edge = edge_tokens()  # tokens 0-5 extreme, 6-7 normal
    normal = np.random.default_rng(3).standard_normal((8, H, D)).astype(np.float32)
    x = np.concatenate([edge, normal])[np.r_[0:16].reshape(2, 8).T.reshape(-1)]  # edge and normal alternate
    slots = np.where(np.arange(16) % 2 == 0, -1, np.arange(16) // 2).astype(np.int64)  # the edge tokens skipped
    expected = write_like_reference(fmt, x, torch.from_numpy(x).to(DEVICE), slots, 4)
    assert any(np.any(want != 0) for want in expected.values())  # the normal tokens were stored


def _bytes_match_reference(tmp_path, spec: dict, x: np.ndarray, **scales) -> None:
    """Write the tokens x [T, 1, D] as keys and values of a one-head cache (slot t = token t) and compare every byte
    of the cache with the reference's encoding."""
    import yaml

    path = tmp_path / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    fmt = kvgen.load(path)
    tokens, _, head = x.shape
    slots = np.arange(tokens, dtype=np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(1, tokens, 1, head, device=DEVICE, **scales)
    xt = torch.from_numpy(x).to(DEVICE)
    fmt.write(cache, xt, xt, torch.from_numpy(slots).to(DEVICE))
    expected = R.new_cache(fmt.spec, 1, tokens, 1, head)
    R.write(fmt.spec, expected, x, x, slots, **scales)
    assert_reference_bytes(cache, expected, 1)


@pytest.mark.parametrize("element", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_scale_floor_below_fp32_normals(tmp_path, dtype, element):
    """A spec whose scale floor is below fp32's normal range (min 1e-45: the floor is the scale dtype's smallest
    value, 2**-149 for fp32, 2**-133 for bf16) compiles, and tokens that small keep the reference's bytes. Their
    scales have no finite fp32 reciprocal: the zeros among them, and a token of zeros (scale = the floor), must stay
    code 0 (0 * inf is NaN: the interpreter stores fp8's NaN code for it, the GPU's clamp turns it into int8 -128)."""
    side = {"element": element, "scale": {"granularity": "per_block", "block": 16, "dtype": dtype, "min": 1.0e-45}}
    spec = {"name": f"tiny_floor_{dtype}_{element}", "cache": {"layout": "interleaved", "storage_dtype": "uint8"},
            "key": side, "value": side}
    x = np.zeros((3, 1, 16), dtype=np.float32)  # token 2: all zeros
    x[0, 0, :] = np.float32(2.0 ** -140) * np.arange(16, dtype=np.float32)  # subnormal inputs, one of them 0
    x[1, 0, :] = np.linspace(-1, 1, 16, dtype=np.float32)
    _bytes_match_reference(tmp_path, spec, x)


@pytest.mark.parametrize("apply", ["reciprocal_multiply", "divide"])
def test_scale_floor_at_fp32_max(tmp_path, apply):
    """A floor written just above fp32's largest value that rounds to it (3.402823466385289e38, as a fuzzed spec had
    it): the kernel's constant must stay fp32 (Triton takes a literal beyond fp32's largest as fp64 and widened the
    scale, whose bitcast to its 32-bit code then failed) and every scale is that largest value. A floor that rounds
    to infinity in fp32 is rejected by the schema, naming the field."""
    side = {"element": "int8", "scale": {"granularity": "per_token_head", "dtype": "fp32",
                                         "min": 3.402823466385289e38, "apply": apply}}
    spec = {"name": f"huge_floor_{apply}", "cache": {"layout": "interleaved", "storage_dtype": "uint8"},
            "key": side, "value": side}
    x = np.zeros((2, 1, 16), dtype=np.float32)
    x[1, 0, :] = np.linspace(-3e38, 3e38, 16, dtype=np.float32)
    _bytes_match_reference(tmp_path, spec, x)
    bad = dict(spec, key=dict(side, scale=dict(side["scale"], min=3.4028236e38)))
    with pytest.raises(ValueError, match="(?s)min.*rounds to infinity in fp32"):
        FormatSpec.model_validate(bad)


@pytest.mark.parametrize("case", ["bf16_rounds_down", "low_bits_mask"])
def test_floor_stored_at_2_pow_minus_128(tmp_path, case):
    """Floors just above 2**-128 (whose fp32 reciprocal is finite) that the stored scale takes down to 2**-128 (whose
    reciprocal is inf): a bf16 scale rounds 2**-128 + 2**-135 to it, and a zero point in an fp32 scale's 4 low bits
    masks 2**-128 + 8 * 2**-149 to it. The zeros of such a group must still encode as the reference's zeros."""
    if case == "bf16_rounds_down":
        side = {"element": "fp8_e4m3", "scale": {"granularity": "per_block", "block": 16, "dtype": "bf16",
                                                 "min": 2.0 ** -128 + 2.0 ** -135}}
        x = np.zeros((2, 1, 16), dtype=np.float32)  # token 0: zeros, scale = the floor
    else:
        side = {"element": "uint4", "packing": "lsb_first", "zero_point": {"storage": "scale_low_bits"},
                "scale": {"granularity": "per_token_head", "dtype": "fp32", "min": 2.0 ** -128 + 8 * 2.0 ** -149,
                          "apply": "reciprocal_multiply"}}
        x = np.zeros((2, 1, 16), dtype=np.float32)
        x[0, 0, 0] = -np.float32(8 * 2.0 ** -128)  # range 8 * 2**-128 over 15: the floor, masked; zero point 8
    x[1, 0, :] = np.linspace(-1, 1, 16, dtype=np.float32)
    spec = {"name": f"floor_{case}", "cache": {"layout": "interleaved", "storage_dtype": "uint8"},
            "key": side, "value": side}
    _bytes_match_reference(tmp_path, spec, x)


@pytest.mark.parametrize("path", ["div_rn", "fp64"])
def test_scale_division_rounds_subnormal_ties_like_ieee(tmp_path, path):
    """A group's scale over the global scale landing exactly on a midpoint of fp32's subnormal grid: the bytes must
    be IEEE division's (round half to even), which a product with a rounded reciprocal would miss. int8 codes with an
    fp32 scale per 16 elements, a global scale of 98 and no floor above fp32's smallest: the block's absmax is
    127 * 147 * 2**-149, so absmax / 127 = 147 * 2**-149 and over 98 it is 1.5 * 2**-149 (IEEE: 2 * 2**-149).
    Both division paths of the writes (codegen.render.fp64_quotient): the default side keeps tl.math.div_rn; a
    rotated side of fp8 codes that divides takes the fp64 quotient (the one-hot token rotates to 16 elements of the
    same size; fp8_e4m3's range 448 in place of 127)."""
    from kvgen.codegen.render import fp64_quotient
    from kvgen.codegen.spec import SideSpec

    side = {"element": "int8", "scale": {"granularity": "per_block", "block": 16, "dtype": "fp32",
                                         "global_scale": True, "min": 1.0e-45}}
    qmax = 448.0 if path == "fp64" else 127.0
    x = np.zeros((1, 1, 16), dtype=np.float32)
    x[0, 0, 3] = np.float32(qmax * 147 * 2.0 ** -149)
    if path == "fp64":
        side["element"] = "fp8_e4m3"
        side["rotation"] = {"kind": "hadamard", "seed": 0}
        side["scale"]["apply"] = "divide"
    else:
        x[0, 0, 7] = -np.float32(5 * 2.0 ** -149)
    assert fp64_quotient(SideSpec.model_validate(side)) == (path == "fp64")
    premise = np.float32(x[0, 0, 3] / np.float32(qmax)) / np.float32(98.0)
    assert premise.view(np.uint32) == 2  # the test's premise: 1.5 * 2**-149, a tie that rounds to even
    spec = {"name": f"subnormal_scales_{path}", "cache": {"layout": "interleaved", "storage_dtype": "uint8"},
            "key": side, "value": side}
    _bytes_match_reference(tmp_path, spec, x, k_scale=98.0, v_scale=98.0)


@pytest.mark.parametrize("zeros", ["neg_pos", "pos_neg", "all_neg"])
def test_float_zero_point_of_signed_zeros(tmp_path, zeros):
    """A group whose minimum is zero, held as -0 and +0 in either order: -0 == +0, so np.min and the kernel's
    reduction may return either; the stored fp16 minimum is +0 in both (SEMANTICS.md "Float zero points")."""
    side = {"element": "uint8", "zero_point": {"storage": "beside_scale", "dtype": "fp16"},
            "scale": {"granularity": "per_block", "block": 16, "dtype": "fp16"}}
    x = np.zeros((2, 1, 32), dtype=np.float32)
    pattern = {"neg_pos": [-0.0, 0.0], "pos_neg": [0.0, -0.0], "all_neg": [-0.0, -0.0]}[zeros]
    x[0, 0, :] = np.array(pattern * 16, dtype=np.float32)
    x[1, 0, :16] = np.array(pattern * 8, dtype=np.float32)
    x[1, 0, 16:] = np.linspace(0, 1, 16, dtype=np.float32)  # a zero minimum beside positive values
    spec = {"name": f"float_zp_{zeros}", "cache": {"layout": "interleaved", "storage_dtype": "uint8"},
            "key": side, "value": side}
    _bytes_match_reference(tmp_path, spec, x)
