"""dot_precision="fast": one fp16 / bf16 term per dot operand (each dequantized key and value, the query and the
probabilities rounded once to the dot's type, as inference engines dequantize), against float64 attention on the
reference-decoded cache within the base tolerance plus conformance.fast_slack, the bound that one rounding of each
factor implies. The bytes, page sizes and error bounds are checked as in the other conformance tests."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from hypothesis import given, settings

import kvgen
from kvgen.conformance import Case, StreamCase, cases, run_case, run_stream
from kvgen.runtime import kernels as K

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
EXAMPLES = int(os.environ.get("KVGEN_FAST_EXAMPLES", "3"))
# where "fast" drops a term for bf16 / fp16 queries: block ratios in two terms (q8_0, q4_0, KIVI; in prefill, decode
# keeps their per-block dots) or a rotated query in two (int4 per token-head, Hadamard); with fp32 queries it also
# drops the probabilities' second term everywhere
CHANGED = ["q8_0", "q4_0", "int4_per_token_head", "int8_per_token_head_hadamard_k"]
STREAMING = ["kivi_2bit", "kivi_4bit"]
# the interpreter is slow on rotations and long cases: on the CPU the suite checks these, on a GPU the rest too
ON_GPU = DEVICE == "cuda"
BOUND_FORMATS = CHANGED + ["bf16", "fp8_e4m3", "nvfp4"] if ON_GPU else ["q8_0", "q4_0", "int4_per_token_head", "fp8_e4m3"]
ONE_TERM_FORMATS = ["q8_0", "int8_per_token_head_hadamard_k"] if ON_GPU else ["q8_0"]


def failures(result: dict) -> dict:
    return {p: m for p, m in result.items() if m}


@pytest.mark.parametrize("name", BOUND_FORMATS)
def test_fast_attention_within_its_bound(name):
    fmt = kvgen.load(name)

    @settings(max_examples=EXAMPLES, deadline=None)
    @given(case=cases(fmt))
    def prop(case):
        assert not failures(run_case(fmt, case, DEVICE, dot_precision="fast"))

    prop()


@pytest.mark.parametrize("name", STREAMING)
def test_fast_kivi_stream_within_its_bound(name):
    """A prefill past the residual window (groups flushed at once), a decode step, then a chunk whose attention is
    checked (prefill rows: the values' block ratios in one fp16 term, not per-block dots)."""
    fmt = kvgen.load(name)
    for dtype in (torch.bfloat16, torch.float32):
        case = StreamCase(head_size=64, block_size=32, num_kv_heads=2, group=4, steps=[[200, 45], [1, 1], [40, 9]],
                          dtype=dtype, window=None, pad_rows=1, seed=11)
        assert not failures(run_stream(fmt, case, DEVICE, dot_precision="fast"))


@pytest.mark.parametrize("name", ONE_TERM_FORMATS)
def test_fast_takes_one_term(name):
    """With fp32 queries the base tolerance leaves room for no fp16 rounding of a factor (5e-5 of max |V|): fast's
    output must need the slack (so it took the one-term path) and stay within it."""
    fmt = kvgen.load(name)
    case = Case(head_size=64, block_size=16, num_kv_heads=2, group=4, seq_lens=[70, 37], q_lens=[1, 1],
                dtype=torch.float32, window=None, holes=0, seed=3, k_scale=1.0, v_scale=1.0, magnitude=1.0)
    assert not failures(run_case(fmt, case, DEVICE))
    assert not failures(run_case(fmt, case, DEVICE, dot_precision="fast"))
    import kvgen.conformance as C

    slack = C.fast_slack
    try:
        C.fast_slack = lambda *a, **k: 0.0
        assert failures(run_case(fmt, case, DEVICE, dot_precision="fast")).keys() == {"attention"}
    finally:
        C.fast_slack = slack


@pytest.mark.parametrize("bits", [0, 4, 8])
def test_fast_block_dots_follow_the_code_bits(monkeypatch, bits):
    """In decode, block-scaled sides with codes of at most FAST_BLOCK_DOT_BITS keep their per-block dots under fast
    (8 by default, every such side of the shipped formats: since the stacked blocks they run faster than the ratios
    in one term), the others take the block ratios in one term; prefill takes them in one term; auto keeps its
    per-block dots in decode."""
    monkeypatch.setattr(K, "interpreting", lambda: False)
    monkeypatch.setattr(K, "FAST_BLOCK_DOT_BITS", bits)
    for name, code_bits in (("q8_0", 8), ("q4_0", 4), ("kivi_2bit", 2)):
        ks = kvgen.load(name)._kernels
        # the dots of a GPU: not what earlier interpreted calls of this process cached
        monkeypatch.setattr(ks, "_dot_modes", {})
        for block_m in (16, 64):
            auto = ks._call_dots(torch.bfloat16, "auto", False, 128, block_m, None)
            fast = ks._call_dots(torch.bfloat16, "fast", False, 128, block_m, None)
            assert (fast["K_TERMS"], fast["V_TERMS"]) == (1, 1)
            assert fast["BLOCK_DOTS"] == (code_bits <= bits and block_m == 16), (name, block_m)
            assert auto["BLOCK_DOTS"] == (block_m == 16), (name, block_m)


@pytest.mark.parametrize("name", ["q8_0", "int4_per_token_head"])
def test_fast_plan_launches_with_autos_tiles(name, monkeypatch):
    """A fast decode plan carries fast's dots (one term) but picks its tiles from auto's dots of the same call."""
    import warnings

    seen = []
    monkeypatch.setattr(K, "FAST_BLOCK_DOT_BITS", 0)  # q8_0's block ratios in one term, not auto's block dots
    choose = K.attention_tiles
    monkeypatch.setattr(K, "attention_tiles", lambda bits, dots, *a, **k: seen.append(dict(dots)) or choose(bits, dots, *a, **k))
    fmt = kvgen.load(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(4, 16, 2, 128, device=DEVICE)
    q = torch.randn(1, 8, 128).to(torch.float16).to(DEVICE)
    meta = (torch.arange(4, dtype=torch.int32, device=DEVICE)[None], torch.tensor([40], dtype=torch.int32, device=DEVICE),
            torch.tensor([0, 1], dtype=torch.int32, device=DEVICE))
    plans = {p: fmt.plan_attention(q, cache, *meta, max_query_len=1, dot_precision=p)._launch.kwargs
             for p in ("auto", "fast")}
    auto_tiles, fast_tiles = seen[0], seen[-1]
    assert fast_tiles == auto_tiles
    terms = ("Q_TERMS", "K_TERMS", "P_TERMS", "V_TERMS")
    assert all(plans["fast"][t] == 1 for t in terms)
    assert any(auto_tiles.get(t, 1) > 1 for t in terms) or auto_tiles.get("BLOCK_DOTS") != plans["fast"].get("BLOCK_DOTS")


def test_unknown_dot_precision_is_named():
    fmt = kvgen.load("bf16")
    cache = fmt.allocate(2, 16, 1, 64)
    q = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"dot_precision: expected one of 'auto', 'ieee', 'quantized', 'fast', "
                                         r"got 'fp16'"):
        fmt.attend(q, cache, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                   torch.tensor([0, 1], dtype=torch.int32), dot_precision="fp16")


@pytest.mark.parametrize("ratios", [True, False])
def test_fast_ratio_tiles_replace_autos_where_block_dots_go(monkeypatch, ratios):
    """A GPU's decode plans (planned here on CPU tensors with the compiled path's choices): "fast" keeps auto's tiles
    but where auto takes per-block dots and fast multiplies the block ratios (q8_0, q4_0, with FAST_BLOCK_DOT_BITS
    at 0), whose entries FAST_RATIO_TILES replaces by code bits; KIVI (its keys fold their scales, its values' block
    dots go too but are not of those bits' classes), mxfp8 (no block dots) and prefill keep auto's tiles; at the
    default bits fast keeps auto's block dots and its tiles."""
    import warnings

    monkeypatch.setattr(K, "interpreting", lambda: False)
    monkeypatch.setattr(K.KernelSet, "_check_device", lambda self, t: None)
    monkeypatch.setattr(K.KernelSet, "_splits", lambda self, *a, **k: 1)
    if ratios:
        monkeypatch.setattr(K, "FAST_BLOCK_DOT_BITS", 0)
    tile_keys = ("BLOCK_N", "num_warps", "num_stages", "maxnreg", "PREFETCH_BLOCKS", "V_SPLIT")
    # the launches the fifteenth session timed at head size 128 (auto's rule then 128/4/2, without block ids ahead or
    # a value split): q8_0 capped at 168 registers, q4_0 at 64 positions, 3 stages, 128 registers
    want = {"q8_0": dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=168, PREFETCH_BLOCKS=0, V_SPLIT=0),
            "q4_0": dict(BLOCK_N=64, num_warps=4, num_stages=3, maxnreg=128, PREFETCH_BLOCKS=0, V_SPLIT=0),
            "kivi_4bit": {}, "mxfp8": {}}
    for name, changed in want.items():
        changed = changed if ratios else {}
        fmt = kvgen.load(name)
        monkeypatch.setattr(fmt._kernels, "_dot_modes", {})
        block = 32 if fmt.spec.streaming else 16
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cache = fmt.allocate(8, block, 2, 128, **({"max_seqs": 1} if fmt.spec.streaming else {}))
        for q_len in (1, 16):
            q = torch.randn(q_len, 8, 128).to(torch.bfloat16)
            meta = (torch.arange(8, dtype=torch.int32)[None], torch.tensor([100], dtype=torch.int32),
                    torch.tensor([0, q_len], dtype=torch.int32))
            extra = {"seq_ids": torch.zeros(1, dtype=torch.int32)} if fmt.spec.streaming else {}
            plans = {p: fmt.plan_attention(q, cache, *meta, max_query_len=q_len, dot_precision=p,
                                           **extra)._launch.kwargs for p in ("auto", "fast")}
            auto = {k: plans["auto"].get(k) for k in tile_keys}
            fast = {k: plans["fast"].get(k) for k in tile_keys}
            assert fast == dict(auto, **(changed if q_len == 1 else {})), (name, q_len, auto, fast)
            if not ratios:
                assert plans["fast"].get("BLOCK_DOTS") == plans["auto"].get("BLOCK_DOTS"), (name, q_len)
