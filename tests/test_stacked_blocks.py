"""Decode of the block-dot formats (q8_0, q4_0: BLOCK_DOTS on both sides) on the query rows a launch fills
(FOLD_ROWS): the stacked helpers against float64 and against the per-block helpers they replace, and the rows the
runtime gives them; the other formats' FOLD_ROWS kinds (ROW_FOLD: KIVI's key fold, "live" for one dot per side)."""

import os

import numpy as np
import pytest
import triton
import triton.language as tl

import kvgen
from kvgen.runtime import kernels as K
from kvgen.runtime.kernels import fold_rows, live_fold_rows

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"

# the generated helpers under test, called from small kernels (Triton resolves a kernel's callees among its globals)
_module = kvgen.load("q8_0")._kernels.module
stacked_scores = _module.stacked_scores
stacked_pv = _module.stacked_pv
block_scores = _module.block_scores
block_pv = _module.block_pv


@triton.jit
def scores_kernel(q_ptr, c_ptr, s_ptr, out_ptr, ref_ptr, R: tl.constexpr, M: tl.constexpr, N: tl.constexpr,
                  H: tl.constexpr, NB: tl.constexpr, Q_TERMS: tl.constexpr):
    rr, rm, rn, rh, rb = tl.arange(0, R), tl.arange(0, M), tl.arange(0, N), tl.arange(0, H), tl.arange(0, NB)
    q = tl.load(q_ptr + rr[:, None] * H + rh[None, :])
    q_all = tl.load(q_ptr + rm[:, None] * H + rh[None, :], mask=(rm < R)[:, None], other=0.0)
    codes = tl.load(c_ptr + rn[:, None] * H + rh[None, :]).to(tl.float16)
    s = tl.load(s_ptr + rn[:, None] * NB + rb[None, :])
    tl.store(out_ptr + rr[:, None] * N + rn[None, :], stacked_scores(q, codes, s, NB, 1, Q_TERMS))
    tl.store(ref_ptr + rm[:, None] * N + rn[None, :], block_scores(q_all, codes, s, NB, 1, Q_TERMS))


@triton.jit
def pv_kernel(p_ptr, c_ptr, s_ptr, out_ptr, ref_ptr, R: tl.constexpr, M: tl.constexpr, N: tl.constexpr,
              H: tl.constexpr, NB: tl.constexpr, P_TERMS: tl.constexpr, SPLIT: tl.constexpr):
    rr, rm, rn, rh, rb = tl.arange(0, R), tl.arange(0, M), tl.arange(0, N), tl.arange(0, H), tl.arange(0, NB)
    p = tl.load(p_ptr + rr[:, None] * N + rn[None, :])
    p_all = tl.load(p_ptr + rm[:, None] * N + rn[None, :], mask=(rm < R)[:, None], other=0.0)
    codes = tl.load(c_ptr + rn[:, None] * H + rh[None, :]).to(tl.float16)
    s = tl.load(s_ptr + rn[:, None] * NB + rb[None, :])
    tl.store(out_ptr + rr[:, None] * H + rh[None, :], stacked_pv(p, codes, s, NB, 1, P_TERMS, SPLIT))
    tl.store(ref_ptr + rm[:, None] * H + rh[None, :], block_pv(p_all, codes, s, NB, 1, P_TERMS))


# (rows R, head H): the paged steps' FOLD_ROWS at GROUP 4 (head sizes 128 and 256: 16 and 32 stacked rows, the
# latter in the head's halves), at head size 64 (8 rows of 2 blocks) and GROUP 8 (8 rows of 4 blocks: halves)
SHAPES = ((4, 128), (4, 256), (8, 64), (8, 128))


@pytest.mark.parametrize("R,H", SHAPES)
def test_stacked_scores_products_are_exact(R, H):
    """stacked_scores: every block's query rows in one dot (block b's zero outside its columns) against float64 and
    against block_scores on the same rows: the products are exact (fp16 query values, codes), so only the fp32 sums
    round (their order over the blocks may differ from block_scores')."""
    import torch

    rng = np.random.default_rng(5 + R + H)
    M, N, NB = 16, 64, H // 32
    for q_terms in (1, 2):
        q = rng.uniform(-1.99, 1.99, (R, H)).astype(np.float32)
        if q_terms == 1:  # fp16 values: one term
            q = q.astype(np.float16).astype(np.float32)
        else:  # bf16 values (8 significant bits) down to 2**-11: two fp16 terms hold them exactly
            q = torch.from_numpy(q * 2.0 ** rng.integers(-10, 1, (R, H))).to(torch.bfloat16).float().numpy()
        codes = rng.integers(-128, 128, (N, H)).astype(np.float32)
        s = (rng.uniform(0.5, 1.0, (N, NB)) * 2.0 ** rng.integers(-14, 6, (N, NB))).astype(np.float16)
        s = s.astype(np.float32)
        dev = [torch.from_numpy(a).to(DEVICE) for a in (q, codes, s)]
        out = torch.empty((R, N), dtype=torch.float32, device=DEVICE)
        ref = torch.empty((M, N), dtype=torch.float32, device=DEVICE)
        scores_kernel[(1,)](*dev, out, ref, R=R, M=M, N=N, H=H, NB=NB, Q_TERMS=q_terms)
        blk = np.arange(H) // 32
        terms = q.astype(np.float64)[:, None, :] * (codes[None, :, :] * s[:, blk][None, :, :])
        want, size = terms.sum(axis=2), np.abs(terms).sum(axis=2)
        got, block = out.cpu().numpy().astype(np.float64), ref.cpu().numpy()[:R].astype(np.float64)
        assert (np.abs(got - want) <= 2.0 ** -20 * size).all(), (q_terms, float((np.abs(got - want) / size).max()))
        assert (np.abs(got - block) <= 2.0 ** -20 * size).all(), q_terms


