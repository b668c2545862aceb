"""Writes with static scales whose reciprocals are not exact (0.1, 0.7, 3.0), at the inputs where a rounding error
in x / s shows: fp8 codes' midpoints (and their fp32 neighbours) times the scale. The kernels' bytes must be the
reference's; a write that divided in fp32 through the reciprocal (x * (1 / s)) once went through every other test,
whose static scales were powers of two and whose random inputs seldom sit on a tie.

The inputs come from ml_dtypes' fp8 values, the expected bytes from kvgen.reference (which reads the spec).
Runs where the suite runs (the interpreter on the CPU; compiled kernels with TRITON_INTERPRET=0 on a GPU).
"""

from __future__ import annotations

import os
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

import kvgen
from kvgen import reference as R

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
HEAD = 32
FP8 = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}


def tie_inputs(element: str, scales: np.ndarray) -> np.ndarray:
    """fp32 [T, H, HEAD]: for head h, every midpoint m between neighbouring positive finite codes of ``element``
    and the largest value, times scales[h] in float64, rounded to fp32, with its two fp32 neighbours; both signs."""
    dt = FP8[element]
    codes = np.arange(256, dtype=np.uint8).view(dt).astype(np.float64)
    pos = np.unique(codes[np.isfinite(codes) & (codes > 0)])
    mids = np.concatenate([(pos[:-1] + pos[1:]) / 2, pos])
    heads = []
    for s in scales:
        x = (mids * s).astype(np.float32)
        x = np.concatenate([x, np.nextafter(x, np.float32(np.inf)), np.nextafter(x, np.float32(0))])
        heads.append(np.concatenate([x, -x]))
    n = -(-len(heads[0]) // HEAD) * HEAD
    out = np.zeros((len(scales), n), np.float32)
    for h, x in enumerate(heads):
        out[h, :len(x)] = x
    return out.reshape(len(scales), n // HEAD, HEAD).transpose(1, 0, 2).copy()


@pytest.mark.parametrize("name,scales", [
    ("fp8_e4m3", [0.1]), ("fp8_e4m3", [3.0]), ("fp8_e4m3", [0.7]), ("fp8_e5m2", [0.1]), ("fp8_e5m2", [3.0]),
    ("fp8_e4m3_per_head", [0.1, 0.7]),
])
def test_static_scale_writes_at_ties(name, scales):
    fmt = kvgen.load(name)
    element = fmt.spec.key.element.value
    key = tie_inputs(element, np.array(scales))
    value = key[::-1].copy()
    tokens, heads = key.shape[:2]
    block = 16
    blocks = -(-tokens // block)
    scale = scales[0] if len(scales) == 1 else scales
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(blocks, block, heads, HEAD, device=DEVICE, k_scale=scale, v_scale=scale)
    slots = np.random.default_rng(0).permutation(blocks * block)[:tokens]
    fmt.write(cache, torch.from_numpy(key).to(DEVICE), torch.from_numpy(value).to(DEVICE),
              torch.from_numpy(slots).to(DEVICE))
    expected = R.new_cache(fmt.spec, blocks, block, heads, HEAD)
    R.write(fmt.spec, expected, key, value, slots, k_scale=scale, v_scale=scale)
    for tensor, want in expected.items():
        got = cache.tensors[tensor].view(torch.uint8).reshape(blocks, -1).cpu().numpy()
        differ = np.argwhere(got != want)
        assert len(differ) == 0, (f"{tensor}: {len(differ)} bytes differ, first at (block, byte) "
                                  f"{tuple(differ[0])}: kernel {got[tuple(differ[0])]:#04x}, reference "
                                  f"{want[tuple(differ[0])]:#04x}")
