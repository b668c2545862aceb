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
EXAMPLES = int(os.environ.get("KVGEN_FAST_EXAMPLES", "4"))
# where "fast" drops a term for bf16 / fp16 queries: block ratios in two terms (q8_0, q4_0, KIVI) or a rotated query
# in two (int4 per token-head, Hadamard); with fp32 queries it also drops the probabilities' second term everywhere
CHANGED = ["q8_0", "q4_0", "int4_per_token_head", "int8_per_token_head_hadamard_k"]
STREAMING = ["kivi_2bit", "kivi_4bit"]


def failures(result: dict) -> dict:
    return {p: m for p, m in result.items() if m}


@pytest.mark.parametrize("name", CHANGED + ["bf16", "fp8_e4m3", "nvfp4"])
def test_fast_attention_within_its_bound(name):
    fmt = kvgen.load(name)

    @settings(max_examples=EXAMPLES, deadline=None)
    @given(case=cases(fmt))
    def prop(case):
        assert not failures(run_case(fmt, case, DEVICE, dot_precision="fast"))

    prop()


@pytest.mark.parametrize("name", STREAMING)
def test_fast_kivi_stream_within_its_bound(name):
    """A prefill past the residual window (groups flushed at once), then decode steps across a group boundary."""
    fmt = kvgen.load(name)
    for dtype in (torch.bfloat16, torch.float32):
        case = StreamCase(head_size=64, block_size=32, num_kv_heads=2, group=4, steps=[[200, 45], [1, 1], [1, 1]],
                          dtype=dtype, window=None, pad_rows=1, seed=11)
        assert not failures(run_stream(fmt, case, DEVICE, dot_precision="fast"))


@pytest.mark.parametrize("name", ["q8_0", "int8_per_token_head_hadamard_k"])
def test_fast_takes_one_term(name):
    """With fp32 queries the base tolerance leaves room for no fp16 rounding of a factor (5e-5 of max |V|): fast's
    output must need the slack (so it took the one-term path) and stay within it."""
    fmt = kvgen.load(name)
    case = Case(head_size=64, block_size=16, num_kv_heads=2, group=4, seq_lens=[200, 37], q_lens=[1, 1],
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


def test_fast_plan_keeps_the_tiles_and_the_narrow_block_dots(monkeypatch):
    """fast launches with auto's tiles; in decode, 4-bit block-scaled sides keep their per-block dots (exact, and
    faster there on the H200) while 8-bit ones take the block ratios in one term."""
    monkeypatch.setattr(K, "interpreting", lambda: False)
    for name, block_dots in (("q8_0", False), ("q4_0", True)):
        ks = kvgen.load(name)._kernels
        for block_m in (16, 64):
            auto = ks._call_dots(torch.bfloat16, "auto", False, 128, block_m, None)
            fast = ks._call_dots(torch.bfloat16, "fast", False, 128, block_m, None)
            assert (fast["K_TERMS"], fast["V_TERMS"]) == (1, 1)
            assert fast["BLOCK_DOTS"] == (block_dots and block_m == 16)
            assert auto["BLOCK_DOTS"] == (block_m == 16)
            if block_m == 64:
                assert (auto["K_TERMS"], auto["V_TERMS"]) == (2, 2)
    ks = kvgen.load("int4_per_token_head")._kernels
    auto, fast = (ks._call_dots(torch.bfloat16, p, True, 128, 16, None) for p in ("auto", "fast"))
    assert (auto["Q_TERMS"], fast["Q_TERMS"]) == (2, 1)
    bits, block = ks.module.CODE_BITS, ks.block_scaled
    assert K.attention_tiles(bits, auto, block, 16, 128) != K.attention_tiles(bits, fast, block, 16, 128)


def test_unknown_dot_precision_is_named():
    fmt = kvgen.load("bf16")
    cache = fmt.allocate(2, 16, 1, 64)
    q = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"dot_precision: expected one of 'auto', 'ieee', 'quantized', 'fast', "
                                         r"got 'fp16'"):
        fmt.attend(q, cache, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                   torch.tensor([0, 1], dtype=torch.int32), dot_precision="fp16")
