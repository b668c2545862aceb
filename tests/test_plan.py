"""`kvgen plan` / kvgen.planner: capacity figures checked against numbers worked out by hand.

Configs (tests/data/configs, the public Hugging Face config.json files):
  Llama-3.1-8B: 32 layers, 32 heads, 8 KV heads (GQA), hidden 4096 -> head size 128, bfloat16.
  gemma-3-12b-it: text_config: 48 layers, 16 heads, 8 KV heads, head size 256 (Gemma-3 default), sliding window 1024,
    every 6th layer full attention -> layers 5, 11, ..., 47 full (8), the other 40 sliding.
  Qwen2.5-7B-Instruct: 28 layers, 28 heads, 4 KV heads, 3584 / 28 = 128; use_sliding_window false -> none sliding.

Page bytes per layer (block 16): bf16 = 16 tokens * heads * head * 2 (K, V) * 2 B; fp8_e4m3 = half of that;
int4_per_token_head cell at head 256 = 128 B K codes + 4 B fp32 scale + 128 B V codes + 4 B = 264 B.
Budgets: 80 GiB = 85,899,345,920 B; 40 GiB = 42,949,672,960 B.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import kvgen
from kvgen.planner import (PlanError, capacity_curve, draw_capacity_png, kv_heads_per_rank, make_plan, parse_size,
                           read_config)
from kvgen.plan_cli import plan as plan_cmd

CONFIGS = Path(__file__).resolve().parent / "data" / "configs"
LLAMA = CONFIGS / "llama-3.1-8b.json"
GEMMA = CONFIGS / "gemma-3-12b-it.json"
QWEN = CONFIGS / "qwen2.5-7b-instruct.json"
GIB80 = 80 * 2**30
GIB40 = 40 * 2**30


def run(*args):
    r = CliRunner().invoke(plan_cmd, [str(a) for a in args], env={"COLUMNS": "220"})
    assert "Traceback" not in r.output, r.output
    return r


def run_json(*args):
    r = run(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


# ------------------------------------------------------------------------------------------------- configs

def test_read_real_configs():
    s = read_config(LLAMA)
    assert (s.num_layers, s.num_attention_heads, s.num_kv_heads, s.head_size) == (32, 32, 8, 128)
    assert s.sliding_layers == () and s.dtype == "bf16" and s.attention == "GQA" and s.name == "llama-3.1-8b"

    g = read_config(GEMMA)  # text_config of a multimodal config
    assert (g.num_layers, g.num_attention_heads, g.num_kv_heads, g.head_size) == (48, 16, 8, 256)
    assert len(g.sliding_layers) == 40 and g.sliding_window == 1024
    assert [i for i in range(48) if i not in g.sliding_layers] == [5, 11, 17, 23, 29, 35, 41, 47]

    q = read_config(QWEN)
    assert (q.num_layers, q.num_attention_heads, q.num_kv_heads, q.head_size) == (28, 28, 4, 128)
    assert q.sliding_layers == ()  # sliding_window 131072 but use_sliding_window false


def test_config_variants_mqa_mha_mistral_layer_types():
    mqa = read_config({"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 1,
                       "hidden_size": 512}, name="mqa")
    assert (mqa.num_kv_heads, mqa.head_size, mqa.attention) == (1, 64, "MQA")
    mha = read_config({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256, "torch_dtype": "float16"})
    assert (mha.num_kv_heads, mha.attention, mha.dtype) == (4, "MHA", "fp16")
    mistral = read_config({"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
                           "head_dim": 64, "sliding_window": 4096})
    assert mistral.sliding_layers == (0, 1, 2) and mistral.sliding_window == 4096
    typed = read_config({"num_hidden_layers": 3, "num_attention_heads": 4, "head_dim": 64, "sliding_window": 512,
                         "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]})
    assert typed.sliding_layers == (0, 1)


@pytest.mark.parametrize("cfg,field", [
    ({"num_attention_heads": 8, "hidden_size": 512}, "num_hidden_layers"),
    ({"num_hidden_layers": 2, "hidden_size": 512}, "num_attention_heads"),
    ({"num_hidden_layers": 2, "num_attention_heads": 8}, "head_dim"),
])
def test_config_missing_field_is_named(cfg, field):
    with pytest.raises(PlanError, match=field):
        read_config(cfg)


# ------------------------------------------------------------------------------------------------- sizes

@pytest.mark.parametrize("text,expected", [
    ("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("141GB", 141 * 10**9), ("8e10", 8 * 10**10),
    ("512MiB", 512 * 2**20), ("1.5 TiB", 3 * 2**39), ("80gib", 80 * 2**30), ("1024", 1024),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("junk", ["eighty", "80GX", "", "-5GiB", "0GB", "80 G B"])
def test_parse_size_junk_names_option(junk):
    with pytest.raises(PlanError, match="--gpu-memory"):
        parse_size(junk)


# ------------------------------------------------------------------------------------------------- figures

def test_llama_fp8_by_hand():
    # page = 16 tokens * 8 heads * 128 * 2 (K, V) * 1 B = 32,768 B per layer; block over 32 layers = 1,048,576 B
    # blocks = 80 * 2^30 / 2^20 = 81,920; tokens = 81,920 * 16 = 1,310,720; bytes/token = 2^20 / 16 = 65,536
    # at 32,768 context: 2,048 blocks per sequence -> 81,920 / 2,048 = 40 sequences
    # bf16: 65,536 B pages -> 40,960 blocks, 655,360 tokens -> gain 2.0
    p = make_plan(read_config(LLAMA), "fp8_e4m3", GIB80, block_size=16, tp=1, context=32768)
    assert p.page_bytes == 32_768 and p.bytes_per_block == 1_048_576 and p.bytes_per_token == 65_536
    assert p.num_blocks == 81_920 and p.max_tokens == 1_310_720
    assert p.blocks_per_seq == 2048 and p.max_seqs == 40
    assert p.bf16_max_tokens == 655_360 and p.gain_vs_bf16 == 2.0
    assert p.padding_bytes_per_block == 0 and p.residual_bytes_per_seq == 0

    b = make_plan(read_config(LLAMA), "bf16", GIB80)
    assert (b.page_bytes, b.num_blocks, b.max_tokens, b.max_seqs, b.gain_vs_bf16) == (65_536, 40_960, 655_360, 20, 1.0)


def test_llama_tensor_parallel_by_hand():
    shape = read_config(LLAMA)
    # tp 2: 8 / 2 = 4 KV heads per rank; page 16 * 4 * 256 = 16,384; block 524,288 B; blocks 80 GiB / 2^19 = 163,840;
    # tokens 2,621,440; 163,840 / 2,048 = 80 sequences (the budget is per GPU)
    p = make_plan(shape, "fp8_e4m3", GIB80, tp=2)
    assert (p.kv_heads_per_rank, p.page_bytes, p.num_blocks, p.max_tokens, p.max_seqs) == (4, 16_384, 163_840,
                                                                                         2_621_440, 80)
    # tp 16 >= 8 KV heads: 1 replicated head per rank; page 4,096; block 131,072 B; blocks 655,360; tokens
    # 10,485,760; 655,360 / 2,048 = 320 sequences; bf16 is still half -> gain 2.0
    p = make_plan(shape, "fp8_e4m3", GIB80, tp=16)
    assert (p.kv_heads_per_rank, p.page_bytes, p.num_blocks, p.max_tokens, p.max_seqs) == (1, 4_096, 655_360,
                                                                                         10_485_760, 320)
    assert p.gain_vs_bf16 == 2.0
    assert kv_heads_per_rank(shape, 8) == 1 and kv_heads_per_rank(shape, 4) == 2
    # Qwen2.5-7B: 4 KV heads; tp 4 -> 1 head; tp 8 -> 28 attention heads do not split (vLLM refuses)
    assert kv_heads_per_rank(read_config(QWEN), 4) == 1
    with pytest.raises(PlanError, match="--tp"):
        kv_heads_per_rank(read_config(QWEN), 8)


@pytest.mark.parametrize("tp", [3, 12])  # 32 heads % 3; 32 % 12 (and 12 is not a multiple of 8 KV heads)
def test_tp_that_does_not_divide(tp):
    with pytest.raises(PlanError, match="--tp"):
        make_plan(read_config(LLAMA), "fp8_e4m3", GIB80, tp=tp)


def test_mqa_tp_replicates_the_single_head():
    mqa = read_config({"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 1,
                       "hidden_size": 512}, name="mqa")
    # 1 head of 64 at bf16, block 16: 16 * 64 * 2 * 2 = 4,096 B; 4 layers -> 16,384 B a block, with tp 1 or 4
    for tp in (1, 4):
        p = make_plan(mqa, "bf16", 2**30, tp=tp, context=1024)
        assert (p.kv_heads_per_rank, p.page_bytes, p.bytes_per_block) == (1, 4_096, 16_384)
        assert p.num_blocks == 2**30 // 16_384 == 65_536 and p.max_seqs == 65_536 // 64 == 1024


def test_gemma_int4_and_skip_sliding_layers_padding_by_hand():
    shape = read_config(GEMMA)
    # int4_per_token_head on all 48 layers: page 16 * 8 * 264 = 33,792 B; block 48 * 33,792 = 1,622,016 B;
    # blocks = 42,949,672,960 // 1,622,016 = 26,479 (26,479.2); tokens 423,664
    # bf16: page 16 * 8 * 256 * 4 = 131,072; block 6,291,456; blocks 6,826 (6,826.7); tokens 109,216
    # gain 26,479 / 6,826 = 3.8792...
    p = make_plan(shape, "int4_per_token_head", GIB40)
    assert (p.page_bytes, p.bytes_per_block, p.num_blocks, p.max_tokens) == (33_792, 1_622_016, 26_479, 423_664)
    assert p.bf16_max_tokens == 109_216 and p.gain_vs_bf16 == pytest.approx(26_479 / 6_826)
    # keep the 40 sliding layers in bf16: the 8 int4 layers are padded to the 131,072 B bf16 page, so a block is
    # 48 * 131,072 = 6,291,456 B as in bf16 -> the same 6,826 blocks: gain 1.0, reported as such; the waste is
    # 8 * (131,072 - 33,792) = 778,240 B per block (12.4 %). At 8,192 context: 512 blocks a sequence -> 13.
    s = make_plan(shape, "int4_per_token_head", GIB40, context=8192, skip_layers=["sliding_window"])
    assert len(s.skip_layers) == 40
    kinds = {k["format"]: (k["num_layers"], k["page_bytes"]) for k in s.layer_kinds}
    assert kinds == {"int4_per_token_head": (8, 33_792), "bf16": (40, 131_072)}
    assert s.page_bytes == 131_072 and s.bytes_per_block == 6_291_456
    assert s.padding_bytes_per_block == 778_240 and s.padding_fraction == pytest.approx(778_240 / 6_291_456)
    assert (s.num_blocks, s.max_tokens, s.max_seqs, s.gain_vs_bf16) == (6_826, 109_216, 13, 1.0)
    assert any("no gain" in n for n in s.notes)


def test_llama_skip_two_layers_padding():
    # layers 0 and 1 in bf16 (65,536 B), 30 in fp8 (32,768 B) padded to 65,536: waste 30 * 32,768 = 983,040 B of
    # each 2,097,152 B block (46.9 %); capacity equals bf16's: 40,960 blocks, gain 1.0
    p = make_plan(read_config(LLAMA), "fp8_e4m3", GIB80, skip_layers=["0", "1"])
    assert p.skip_layers == [0, 1] and p.padding_bytes_per_block == 983_040 and p.bytes_per_block == 2_097_152
    assert p.num_blocks == 40_960 and p.gain_vs_bf16 == 1.0


def test_fp16_model_skips_to_fp16():
    shape = read_config({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                         "torch_dtype": "float16"})
    p = make_plan(shape, "fp8_e4m3", 2**30, skip_layers=["1"])
    assert [k["format"] for k in p.layer_kinds] == ["fp8_e4m3", "fp16"]


def test_kivi_residual_by_hand():
    # kivi_2bit, block 32 (its group), Llama: 96 B per token and head (K: 32 B codes + 16 B fp16 scale/min per
    # channel over 32 tokens; V: 32 B codes + 16 B) -> page 32 * 8 * 96 = 24,576 B; block 32 * 24,576 = 786,432 B;
    # blocks = 85,899,345,920 // 786,432 = 109,226 (109,226.7); tokens 3,495,232.
    # bf16 at block 32: page 131,072, block 4,194,304 B, 20,480 blocks, 655,360 tokens -> gain 5.3333
    # residual: 160-token bf16 ring * 8 heads * 128 * 2 (K, V) * 2 B = 655,360 B a layer; * 32 layers = 20,971,520 B
    # at 32,768 context: 1,024 blocks = 805,306,368 B + 20,971,520 = 826,277,888 B a sequence -> 103 (103.96);
    # without the residual it would be 109,226 // 1,024 = 106. The blocks beside 103 windows: (85,899,345,920 -
    # 103 * 20,971,520 = 83,739,279,360) // 786,432 = 106,480 (106,480.0; 103 * 1,024 = 105,472 of them in use at
    # 32,768 tokens each), tokens 3,407,360, gain 3,407,360 / 655,360 = 5.199
    p = make_plan(read_config(LLAMA), "kivi_2bit", GIB80, block_size=32)
    assert (p.page_bytes, p.bytes_per_block, p.num_blocks, p.max_tokens) == (24_576, 786_432, 106_480, 3_407_360)
    assert p.bf16_max_tokens == 655_360 and p.gain_vs_bf16 == pytest.approx(3_407_360 / 655_360)
    assert p.residual_bytes_per_seq == 20_971_520 and p.blocks_per_seq == 1024 and p.max_seqs == 103
    # skipped layers keep no residual: layers 0, 1 in bf16 -> 30 * 655,360 B
    s = make_plan(read_config(LLAMA), "kivi_2bit", GIB80, block_size=32, skip_layers=[0, 1])
    assert s.residual_bytes_per_seq == 30 * 655_360


def test_kivi_needs_block_multiple_of_group():
    with pytest.raises(PlanError, match="--block-size"):
        make_plan(read_config(LLAMA), "kivi_2bit", GIB80, block_size=16)


@pytest.mark.parametrize("skip,match", [(["48"], "out of range"), (["sliding_window"], "no sliding-window"),
                                        (["full"], "neither")])
def test_skip_layer_errors(skip, match):
    shape = read_config(LLAMA if skip == ["sliding_window"] else GEMMA)
    with pytest.raises(PlanError, match=match):
        make_plan(shape, "fp8_e4m3", GIB80, skip_layers=skip)


def test_capacity_curve_matches_plan():
    p = make_plan(read_config(LLAMA), "fp8_e4m3", GIB80)
    assert capacity_curve(p, [16_384, 32_768, 131_072]) == [80, 40, 10]


# ------------------------------------------------------------------------------------------------- CLI

def test_cli_json_llama_fp8_and_bf16():
    d = run_json("--config", LLAMA, "--format", "fp8_e4m3", "--format", "bf16", "--gpu-memory", "80GiB")
    assert d["model"]["num_kv_heads"] == 8 and d["model"]["head_size"] == 128 and d["budget_bytes"] == GIB80
    fp8, bf16 = d["plans"]
    assert (fp8["format"], fp8["page_bytes"], fp8["bytes_per_token"], fp8["num_blocks"], fp8["max_tokens"],
            fp8["max_seqs"], fp8["gain_vs_bf16"]) == ("fp8_e4m3", 32_768, 65_536, 81_920, 1_310_720, 40, 2.0)
    assert (bf16["max_tokens"], bf16["max_seqs"], bf16["gain_vs_bf16"]) == (655_360, 20, 1.0)


def test_cli_json_tp_and_skip_layers_nargs():
    d = run_json("--config", LLAMA, "--format", "fp8_e4m3", "--gpu-memory", "80GiB", "--tp", "16")
    assert d["plans"][0]["kv_heads_per_rank"] == 1 and d["plans"][0]["max_tokens"] == 10_485_760
    # `--skip-layers sliding_window 5 11`: the words after the option are layers too
    d = run_json("--config", GEMMA, "--format", "int4_per_token_head", "--gpu-memory", "40GiB",
                 "--skip-layers", "sliding_window", "5", "11", "--context", "8192")
    p = d["plans"][0]
    assert len(p["skip_layers"]) == 42 and p["num_blocks"] == 6_826 and p["max_seqs"] == 13
    assert p["gain_vs_bf16"] == 1.0 and p["padding_bytes_per_block"] == 6 * (131_072 - 33_792)


def test_cli_table():
    r = run("--config", GEMMA, "--format", "int4_per_token_head", "--gpu-memory", "40GiB",
            "--skip-layers", "sliding_window")
    assert r.exit_code == 0, r.output
    for text in ("gemma-3-12b-it", "8x int4_per_token_head 33,792", "40x bf16 131,072", "778,240 B/block",
                 "6,826", "109,216", "1.00x", "no gain"):
        assert text in r.output, (text, r.output)


def test_cli_png(tmp_path):
    out = tmp_path / "capacity.png"
    r = run("--config", QWEN, "--format", "fp8_e4m3", "--format", "nvfp4", "--format", "kivi_2bit",
            "--block-size", "32", "--gpu-memory", "141GB", "--tp", "2", "--png", out)
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 1000


@pytest.mark.parametrize("args,needle", [
    (["--format", "nvfp4", "--gpu-memory", "eighty"], "--gpu-memory"),
    (["--format", "kivi_2bit", "--gpu-memory", "80GiB"], "--block-size"),
    (["--format", "fp8_e4m3", "--gpu-memory", "80GiB", "--tp", "3"], "--tp"),
    (["--format", "fp8_e4m3", "--gpu-memory", "80GiB", "--skip-layers", "99"], "--skip-layers"),
    (["--format", "no_such_format", "--gpu-memory", "80GiB"], "no_such_format"),
    (["--format", "fp8_e4m3", "--gpu-memory", "80GiB", "7"], "unexpected argument"),
])
def test_cli_errors_are_one_line(args, needle):
    # each an option's value the command cannot take: a usage error, exit 2 (README, "Exit codes")
    r = run("--config", LLAMA, *args)
    assert r.exit_code == 2, r.output
    assert needle in r.output and r.output.count("\n") <= 2, r.output


def test_cli_missing_config_field(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_attention_heads": 8, "hidden_size": 512}))
    r = run("--config", cfg, "--format", "fp8_e4m3", "--gpu-memory", "1GiB")
    assert r.exit_code == 1 and "num_hidden_layers" in r.output, r.output


def test_cli_bad_spec_as_format_is_exit_1(tmp_path):
    # a bad spec file exits 1 like every command's, not as a usage error
    spec = tmp_path / "bad.yaml"
    spec.write_text("kvgen_spec: 1\nname: bad\nkey:\n  element: int9\nvalue:\n  element: bf16\n")
    r = run("--config", LLAMA, "--format", str(spec), "--gpu-memory", "1GiB")
    assert r.exit_code == 1 and f"{spec}:4" in r.output, r.output


def test_help_has_example():
    r = run("--help")
    assert r.exit_code == 0 and "Example:" in r.output and "--skip-layers" in r.output


@pytest.mark.parametrize("kwargs,option", [
    (dict(budget=-5), "--gpu-memory"), (dict(budget=None), "--gpu-memory"), (dict(budget=float("inf")), "--gpu-memory"),
    (dict(budget=float("nan")), "--gpu-memory"), (dict(budget=GIB80, block_size="16"), "--block-size"),
    (dict(budget=GIB80, context=0), "--context"), (dict(budget=GIB80, tp=1.0), "--tp"),
])
def test_make_plan_from_python_names_a_bad_budget_or_option(kwargs, option):
    """From Python, numbers skipped parse_size: a negative budget planned -1 blocks, None / a string block size
    raised TypeError. Each is now the CLI option's error."""
    with pytest.raises(PlanError, match=f"^{option}: "):
        make_plan(read_config(LLAMA), "fp8_e4m3", **kwargs)


