"""kvgen eval (kvgen.evaluate, kvgen.eval_cli): metrics on a tiny case, the CLI's JSON, PNG and errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kvgen import evaluate as E
from kvgen.eval_cli import eval_cmd

SPECS = Path(E.__file__).resolve().parent / "specs"
CTX = 256


@pytest.fixture(scope="module")
def rows():
    r = E.evaluate(["bf16", "fp8_e4m3", "int8_per_token_head", "int4_per_token_head", "kivi_4bit"], [CTX], 1)
    return {x["format"]: x for x in r}


def test_synthetic_data_shapes_and_peaked_attention():
    q, k, v = E.synthetic_kv(CTX, 0)
    assert q.shape == (32, 4, 128) and k.shape == v.shape == (CTX, 8, 128) and k.dtype == np.float32
    # outlier channels: the largest channel RMS of a head is well above the median channel RMS
    rms = np.sqrt((k.astype(np.float64) ** 2).mean(axis=0))  # [H, D]
    assert np.all(rms.max(axis=1) > 5 * np.median(rms, axis=1))
    # peaked attention: the top-8 positions hold much more than 8 / CTX of the weight
    logits = q[0] @ k[:, 0, :].astype(np.float64).T / np.sqrt(128)
    w = np.exp(logits - logits.max(1, keepdims=True))
    w /= w.sum(1, keepdims=True)
    assert np.sort(w, axis=1)[:, -8:].sum(1).mean() > 0.3


def test_rope_preserves_pair_norms():
    x = np.random.default_rng(1).standard_normal((5, 2, 8)).astype(np.float32)
    y = E.rope(x, np.arange(5))
    np.testing.assert_allclose(np.hypot(y[..., 0::2], y[..., 1::2]), np.hypot(x[..., 0::2], x[..., 1::2]),
                               rtol=1e-5)
    np.testing.assert_allclose(y[0], x[0], rtol=1e-6)  # position 0: no rotation


def test_unquantized_reference_matches_itself():
    q, k, v = E.synthetic_kv(64, 3)
    out, top = E.attention(q, k, v)
    m = E.attention_metrics(out, top, out, top)
    assert m == {"attn_rel_l2": 0.0, "cosine": pytest.approx(1.0), "topk": 1.0}


def test_metric_ordering(rows):
    bf16, fp8, int8, int4 = (rows[n] for n in ("bf16", "fp8_e4m3", "int8_per_token_head", "int4_per_token_head"))
    # bf16: K and V error ~ bf16 rounding (relative half-ulp 2^-9, RMS ~ 2^-9 / sqrt(3))
    assert 5e-4 < bf16["key_rel"] < 2.5e-3 and 5e-4 < bf16["value_rel"] < 2.5e-3
    assert bf16["attn_rel_l2"] < 0.02 and bf16["cosine"] > 0.9999 and bf16["topk"] >= 0.97
    assert fp8["attn_rel_l2"] > bf16["attn_rel_l2"] and fp8["key_rel"] > bf16["key_rel"]
    assert int4["attn_rel_l2"] > int8["attn_rel_l2"] and int4["value_rel"] > int8["value_rel"]
    assert int4["topk"] <= int8["topk"] <= 1.0
    for r in rows.values():
        assert 0.0 <= r["topk"] <= 1.0 and -1.0 <= r["cosine"] <= 1.0 + 1e-12
        assert len(r["per_seed"]["attn_rel_l2"]) == 1


def test_bytes_and_kivi(rows):
    assert rows["bf16"]["bytes_per_token_head"] == 512
    assert rows["int4_per_token_head"]["bytes_per_token_head"] == 136
    kivi = rows["kivi_4bit"]
    # at 256 tokens with R = 128, G = 32: Q(256) = 128 positions quantized, the rest in bf16
    assert kivi["quantized_fraction"] == pytest.approx(0.5)
    assert kivi["key_rel"] > rows["bf16"]["key_rel"]


def test_static_scale_is_calibrated():
    spec = E.resolve_format("fp8_e4m3").spec
    x = np.full((4, 2, 16), 3.0, np.float32)
    assert E.calibrated_scale(spec, "key", x) == pytest.approx(3.0 / 448.0)
    assert E.calibrated_scale(E.resolve_format("int8_per_token_head").spec, "key", x) is None


def test_cli_json_and_png(tmp_path):
    png = tmp_path / "acc.png"
    res = CliRunner().invoke(eval_cmd, ["bf16", "int8_per_token_head", "--context", "128", "--seeds", "1",
                                        "--json", "--png", str(png)])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [r["format"] for r in data["results"]] == ["int8_per_token_head", "bf16"]  # sorted by bytes
    assert data["contexts"] == [128] and data["seeds"] == 1
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_table_and_spec_path(tmp_path):
    text = (SPECS / "int4_per_token_head.yaml").read_text()
    text = re.sub(r"^name: int4_per_token_head$", "name: int4_norot", text, flags=re.M)
    text = re.sub(r"  rotation:\n    kind: hadamard\n    seed: 0\n", "", text)
    spec = tmp_path / "int4_norot.yaml"
    spec.write_text(text)
    res = CliRunner().invoke(eval_cmd, [str(spec), "--context", "64", "--seeds", "1"])
    assert res.exit_code == 0, res.output
    assert E.resolve_format(str(spec)).spec.key.rotation is None
    assert "int4_norot" in res.stdout and "136" in res.stdout


def test_cli_kivi_footnote_names_each_specs_own_window(tmp_path):
    """The table's KIVI footnote reads the window from the spec: G = 16, R = 32 in fp32 keeps the newest 32..47."""
    text = (SPECS / "kivi_4bit.yaml").read_text().replace("name: kivi_4bit", "name: kivi_small_window")
    text = text.replace("group_tokens: 32", "group_tokens: 16").replace("block: 32", "block: 16")
    text = text.replace("residual: {tokens: 128, dtype: bf16}", "residual: {tokens: 32, dtype: fp32}")
    spec = tmp_path / "kivi_small_window.yaml"
    spec.write_text(text)
    res = CliRunner().invoke(eval_cmd, [str(spec), "kivi_2bit", "--context", "64", "--seeds", "1"])
    assert res.exit_code == 0, res.output
    out = " ".join(res.stdout.split())
    assert "kivi_small_window: the newest 32..47 tokens stay in fp32" in out
    assert "kivi_2bit: the newest 128..159 tokens stay in bf16" in out


