"""Conformance of every shipped format's generated kernels against the NumPy reference (hypothesis).

For random shapes (odd token counts, several block and head sizes, GQA ratios), data with outliers, zero rows and
negative values, slot mappings with -1 holes and shuffled block tables:
  (a) the bytes the write kernel stores equal the bytes the reference encodes, exactly;
  (b) paged attention matches float64 attention on the reference-decoded cache within the tolerance below, for
      decode, prefill and chunked prefill, with and without a sliding window;
  (c) page_bytes equals the bytes allocate() really took per block, and the reference's own page size;
  (d) the quantization error stays within the bound the spec implies (reference.error_bound).
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvgen
from kvgen import reference as R

FORMATS = kvgen.shipped_names()
# CPU under the Triton interpreter by default; TRITON_INTERPRET=0 on a GPU machine runs the compiled kernels
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"

# Attention tolerance per query dtype: |out - ref| <= ATOL * max|V| + RTOL * |ref|. The kernel computes in fp32
# (exact fp32 dots); the slack is the rounding of the output to the query dtype (the interpreter truncates bf16,
# so up to 2**-7 relative) plus fp32 accumulation.
TOLERANCE = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
DTYPES = list(TOLERANCE)


@dataclasses.dataclass
class Case:
    head_size: int
    block_size: int
    num_kv_heads: int
    group: int
    seq_lens: list[int]
    q_lens: list[int]
    dtype: torch.dtype
    window: int | None
    holes: int
    seed: int
    k_scale: float
    v_scale: float
    magnitude: float


@st.composite
def cases(draw) -> Case:
    num_seqs = draw(st.integers(1, 3))
    seq_lens = draw(st.lists(st.integers(1, 45), min_size=num_seqs, max_size=num_seqs))
    mode = draw(st.sampled_from(["decode", "prefill", "chunked"]))
    if mode == "decode":
        q_lens = [1] * num_seqs
    elif mode == "prefill":
        q_lens = list(seq_lens)
    else:
        q_lens = [draw(st.integers(1, n)) for n in seq_lens]
    return Case(
        head_size=draw(st.sampled_from([16, 32, 48, 64])),  # 48: a head size that is not a power of two
        block_size=draw(st.sampled_from([1, 4, 16])),
        num_kv_heads=draw(st.integers(1, 3)),
        group=draw(st.sampled_from([1, 2, 3, 4])),
        seq_lens=seq_lens,
        q_lens=q_lens,
        dtype=draw(st.sampled_from(DTYPES)),
        window=draw(st.one_of(st.none(), st.integers(1, 20))),
        holes=draw(st.integers(0, 5)),
        seed=draw(st.integers(0, 2**31 - 1)),
        k_scale=draw(st.sampled_from([1.0, 0.037, 2.5])),
        v_scale=draw(st.sampled_from([1.0, 0.5, 7.25])),
        magnitude=draw(st.sampled_from([1.0, 30.0, 1e-3])),
    )


def kv_data(rng: np.random.Generator, shape: tuple, magnitude: float) -> np.ndarray:
    """Normal data with outlier channels, a few exact zeros, an all-zero row and large negative values."""
    x = rng.standard_normal(shape).astype(np.float32) * magnitude
    x[..., rng.integers(0, shape[-1])] *= 20.0  # an outlier channel
    x[rng.random(shape) < 0.05] = 0.0
    if shape[0] > 2:
        x[rng.integers(0, shape[0])] = 0.0  # a whole token of zeros: its dynamic scale is the floor
        x[rng.integers(0, shape[0]), :, 0] = -60.0 * magnitude
    return x


def build_batch(case: Case, rng: np.random.Generator):
    """Shuffled block tables, a slot mapping over all tokens with -1 holes, and the data to write."""
    bs = case.block_size
    blocks_needed = [(n + bs - 1) // bs for n in case.seq_lens]
    num_blocks = sum(blocks_needed) + 2
    perm = rng.permutation(num_blocks)
    block_table = np.zeros((len(case.seq_lens), max(blocks_needed) + 1), dtype=np.int32)
    used = 0
    for s, nb in enumerate(blocks_needed):
        block_table[s, :nb] = perm[used:used + nb]
        used += nb
    slots = []
    for s, n in enumerate(case.seq_lens):
        pos = np.arange(n)
        slots.append(block_table[s, pos // bs].astype(np.int64) * bs + pos % bs)
    slots = np.concatenate(slots)
    hole_at = rng.integers(0, len(slots) + 1, size=case.holes)
    slots = np.insert(slots, hole_at, -1)  # tokens the engine asks to skip (padding)
    shape = (len(slots), case.num_kv_heads, case.head_size)
    key = kv_data(rng, shape, case.magnitude)
    value = kv_data(rng, shape, case.magnitude)
    return num_blocks, block_table, slots, key, value


def run_case(fmt: kvgen.Format, case: Case) -> None:
    rng = np.random.default_rng(case.seed)
    spec = fmt.spec
    num_blocks, block_table, slots, key, value = build_batch(case, rng)
    static = {"k_scale": None, "v_scale": None}
    for side, name, val in (("key", "k_scale", case.k_scale), ("value", "v_scale", case.v_scale)):
        sc = spec.side(side).scale
        if sc is not None and sc.granularity.is_static:
            static[name] = val
    cache = fmt.allocate(num_blocks, case.block_size, case.num_kv_heads, case.head_size, device=DEVICE, **static)

    # inputs in the case's dtype; the reference sees exactly the values the kernel loads
    key_t = torch.from_numpy(key).to(case.dtype)
    value_t = torch.from_numpy(value).to(case.dtype)
    fmt.write(cache, key_t.to(DEVICE), value_t.to(DEVICE), torch.from_numpy(slots).to(DEVICE))

    # (c) page bytes: the formula, the allocation and the reference agree
    allocated = sum(t.numel() * t.element_size() for n, t in cache.tensors.items() if n.endswith("cache"))
    page = fmt.page_bytes(case.block_size, case.num_kv_heads, case.head_size)
    assert allocated == page * num_blocks
    assert page == R.page_bytes(spec, case.block_size, case.num_kv_heads, case.head_size)

    # (a) bytes: the kernel's cache equals the reference's encoding of the same inputs
    key32 = key_t.float().numpy()
    value32 = value_t.float().numpy()
    expected = R.new_cache_bytes(spec, num_blocks, case.block_size, case.num_kv_heads, case.head_size)
    R.write(spec, expected, key32, value32, slots, k_scale=static["k_scale"], v_scale=static["v_scale"])
    got = cache.tensors["kv_cache"].view(torch.uint8).cpu().numpy()
    if not np.array_equal(got, expected):
        diff = np.argwhere(got != expected)
        b, o, h, c = diff[0]
        raise AssertionError(f"{len(diff)} bytes differ; first at block {b} offset {o} head {h} byte {c}: kernel "
                             f"{got[b, o, h, c]:#04x}, reference {expected[b, o, h, c]:#04x}")

    # (d) quantization error of every written token within the spec's bound
    k_deq, v_deq = R.read(spec, expected, static["k_scale"], static["v_scale"], head_size=case.head_size)
    written = slots >= 0
    blk, off = slots[written] // case.block_size, slots[written] % case.block_size
    for side, x, deq, s in (("key", key32, k_deq, static["k_scale"]), ("value", value32, v_deq, static["v_scale"])):
        bound = R.error_bound(spec.side(side), x[written], s)
        err = np.abs(deq[blk, off] - x[written].astype(np.float64))
        assert np.all(err <= bound), f"{side}: quantization error {err.max():.3g} above its bound"

    # (b) attention against float64 on the dequantized cache
    q_lens = np.array(case.q_lens)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_q_heads = case.num_kv_heads * case.group
    query = torch.from_numpy(rng.standard_normal((int(qsl[-1]), num_q_heads, case.head_size)).astype(np.float32))
    query = query.to(case.dtype)
    sm_scale = 1.0 / np.sqrt(case.head_size)
    out = fmt.attend(query.to(DEVICE), cache, torch.from_numpy(block_table).to(DEVICE),
                     torch.tensor(case.seq_lens, dtype=torch.int32, device=DEVICE), torch.from_numpy(qsl).to(DEVICE),
                     sm_scale=sm_scale, sliding_window=case.window).cpu()
    ref = R.paged_attention(query.double().numpy(), k_deq, v_deq, block_table, np.array(case.seq_lens), qsl,
                            sm_scale, case.window)
    atol, rtol = TOLERANCE[case.dtype]
    vmax = max(float(np.abs(v_deq).max()), 1e-30)
    err = np.abs(out.double().numpy() - ref)
    limit = atol * vmax + rtol * np.abs(ref)
    assert np.all(err <= limit), (f"attention error {err.max():.3g} above tolerance "
                                  f"(worst ratio {(err / limit).max():.2f})")


@pytest.fixture(autouse=True)
def _quiet_scale_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


@pytest.mark.parametrize("name", FORMATS)
@settings(max_examples=40, deadline=None)
@given(case=cases())
def test_conformance(name, case):
    run_case(kvgen.load(name), case)


@pytest.mark.parametrize("name", FORMATS)
def test_decode_long_context(name):
    """A decode step over a context longer than one attention tile, with GQA 4 and a sliding window."""
    case = Case(head_size=64, block_size=16, num_kv_heads=2, group=4, seq_lens=[300, 17], q_lens=[1, 1],
                dtype=torch.float32, window=None, holes=2, seed=7, k_scale=0.5, v_scale=2.0, magnitude=1.0)
    run_case(kvgen.load(name), case)
    run_case(kvgen.load(name), dataclasses.replace(case, window=100, q_lens=[5, 3], seed=8))
