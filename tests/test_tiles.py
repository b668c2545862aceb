"""The attention launch configuration (kvgen.runtime.kernels.attention_tiles) for every shipped format, query dtype
and dot precision, as a GPU run would choose it (the interpreter always takes its own single tile).

The register caps were measured with bf16 queries on kernels whose operands go to tensor cores in one term per
query and probability; a second query dot (fp32 or rotated queries) spilled under the cap on the H200
(int8_per_token_head_hadamard_k: 603 -> 874 us), and exact fp32 dots (KIVI, "ieee") were never measured with one.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import kvgen
from kvgen.runtime import kernels as K
from kvgen.runtime import occupancy

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# the plan tests below run where the suite runs: the interpreter on the CPU, compiled kernels on a GPU
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"


def choices(head_pad: int = 128):
    for name in kvgen.shipped_names():
        fmt = kvgen.load(name)
        ks = fmt._kernels
        for precision in ("auto", "ieee", "quantized"):
            if precision == "quantized" and not any(fmt.quantized_dot.values()):
                continue
            for dtype in DTYPES:
                dots = ks.dot_modes(dtype, precision, fmt.spec.key.rotation is not None, head_pad, None)
                yield name, precision, dtype, dots, ks


@pytest.fixture
def compiled(monkeypatch):
    monkeypatch.setattr(K, "interpreting", lambda: False)


@pytest.mark.parametrize("head_pad", [64, 128])
def test_register_caps_only_where_measured(compiled, head_pad):
    for name, precision, dtype, dots, ks in choices(head_pad):
        tiles = K.attention_tiles(ks.module.CODE_BITS, dots, ks.block_scaled, head_pad=head_pad,
                                  pow2_blocks=ks.pow2_blocks)
        two_term_query = any(dots[f"DOT_{s}"] in (1, 2) and dots[f"{x}_TERMS"] > 1 for s, x in (("K", "Q"), ("V", "P")))
        exact_only = dots["DOT_K"] == 0 and dots["DOT_V"] == 0
        where = f"{name} {precision} {dtype} head {head_pad}"
        # two-term queries keep the compiler's registers but for int4 per token-head's class (4-bit codes, rotated
        # query in two terms, no block scales), measured faster capped (twenty-fourth session; 0.1 spills a position),
        # and the rotated-key format's query alone in two terms (bf16 / fp16 queries, probabilities in one) at head
        # size 64 (twenty-fifth session, run 5) and, since its decode carries 8 rows (live_fold_rows), at 128
        # (fifty-first session, H100); fp32 queries (probabilities in two terms too) were never timed capped
        int4_class = max(ks.module.CODE_BITS.values()) == 4 and not ks.block_scaled
        rotated = (head_pad in (64, 128) and max(ks.module.CODE_BITS.values()) == 8 and not ks.block_scaled
                   and dots["Q_TERMS"] == 2 and dots["P_TERMS"] == 1)
        if exact_only or (two_term_query and not (int4_class or rotated)):
            assert "maxnreg" not in tiles, where
        assert tiles["BLOCK_N"] in (64, 128) and tiles["programs_per_sm"] in (4, 8), where


def test_measured_choices(compiled):
    """The configurations benchmarks/RESULTS.md measured for bf16 queries with dot_precision auto."""
    def tiles(name, dtype=torch.bfloat16, precision="auto"):
        fmt = kvgen.load(name)
        ks = fmt._kernels
        dots = ks.dot_modes(dtype, precision, fmt.spec.key.rotation is not None, 128, None)
        return K.attention_tiles(ks.module.CODE_BITS, dots, ks.block_scaled, wide=wide(name),
                                 pow2_blocks=ks.pow2_blocks, position_scales=ks.position_scales,
                                 float_codes=ks.float_codes)

    assert tiles("bf16") == dict(BLOCK_N=64, num_warps=4, num_stages=3, maxnreg=128, programs_per_sm=8)
    # twenty-second session: 16-byte code rows take block ids one step ahead and a third stage
    for name in ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3_per_head", "int8_per_token_head_separate"):
        assert tiles(name) == dict(BLOCK_N=128, num_warps=4, num_stages=3, maxnreg=168, programs_per_sm=4,
                                   prefetch_blocks=True), name
    # vLLM's inline-scale cells (132 bytes a side) ran 1.4-1.5x slower that way and keep two stages; fp8 per
    # token-head's decode on every row (fifty-first session, H100: 8 of 16 rows 4-8% slower for it alone)
    two = dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=168, programs_per_sm=8)
    assert tiles("int8_per_token_head") == two
    assert tiles("fp8_per_token_head") == dict(two, live_fold=False)
    assert tiles("mxfp8") == dict(BLOCK_N=128, num_warps=4, num_stages=2, programs_per_sm=8)
    # sixth session's sweeps (benchmarks/RESULTS.md): the block-scaled classes and int4 take 128 positions per step
    assert tiles("q8_0") == dict(BLOCK_N=128, num_warps=4, num_stages=2, programs_per_sm=8)
    # fifty-first session (H100; decode on 8 rows, the value dot in two halves): nvfp4 and mxfp4 at 2 stages, block
    # ids ahead and 128 registers, 4 programs per SM (nvfp4 440 -> 405 us at 64 x 8192, 251 -> 232 at 256 x 1024;
    # mxfp4 404 -> 398, 223 -> 215; both level at 4 x 65536). Before, mxfp4 took 3 stages and 168 registers
    # (twenty-fourth session: 7% faster then), nvfp4 the 8-bit block class's tiles
    split = dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=128, programs_per_sm=4, prefetch_blocks=True,
                 value_split=2)
    for name in ("nvfp4", "nvfp4_separate", "mxfp4"):
        assert tiles(name) == split, name
    assert tiles("int4_per_token_head") == dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=168,
                                                programs_per_sm=4, prefetch_blocks=True)
    # KIVI, and q4_0 where it keeps two terms (decode without per-block dots: GQA groups above 16, or the exact
    # dots of these tests' fp32 queries), split for 8 programs per SM
    for name in ("q4_0", "kivi_2bit", "kivi_4bit"):
        assert tiles(name) == dict(BLOCK_N=64, num_warps=4, num_stages=3, programs_per_sm=8), name
    # head size 64: bf16 and fp16 take 128 positions per step under the 8-bit cap (the quantized formats' own rules
    # there follow)
    def tiles_at(name, head_pad):
        fmt = kvgen.load(name)
        ks = fmt._kernels
        dots = ks.dot_modes(torch.bfloat16, "auto", fmt.spec.key.rotation is not None, head_pad, None)
        return K.attention_tiles(ks.module.CODE_BITS, dots, ks.block_scaled, head_pad=head_pad,
                                 wide=wide(name, head_pad), pow2_blocks=ks.pow2_blocks,
                                 position_scales=ks.position_scales, float_codes=ks.float_codes)

    for name in ("bf16", "fp16"):
        assert tiles_at(name, 64) == dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=168, programs_per_sm=8)
        assert tiles_at(name, 128) == tiles("bf16")
    # twenty-fourth session, run 7 (values converted first where the rule says so): at head size 64 the 8-bit
    # formats with per-tensor or per-token scales and nvfp4 take 3 stages, block ids ahead and 168 registers (7-13%
    # faster), mxfp4 and int4 per token-head 2 stages and 128 registers (15-16%), mxfp8 kept its tiles (until the
    # scale words below)
    three = dict(BLOCK_N=128, num_warps=4, num_stages=3, maxnreg=168, programs_per_sm=4, prefetch_blocks=True)
    for name in ("int8_per_token_head", "fp8_per_token_head", "fp8_e4m3", "nvfp4"):
        assert tiles_at(name, 64) == three, name
    # fifty-first session (H100, decode at 64 x 8192 on 8 rows): int8 separate 270 -> 248 us and mxfp8 329 -> 296 at
    # 2 stages and 128 registers, 4 programs per SM
    capped = dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=128, programs_per_sm=4, prefetch_blocks=True)
    assert tiles_at("int8_per_token_head_separate", 64) == capped
    for name in ("mxfp4", "int4_per_token_head"):
        assert tiles_at(name, 64) == dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=128, programs_per_sm=4), name
    # twenty-sixth session, run 1: with its scale rows read as words mxfp8 took the 3-stage tiles at head size 64
    # (its own rule since); where the layout keeps them byte-wise (an odd number of KV heads) those tiles ran slower
    # (357 against 308 us)
    assert tiles_at("mxfp8", 64) == capped
    fmt = kvgen.load("mxfp8")
    dots = fmt._kernels.dot_modes(torch.bfloat16, "auto", False, 64, None)
    assert K.attention_tiles(fmt._kernels.module.CODE_BITS, dots, True, head_pad=64, wide=True, pow2_blocks=True,
                             scale_words=False) == tiles("mxfp8")
    # twenty-fifth session, run 5: the rotated-key format (a second query term, spilled under the cap at head size
    # 128) and q4_0 / q8_0's per-block dots (decode's own dots, hence the call's) take the 3-stage tiles at 64
    assert tiles_at("int8_per_token_head_hadamard_k", 64) == three

    def decode_tiles(name, head_pad):
        """A decode call's tiles from the call's own dots (with decode's choices: per-block dots, key fold)."""
        ks = kvgen.load(name)._kernels
        dots = ks._call_dots(torch.bfloat16, "auto", False, head_pad, K.DECODE_ROWS, None)
        return dots, K.attention_tiles(ks.module.CODE_BITS, dots, ks.block_scaled, K.DECODE_ROWS, head_pad,
                                       wide(name, head_pad), ks.pow2_blocks, position_scales=ks.position_scales,
                                       float_codes=ks.float_codes)

    for name in ("q4_0", "q8_0"):
        dots, got = decode_tiles(name, 64)
        assert dots["BLOCK_DOTS"], name
        # fifty-first session (H100): q4_0 at 128 registers, 287 -> 260 us at 64 x 8192
        assert got == (dict(three, maxnreg=128) if name == "q4_0" else three), name
    # fifty-first session (H100; the blocks' dots stacked on the rows decode fills): at head size 128 q8_0 capped at
    # 168 registers (573 -> 539 us at 64 x 8192, 296 -> 259 at 4 x 65536, 329 -> 299 at 256 x 1024), q4_0 nvfp4's
    # tiles with the value dot in halves (574 -> 457, 300 -> 240, 328 -> 269); fifty-second session: q8_0's split
    # for 8 programs per SM (541 -> 504 us at 64 x 8192, level at the other two)
    assert decode_tiles("q8_0", 128)[1] == dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=168,
                                                programs_per_sm=8)
    assert decode_tiles("q4_0", 128)[1] == split
    # KIVI's decode (key fold, the values' block dots): kivi_4bit at 128 registers at head size 128 (1227 -> 1067 us
    # at 64 x 8192, 622 -> 531 at 4 x 65536, 810 -> 790 at 256 x 1024); kivi_2bit capped at the 168 it compiled to
    # before its key codes took the code-major order (uncapped it would take 201-214 registers, 2 programs per SM;
    # timed with that order only, fifty-third session, H100: 1095 -> 861 us at 64 x 8192)
    dots, got = decode_tiles("kivi_4bit", 128)
    assert dots["KEY_FOLD"] and got == dict(BLOCK_N=64, num_warps=4, num_stages=3, maxnreg=128, programs_per_sm=4)
    assert decode_tiles("kivi_2bit", 128)[1] == dict(BLOCK_N=64, num_warps=4, num_stages=3, maxnreg=168,
                                                     programs_per_sm=8)
    # the rotated-key format at head size 128 (fifty-first session: 267 -> 251 us at 4 x 65536, 353 -> 310 at 256 x
    # 1024, level at 64 x 8192) under the cap its second query term spilled under before decode carried 8 rows
    assert tiles("int8_per_token_head_hadamard_k") == dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=168,
                                                           programs_per_sm=4)
    # head size 256 (twenty-sixth session, runs 3-4: the head-128 rules spilled there; twenty-seventh, run 2: the
    # values converted first at 64 positions per step, 168 registers but for mxfp8, 128 for int4 per token-head)
    assert tiles_at("bf16", 256) == dict(BLOCK_N=32, num_warps=4, num_stages=3, programs_per_sm=4,
                                         prefetch_blocks=True)
    first = dict(num_warps=4, num_stages=2, programs_per_sm=4, prefetch_blocks=True, convert_first=True)
    for name in ("fp8_e4m3", "int8_per_token_head_separate", "nvfp4", "mxfp4"):
        assert tiles_at(name, 256) == dict(first, BLOCK_N=64, maxnreg=168), name
    assert tiles_at("mxfp8", 256) == dict(first, BLOCK_N=64)
    assert tiles_at("int4_per_token_head", 256) == dict(first, BLOCK_N=128)
    for name in ("int8_per_token_head", "fp8_per_token_head"):
        assert tiles_at(name, 256) == dict(BLOCK_N=64, num_warps=4, num_stages=2, programs_per_sm=4), name
    # measured before the table (run 1): the rotated-key format with fp32 queries (a second probability term) and
    # exact dots keep the earlier choice
    assert tiles("int8_per_token_head_hadamard_k", torch.float32) == dict(BLOCK_N=128, num_warps=4, num_stages=2,
                                                                          programs_per_sm=4)
    # KIVI at head size 64 (twenty-fifth session, run 6: 1.5x faster with 2 stages; no key fold there)
    for name, tiles64 in (("kivi_2bit", dict(BLOCK_N=64, num_warps=4, num_stages=2, maxnreg=128, programs_per_sm=4)),
                          ("kivi_4bit", dict(BLOCK_N=128, num_warps=4, num_stages=2, programs_per_sm=4))):
        assert decode_tiles(name, 64)[1] == tiles64, name
    assert decode_tiles("kivi_2bit", 128)[1] == dict(tiles("kivi_2bit"), maxnreg=168)  # (its block dots' 168 cap)
    # ... whose steps hold whole token groups of 32 (the runtime takes at least BLOCK_N_GROUP positions per step)
    assert kvgen.load("kivi_4bit")._kernels.module.BLOCK_N_GROUP == 32
    assert tiles("int8_per_token_head", precision="ieee") == dict(BLOCK_N=128, num_warps=4, num_stages=2,
                                                                   programs_per_sm=4)
    # the quantized domain was measured under the 8-bit cap (benchmarks/decode_modes.py), rotated keys included
    assert tiles("int8_per_token_head_hadamard_k", precision="quantized")["maxnreg"] == 168
    # ... and int8 separate's at 2 stages and 128 registers, 4 programs per SM (forty-ninth session, H100: 8-12% less
    # time at the three head-128 decode shapes); its exact dots keep the 16-byte rows' rule above
    quantized_rule = dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=128, programs_per_sm=4)
    assert tiles("int8_per_token_head_separate", precision="quantized") == quantized_rule
    assert tiles("int8_per_token_head_separate") != quantized_rule
    for name in ("int8_per_token_head", "int8_per_token_head_hadamard_k", "mixed_k8_v4"):
        assert tiles(name, precision="quantized") != quantized_rule, name