def test_make_plan_takes_numpy_and_float_budgets_as_whole_bytes():
    want = make_plan(read_config(LLAMA), "fp8_e4m3", GIB80, block_size=16)
    got = make_plan(read_config(LLAMA), "fp8_e4m3", np.int64(GIB80), block_size=np.int64(16))
    assert got == want
    as_float = make_plan(read_config(LLAMA), "fp8_e4m3", float(GIB80))
    assert type(as_float.num_blocks) is int and as_float.num_blocks == want.num_blocks


def test_gemma3_4b_takes_the_text_config_defaults_it_leaves_out():
    """google/gemma-3-4b-it's text_config gives no head counts: transformers' Gemma3TextConfig has 8 attention
    heads, 4 KV heads and head size 256 (the plan refused it, and with num_attention_heads given took 8 KV heads)."""
    cfg = {"model_type": "gemma3", "torch_dtype": "bfloat16",
           "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                           "num_hidden_layers": 34, "sliding_window": 1024, "rope_scaling": {"factor": 8.0}}}
    shape = read_config(cfg, name="gemma-3-4b-it")
    assert (shape.num_attention_heads, shape.num_kv_heads, shape.head_size) == (8, 4, 256)
    assert shape.sliding_layers == tuple(i for i in range(34) if (i + 1) % 6)  # 5 local : 1 global
    explicit = dict(cfg, text_config=dict(cfg["text_config"], num_attention_heads=16, num_key_value_heads=8))
    assert read_config(explicit).num_kv_heads == 8


@pytest.mark.parametrize("field,value", [("max_window_layers", "2"), ("max_window_layers", -2),
                                         ("sliding_window_pattern", "6")])
def test_odd_sliding_window_fields_are_named(field, value):
    """A string or negative layer count raised TypeError or planned negative layer indices."""
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512,
           "sliding_window": 4096, "use_sliding_window": True, field: value}
    if field == "sliding_window_pattern":
        cfg["model_type"] = "gemma3_text"
    with pytest.raises(PlanError, match=f"field '{field}'"):
        read_config(cfg)


def test_a_size_beyond_floats_is_named():
    for text in ("1e400", "1e400GiB"):
        with pytest.raises(PlanError, match="^--gpu-memory: .* is not a positive size"):
            parse_size(text)
