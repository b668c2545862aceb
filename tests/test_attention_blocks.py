"""Attention over block-scaled caches at the edges of their scales' range and with one outlier token, against the
float64 reference on the dequantized cache. The conformance check's tolerance is relative to the cache's largest
value, so these two cases would pass it even where rows that never see an outlier lose precision, or where block
scales near their dtype's top overflow inside the kernel: here each row is checked relative to its own output."""

from __future__ import annotations

import math
import os
import warnings

import numpy as np
import pytest
import torch

import kvgen
from kvgen import reference as R
from kvgen.conformance import Case, run_case

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
BLOCK_SCALED = ["q8_0", "q4_0", "mxfp8", "mxfp4", "nvfp4"]


@pytest.mark.parametrize("name", BLOCK_SCALED)
@pytest.mark.parametrize("magnitude", [1e30, 1e33])
def test_huge_values(name, magnitude):
    """Values near fp32's top give block scales near their dtype's (e8m0 up to 2**127): no step of the kernel may
    overflow where the dequantized values do not."""
    case = Case(head_size=64, block_size=4, num_kv_heads=1, group=2, seq_lens=[20], q_lens=[1],
                dtype=torch.float32, window=None, holes=0, seed=3, k_scale=1.0, v_scale=1.0, magnitude=magnitude)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        failures = {k: v for k, v in run_case(kvgen.load(name), case, DEVICE).items() if v}
    assert not failures, failures


@pytest.mark.parametrize("name", BLOCK_SCALED)
@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 2e-5), (torch.float16, 2e-3)])
def test_rows_that_do_not_see_an_outlier_keep_their_precision(name, dtype, rtol):
    """A prefill whose last token's values are 1e5 times the others: every earlier query row (which cannot see it)
    must match the reference within rtol of that row's own largest output, whatever the outlier does to the step's
    scales."""
    fmt = kvgen.load(name)
    H, D, BS, N = 1, 64, 4, 40
    rng = np.random.default_rng(0)
    k = rng.standard_normal((N, H, D)).astype(np.float32)
    v = rng.standard_normal((N, H, D)).astype(np.float32)
    v[N - 1] *= np.float32(1e5)
    nb = N // BS + 1
    table = np.arange(nb, dtype=np.int32)[None, :]
    slots = np.arange(N, dtype=np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(nb, BS, H, D, device=DEVICE)
    fmt.write(cache, torch.from_numpy(k).to(DEVICE), torch.from_numpy(v).to(DEVICE), torch.from_numpy(slots).to(DEVICE))
    expected = R.new_cache(fmt.spec, nb, BS, H, D)
    R.write(fmt.spec, expected, k, v, slots)
    k_deq, v_deq = R.read(fmt.spec, expected, None, None, head_size=D, block_size=BS, num_kv_heads=H)
    q = torch.from_numpy(rng.standard_normal((N, 2 * H, D)).astype(np.float32) * 3).to(dtype)
    qsl = np.array([0, N], dtype=np.int32)
    out = fmt.attend(q.to(DEVICE), cache, torch.from_numpy(table).to(DEVICE),
                     torch.tensor([N], dtype=torch.int32, device=DEVICE), torch.from_numpy(qsl).to(DEVICE),
                     sm_scale=1 / math.sqrt(D), num_splits=1).double().cpu().numpy()
    ref = R.paged_attention(q.double().numpy(), k_deq, v_deq, table, np.array([N]), qsl, 1 / math.sqrt(D), None)
    rows = slice(0, N - 1)
    err = np.abs(out[rows] - ref[rows]).max(axis=-1)
    scale = np.abs(ref[rows]).max(axis=-1)
    assert np.all(err <= rtol * scale), f"worst row error {np.max(err / scale):.3g} of its output, limit {rtol}"