def wide(name: str, head_size: int = 128, sides: str = "KV") -> bool:
    """kvgen.runtime.kernels.wide_rows of a format's cache at block size 16 (KIVI: its group), 8 KV heads."""
    return K.wide_rows(consts_of(name, head_size), sides)


def test_wide_rows():
    """16-byte code rows: cells of whole 16-byte multiples (fp8 per tensor, int8 with its scales in their own
    tensors), not vLLM's inline-scale cells (int8 / fp8 per token-head: 132 bytes a side) nor q8_0's (136)."""
    for name in ("bf16", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head_separate", "nvfp4_separate"):
        assert wide(name), name
    for name in ("int8_per_token_head", "fp8_per_token_head", "q8_0", "int8_asym_per_token_head", "mixed_k8_v4"):
        assert not wide(name), name
    assert not wide("fp8_e4m3", head_size=24)  # 24-byte rows


def decode_case(name: str, ctx: int, head_size: int):
    """A written cache of two sequences of ``ctx`` tokens (2 KV heads, a shuffled block table) and a bf16 query of 4
    heads per KV head, on the suite's device: (format, the query, the cache and attend's arguments)."""
    fmt = kvgen.load(name)
    block = 32 if fmt.spec.streaming else 16
    seqs = 2
    blocks = seqs * -(-ctx // block)
    torch.manual_seed(0)
    extra = {"max_seqs": seqs} if fmt.spec.streaming else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(blocks, block, 2, head_size, device=DEVICE, **extra)
    table = torch.randperm(blocks, dtype=torch.int32).reshape(seqs, -1)
    slots = (table.long()[:, :, None] * block + torch.arange(block)).reshape(seqs, -1)[:, :ctx].reshape(-1)
    seq_lens = torch.full((seqs,), ctx, dtype=torch.int32)
    qsl = torch.arange(seqs + 1, dtype=torch.int32)
    table, slots, seq_lens, qsl = (t.to(DEVICE) for t in (table, slots, seq_lens, qsl))
    k, v = torch.randn(2, seqs * ctx, 2, head_size, device=DEVICE)
    ids = {"seq_ids": torch.arange(seqs, dtype=torch.int32, device=DEVICE)} if fmt.spec.streaming else {}
    meta = dict(ids, query_start_loc=qsl * ctx, seq_lens=seq_lens, block_table=table) if fmt.spec.streaming else {}
    fmt.write(cache, k, v, slots, **meta)
    q = torch.randn(seqs, 8, head_size, dtype=torch.bfloat16, device=DEVICE)
    return fmt, q, (cache, table, seq_lens, qsl), ids


@pytest.mark.parametrize("name", ["fp8_e4m3", "int8_per_token_head", "kivi_2bit"])
def test_prefetched_block_ids_change_nothing(name, monkeypatch):
    """PREFETCH_BLOCKS (the next step's block ids loaded one step ahead) gives the same output, bit for bit, as
    loading them in the step: several whole tiles and a partial one, with and without splits, a shuffled table; in
    the interpreter and compiled (two and three pipeline stages)."""
    fmt, q, (cache, table, seq_lens, qsl), ids = decode_case(name, 9 * 32 + 5, 64)
    for stages in ((2,) if DEVICE == "cpu" else (2, 3)):
        outs = {}
        for prefetch in (False, True):
            tiles = {"BLOCK_N": 32, "prefetch_blocks": prefetch}
            monkeypatch.setattr(K, "INTERPRETER_TILES", tiles)
            monkeypatch.setattr(K, "TILE_OVERRIDE", dict(tiles, num_warps=4, num_stages=stages))
            outs[prefetch] = [fmt.attend(q, cache, table, seq_lens, qsl, max_query_len=1, num_splits=s, **ids)
                              for s in (1, 3)]
        for a, b in zip(outs[False], outs[True]):
            assert torch.equal(a, b), f"{name}, {stages} stages"


def test_values_converted_first_where_measured(compiled):
    """V_CONVERT_FIRST (the value codes converted in their load's layout) in decode with tensor-core dots, for the
    formats whose value codes are narrower than the dot type: every one but vLLM's inline-scale cells, whose 8-bit
    value rows are 4-byte aligned (measured slower with it, benchmarks/RESULTS.md, twenty-third session); never
    for 16-bit values, exact fp32 dots, int8 dots, prefill or heads over 128, nor in the interpreter (inline PTX)."""
    def convert(name, precision="auto", block_m=16, head_pad=128):
        fmt = kvgen.load(name)
        ks = fmt._kernels
        dots = ks.dot_modes(torch.bfloat16, precision, fmt.spec.key.rotation is not None, head_pad, None)
        return K.convert_values_first(ks.module.CODE_BITS, dots, block_m, head_pad, wide(name, sides="V"))

    inline_8bit = {"int8_per_token_head", "fp8_per_token_head", "int8_asym_per_token_head",
                   "int8_per_token_head_hadamard_k", "q8_0"}
    for name in kvgen.shipped_names():
        narrow = kvgen.load(name)._kernels.module.CODE_BITS["v"] < 16
        assert convert(name) == (narrow and name not in inline_8bit), name
        assert not convert(name, "ieee"), name
        assert not convert(name, block_m=64), name
        assert not convert(name, head_pad=256), name  # its staging buffer: 1 program per SM for the 8-bit formats
    assert not convert("int8_per_token_head_separate", "quantized")  # int8 dots: the codes are the operand
    # a tile rule's own convert_first replaces the rows / head size / row width conditions, not the operands'
    fmt = kvgen.load("fp8_e4m3")
    bits = fmt._kernels.module.CODE_BITS
    dots = fmt._kernels.dot_modes(torch.bfloat16, "auto", False, 256, None)
    assert K.convert_values_first(bits, dots, 16, 256, True, rule=True)
    assert not K.convert_values_first(bits, dots, 16, 128, True, rule=False)
    exact = fmt._kernels.dot_modes(torch.bfloat16, "ieee", False, 256, None)
    assert not K.convert_values_first(bits, exact, 16, 256, True, rule=True)
    bf16 = kvgen.load("bf16")._kernels
    assert not K.convert_values_first(bf16.module.CODE_BITS, bf16.dot_modes(torch.bfloat16, "auto", False, 256, None),
                                      16, 256, True, rule=True)
    K.interpreting = lambda: True  # (the fixture restores it)
    assert not convert("fp8_e4m3")
    assert not K.convert_values_first(bits, dots, 16, 256, True, rule=True)


def test_rule_convert_first_is_no_launch_option(monkeypatch):
    """A tile rule's convert_first entry sets the kernel's V_CONVERT_FIRST and is not passed on as a launch option:
    the plan's launch holds no such argument and the output is the same. Compiled, at head size 256, where the
    values are otherwise not converted first (CONVERT_FIRST_MAX_HEAD), the entry turns it on; the interpreter's tiles
    never convert first."""
    fmt, q, (cache, table, seq_lens, qsl), ids = decode_case("fp8_e4m3", 2 * 32 + 5, 256)
    tiles = dict(BLOCK_N=64, num_warps=4, num_stages=2)
    monkeypatch.setattr(K, "TILE_OVERRIDE", None if DEVICE == "cpu" else tiles)
    plain = fmt.attend(q, cache, table, seq_lens, qsl, max_query_len=1, **ids)
    monkeypatch.setattr(K, "INTERPRETER_TILES", dict(K.INTERPRETER_TILES, convert_first=True))
    monkeypatch.setattr(K, "TILE_OVERRIDE", None if DEVICE == "cpu" else dict(tiles, convert_first=True))
    launch = fmt.plan_attention(q, cache, table, seq_lens, qsl, max_query_len=1, **ids)._launch.kwargs
    assert "convert_first" not in launch and launch["V_CONVERT_FIRST"] == int(DEVICE != "cpu")
    assert torch.equal(fmt.attend(q, cache, table, seq_lens, qsl, max_query_len=1, **ids), plain)


@pytest.mark.parametrize("name", ["fp8_e4m3", "int8_per_token_head_separate", "nvfp4", "mxfp8", "kivi_2bit",
                                  "int8_per_token_head"])
def test_values_converted_first_change_nothing(name, monkeypatch):
    """Compiled, V_CONVERT_FIRST on or off gives the same output bit for bit (the dot reads the same 16-bit values;
    only where they are converted moves): several whole tiles and a partial one, with and without splits."""
    if DEVICE == "cpu":
        pytest.skip("inline PTX: compiled kernels only (the interpreter never converts first)")
    fmt, q, (cache, table, seq_lens, qsl), ids = decode_case(name, 9 * 64 + 5, 128)
    outs = {}
    for first in (False, True):
        monkeypatch.setattr(K, "CONVERT_FIRST_OVERRIDE", first)
        outs[first] = [fmt.attend(q, cache, table, seq_lens, qsl, max_query_len=1, num_splits=s, **ids)
                       for s in (1, 3)]
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a, b), name


def test_write_tiles_measured(compiled):
    """The write launches benchmarks/RESULTS.md measured (writes of 32768 tokens, benchmarks/tune_writes.py): 4 tokens
    per program on one warp (seventh session), 8 for mxfp4, the one format they made faster (twelfth session, run 1:
    83 -> 77-78 us; int4 per token-head 128 -> 192, nvfp4 103 -> 125)."""
    for name in kvgen.shipped_names():
        ks = kvgen.load(name)._kernels
        tiles = K.write_tiles(ks.module.CODE_BITS, ks.pow2_blocks)
        assert tiles == dict(BLOCK_T=8 if name == "mxfp4" else 4, num_warps=1), name
    # the rule is the class's, 4-bit codes with e8m0 block scales: mxfp8 (8-bit) and nvfp4 (e4m3 scales) keep 4
    assert kvgen.load("mxfp4")._kernels.pow2_blocks and kvgen.load("mxfp8")._kernels.pow2_blocks
    assert not kvgen.load("nvfp4")._kernels.pow2_blocks


def test_prefill_takes_no_decode_cap(compiled):
    """Programs that hold more query rows than a decode step (chunked prefill: 64) take no decode cap (the decode
    caps slowed the 4 x 2048-token prefill by 35-40% on the H200): the configuration used before the decode table,
    but where the twenty-sixth session measured prefill tiles at head size 128 with tensor-core dots of one term
    (runs 2 and 4): bf16 / fp16 at 128 positions per step, nvfp4 / mxfp4 at 128 with 3 stages, both with block ids
    one step ahead."""
    measured = {"bf16": dict(BLOCK_N=128, num_warps=4, num_stages=2, programs_per_sm=4, prefetch_blocks=True),
                "nvfp4": dict(BLOCK_N=128, num_warps=4, num_stages=3, programs_per_sm=4, prefetch_blocks=True)}
    for name, precision, dtype, dots, ks in choices():
        args = (ks.module.CODE_BITS, dots, ks.block_scaled)
        kw = dict(pow2_blocks=ks.pow2_blocks)
        prefill = K.attention_tiles(*args, block_m=64, **kw)
        eight_bit = max(ks.module.CODE_BITS.values()) == 8
        before = (dict(BLOCK_N=128, num_warps=4, num_stages=2, programs_per_sm=4) if eight_bit
                  else dict(BLOCK_N=64, num_warps=4, num_stages=3, programs_per_sm=4))
        one_term = dots["DOT_K"] in (1, 2) and dots["Q_TERMS"] == dots["K_TERMS"] == dots["V_TERMS"] == 1
        cls = ("bf16" if name in ("bf16", "fp16") else
               "nvfp4" if name in ("nvfp4", "nvfp4_separate", "mxfp4") else None)
        want = measured[cls] if cls and one_term and dtype != torch.float32 else before
        assert prefill == want, f"{name} {precision} {dtype}"
        # head sizes other than 128 keep the configuration of before
        assert K.attention_tiles(*args, block_m=64, head_pad=64, **kw) == before, f"{name} {precision} {dtype}"
        # speculative decoding's few query tokens per sequence still fill one decode tile of 16 rows
        assert K.attention_tiles(*args, block_m=8, **kw) == K.attention_tiles(*args, **kw), f"{name} {precision} {dtype}"
    fmt = kvgen.load("fp8_e4m3")
    dots = fmt._kernels.dot_modes(torch.bfloat16, "auto", False, 128, None)
    assert K.attention_tiles(fmt._kernels.module.CODE_BITS, dots, False,
                             block_m=16)["maxnreg"] == 168


def consts_of(name: str, head_size: int = 128, num_kv_heads: int = 8) -> dict:
    """The layout constants of a launch on a format's cache at block size 16 (KIVI: its group)."""
    fmt = kvgen.load(name)
    block = fmt.layout.RESIDUAL["group"] if fmt.spec.streaming else 16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(1, block, num_kv_heads, head_size, **({"max_seqs": 1} if fmt.spec.streaming else {}))
    return fmt._kernel_args(cache)[1]


def test_prefill_rows_where_measured(compiled, monkeypatch):
    """Chunked prefill takes programs of 128 query rows on 8 warps (RULED_PREFILL_ROWS) where the H200 measured them
    faster (4 x 8192 with 2048 new tokens, bf16 queries). Head size 128 (twenty-seventh session, run 3): fp8 per tensor,
    mxfp8 and q8_0 at 128 positions per step, int4 per token-head, q4_0 and kivi_2bit at 64. Head size 256 (twenty-
    eighth session, runs 2 / 4 / 5): bf16, q4_0 and kivi_2bit at 64; fp8 per tensor, mxfp8, nvfp4 and mxfp4 (its tiles
    forced) at 128; int8 separate at 128 (twenty-ninth session, run 4). Head size 64: fp8 per tensor and q4_0 at 128,
    int4 per token-head at 64. With the per-position scale words spread over the threads (thirty-second session): the
    per token-head formats at 256 at 128 (int4 per token-head too), int8 separate at 128 and 256. With the mask-free
    steps too (thirty-third session, on an H100): int8 / fp8 per token-head, int8 asym and mixed_k8_v4 at 128. int4 per
    token-head with separate scales (fifty-third session, on an H100; the rules' tiles, forced 64 against 128 rows):
    faster at 128 rows at head size 128 (6542 -> 6171 us) and 256 (20136 -> 16117), level at 64 (4494 against 4549).
    Following these rules untimed (or timed with the rule alone): fp8 per head / e5m2 (fp8's), fp16 (bf16's, and with
    bf16 queries), nvfp4_separate (nvfp4's), kivi_4bit at 64 / 256 (q4_0's), int8 separate's quantized domain at 128 /
    256 and the per token-head formats' at 128 / 256 (any query type, the Hadamard format's too: its int8 dots take one
    query term; not checked here). Elsewhere 64 rows: the formats measured slower or level there (bf16 at 64 / 128, int8
    separate at 64, nvfp4 at 64 / 128, mxfp4 at 64 / 128, mxfp8 at 64, the Hadamard format at 128 under auto and fast: a
    two-term query), the per token-head formats at 64 (three slower, int8 asym level), fp32 queries under auto and fast,
    a bf16 cache read with fp16 queries (two terms), and decode and short chunks, which fill no more than 64 rows.
    The five cells shipped with separate scales in the fifty-fifth session follow their inline cells' rules."""
    fp8 = {"fp8_e4m3": 128, "fp8_e4m3_per_head": 128, "fp8_e5m2": 128}
    wide = {
        128: dict(fp8, mxfp8=128, q8_0=128, int4_per_token_head=64, q4_0=64, kivi_2bit=64, kivi_4bit=64,
                  int8_per_token_head_separate=128, int8_per_token_head=128, fp8_per_token_head=128,
                  int8_asym_per_token_head=128, mixed_k8_v4=128, int4_per_token_head_separate=64),
        256: dict(fp8, bf16=64, fp16=64, mxfp8=128, nvfp4=128, nvfp4_separate=128, mxfp4=128, q4_0=64,
                  kivi_2bit=64, kivi_4bit=64, int8_per_token_head_separate=128, int8_per_token_head=128,
                  fp8_per_token_head=128, int8_asym_per_token_head=128, int8_per_token_head_hadamard_k=128,
                  int4_per_token_head=128, mixed_k8_v4=128, int4_per_token_head_separate=128),
        64: dict(fp8, int4_per_token_head=64, int4_per_token_head_separate=64, q4_0=128, kivi_4bit=128),
    }
    # the cells shipped with their scales out of the cell in the fifty-fifth session follow their cells' rules
    # (prefill untimed in that layout)
    for ruled in wide.values():
        ruled.update({f"{cell}_separate": ruled[cell] for cell in ("fp8_per_token_head", "int8_asym_per_token_head",
                                                                    "mixed_k8_v4", "q8_0", "q4_0") if cell in ruled})
    for name in kvgen.shipped_names():
        fmt = kvgen.load(name)
        ks, rotated = fmt._kernels, fmt.spec.key.rotation is not None
        for head_size, ruled in wide.items():
            consts = consts_of(name, head_size)
            # the query types a rule of 128 rows admits: a bf16 cache's with bf16 queries alone (fp16 ones take two
            # terms), an fp16 cache's with either 16-bit type, the other formats' with either
            ruled_types = {"bf16": (torch.bfloat16,)}.get(name, (torch.bfloat16, torch.float16))
            for dtype in DTYPES:
                for precision in ("auto", "fast"):
                    rows = ks.query_rows(dtype, precision, rotated, 4, 2048, consts)
                    want = 128 if name in ruled and dtype in ruled_types else 64
                    assert rows == want, (name, head_size, dtype, precision)
                if rows == 128:
                    dots = ks._call_dots(dtype, "auto", rotated, head_size, rows, None)
                    tiles = K.attention_tiles(ks.module.CODE_BITS, dots, ks.block_scaled, rows, head_size,
                                              K.wide_rows(consts), ks.pow2_blocks,
                                              K.scale_rows_in_words(consts, ks.scale_rows), ks.position_scales)
                    assert tiles == dict(BLOCK_N=ruled[name], num_warps=8, num_stages=2, programs_per_sm=4), name
        consts = consts_of(name)
        assert ks.query_rows(torch.bfloat16, "auto", rotated, 4, 1, consts) == 16, name
        assert ks.query_rows(torch.bfloat16, "auto", rotated, 4, 16, consts) == 64, name  # 16 tokens fill 64 rows
    # experiments choose the rows themselves: under TILE_OVERRIDE no rule names them
    ks = kvgen.load("fp8_e4m3")._kernels
    monkeypatch.setattr(K, "TILE_OVERRIDE", dict(BLOCK_N=64, num_warps=4, num_stages=2))
    assert ks.query_rows(torch.bfloat16, "auto", False, 4, 2048, consts_of("fp8_e4m3")) == 64


def test_position_scales():
    """The tile key's position scales: scales computed on write (per token-head, per block, per channel group), not
    the static per-tensor / per-head ones nor none (the 8-bit formats fp8 per tensor and int8 separate share every
    other field, and ran 0.91x and 1.37x their 64-row prefill with 128 rows)."""
    static = {"bf16", "fp16", "fp8_e4m3", "fp8_e4m3_per_head", "fp8_e5m2"}
    for name in kvgen.shipped_names():
        assert kvgen.load(name)._kernels.position_scales == (name not in static), name


def test_small_heads_stay_off_warpgroup_dots(compiled):
    """Heads of 32 or fewer elements never meet a tensor-core dot in a program of 64 or more query rows (warpgroup
    dots, which Triton 3.6 miscompiles there on Hopper: kvgen.runtime.kernels.SMALL_HEAD_PAD); larger heads keep
    their 64 rows. Every row count holds the whole GQA group of a KV head."""
    for head_pad in (16, 32, 64, 128):
        for group in (1, 2, 3, 4, 5, 8, 16, 32, 64):
            for q_len in (1, 2, 7, 22, 100):
                rows = K.query_rows(group, q_len, head_pad)
                where = f"head_pad {head_pad} group {group} q_len {q_len}"
                assert rows >= group and rows & (rows - 1) == 0, where
                if head_pad <= 32:
                    assert rows <= 32 or rows == K._next_pow2(group), where
                    assert K.tensor_core_rows_ok(rows, head_pad) == (rows <= 32), where
                else:
                    assert K.tensor_core_rows_ok(rows, head_pad), where
                    if group * q_len >= 64 and group <= 64:  # prefill fills its 64 rows
                        assert rows == 64, where


def test_split_rule(compiled, monkeypatch):
    """KV splits on a 132-SM GPU (the H200), as benchmarks/RESULTS.md measured them (ninth session,
    benchmarks/tune_splits.py): the tile rule's programs per SM with at least 512 positions per split, and for few
    sequences at least two programs per SM with at least 128 positions per split."""
    ks = kvgen.load("bf16")._kernels
    monkeypatch.setitem(K.KernelSet._SMS, 0, 132)
    dev = torch.device("cuda", 0)

    def splits(seqs, ctx, programs_per_sm=8, heads=8):
        return ks._splits(seqs * heads, ctx, seqs, 4 * heads, 128, dev, programs_per_sm)

    # short contexts, few sequences: two programs per SM (264 in all), splits of 128 positions at least
    assert splits(4, 1024) == 8  # 32 programs x 8
    assert splits(1, 8192) == 33  # 8 programs x 33
    assert splits(4, 512) == 4
    assert splits(4, 100) == 1
    # longer contexts: the tile rule's 8 programs per SM (1056), splits of 512 positions at least
    assert splits(4, 4096) == 8
    assert splits(4, 16384) == 32
    assert splits(4, 65536) == 33
    assert splits(4, 65536, programs_per_sm=4) == 17
    assert splits(16, 1024) == 2
    # many sequences (512 programs, more than two per SM): the tile rule alone
    assert splits(64, 8192) == 3
    assert splits(64, 8192, programs_per_sm=4) == 2
    assert splits(64, 1024) == 2
    assert splits(256, 1024) == 1


def test_resident_programs():
    """Programs per SM on sm_90 from a kernel's registers, warps and shared memory (registers in units of 8 per
    thread): the counts benchmarks/sass_count.py printed for the shipped kernels on 2026-12-02."""
    assert occupancy.resident_programs(128, 4, 38 * 1024) == 4  # bf16
    assert occupancy.resident_programs(168, 4, 40 * 1024) == 3  # fp8_e4m3
    assert occupancy.resident_programs(249, 4, 26 * 1024) == 2  # q4_0 (rounded up to 256)
    assert occupancy.resident_programs(255, 4, 57 * 1024) == 2  # mxfp8
    assert occupancy.resident_programs(72, 4, 100 * 1024) == 2  # shared memory, not registers
    assert occupancy.resident_programs(32, 1, 0) == 32  # at most 32 blocks
    assert occupancy.resident_programs(255, 16, 0) == 1  # never none


def test_split_makespan():
    """The waves model by hand: 33 splits of 512 steps (4 x 65536 at 128 positions a step) are 32 of 16 steps and an
    empty one, 1024 programs of 16 steps (+1) on 396 slots: three program-times; 37 splits (36 of 14 steps, the last
    of 8) fit the same three waves of shorter programs, the short ones last."""
    assert occupancy.split_makespan(32, 512, 33, 396) == 3 * 17
    assert occupancy.split_makespan(32, 512, 37, 396) == 3 * 15
    assert occupancy.split_makespan(32, 512, 1, 396) == 512 + 1
    # 17 splits on 264 slots: 512 programs of 31 steps, then 32 of 16; the 16 slots the second wave leaves free run
    # the short ones two after another, while the second wave ends at 64
    assert occupancy.split_makespan(32, 512, 17, 264) == 32 + 2 * 17
    assert occupancy.split_makespan(3, 0, 1, 10) == 2  # no positions: one step each, not a division by zero


def test_wave_splits():
    """Decode's split counts at the shapes the H200 timed (benchmarks/RESULTS.md, seventeenth session): raised where
    the rule's grid leaves a wave of a latency-bound kernel partly filled, kept elsewhere."""
    sms = 132
    ws = occupancy.wave_splits
    assert ws(32, 33, 512, 3 * sms, 128) == 37  # 4 x 65536, 3 per SM (fp8 197 -> 183 us, nvfp4 296 -> 290)
    assert ws(32, 33, 1024, 4 * sms, 128) == 33  # bf16: 1024 programs in 2 waves (37 splits took 304 us, 33 267)
    assert ws(32, 33, 512, 2 * sms, 128) == 33  # 2 per SM: 3.88 waves
    assert ws(32, 17, 512, 2 * sms, 128) == 17  # int4 per token-head: its tail is the short last splits
    assert ws(64, 9, 256, 2 * sms, 64) == 16  # int4 at 8 x 32768 (514 -> 428 us)
    assert ws(32, 33, 512, 3 * sms, 35) == 33  # 35 splits: 5.9% sooner in the model, under MIN_GAIN
    assert ws(512, 3, 64, 3 * sms, 16) == 3  # 64 x 8192
    assert ws(512, 3, 128, 4 * sms, 16) == 3
    assert ws(2048, 1, 8, 3 * sms, 2) == 1  # 256 x 1024 (5.17 waves; 2 splits took longer)
    assert ws(32, 8, 16, 4 * sms, 64) == 8  # 4 x 1024: fewer programs than slots (the model alone would take 16)
    assert occupancy.split_makespan(32, 16, 16, 4 * sms) < 0.9 * occupancy.split_makespan(32, 16, 8, 4 * sms)
    for programs in (8, 32, 100, 512):
        for splits in (1, 2, 3, 8, 33):
            for resident in (2 * sms, 3 * sms, 4 * sms):
                s = ws(programs, splits, 512, resident, 128)
                assert splits <= s <= max(splits, min(128, 2 * splits))
                if s > splits:  # only for a predicted gain of MIN_GAIN
                    new = occupancy.split_makespan(programs, 512, s, resident)
                    old = occupancy.split_makespan(programs, 512, splits, resident)
                    assert new <= (1 - occupancy.MIN_GAIN) * old


@pytest.mark.skipif(DEVICE != "cuda", reason="the compiled kernel's registers decide: a GPU run")
@pytest.mark.parametrize("name", ["fp8_e4m3", "bf16"])
def test_plan_fills_the_last_wave(name):
    """A decode plan's split count is the old rule's, raised by wave_splits for the programs per SM of the binary
    it launches; the output does not change beyond the fp32 sums' order (against the same plan with one split)."""
    fmt = kvgen.load(name)
    seqs, ctx, heads = 4, 32768, 8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(seqs * ctx // 16, 16, heads, 128, device="cuda")
    for t in cache.tensors.values():
        if t.dtype == torch.uint8:
            t.random_(0, 256)
            t.masked_fill_((t & 0x7F) == 0x7F, 0)  # fp8 codes of either sign, no NaN
        elif t.is_floating_point() and t.numel() > 64:
            t.normal_()
    table = torch.randperm(seqs * ctx // 16, dtype=torch.int32, device="cuda").reshape(seqs, -1)
    lens = torch.full((seqs,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(seqs + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(seqs, 4 * heads, 128, dtype=torch.bfloat16, device="cuda")
    plan = fmt.plan_attention(q, cache, table, lens, qsl, max_query_len=1)
    ks = fmt._kernels
    binary = ks.launch("paged_attention_kernel").compiled(
        plan._launch.grid, q, q, plan._launch.part, plan._launch.ml, stride_qt=q.stride(0), stride_qh=q.stride(1),
        stride_ot=q.stride(0), stride_oh=q.stride(1), **fmt._kernel_args(cache)[0], **plan._launch.kwargs)
    resident = occupancy.resident_programs(binary.n_regs, binary.metadata.num_warps, binary.metadata.shared)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dots = ks.dot_modes(torch.bfloat16, "auto", False, 128, None)
    pps = K.attention_tiles(ks.module.CODE_BITS, dots, ks.block_scaled, wide=wide(name))["programs_per_sm"]
    old = ks._splits(seqs * heads, ctx, seqs, 4 * heads, 128, q.device, pps)
    steps = -(-ctx // plan._launch.kwargs["BLOCK_N"])
    assert plan._launch.grid[2] == occupancy.wave_splits(seqs * heads, old, steps, resident * sms,
                                                         ks._most_splits(ctx, seqs, 4 * heads, 128))
    if sms == 132:  # the H200, with the tiles of 2026-12-04: fp8 at 2 programs per SM (the values' 16-bit staging
        # buffer of V_CONVERT_FIRST: 104 KiB of shared memory; its split target 4 per SM: 17 splits by the rule,
        # which the waves keep; 3 programs and 24 splits before), bf16 at 4 (target 8: 33)
        assert (resident, plan._launch.grid[2]) == {"fp8_e4m3": (2, 17), "bf16": (4, 33)}[name]
    one = fmt.attend(q, cache, table, lens, qsl, max_query_len=1, num_splits=1).float()
    # splits round each probability to the dot type (bf16 here: unit roundoff 2**-8) against their own running
    # maximum, and sum in another order: an output element moves by a few roundoffs of the typical output, far more
    # than a cancelled element's own size (H200 2026-12-04: fp8, 17 splits against 1, 0.0049 at an element of 0.11;
    # bf16, 33 against 1, 6.9e-5 where the largest output was 0.036, 2**-9 of it). A split combined wrongly moves
    # elements by the output's own size.
    torch.testing.assert_close(plan.run(q, cache).float(), one, rtol=2e-2, atol=2**-7 * one.abs().max().item())


def decode_and_prefill_plans(fmt):
    """The launch arguments of a decode (1 query token) and a prefill (16) plan on a small cache, and the cache and
    block table: one sequence of 40 tokens, 8 query heads over 2 KV heads, head size 128, on the suite's device."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(4, 16, 2, 128, device=DEVICE)
    table = torch.arange(4, dtype=torch.int32, device=DEVICE)[None]
    seen = {}
    for q_len in (1, 16):
        q = torch.randn(q_len, 8, 128).to(torch.bfloat16).to(DEVICE)
        plan = fmt.plan_attention(q, cache, table, torch.tensor([40], dtype=torch.int32, device=DEVICE),
                                  torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE), max_query_len=q_len)
        seen[q_len] = plan._launch.kwargs
    return seen[1], seen[16], cache, table


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_block_dots_in_decode_only(name, monkeypatch):
    """Decode plans of the two-term block formats take per-block dots on the codes (one term, so the one-term block
    classes' tiles); prefill plans keep the block ratios in two terms (and their class's tiles)."""
    fmt = kvgen.load(name)
    decode, prefill, cache, table = decode_and_prefill_plans(fmt)
    assert decode["BLOCK_DOTS"] and decode["K_TERMS"] == decode["V_TERMS"] == 1
    assert not prefill["BLOCK_DOTS"] and prefill["K_TERMS"] == prefill["V_TERMS"] == 2
    # decode of 32 query heads per KV head (32 rows per program) and exact fp32 dots keep the block ratios
    q = torch.randn(1, 64, 128).to(torch.bfloat16).to(DEVICE)
    meta = (table, torch.tensor([40], dtype=torch.int32, device=DEVICE),
            torch.tensor([0, 1], dtype=torch.int32, device=DEVICE))
    wide = fmt.plan_attention(q, cache, *meta, max_query_len=1)._launch.kwargs
    assert wide["BLOCK_M"] == 32 and not wide["BLOCK_DOTS"] and wide["K_TERMS"] == wide["V_TERMS"] == 2
    exact = fmt.plan_attention(q[:, :8], cache, *meta, max_query_len=1, dot_precision="ieee")._launch.kwargs
    assert not exact["BLOCK_DOTS"] and exact["DOT_K"] == exact["DOT_V"] == 0
    ks = fmt._kernels
    dots = {k: decode[k] for k in ("DOT_K", "DOT_V", "Q_TERMS", "K_TERMS", "P_TERMS", "V_TERMS", "BLOCK_DOTS")}
    monkeypatch.setattr(K, "interpreting", lambda: False)  # the tiles a GPU would take for these dots
    tiles = K.attention_tiles(ks.module.CODE_BITS, dots, ks.block_scaled, head_pad=128, pow2_blocks=ks.pow2_blocks)
    # one term: 128 positions and 2 stages (q4_0 lost 7-10% with 3 at head size 128), not q4_0's two-term class
    # (64/4/3); since the fifty-first session capped (q8_0 168 registers, q4_0 128 with the value dot in halves)
    assert tiles["BLOCK_N"] == 128 and tiles["num_stages"] == 2 and tiles["maxnreg"] == 168 - 40 * (name == "q4_0")
    # head size 64: the block dots' own rule (twenty-fifth session, run 5: 3 stages faster there), which prefill's
    # two-term class does not take
    tiles = K.attention_tiles(ks.module.CODE_BITS, dots, ks.block_scaled, head_pad=64, pow2_blocks=ks.pow2_blocks)
    assert tiles["num_stages"] == 3 and tiles["prefetch_blocks"], tiles
    prefill_dots = {k: prefill[k] for k in dots}
    tiles = K.attention_tiles(ks.module.CODE_BITS, prefill_dots, ks.block_scaled, prefill["BLOCK_M"], head_pad=64,
                              pow2_blocks=ks.pow2_blocks)
    assert "prefetch_blocks" not in tiles and "maxnreg" not in tiles, tiles


@pytest.mark.parametrize("name, pairs", [("mxfp8", True), ("mxfp4", False), ("q8_0", False)])
def test_ratio_pairs_in_decode_only(name, pairs):
    """mxfp8's e8m0 ratios (e4m3 codes) multiply the codes as two fp16 factors in decode and in one fp32 product in
    prefill (the H200 measured the pair 9% slower there); mxfp4's codes take one fp16 factor everywhere, and formats
    without e8m0 scales have no such choice."""
    decode, prefill, _, _ = decode_and_prefill_plans(kvgen.load(name))
    if pairs:
        assert decode["RATIO_PAIRS"] is True and prefill["RATIO_PAIRS"] is False
    else:
        assert "RATIO_PAIRS" not in decode and "RATIO_PAIRS" not in prefill


def test_kivi_flush_warps_follow_the_elements_a_program_holds(monkeypatch):
    """The flush takes 2 warps for groups of 32 tokens at head size 128 (the H200's fastest of 1 / 2 / 4 / 8 there:
    benchmarks/RESULTS.md, eighteenth session), twice that for twice the elements, and FLUSH_OPTIONS overrides it."""
    assert K.flush_options(32, 128) == {"num_warps": 2, "maxnreg": 168}
    assert K.flush_options(32, 256)["num_warps"] == 4
    assert K.flush_options(64, 256)["num_warps"] == 8
    assert K.flush_options(32, 32)["num_warps"] == 1
    assert K.flush_options(128, 512)["num_warps"] == 8  # capped
    monkeypatch.setattr(K, "FLUSH_OPTIONS", {"num_warps": 4, "maxnreg": 96})
    assert K.flush_options(32, 128) == {"num_warps": 4, "maxnreg": 96}


def test_tile_rule_memo_follows_a_replaced_table(monkeypatch):
    """tile_rule remembers each key's rule; a new ATTENTION_TILES (as experiments install) is read afresh, and the
    remembered answer is the first rule that admits the key."""
    key = K.attention_key({"k": 8, "v": 8}, dict(DOT_K=1, DOT_V=1, K_TERMS=1, V_TERMS=1, Q_TERMS=1, P_TERMS=1),
                          False, 1, 128, True, False, True, False)
    first = next((r, t) for r, t in K.ATTENTION_TILES if K.rule_matches(r, key))
    assert K.tile_rule(key) == first and K.tile_rule(key) == first
    mine = dict(BLOCK_N=32, num_warps=2, num_stages=1)
    monkeypatch.setattr(K, "ATTENTION_TILES", ((tuple([None] * len(key)), mine),))
    assert K.tile_rule(key)[1] is mine
    monkeypatch.undo()
    assert K.tile_rule(key) == first
