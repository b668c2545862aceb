"""KIVI formats: random append streams (prefill, decode steps, chunks; sequences of different lengths in one
batch; padding rows with slot -1) against the reference's simulation of the same stream: every stored byte of the
pages and residual buffers after every write, and attention over quantized history plus residual."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
import yaml
from hypothesis import given, settings

import kvgen
from kvgen.conformance import StreamCase, run_stream, stream_cases

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
EXAMPLES = int(os.environ.get("KVGEN_KIVI_EXAMPLES", "12"))
SHIPPED = [n for n in kvgen.shipped_names() if kvgen.load(n).spec.streaming]

# a small KIVI-style spec so that short streams cross many group boundaries: G = 8, R = 16, 4-bit, fp32 residual
SMALL = {
    "name": "kivi_small",
    "key": {"element": "uint4", "zero_point": {"dtype": "fp16"},
            "scale": {"granularity": "per_channel_group", "group_tokens": 8, "dtype": "fp16", "placement": "page_end"},
            "residual": {"tokens": 16, "dtype": "fp32"}},
    "value": {"element": "uint4", "zero_point": {"dtype": "fp32"},
              "scale": {"granularity": "per_block", "block": 16, "dtype": "bf16", "apply": "reciprocal_multiply"},
              "residual": {"tokens": 16, "dtype": "fp32"}},
}


@pytest.fixture(scope="module")
def small_format(tmp_path_factory):
    root = tmp_path_factory.mktemp("kivi")
    path = root / "kivi_small.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    os.environ.setdefault("KVGEN_CACHE_DIR", str(root / "cache"))
    return kvgen.load(path)


def assert_stream(fmt, case):
    failures = {p: m for p, m in run_stream(fmt, case, DEVICE).items() if m}
    assert not failures, failures


def test_shipped_kivi_formats():
    assert SHIPPED == ["kivi_2bit", "kivi_4bit"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_streams(name):
    fmt = kvgen.load(name)

    @settings(max_examples=EXAMPLES, deadline=None)
    @given(case=stream_cases(fmt))
    def prop(case):
        assert_stream(fmt, case)

    prop()


def test_small_group_streams(small_format):
    @settings(max_examples=2 * EXAMPLES, deadline=None)
    @given(case=stream_cases(small_format))
    def prop(case):
        assert_stream(small_format, case)

    prop()


@pytest.mark.parametrize("name", SHIPPED + ["small"])
def test_groups_without_finite_values(name, small_format):
    """+-inf in a key channel of every token and in whole value groups, NaN among finite keys: through the ring
    and the flush (compiled, each group's finite range is the min / max of x + x * 0, NaN for these), every stored
    byte equals the reference's."""
    fmt = small_format if name == "small" else kvgen.load(name)
    g, r = fmt.layout.RESIDUAL["group"], fmt.layout.RESIDUAL["tokens"]
    case = StreamCase(head_size=64, block_size=g, num_kv_heads=2, group=1,
                      steps=[[r + 2 * g + 3, 5], [1, 1], [g + 1, r + g]], dtype=torch.float32, window=None,
                      pad_rows=1, seed=7, nonfinite=True)
    failures = {p: m for p, m in run_stream(fmt, case, DEVICE).items() if m}
    assert not failures, failures


@pytest.mark.parametrize("name", SHIPPED)
def test_long_prefill_then_decode(name):
    """A prompt of 300 tokens (several groups quantized at once), then decode steps across a group boundary."""
    import torch

    fmt = kvgen.load(name)
    case = StreamCase(head_size=64, block_size=32, num_kv_heads=2, group=4, steps=[[300, 45]] + [[1, 1]] * 3,
                      dtype=torch.float32, window=None, pad_rows=2, seed=5)
    assert_stream(fmt, case)


STREAMS = [  # (steps, window, splits, query dtype): group-crossing prefills, chunked prefill past the residual
    # window, decode; on a GPU each stream takes both 16-bit query dtypes, on the CPU (interpreted: 7-25 s per
    # stream and dtype) one each
    ([[300, 200], [300, 150]], 200, 3, torch.bfloat16),
    ([[600, 413, 230], [37, 1, 5]], None, 2, torch.float16),
]


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("steps,window,splits,dtype", STREAMS)
def test_fixed_streams_with_tensor_core_dots(name, steps, window, splits, dtype):
    """bf16 and fp16 queries (the tensor-core path; fp32 queries take two-term dots), several quantized groups per
    sequence, a query tile whose last position falls inside the quantized part (the masked last step), windows and
    KV splits: every example, where the hypothesis draws cover these combinations only now and then."""
    fmt = kvgen.load(name)
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    for query_dtype in (dtype, other) if DEVICE == "cuda" else (dtype,):
        case = StreamCase(head_size=64, block_size=64, num_kv_heads=2, group=4, steps=steps, dtype=query_dtype,
                          window=window, pad_rows=1, seed=11, splits=splits)
        assert_stream(fmt, case)


def test_small_groups_keep_exact_dots(small_format):
    """G = 8: a step of 8 positions is below what a tensor-core dot takes (16), so the kernel keeps exact fp32 dots
    over 64-position steps (kvgen.codegen.render.dot_operand)."""
    assert small_format._kernels.module.BLOCK_N_GROUP is None
    assert small_format._kernels.module.DOT_OPERANDS["k"][0] == ""


@pytest.mark.parametrize("name", SHIPPED)
def test_pages_before_the_window_are_not_read(name):
    """A sliding window that starts inside an attention step: the pages wholly before the window's first token
    group (freed ones, say: here every byte 0xFF, NaN scales) must not enter any step, whatever the step size."""
    import torch

    fmt = kvgen.load(name)
    group = fmt.layout.RESIDUAL["group"]
    ctx, window, block, heads, head_size = 1000, 300, group, 1, 64
    i32 = dict(dtype=torch.int32, device=DEVICE)
    blocks = ctx // block + 2
    cache = fmt.allocate(blocks, block, heads, head_size, device=DEVICE, max_seqs=1)
    torch.manual_seed(0)
    kv = torch.randn(2, ctx, heads, head_size, device=DEVICE)
    table = torch.arange(blocks, **i32)[None, :]
    meta = dict(seq_ids=torch.zeros(1, **i32), seq_lens=torch.tensor([ctx], **i32), block_table=table)
    fmt.write(cache, kv[0], kv[1], torch.arange(ctx, device=DEVICE), query_start_loc=torch.tensor([0, ctx], **i32),
              max_query_len=ctx, **meta)
    q = torch.randn(1, 2, head_size, device=DEVICE)
    lo = ctx - window  # the query sits at ctx - 1: it sees [ctx - window, ctx)
    assert lo // group * group < (ctx - fmt.layout.RESIDUAL["tokens"]) // group * group  # quantized pages in view

    def attend():
        return fmt.attend(q, cache, table, meta["seq_lens"], torch.tensor([0, 1], **i32), sliding_window=window,
                          seq_ids=meta["seq_ids"], max_query_len=1)

    before = attend()
    unseen = lo // group * group // block  # pages before the window's first group
    for t in cache.tensors.values():
        if t.shape[0] == blocks:
            t.view(torch.uint8)[:unseen] = 0xFF
    after = attend()
    assert bool(torch.isfinite(after).all()) and torch.equal(before, after)


# KIVI keys with NVFP4-style values (e2m1 codes, an e4m3 scale per 16 elements): the values take fixed block ratios
# (codegen.render.fixed_block_shift), whose constant factor must reach the paged positions only, not the residual ring
FIXED_VALUES = {
    "name": "kivi_keys_nvfp4_values",
    "key": SMALL["key"],
    "value": {"element": "fp4_e2m1",
              "scale": {"granularity": "per_block", "block": 16, "dtype": "fp8_e4m3", "placement": "inline"},
              "residual": {"tokens": 16, "dtype": "fp32"}},
}


def test_fixed_value_ratios_with_a_residual_window(tmp_path):
    from kvgen.codegen.render import side_context

    path = tmp_path / "kivi_keys_nvfp4_values.yaml"
    path.write_text(yaml.safe_dump(FIXED_VALUES))
    fmt = kvgen.load(path)
    assert side_context("value", fmt.spec.value)[0].tok == "fixed"

    @settings(max_examples=max(EXAMPLES // 2, 3), deadline=None)
    @given(case=stream_cases(fmt))
    def prop(case):
        assert_stream(fmt, case)

    prop()


def kivi_2bit_variant(tmp_path, name: str, edit):
    """specs/kivi_2bit.yaml changed by ``edit(spec)`` (a dict, in place), saved as ``name`` and loaded."""
    spec = yaml.safe_load((Path(__file__).resolve().parents[1] / "specs" / "kivi_2bit.yaml").read_text())
    spec["name"] = name
    edit(spec)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    os.environ.setdefault("KVGEN_CACHE_DIR", str(tmp_path / "cache"))
    return kvgen.load(path)


@pytest.mark.parametrize("ring", ["fp16", "bf16"])
def test_residual_steps_take_tensor_core_dots(ring, tmp_path):
    """The residual ring's steps dot its values in their own dtype (one term) with tensor cores where the query and
    the probabilities fit two terms of it (kvgen.runtime.kernels: DOT_R); fp32 queries on a bf16 ring and the
    interpreter's bf16 keep exact fp32 dots. An fp16 ring runs its tensor-core path here in the interpreter: a
    stream through it."""
    import torch

    def ring_dtype(spec):
        for side in ("key", "value"):
            spec[side]["residual"]["dtype"] = ring

    fmt = kivi_2bit_variant(tmp_path, f"kivi_2bit_{ring}_ring", ring_dtype)
    ks = fmt._kernels
    assert ks.module.RESIDUAL_DOT == ring
    on_gpu = DEVICE == "cuda"
    want = {"fp16": 1, "bf16": 2 if on_gpu else 0}[ring]
    for dtype in (torch.bfloat16, torch.float16):
        assert ks.dot_modes(dtype, "auto", False, 64)["DOT_R"] == want, dtype
    # fp32 queries and probabilities keep 22 bits: two fp16 terms, three of bf16 (so exact fp32 dots)
    assert ks.dot_modes(torch.float32, "auto", False, 64)["DOT_R"] == (1 if ring == "fp16" else 0)
    assert ks.dot_modes(torch.float16, "ieee", False, 64)["DOT_R"] == 0
    if want:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            case = StreamCase(head_size=64, block_size=64, num_kv_heads=2, group=4, steps=[[300, 200], [64, 33]],
                              dtype=dtype, window=200, pad_rows=1, seed=13, splits=3)
            assert_stream(fmt, case)


@pytest.mark.parametrize("name", SHIPPED)
def test_key_fold_in_decode_only(name):
    """Decode with a query of one dot term (bf16, fp16) folds each token group's key scales into the query and dots
    the codes alone (KEY_FOLD, group_scores) at padded heads of 128 and 256 (runtime.kernels.KEY_FOLD_HEADS,
    measured); fp32 queries (two terms), prefill, other heads and exact fp32 dots keep the codes times the scales."""
    import torch

    fmt = kvgen.load(name)
    table = torch.arange(4, dtype=torch.int32, device=DEVICE)[None]

    def plan(q_len, dtype=torch.bfloat16, head=128, **kw):
        cache = fmt.allocate(4, 32, 2, head, device=DEVICE, max_seqs=1)
        q = torch.randn(q_len, 8, head).to(dtype).to(DEVICE)
        return fmt.plan_attention(q, cache, table, torch.tensor([100], dtype=torch.int32, device=DEVICE),
                                  torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE), max_query_len=q_len,
                                  seq_ids=torch.zeros(1, dtype=torch.int32, device=DEVICE), **kw)._launch.kwargs

    assert plan(1)["KEY_FOLD"] is True and plan(1, torch.float16)["KEY_FOLD"] is True
    assert plan(1, head=96)["KEY_FOLD"] is True  # padded to 128
    assert plan(1, head=256)["KEY_FOLD"] is True
    assert plan(1, torch.float32)["KEY_FOLD"] is False
    assert plan(16)["KEY_FOLD"] is False
    assert plan(1, head=64)["KEY_FOLD"] is False
    assert plan(1, dot_precision="ieee")["KEY_FOLD"] is False


@pytest.fixture
def key_folds(monkeypatch):
    """KEY_FOLD of every attention launch planned while the test runs, in order."""
    from kvgen.runtime import kernels as K

    folds = []
    plan_attend = K.KernelSet.plan_attend

    def spy(self, *args, **kwargs):
        launch = plan_attend(self, *args, **kwargs)
        folds.append(launch.kwargs.get("KEY_FOLD"))
        return launch

    monkeypatch.setattr(K.KernelSet, "plan_attend", spy)
    return folds


DECODE_STREAMS = [  # (steps, window, splits, head size): decode steps (one query token per sequence) after
    # group-crossing prefills; head size 96 (padded to 128) takes the fold without lowering the runtime's rule
    ([[300, 200], [1, 1], [1, 1]], 200, 3, 64),
    ([[600, 413, 230], [1, 1, 1]], None, 2, 64),
    ([[250, 100], [1, 1]], None, 2, 96),
    ([[200, 170], [1, 1]], None, 2, 256),
]


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("steps,window,splits,head", DECODE_STREAMS)
def test_decode_streams_through_the_key_fold(name, steps, window, splits, head, monkeypatch, key_folds):
    """The key fold's decode against the reference, at the suite's head size of 64 (the fold's head rule widened to
    it), at 96 (padded to 128) and at 256: bf16 and fp16 queries, several groups per step, windows and KV
    splits. Every attention launch of the last step takes the fold."""
    import torch

    from kvgen.runtime import kernels as K

    monkeypatch.setattr(K, "KEY_FOLD_HEADS", (64, 128, 256))
    folds = key_folds
    fmt = kvgen.load(name)
    for dtype in (torch.bfloat16, torch.float16):
        case = StreamCase(head_size=head, block_size=64, num_kv_heads=2, group=4, steps=steps, dtype=dtype,
                          window=window, pad_rows=1, seed=17, splits=splits)
        assert_stream(fmt, case)
        assert folds and folds[-1] is True, folds
        folds.clear()


# the generated helper under test, called from a small kernel (Triton resolves a kernel's callees among its globals)
group_scores = kvgen.load("kivi_2bit")._kernels.module.group_scores


@triton.jit
def scores_kernel(q_ptr, c_ptr, r_ptr, m_ptr, out_ptr, tok, M: tl.constexpr, N: tl.constexpr, H: tl.constexpr,
                  G: tl.constexpr):
    rm, rn, rh, rg = tl.arange(0, M), tl.arange(0, N), tl.arange(0, H), tl.arange(0, N // G)
    q = tl.load(q_ptr + rm[:, None] * H + rh[None, :])
    codes = tl.load(c_ptr + rn[:, None] * H + rh[None, :]).to(tl.float16)
    ratio = tl.load(r_ptr + rg[:, None] * H + rh[None, :])
    gmin = tl.load(m_ptr + rg[:, None] * H + rh[None, :])
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], group_scores(q, codes, ratio, gmin, tok, G, 1))


def test_group_scores_products_are_exact():
    """group_scores (KEY_FOLD) against float64: each group's query row times its scales goes to the dot in two fp16
    terms (times 2**13), exact for products of at least 2**-16, so here only the fp32 sums round. A fold in one term
    would be off by up to 2**-12 of each product."""
    import numpy as np
    import torch

    rng = np.random.default_rng(3)
    N, H, G = 64, 128, 32
    # 16 rows: the second term's dot accumulates into the first's; 4 (the paged steps' FOLD_ROWS in decode): both
    # terms' rows in one dot
    for M, qdtype in ((16, np.float16), (16, "bf16"), (4, np.float16), (4, "bf16")):
        q = rng.uniform(-1.99, 1.99, (M, H)).astype(np.float32)
        # query values of the dot type: bf16 (8 significant bits) or fp16 (11)
        q = (torch.from_numpy(q).to(torch.bfloat16).float().numpy() if qdtype == "bf16"
             else q.astype(np.float16).astype(np.float32))
        codes = rng.integers(0, 4, (N, H)).astype(np.float32)
        ratio = rng.uniform(2.0 ** -6, 1.0, (N // G, H)).astype(np.float16).astype(np.float32)  # fp16 values <= 1
        gmin = rng.uniform(-4, 4, (N // G, H)).astype(np.float16).astype(np.float32)
        tok = 8.0
        dev = [torch.from_numpy(a).to(DEVICE) for a in (q, codes, ratio, gmin)]
        out = torch.empty((M, N), dtype=torch.float32, device=DEVICE)
        scores_kernel[(1,)](*dev, out, tok, M=M, N=N, H=H, G=G)
        g = np.arange(N) // G
        keys = codes[None, :, :] * ratio[g][None, :, :] * tok + gmin[g][None, :, :]  # dequantized, [1, N, H]
        terms = q.astype(np.float64)[:, None, :] * keys
        want, size = terms.sum(axis=2), np.abs(terms).sum(axis=2)
        err = np.abs(out.cpu().numpy().astype(np.float64) - want)
        assert (err <= 2.0 ** -20 * size).all(), (qdtype, float((err / size).max()))


def test_fp32_key_minima(tmp_path):
    """KIVI keys with fp32 minima (a valid spec): no fp16 term holds them, so attention adds q . min per group in
    fp32 rather than in a one-term fp16 dot (which failed conformance for fp32 queries and bf16 prefill)."""
    import torch

    def fp32_minima(spec):
        spec["key"]["element"] = "uint4"
        spec["key"]["zero_point"]["dtype"] = "fp32"

    fmt = kivi_2bit_variant(tmp_path, "kivi_2bit_fp32_key_minima", fp32_minima)
    for dtype in (torch.float32, torch.bfloat16):
        case = StreamCase(head_size=64, block_size=64, num_kv_heads=2, group=4, steps=[[300, 200], [40, 1]],
                          dtype=dtype, window=None, pad_rows=1, seed=23, splits=2)
        assert_stream(fmt, case)


def test_decode_stream_with_one_group_per_step(tmp_path, key_folds):
    """Key groups of 128 tokens: a step holds one group (the fold's dot has one block of query rows), at head size 96
    (padded to 128, so the runtime's own rule folds): bf16 decode after a prefill of several groups."""
    import torch

    fmt = kivi_2bit_variant(tmp_path, "kivi_2bit_g128", lambda spec: spec["key"]["scale"].update(group_tokens=128))
    assert fmt._kernels.module.KEY_FOLD and fmt._kernels.module.BLOCK_N_GROUP == 128
    case = StreamCase(head_size=96, block_size=128, num_kv_heads=2, group=4, steps=[[700, 530], [1, 1]],
                      dtype=torch.bfloat16, window=None, pad_rows=1, seed=29, splits=2)
    assert_stream(fmt, case)
    assert key_folds and key_folds[-1] is True, key_folds