def test_cli_unknown_format_is_one_line():
    res = CliRunner().invoke(eval_cmd, ["no_such_format", "--seeds", "1"])
    assert res.exit_code == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "no_such_format" in lines[0] and "error" in lines[0]


@pytest.mark.parametrize("name", ["int8_per_token_head", "nvfp4", "fp8_e4m3_per_head", "kivi_2bit"])
def test_kernel_backend_matches_reference_attention(name):
    # the kernels' attention output (interpreted here) against float64 attention on the reference decoding of the
    # same cache: same metrics up to fp32 rounding, and the outputs themselves within the fp32 tolerance
    q, k, v = E.synthetic_kv(288, seed=3)
    from kvgen.evaluate_kernels import kernel_attention

    out = kernel_attention(name, q, k, v)
    kq, vq = E.quantize_kv(E.resolve_format(name).spec, k, v)
    ref, _ = E.attention(q, kq, vq)
    vmax = float(np.abs(vq).max())
    assert np.all(np.abs(out - ref) <= 5e-5 * vmax + 5e-5 * np.abs(ref)), float(np.abs(out - ref).max())
    exact, _ = E.attention(q, k, v)
    assert E.rel_err(out, exact) > 1e-4  # the quantization error is there: the kernels did not attend to fp32 K/V


