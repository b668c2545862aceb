"""The generated fp8_e4m3fnuz encode and decode (codegen/templates/codecs/minifloat.py.jinja, special "fnuz")
against the reference (ml_dtypes float8_e4m3fnuz, clipped first): every fp32 within a few hundred ulps of each grid
value and midpoint, zeros of both signs, values that round to zero with either sign (no -0 in fnuz: 0x80 is NaN),
subnormals, saturation, infinities and NaN; and every one of the 256 codes decoded."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import kvgen
from kvgen.codegen.spec import ElementType
from kvgen.reference.codes import code_values, element_codes

SPEC = """name: fnuz_per_token_head
key: &side
  element: fp8_e4m3fnuz
  scale: {granularity: per_token_head, min: 1.0e-6}
value: *side
"""
ULPS = 256


@triton.jit
def _encode(x_ptr, out_ptr, n, encode: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(out_ptr + i, encode(x), mask=i < n)


@triton.jit
def _decode(c_ptr, out_ptr, n, decode: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c = tl.load(c_ptr + i, mask=i < n, other=0)
    tl.store(out_ptr + i, decode(c), mask=i < n)


@triton.jit
def _decode_dot(c_ptr, out_ptr, n, decode: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c = tl.load(c_ptr + i, mask=i < n, other=0)
    tl.store(out_ptr + i, decode(c, False).to(tl.float32), mask=i < n)


@pytest.fixture(scope="module")
def fnuz_format(tmp_path_factory):
    """A spec of the element (none is shipped), built into a cache of its own."""
    root = tmp_path_factory.mktemp("fnuz")
    (root / "fnuz.yaml").write_text(SPEC)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVGEN_CACHE_DIR", str(root / "cache"))
        fmt = kvgen.load(root / "fnuz.yaml")
    assert fmt.spec.key.element == ElementType.fp8_e4m3fnuz
    return fmt


def _module(fmt):
    return fmt._kernels.module


def hard_values() -> np.ndarray:
    grid = np.arange(0, 128, dtype=np.uint8).view(ml_dtypes.float8_e4m3fnuz).astype(np.float64)
    points = set(grid.tolist()) | {(a + b) / 2 for a, b in zip(grid, grid[1:])} | {248.0, 256.0, 2.0 ** -11}
    centres = np.array(sorted(points), dtype=np.float32).view(np.int32)
    near = (centres[:, None] + np.arange(-ULPS, ULPS + 1, dtype=np.int32)[None, :]).ravel()
    near = near[near >= 0].view(np.float32)
    special = np.array([0.0, 1e-45, 1e-40, 2.0 ** -126, 2.0 ** -30, 1e30, 3.4e38, np.inf], dtype=np.float32)
    rng = np.random.default_rng(0)
    spread = rng.integers(0, 0x7F800000, 1 << 14, dtype=np.int64).astype(np.uint32).view(np.float32)
    mags = np.concatenate([near, special, spread])
    return np.concatenate([mags, -mags, np.array([np.nan, -np.nan], np.float32)])


def test_fnuz_encode_matches_the_reference(fnuz_format):
    m = _module(fnuz_format)
    x = hard_values()
    out = torch.empty(x.size, dtype=torch.uint8)
    _encode[(triton.cdiv(x.size, 1024),)](torch.from_numpy(x), out, x.size, m.k_encode, 1024)
    got, want = out.numpy(), element_codes(ElementType.fp8_e4m3fnuz, x)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} of {x.size} differ, e.g. {x[bad[:4]].tolist()} -> {got[bad[:4]]} not {want[bad[:4]]}"
    assert not np.any(got[(x == 0) | ((np.abs(x) < 2.0 ** -11))] == 0x80)  # no negative zero


def test_fnuz_decode_every_code(fnuz_format):
    m = _module(fnuz_format)
    codes = np.arange(256, dtype=np.uint8)
    want = code_values(ElementType.fp8_e4m3fnuz, codes)
    for kernel, fn in ((_decode, m.k_decode), (_decode_dot, m.k_decode_dot)):
        out = torch.empty(256, dtype=torch.float32)
        kernel[(1,)](torch.from_numpy(codes), out, 256, fn, 256)
        got = out.numpy().astype(np.float64)
        same = (got == want) | (np.isnan(got) & np.isnan(want))
        assert same.all(), f"{fn}: codes {codes[~same][:4]} -> {got[~same][:4]} not {want[~same][:4]}"
    assert np.isnan(want[0x80]) and want[0x7F] == 240.0 and want[0xFF] == -240.0