@pytest.mark.parametrize("R,H", SHAPES)
def test_stacked_pv_matches_block_pv(R, H):
    """stacked_pv: every block's weighted rows in one dot against float64 and against block_pv on the same rows:
    the weights relative to each (block, row)'s largest (at most 1, in P_TERMS fp16 terms), the codes exact, each
    output column from its own block's rows (plus exact zeros). Its dot in two or four parts of the columns
    (SPLIT, V_SPLIT's value_dot) gives the same output bit for bit."""
    import torch

    rng = np.random.default_rng(7 + R + H)
    M, N, NB = 16, 64, H // 32
    for p_terms in (1, 2):
        p = rng.uniform(0.0, 1.0, (R, N)).astype(np.float32) ** 4  # probabilities of one step, rows' largest <= 1
        p[:, rng.integers(0, N, 8)] = 0.0
        codes = rng.integers(-8, 8, (N, H)).astype(np.float32)
        s = (rng.uniform(0.5, 1.0, (N, NB)) * 2.0 ** rng.integers(-10, 4, (N, NB))).astype(np.float16)
        s = s.astype(np.float32)
        dev = [torch.from_numpy(a).to(DEVICE) for a in (p, codes, s)]
        out = torch.empty((R, H), dtype=torch.float32, device=DEVICE)
        ref = torch.empty((M, H), dtype=torch.float32, device=DEVICE)
        pv_kernel[(1,)](*dev, out, ref, R=R, M=M, N=N, H=H, NB=NB, P_TERMS=p_terms, SPLIT=0)
        for split in (2, 4):
            parts = torch.empty_like(out)
            pv_kernel[(1,)](*dev, parts, torch.empty_like(ref), R=R, M=M, N=N, H=H, NB=NB, P_TERMS=p_terms,
                            SPLIT=split)
            assert torch.equal(parts, out), (p_terms, split)
        blk = np.arange(H) // 32
        terms = p.astype(np.float64)[:, :, None] * (codes * s[:, blk])[None, :, :]  # [R, N, H]
        want, size = terms.sum(axis=1), np.abs(terms).sum(axis=1)
        got, block = out.cpu().numpy().astype(np.float64), ref.cpu().numpy()[:R].astype(np.float64)
        # one fp16 term rounds each weight (2**-11 of it); two keep 22 bits
        bound = (2.0 ** -10 if p_terms == 1 else 2.0 ** -20) * size
        assert (np.abs(got - want) <= bound).all(), (p_terms, float((np.abs(got - want) / size).max()))
        assert (np.abs(got - block) <= 2.0 ** -20 * size).all(), p_terms


