"""Conformance of every shipped format's generated kernels against the NumPy reference (hypothesis).

The properties live in kvgen.conformance (they are also `kvgen test`): stored bytes equal the reference's encoding
exactly; paged attention within tolerance of float64 for decode, prefill and chunked prefill with GQA and sliding
windows; page_bytes equal to the allocated bytes; quantization error within the spec's bound.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from hypothesis import given, settings

import kvgen
from kvgen.conformance import Case, cases, run_case

# formats with a residual window (KIVI) append to sequences: tests/test_kivi.py checks them
FORMATS = [n for n in kvgen.shipped_names() if not kvgen.load(n).spec.streaming]
# CPU under the Triton interpreter by default; TRITON_INTERPRET=0 on a GPU machine runs the compiled kernels
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
# hypothesis cases per format: 30 on a GPU, 14 on the CPU (the interpreter) so the suite stays under ten minutes on
# two cores with its install (20 took it to 9-10 minutes in the fifty-ninth session). KVGEN_EXAMPLES overrides both.
EXAMPLES = int(os.environ.get("KVGEN_EXAMPLES", "30" if DEVICE == "cuda" else "14"))


def small_tiles(monkeypatch):
    """32 KV positions per attention step, so the test sequences (up to 45 tokens) take a whole tile (loads without
    masks) and a partial last one, and the KV splits drawn by the strategy (1-3) really divide them, on the GPU and
    in the interpreter."""
    from kvgen.runtime import kernels

    monkeypatch.setattr(kernels, "INTERPRETER_TILES", {"BLOCK_N": 32})
    monkeypatch.setattr(kernels, "TILE_OVERRIDE", {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2})



def assert_conforms(fmt, case):
    failures = {p: msg for p, msg in run_case(fmt, case, DEVICE).items() if msg}
    assert not failures, failures


@pytest.mark.parametrize("name", FORMATS)
def test_conformance_with_small_tiles_and_splits(name, monkeypatch):
    small_tiles(monkeypatch)
    fmt = kvgen.load(name)

    @settings(max_examples=max(EXAMPLES // 6, 3), deadline=None)
    @given(case=cases(fmt))
    def prop(case):
        assert_conforms(fmt, case)

    prop()


@pytest.mark.parametrize("name", FORMATS)
def test_conformance(name):
    fmt = kvgen.load(name)

    @settings(max_examples=EXAMPLES, deadline=None)
    @given(case=cases(fmt))
    def prop(case):
        assert_conforms(fmt, case)

    prop()


@pytest.mark.parametrize("name", ["int8_per_token_head", "nvfp4", "q4_0", "bf16"])
def test_prefill_over_many_whole_steps(name, monkeypatch):
    """Chunked prefill whose query tiles span several whole steps of 32 positions: steps every row sees whole (no
    visibility mask), steps on the causal diagonal and steps on a sliding window's edge, each a loop of its own in
    the kernel, with and without a window, with a split, and with tiles whose bounds fall on step boundaries."""
    from kvgen.runtime import kernels

    small_tiles(monkeypatch)
    # block ids loaded one step ahead, carried from one loop into the next
    monkeypatch.setattr(kernels, "INTERPRETER_TILES", {"BLOCK_N": 32, "prefetch_blocks": True})
    fmt = kvgen.load(name)
    case = Case(head_size=32, block_size=4, num_kv_heads=1, group=2, seq_lens=[230, 161], q_lens=[150, 161],
                dtype=torch.float32, window=None, holes=0, seed=11, k_scale=0.5, v_scale=2.0, magnitude=1.0)
    assert_conforms(fmt, case)
    assert_conforms(fmt, dataclasses.replace(case, window=70, seed=12))
    assert_conforms(fmt, dataclasses.replace(case, window=45, splits=2, seed=13))
    # query tiles whose first position or window edge falls on a step boundary: a bound one position off fails
    aligned = dataclasses.replace(case, seq_lens=[200, 230], q_lens=[170, 162], seed=14)
    assert_conforms(fmt, aligned)
    assert_conforms(fmt, dataclasses.replace(aligned, window=70, seed=15))


@pytest.mark.parametrize("name", FORMATS)
def test_long_context(name):
    """A decode step over a context longer than one attention tile, then a chunked-prefill step with a window."""
    fmt = kvgen.load(name)
    case = Case(head_size=64, block_size=16, num_kv_heads=2, group=4, seq_lens=[300, 17], q_lens=[1, 1],
                dtype=torch.float32, window=None, holes=2, seed=7, k_scale=0.5, v_scale=2.0, magnitude=1.0)
    assert_conforms(fmt, case)
    assert_conforms(fmt, dataclasses.replace(case, window=100, q_lens=[5, 3], seed=8))


# Chunked prefill in programs of 128 query rows on 8 warps, where the tile rules name them (kvgen.runtime.kernels.
# RULED_PREFILL_ROWS; twenty-seventh session at head size 128, twenty-eighth at 64 and 256, twenty-ninth int8 separate
# at 256, thirty-second the per token-head formats at 256 and int8 separate at 128, thirty-third the 8-bit per
# token-head formats but Hadamard at 128). The interpreter always takes 128 rows; this runs the compiled kernels with
# the rules' tiles, and a format whose rules keep 64 rows (the Hadamard format at head size 128: a two-term query)
# under PREFILL_ROWS = 128 forced.
@pytest.mark.skipif(DEVICE != "cuda", reason="compiled prefill programs of 128 rows: a GPU run")
@pytest.mark.parametrize("name, head_size", [(n, 128) for n in (
    "fp8_e4m3", "mxfp8", "q8_0", "int4_per_token_head", "q4_0", "kivi_2bit", "kivi_4bit",
    "int8_per_token_head_separate", "int8_per_token_head", "fp8_per_token_head", "int8_asym_per_token_head",
    "mixed_k8_v4")]
    + [(n, 256) for n in ("bf16", "fp8_e4m3", "mxfp8", "nvfp4", "mxfp4", "q4_0", "kivi_2bit", "kivi_4bit",
                          "int8_per_token_head_separate", "int8_per_token_head", "fp8_per_token_head",
                          "int8_asym_per_token_head", "int8_per_token_head_hadamard_k", "int4_per_token_head",
                          "mixed_k8_v4")]
    + [(n, 64) for n in ("fp8_e4m3", "int4_per_token_head", "q4_0", "kivi_4bit")]
    + [("int8_per_token_head_hadamard_k", 128)])
def test_prefill_rows_128_conform(name, head_size, monkeypatch):
    import warnings

    from kvgen.conformance import StreamCase, run_stream
    from kvgen.runtime import kernels

    fmt = kvgen.load(name)
    block = fmt.layout.RESIDUAL["group"] if fmt.spec.streaming else 16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(1, block, 2, head_size, **({"max_seqs": 1} if fmt.spec.streaming else {}))
    rows = fmt._kernels.query_rows(torch.bfloat16, "auto", fmt.spec.key.rotation is not None, 4, 700,
                                   fmt._kernel_args(cache)[1])
    if (name, head_size) == ("int8_per_token_head_hadamard_k", 128):
        assert rows == 64
        monkeypatch.setattr(kernels, "PREFILL_ROWS", 128)
        monkeypatch.setattr(kernels, "TILE_OVERRIDE", {"BLOCK_N": 128, "num_warps": 8, "num_stages": 2})
    else:
        assert rows == 128
    if fmt.spec.streaming:  # KIVI: a prefill, then a 700-token chunk beside a decode step
        case = StreamCase(head_size=head_size, block_size=fmt.layout.RESIDUAL["group"], num_kv_heads=2, group=4,
                          steps=[[1100, 600], [700, 1]], dtype=torch.bfloat16, window=None, pad_rows=0, seed=15)
        for c in (case, dataclasses.replace(case, splits=3, seed=16)):
            failures = {p: m for p, m in run_stream(fmt, c, DEVICE).items() if m}
            assert not failures, failures
        return
    case = Case(head_size=head_size, block_size=16, num_kv_heads=2, group=4, seq_lens=[1100, 600], q_lens=[700, 1],
                dtype=torch.bfloat16, window=None, holes=2, seed=15, k_scale=0.5, v_scale=2.0, magnitude=1.0)
    assert_conforms(fmt, case)
    assert_conforms(fmt, dataclasses.replace(case, splits=3, window=300, seed=16))


@pytest.mark.skipif(DEVICE != "cuda", reason="the compiled kernels' tile rules: a GPU run")
@pytest.mark.parametrize("name", ["kivi_2bit", "kivi_4bit"])
def test_kivi_decode_256(name):
    """KIVI's decode at head size 256 (its own tiles since the twenty-eighth session: 64 positions per step, the
    values converted first): decode steps over 1100 and 600 written tokens, whole and in 3 splits."""
    from kvgen.conformance import StreamCase, run_stream

    fmt = kvgen.load(name)
    case = StreamCase(head_size=256, block_size=fmt.layout.RESIDUAL["group"], num_kv_heads=2, group=4,
                      steps=[[1100, 600], [1, 1], [1, 1]], dtype=torch.bfloat16, window=None, pad_rows=0, seed=21)
    for c in (case, dataclasses.replace(case, splits=3, seed=22)):
        failures = {p: m for p, m in run_stream(fmt, c, DEVICE).items() if m}
        assert not failures, failures


# The twenty-sixth and twenty-seventh sessions' tile rules (head size 256, mxfp8's 3 stages at head size 64, chunked
# prefill's own tiles at head size 128): compiled kernels only, since the interpreter takes
# INTERPRETER_TILES, which the other cases run.
GPU_RULES = pytest.mark.skipif(DEVICE != "cuda", reason="the compiled kernels' tile rules: a GPU run")


@pytest.mark.parametrize("name, head_size, q_lens", [(n, 128, [1, 1]) for n in (
    "bf16", "fp8_e4m3", "int8_per_token_head", "int8_asym_per_token_head", "nvfp4")]
    + [(n, 64, [1, 1]) for n in ("int8_per_token_head_separate", "mxfp4", "int4_per_token_head",
                                 "int8_per_token_head_hadamard_k", "q4_0")]
    + [pytest.param(n, 256, [1, 1], marks=GPU_RULES) for n in (
        "bf16", "fp8_e4m3", "int8_per_token_head_separate", "int8_per_token_head", "fp8_per_token_head", "mxfp8")]
    + [pytest.param(n, 256, [1, 1], marks=GPU_RULES) for n in ("nvfp4", "mxfp4", "int4_per_token_head", "q4_0", "q8_0")]
    + [pytest.param("mxfp8", 64, [1, 1], marks=GPU_RULES)]
    + [pytest.param(n, 128, [700, 1], marks=GPU_RULES) for n in ("bf16", "nvfp4", "mxfp4", "nvfp4_separate")])
def test_long_decode_many_tiles(name, head_size, q_lens):
    """Decode (or a 700-token chunk beside a decode) over 2100 and 1500 tokens: 12 to 33 whole tiles per program at
    the GPU's 64-128 positions per step, so the compiled loop's software pipeline (copies of later steps in flight,
    shared buffers reused) runs many iterations; then with 3 splits and a sliding window. Head size 64 takes tiles
    of its own on the H200 (three stages for int8 separate, the rotated keys and q4_0's per-block dots, two stages and
    128 registers for mxfp4 and int4 per token-head). The interpreter has no pipeline to exercise: on the CPU 640 and
    480 tokens (5 and 4 steps of its 128 positions, INTERPRETER_TILES; a 300-token window) check the same loop's
    arithmetic over several steps in a third of the time."""
    fmt = kvgen.load(name)
    lens, window = ([2100, 1500], 700) if DEVICE == "cuda" else ([640, 480], 300)
    case = Case(head_size=head_size, block_size=16, num_kv_heads=2, group=4, seq_lens=lens, q_lens=q_lens,
                dtype=torch.bfloat16, window=None, holes=2, seed=11, k_scale=0.5, v_scale=2.0, magnitude=1.0)
    assert_conforms(fmt, case)
    assert_conforms(fmt, dataclasses.replace(case, splits=3, window=window, seed=12))
