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


@pytest.mark.parametrize("name", FORMATS)
def test_edge_values_bytes_and_behaviour(name):
    fmt = kvgen.load(name)
    spec = fmt.spec
    x = edge_tokens()
    slots = np.arange(8, dtype=np.int64)
    scales = {}
    for side, key in (("key", "k_scale"), ("value", "v_scale")):
        if fmt.static_scale_kind(side) is not None:
            scales[key] = 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(2, BS, H, D, device=DEVICE, **scales)
    fmt.write(cache, torch.from_numpy(x).to(DEVICE), torch.from_numpy(x).to(DEVICE), torch.from_numpy(slots).to(DEVICE))
    expected = R.new_cache(spec, 2, BS, H, D)
    R.write(spec, expected, x, x, slots, k_scale=scales.get("k_scale"), v_scale=scales.get("v_scale"))
    for t, want in expected.items():
        got = cache.tensors[t].view(torch.uint8).reshape(2, -1).cpu().numpy()
        assert np.array_equal(got, want), f"{t}: bytes differ at {np.argwhere(got != want)[:3].tolist()}"

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
    if side.element.value.startswith("fp8"):
        assert np.isnan(k[1, :, 5]).all()  # fp8 keeps NaN (0x7F / 0x7E with the sign)
    else:
        assert np.all(np.isfinite(k[1])) and np.all(np.isfinite(k[5]))  # integers and fp4 store NaN as 0.0 would be
    # huge values: finite codes, saturated at worst
    assert np.all(np.isfinite(k[4]))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_scale_floor_below_fp32_normals(tmp_path, dtype):
    """A spec whose scale floor is below fp32's normal range (min 1e-45: the floor is the scale dtype's smallest
    value, 2**-149 for fp32, 2**-133 for bf16) compiles, and tokens that small keep the reference's bytes."""
    import yaml

    spec = {"name": f"tiny_floor_{dtype}", "cache": {"layout": "interleaved", "storage_dtype": "uint8"},
            "key": {"element": "int8", "scale": {"granularity": "per_block", "block": 16, "dtype": dtype,
                                                 "min": 1.0e-45}}}
    spec["value"] = spec["key"]
    path = tmp_path / f"tiny_floor_{dtype}.yaml"
    path.write_text(yaml.safe_dump(spec))
    fmt = kvgen.load(path)
    x = np.zeros((2, 1, 16), dtype=np.float32)
    x[0, 0, :] = np.float32(2.0 ** -140) * np.arange(16, dtype=np.float32)  # subnormal inputs
    x[1, 0, :] = np.linspace(-1, 1, 16, dtype=np.float32)
    slots = np.arange(2, dtype=np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(1, 2, 1, 16, device=DEVICE)
    xt = torch.from_numpy(x).to(DEVICE)
    fmt.write(cache, xt, xt, torch.from_numpy(slots).to(DEVICE))
    expected = R.new_cache(fmt.spec, 1, 2, 1, 16)
    R.write(fmt.spec, expected, x, x, slots)


def test_scale_division_rounds_subnormal_ties_like_ieee(tmp_path):
    """A group's scale over the global scale landing exactly on a midpoint of fp32's subnormal grid: the bytes must
    be IEEE division's (round half to even), which a product with a rounded reciprocal would miss. int8 codes with an
    fp32 scale per 16 elements, a global scale of 98 and no floor above fp32's smallest: the block's absmax is
    127 * 147 * 2**-149, so absmax / 127 = 147 * 2**-149 and over 98 it is 1.5 * 2**-149 (IEEE: 2 * 2**-149)."""
    import yaml

    spec = {"name": "subnormal_scales", "cache": {"layout": "interleaved", "storage_dtype": "uint8"},
            "key": {"element": "int8", "scale": {"granularity": "per_block", "block": 16, "dtype": "fp32",
                                                 "global_scale": True, "min": 1.0e-45}}}
    spec["value"] = spec["key"]
    path = tmp_path / "subnormal_scales.yaml"
    path.write_text(yaml.safe_dump(spec))
    fmt = kvgen.load(path)
    x = np.zeros((1, 1, 16), dtype=np.float32)
    x[0, 0, 3] = np.float32(127 * 147 * 2.0 ** -149)
    x[0, 0, 7] = -np.float32(5 * 2.0 ** -149)
    slots = np.zeros(1, dtype=np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(1, 1, 1, 16, device=DEVICE, k_scale=98.0, v_scale=98.0)
    xt = torch.from_numpy(x).to(DEVICE)
    fmt.write(cache, xt, xt, torch.from_numpy(slots).to(DEVICE))
    expected = R.new_cache(fmt.spec, 1, 1, 1, 16)
    R.write(fmt.spec, expected, x, x, slots, k_scale=98.0, v_scale=98.0)
    scale = np.float32(x[0, 0, 3] / np.float32(127.0)) / np.float32(98.0)
    assert scale.view(np.uint32) == 2  # the tie rounded to even, as the reference computes it
    for t, want in expected.items():
        got = cache.tensors[t].view(torch.uint8).reshape(1, -1).cpu().numpy()
        assert np.array_equal(got, want), f"{t}: bytes differ at {np.argwhere(got != want)[:3].tolist()}"