def test_backend_choice():
    assert E.resolve_backend("reference") == "reference"
    assert E.resolve_backend("auto") in ("kernels", "reference")
    with pytest.raises(E.EvalError, match="backend"):
        E.resolve_backend("gpu")
    rows = E.evaluate(["int8_per_token_head"], contexts=[160], seeds=1, backend="kernels")
    ref_rows = E.evaluate(["int8_per_token_head"], contexts=[160], seeds=1, backend="reference")
    assert rows[0]["backend"] == "kernels" and ref_rows[0]["backend"] == "reference"
    assert rows[0]["attn_rel_l2"] == pytest.approx(ref_rows[0]["attn_rel_l2"], rel=1e-3)


def test_quantized_dot_precision_costs_accuracy_on_int8_only():
    """--dot-precision quantized: the int8 format's attention error grows (query and probabilities in int8: about
    +10..20% in docs/accuracy.md's measurement), a format without int8 codes runs its default unchanged."""
    kw = dict(contexts=[160], seeds=1, backend="kernels")
    exact = {r["format"]: r for r in E.evaluate(["int8_per_token_head", "fp8_e4m3"], **kw)}
    quant = {r["format"]: r for r in E.evaluate(["int8_per_token_head", "fp8_e4m3"], dot_precision="quantized", **kw)}
    ratio = quant["int8_per_token_head"]["attn_rel_l2"] / exact["int8_per_token_head"]["attn_rel_l2"]
    assert 1.01 < ratio < 1.5, ratio
    assert quant["fp8_e4m3"]["attn_rel_l2"] == exact["fp8_e4m3"]["attn_rel_l2"]
    assert quant["int8_per_token_head"]["dot_precision"] == "quantized" and quant["fp8_e4m3"]["dot_precision"] == "auto"
    assert exact["int8_per_token_head"]["dot_precision"] == "auto"