def test_fold_rows_of_block_dot_formats():
    """FOLD_ROWS: the rows a decode fills, at least what fills a dot's 16 rows with the blocks stacked; every row
    (block_m) without BLOCK_DOTS, and KIVI's rule (the key fold with the values' block dots) unchanged."""
    on, off = dict(BLOCK_DOTS=True), dict(BLOCK_DOTS=False)
    # q8_0 / q4_0: no key groups, 4 key and value blocks at head size 128
    assert fold_rows(on, 16, 4, 1, 0, 4, 4) == 4
    assert fold_rows(on, 16, 1, 1, 0, 4, 4) == 4
    assert fold_rows(on, 16, 3, 1, 0, 4, 4) == 4
    assert fold_rows(on, 16, 8, 1, 0, 4, 4) == 8
    assert fold_rows(on, 16, 16, 1, 0, 4, 4) == 16
    assert fold_rows(on, 16, 4, 2, 0, 4, 4) == 8  # two query tokens
    assert fold_rows(on, 16, 4, 1, 0, 2, 2) == 8  # head size 64: two blocks
    assert fold_rows(on, 16, 4, 1, 0, 8, 8) == 4  # head size 256
    assert fold_rows(off, 16, 4, 1, 0, 4, 4) == 16
    # KIVI: the key fold's groups; without KEY_FOLD every row, even with the values' block dots
    assert fold_rows(dict(on, KEY_FOLD=True), 16, 4, 1, 2, 4) == 4
    assert fold_rows(dict(on, KEY_FOLD=False), 16, 4, 1, 2, 4) == 16
    assert fold_rows(dict(off, KEY_FOLD=True), 16, 4, 1, 2, 4) == 16


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_decode_plans_fold_rows(name):
    """A GROUP 4 decode of q8_0 / q4_0 launches with BLOCK_DOTS and FOLD_ROWS 4 of its 16 rows; prefill carries
    every row."""
    import torch

    fmt = kvgen.load(name)
    cache = fmt.allocate(8, 16, 2, 128, device=DEVICE)
    table = torch.arange(8, dtype=torch.int32, device=DEVICE).reshape(2, 4)
    for q_len, want in ((1, 4), (40, None)):
        q = torch.zeros(2 * q_len, 8, 128, dtype=torch.float16, device=DEVICE)
        plan = fmt.plan_attention(q, cache, table, torch.full((2,), 60, dtype=torch.int32, device=DEVICE),
                                  torch.arange(3, dtype=torch.int32, device=DEVICE) * q_len, max_query_len=q_len)
        kw = plan._launch.kwargs
        if want is None:
            assert not kw["BLOCK_DOTS"] and kw["FOLD_ROWS"] == kw["BLOCK_M"], kw
        else:
            assert kw["BLOCK_DOTS"] and kw["BLOCK_M"] == 16 and kw["FOLD_ROWS"] == want, kw


def test_row_fold_kinds():
    """Every shipped format's kernel has one kind of FOLD_ROWS: KIVI the key fold's, q8_0 / q4_0 (either layout) the
    stacked blocks', every other format the live rows' (one dot per side)."""
    names = kvgen.shipped_names()
    assert {"kivi_2bit", "q8_0", "q4_0", "bf16", "nvfp4"} <= set(names)
    for name in names:
        module = kvgen.load(name)._kernels.module
        blocks = ("q8_0", "q4_0", "q8_0_separate", "q4_0_separate")
        want = "key" if name.startswith("kivi") else "blocks" if name in blocks else "live"
        assert module.ROW_FOLD == want, (name, module.ROW_FOLD)


def test_live_fold_rows(monkeypatch):
    """The live rows: 8 of a 16-row tile where the launch's queries fill no more, every row otherwise (and with the
    runtime's LIVE_FOLD off)."""
    assert live_fold_rows(16, 4, 1) == 8
    assert live_fold_rows(16, 8, 1) == 8
    assert live_fold_rows(16, 1, 1) == 8
    assert live_fold_rows(16, 4, 2) == 8
    assert live_fold_rows(16, 16, 1) == 16
    assert live_fold_rows(16, 4, 3) == 16
    assert live_fold_rows(32, 4, 1) == 32
    assert live_fold_rows(64, 4, 16) == 64
    assert live_fold_rows(16, 4, 1, live_fold=False) == 16  # a tile rule's live_fold=False
    monkeypatch.setattr(K, "LIVE_FOLD", False)
    assert live_fold_rows(16, 4, 1) == 16


@pytest.mark.parametrize("name", ["bf16", "int4_per_token_head", "fp8_per_token_head"])
def test_decode_plans_live_rows(name):
    """A GROUP 4 decode of a format of one dot per side launches with FOLD_ROWS 8 of its 16 rows, but where its
    compiled tile rule says live_fold=False (fp8 per token-head: every row); prefill carries every row."""
    import torch

    fmt = kvgen.load(name)
    cache = fmt.allocate(8, 16, 2, 128, device=DEVICE)
    table = torch.arange(8, dtype=torch.int32, device=DEVICE).reshape(2, 4)
    every_row = name == "fp8_per_token_head" and DEVICE == "cuda"  # the interpreter's tiles name no live_fold
    for q_len, want in ((1, 16 if every_row else 8), (40, None)):
        q = torch.zeros(2 * q_len, 8, 128, dtype=torch.float16, device=DEVICE)
        plan = fmt.plan_attention(q, cache, table, torch.full((2,), 60, dtype=torch.int32, device=DEVICE),
                                  torch.arange(3, dtype=torch.int32, device=DEVICE) * q_len, max_query_len=q_len)
        kw = plan._launch.kwargs
        if want is None:
            assert kw["FOLD_ROWS"] == kw["BLOCK_M"], kw
        else:
            assert kw["BLOCK_M"] == 16 and kw["FOLD_ROWS"] == want, kw