def test_cli_json_records_dot_precision():
    res = CliRunner().invoke(eval_cmd, ["fp8_e4m3", "--context", "64", "--seeds", "1", "--backend", "kernels",
                                        "--dot-precision", "quantized", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["dot_precision"] == "quantized" and data["results"][0]["dot_precision"] == "auto"
    table = CliRunner().invoke(eval_cmd, ["fp8_e4m3", "--context", "64", "--seeds", "1", "--backend", "kernels",
                                          "--dot-precision", "quantized"])
    assert "fp8_e4m3 has no int8 codes and ran auto" in table.stdout


def test_dot_precision_needs_the_kernel_backend():
    with pytest.raises(E.EvalError, match="dot_precision: 'quantized' applies to the kernels backend"):
        E.evaluate(["int8_per_token_head"], contexts=[160], seeds=1, backend="reference", dot_precision="quantized")
    res = CliRunner().invoke(eval_cmd, ["int8_per_token_head", "--seeds", "1", "--backend", "reference",
                                        "--dot-precision", "quantized"])
    assert res.exit_code == 2 and "--backend kernels" in res.stderr  # an option's value eval cannot take
    assert res.stderr.strip().startswith("error: --dot-precision: 'quantized'"), res.stderr  # the option


def test_dequantize_first_costs_a_16_bit_rounding():
    """--dequantize-first: the same format and bf16 queries, the cache rounded once to bf16 before attention: the
    attention error moves by at most a few percent (bf16's 2**-9 relative rounding is far below int8's own error)
    but does move (the rounding is real), and the rows record what ran."""
    kw = dict(contexts=[160], seeds=1, backend="kernels", query_dtype="bf16")
    plain = E.evaluate(["int8_per_token_head"], **kw)[0]
    first = E.evaluate(["int8_per_token_head"], dequantize_first=True, **kw)[0]
    ratio = first["attn_rel_l2"] / plain["attn_rel_l2"]
    assert ratio != 1.0 and 0.95 < ratio < 1.1, ratio
    assert first["dequantize_first"] and first["query_dtype"] == "bf16" and not plain["dequantize_first"]


def test_dequantize_first_needs_the_kernel_backend_and_16_bit_queries():
    with pytest.raises(E.EvalError, match="apply to the kernels backend"):
        E.evaluate(["int8_per_token_head"], contexts=[160], seeds=1, backend="reference", dequantize_first=True)
    with pytest.raises(E.EvalError, match="dequantize_first: True takes the query's type"):
        E.evaluate(["int8_per_token_head"], contexts=[160], seeds=1, backend="kernels", dequantize_first=True)
    with pytest.raises(E.EvalError, match="dequantize_first: runs on dequantized values"):
        E.evaluate(["int8_per_token_head"], contexts=[160], seeds=1, backend="kernels", dequantize_first=True,
                   query_dtype="bf16", dot_precision="quantized")
    res = CliRunner().invoke(eval_cmd, ["int8_per_token_head", "--seeds", "1", "--backend", "kernels",
                                        "--dequantize-first", "--query-dtype", "fp32"])
    assert res.exit_code == 2 and "--query-dtype bf16" in res.stderr and "--dense-dtype" in res.stderr
    with pytest.raises(E.EvalError, match="expected False, True, 'bf16' or 'fp16', got 1"):
        E.evaluate(["int8_per_token_head"], contexts=[160], seeds=1, backend="kernels", dequantize_first=1)
    res = CliRunner().invoke(eval_cmd, ["int8_per_token_head", "--context", "64", "--seeds", "1", "--backend",
                                        "kernels", "--dequantize-first", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["dequantize_first"] and data["query_dtype"] == "bf16" and data["results"][0]["dequantize_first"]
    res = CliRunner().invoke(eval_cmd, ["int8_per_token_head", "--context", "64", "--seeds", "1", "--backend",
                                        "kernels", "--dense-dtype", "fp16"])
    assert res.exit_code != 0 and "--dense-dtype goes with --dequantize-first" in res.output


def test_an_fp16_dense_cache_keeps_int8_values():
    """--dense-dtype fp16 with bf16 queries: the int8 format's dequantized values keep 11 bits, so its attention
    error moves less than with the bf16 dense cache (docs/accuracy.md)."""
    kw = dict(contexts=[160], seeds=1, backend="kernels", query_dtype="bf16")
    plain = E.evaluate(["int8_per_token_head"], **kw)[0]["attn_rel_l2"]
    bf16 = E.evaluate(["int8_per_token_head"], dequantize_first=True, **kw)[0]["attn_rel_l2"]
    fp16 = E.evaluate(["int8_per_token_head"], dequantize_first="fp16", **kw)[0]["attn_rel_l2"]
    assert abs(fp16 - plain) < abs(bf16 - plain), (plain, bf16, fp16)


def test_global_scale_is_calibrated_within_the_range_allocate_takes():
    """nvfp4: absmax / (6 * 448), clamped to [2**-32, 2**32] (Format.allocate refuses others)."""
    spec = E.resolve_format("nvfp4").spec
    x = np.full((4, 2, 16), 3.0, np.float32)
    assert E.calibrated_scale(spec, "key", x) == pytest.approx(3.0 / (6 * 448))
    assert E.calibrated_scale(spec, "key", x * 1e-9) == 2.0 ** -32
    assert E.calibrated_scale(spec, "key", x * 1e15) == 2.0 ** 32


def test_cli_png_is_png_whatever_its_name_and_checked_before_the_work(tmp_path):
    """--png ev.pdf wrote a PDF and --png x.xyz failed in matplotlib after the whole evaluation, losing its table;
    a missing directory is refused before any work."""
    out = tmp_path / "ev.pdf"
    res = CliRunner().invoke(eval_cmd, ["bf16", "--context", "64", "--seeds", "1", "--png", str(out)])
    assert res.exit_code == 0, res.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "Attention accuracy" in res.stdout
    from kvgen.cli import main as cli_main

    res = CliRunner().invoke(cli_main, ["eval", "bf16", "--context", "64", "--seeds", "1",
                                        "--png", str(tmp_path / "nowhere" / "a.png")])
    assert res.exit_code == 1 and "a.png: No such file or directory" in res.stderr, res.output
    assert "attn rel L2" not in res.stdout  # refused before the evaluation
