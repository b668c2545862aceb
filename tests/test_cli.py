"""The `kvgen` command line: help texts, list, show, demo; errors as one line, never a traceback.

Page sizes are worked out by hand from vLLM's layouts: a bf16 cell is K and V at 2 bytes per element,
2 * 2 * 128 = 512 B; an int8_per_token_head cell is 128 B of K codes, a 4 B fp32 K scale, 128 B of V codes and a
4 B V scale = 264 B. A page at the defaults (block 16, 8 KV heads) is 16 * 8 cells: 65,536 B and 33,792 B.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import kvgen
from kvgen.cli import main as cli_main
from kvgen.conformance import PROPERTIES

ROOT = Path(kvgen.__file__).resolve().parent
KVGEN = Path(sys.executable).parent / "kvgen"
SHIPPED = sorted(p.stem for p in (ROOT / "specs").glob("*.yaml"))

# block 16, 8 KV heads, head size 128
PAGE_BYTES = {"bf16": 65_536, "fp16": 65_536, "fp8_e4m3": 32_768, "fp8_e5m2": 32_768,
              "fp8_per_token_head": 33_792, "int8_per_token_head": 33_792}
CELL_BYTES = {"bf16": 512, "fp16": 512, "fp8_e4m3": 256, "fp8_e5m2": 256, "fp8_per_token_head": 264,
              "int8_per_token_head": 264}


def run_kvgen(*args, columns=200, **env):
    e = dict(os.environ, COLUMNS=str(columns), TRITON_INTERPRET="1")
    e.update(env)
    r = subprocess.run([str(KVGEN), *map(str, args)], capture_output=True, text=True, env=e, timeout=300)
    assert "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    return r


def test_test_refuses_two_specs_of_one_name(tmp_path):
    """Two SPECs defining one format name would print two rows of one name: refused before any case runs."""
    text = (ROOT / "specs" / "q4_0.yaml").read_text()
    (tmp_path / "a.yaml").write_text(text)
    (tmp_path / "b.yaml").write_text(text.replace("scale = amax / 7", "scale = amax / 7 (a copy)"))
    r = run_kvgen("test", tmp_path / "a.yaml", tmp_path / "b.yaml", "--examples", "1")
    assert r.returncode == 2 and "both define format 'q4_0'" in r.stderr and "b.yaml" in r.stderr, r.stderr
    r = run_kvgen("test", "q4_0", "q4_0", "--examples", "1")
    assert r.returncode == 2 and "SPEC: q4_0 is given twice" in r.stderr, r.stderr


def test_python_dash_m_kvgen_is_the_kvgen_command():
    import sys

    r = subprocess.run([sys.executable, "-m", "kvgen", "list", "--head-size", "64"], capture_output=True, text=True,
                       env=dict(os.environ, COLUMNS="200", TRITON_INTERPRET="1"), timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Page sizes at block size 16, 8 KV heads, head size 64" in r.stdout and "q4_0_separate" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "kvgen", "show", "no_such_format"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "Usage: kvgen" not in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


ALL = ["build", "validate", "list", "show", "demo", "test", "schema", "doctor", "plan", "import-scheme", "calibrate",
       "eval"]


@pytest.mark.parametrize("args", [[]] + [[c] for c in ALL],
                         ids=lambda a: a[0] if a else "kvgen")
def test_help(args):
    r = CliRunner().invoke(cli_main, args + ["--help"])
    assert r.exit_code == 0, r.output
    assert "Example" in r.output
    assert "Usage:" in r.output


def test_subcommands_are_listed_in_main_help():
    r = CliRunner().invoke(cli_main, ["--help"])
    for sub in ALL:
        assert re.search(rf"^\s+{sub}\s", r.output, re.M), r.output


def test_version():
    r = CliRunner().invoke(cli_main, ["--version"])
    assert r.exit_code == 0
    assert kvgen.__version__ in r.output


def row_of(output: str, name: str) -> str:
    """The table row whose first cell is ``name``."""
    rows = [line for line in output.splitlines() if re.match(rf"^\s*[│|]\s*{name}\s*[│|]", line)]
    assert len(rows) == 1, f"{name}: {len(rows)} rows in\n{output}"
    return rows[0]


def test_list_prints_every_format_with_page_bytes():
    r = run_kvgen("list")
    assert r.returncode == 0, r.stderr
    for name in SHIPPED:
        row = row_of(r.stdout, name)
        if name in PAGE_BYTES:
            assert f"{PAGE_BYTES[name]:,}" in row, row
            parts = re.search(r"(\d+)\+(\d+)(?:\+(\d+))?", row)  # K + V (+ padding) bytes per token and head
            assert parts and sum(int(p) for p in parts.groups() if p) == CELL_BYTES[name], row
    assert "65,536" in row_of(r.stdout, "bf16")
    assert "33,792" in row_of(r.stdout, "int8_per_token_head")


def test_list_shows_kivi_at_its_token_group():
    # block size 16 is below KIVI's group of 32 tokens: the row uses block 32. Per token and head (by hand): K 32 B of
    # 2-bit codes + an fp16 scale and minimum per channel over 32 tokens (128 * 4 / 32 = 16 B); V 32 B of codes + an
    # fp16 scale and minimum per 32 elements (4 * 4 = 16 B): 96 B, x 32 tokens x 8 heads = 24,576 B; 96 / 512 of bf16.
    r = run_kvgen("list", columns=200)
    row = row_of(r.stdout, "kivi_2bit")
    assert "24,576 (block 32)" in row and "0.188" in row, row


def test_list_other_shape():
    r = run_kvgen("list", "--block-size", "32", "--num-kv-heads", "2", "--head-size", "64")
    assert r.returncode == 0, r.stderr
    assert f"{32 * 2 * 2 * 2 * 64:,}" in row_of(r.stdout, "bf16")  # 16,384
    assert f"{32 * 2 * (64 + 4 + 64 + 4):,}" in row_of(r.stdout, "int8_per_token_head")  # 8,704


def test_list_at_80_columns_prints_full_names():
    r = run_kvgen("list", columns=80)
    assert r.returncode == 0
    for name in SHIPPED:
        assert name in r.stdout, f"{name} missing or truncated"
    assert "65,536" in r.stdout and "33,792" in r.stdout


def line_with(output: str, needle: str) -> str:
    lines = [line for line in output.splitlines() if needle in line]
    assert lines, f"no line with {needle!r} in\n{output}"
    return lines[0]


def invoke(*args, **env):
    r = CliRunner(env=env or None).invoke(cli_main, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    return r


def test_show_int8_per_token_head():
    r = invoke("show", "int8_per_token_head")
    assert r.exit_code == 0, r.output
    per_token = line_with(r.stdout, "bytes per token")
    assert re.findall(r"\b132\b", per_token) == ["132", "132"], per_token  # K 132 = 128 + 4, V 132
    assert re.search(r"\b264\b", per_token), per_token
    assert "33,792" in line_with(r.stdout, "per page")
    for side in ("key", "value"):
        where = line_with(r.stdout, f"{side} scale")
        assert "inline" in where and re.search(r"per[_ ]token", where), where


def test_show_bf16_and_a_static_format():
    r = invoke("show", "bf16")
    assert r.exit_code == 0
    assert re.findall(r"\b256\b", line_with(r.stdout, "bytes per token"))[:2] == ["256", "256"]
    assert "65,536" in line_with(r.stdout, "per page")
    assert "none" in line_with(r.stdout, "key scale")
    r = invoke("show", "fp8_e4m3")
    assert r.exit_code == 0
    assert "32,768" in line_with(r.stdout, "per page")
    assert "static" in line_with(r.stdout, "key scale") and "static" in line_with(r.stdout, "value scale")


def test_show_says_where_auto_dequantizes_first():
    from kvgen.runtime.dequantize import auto_min_new_tokens
    for name in ("q4_0", "int8_per_token_head"):
        line = line_with(invoke("show", name).stdout, "chunked prefill")
        assert f"from {auto_min_new_tokens(kvgen.load(name))} new tokens" in line, line
    # at the head size asked for: a head of 64 needs four times the new tokens of one of 128
    at_64 = line_with(invoke("show", "int8_per_token_head", "--head-size", "64").stdout, "chunked prefill")
    assert f"from {4 * auto_min_new_tokens(kvgen.load('int8_per_token_head'))} new tokens" in at_64, at_64
    assert "head size 64" in at_64, at_64
    assert "runs the fused kernels" in line_with(invoke("show", "fp8_e4m3").stdout, "chunked prefill")
    # q8_0's own count under "fast" dots, where its fused kernel drops a term; none where fast changes nothing
    fast = auto_min_new_tokens(kvgen.load("q8_0"), dot_precision="fast")
    assert fast != auto_min_new_tokens(kvgen.load("q8_0"))
    assert f'from {fast} under dot_precision="fast"' in line_with(invoke("show", "q8_0").stdout, "chunked prefill")
    assert "under dot_precision" not in line_with(invoke("show", "int8_per_token_head").stdout, "chunked prefill")


def test_show_prints_each_fields_padding():
    """int8 asym's zero points are followed by 3 bytes of padding (the values' codes start at a multiple of 4), which a
    write stores as zeros; `kvgen show` says so on each zero point's row."""
    out = invoke("show", "int8_asym_per_token_head", "--head-size", "128").stdout
    assert "pad" in line_with(out, "offset")

    def pad_of(field):  # the pad column, just before the field's name
        cells = [c.strip() for c in line_with(out, f" {field} ").replace("┃", "│").split("│")]
        return cells[cells.index(field) - 1]
    assert (pad_of("k_zp"), pad_of("v_zp"), pad_of("k_data"), pad_of("v_scale")) == ("3", "3", "0", "0")


def test_show_prints_storage_dtype_and_shape():
    r = invoke("show", "int8_per_token_head")
    storage = line_with(r.stdout, "storage")
    assert "int8" in storage, storage
    assert "num_blocks" in storage, storage


def test_show_unknown_name_is_one_line_error():
    r = run_kvgen("show", "no_such_format_xyz")
    assert r.returncode == 2  # a format name that names nothing: a usage error (README, "Exit codes")
    assert r.stdout == ""
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert "no_such_format_xyz" in err
    assert "bf16" in err  # says which formats exist


def test_show_a_head_size_the_format_cannot_take_is_a_usage_error():
    """q4_0's scale blocks of 32 do not divide head size 20: an option's value the format cannot take (exit 2), one
    line naming the options and the reason."""
    r = run_kvgen("show", "q4_0", "--head-size", "20")
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "--head-size 20" in err and "multiple of the key scale block 32" in err, err


def test_show_spec_yaml(tmp_path):
    spec = tmp_path / "show_me.yaml"
    spec.write_text("name: show_me\ndescription: shown\nkey:\n  element: fp16\nvalue:\n  element: fp16\n")
    r = invoke("show", spec, "--head-size", "64", "--num-kv-heads", "2", KVGEN_CACHE_DIR=str(tmp_path / "c"))
    assert r.exit_code == 0, r.output
    assert "show_me" in r.stdout
    assert f"{16 * 2 * 2 * 2 * 64:,}" in line_with(r.stdout, "per page")


def test_show_text_with_brackets_does_not_crash(tmp_path):
    spec = tmp_path / "brackets.yaml"
    spec.write_text('name: brackets\ndescription: "cell [k | v], see [/docs]"\nkey:\n  element: fp16\n'
                    "value:\n  element: fp16\n")
    runner = CliRunner(env={"KVGEN_CACHE_DIR": str(tmp_path / "c")})
    r = runner.invoke(cli_main, ["show", str(spec)])
    assert r.exception is None, repr(r.exception)  # an exception escaping main() is a traceback for the user
    assert "cell [k | v], see [/docs]" in r.stdout
    weird = tmp_path / "[/x]" / "missing_format_dir"
    r = runner.invoke(cli_main, ["show", str(weird)])
    assert isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 2 and str(weird) in r.stderr  # a name that names nothing: a usage error


def test_demo_bf16():
    r = invoke("demo", "--format", "bf16", "--seqs", "2", "--context", "20")
    assert r.exit_code == 0, r.output
    m = re.search(r"relative L2 error[^:]*:\s*([0-9.eE+-]+)", r.stdout)
    assert m, r.stdout
    err = float(m.group(1))
    assert 0 <= err < 1e-2, err
    assert "bf16" in r.stdout


def test_demo_of_a_users_spec_lists_its_page_sizes(tmp_path):
    """The closing page-size table holds the demonstrated format too, not only the shipped ones."""
    spec = tmp_path / "mine.yaml"
    spec.write_text((ROOT / "specs" / "fp8_e4m3.yaml").read_text().replace("name: fp8_e4m3", "name: my_demo_fp8"))
    r = invoke("demo", "--format", spec, "--seqs", "1", "--context", "20",
               KVGEN_CACHE_DIR=str(tmp_path / "cache"), COLUMNS="200")
    assert r.exit_code == 0, r.output
    assert "1 sequence of [20] tokens" in r.stdout
    row = next(line for line in r.stdout.splitlines() if "my_demo_fp8" in line and "32,768" in line)
    assert "128+128" in row


def test_demo_unknown_format_is_one_line_error():
    r = CliRunner().invoke(cli_main, ["demo", "--format", "no_such_format_xyz"])
    assert r.exit_code == 2  # a format name that names nothing: a usage error (README, "Exit codes")
    assert isinstance(r.exception, SystemExit)
    assert "no_such_format_xyz" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_schema_is_the_spec_json_schema(tmp_path):
    out = tmp_path / "kvgen.schema.json"
    r = CliRunner().invoke(cli_main, ["schema", "-o", str(out)])
    assert r.exit_code == 0, r.output
    import json

    schema = json.loads(out.read_text())
    assert schema["additionalProperties"] is False  # unknown keys are errors in editors too
    assert {"name", "key", "value"} <= set(schema["required"])
    assert "fp8_e4m3" in json.dumps(schema["$defs"]["ElementType"])
    # editors learn the draft and the name rule: a name the validator refuses does not pass the schema either
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    import re

    pattern = re.compile(schema["properties"]["name"]["pattern"])
    for name in ("kivi_2bit", "q4_0"):
        assert pattern.search(name)
    for name in ("Bad", "a.b", "1x", "café"):
        assert not pattern.search(name)


def test_doctor_reports_the_interpreter_and_runs():
    r = CliRunner().invoke(cli_main, ["doctor"])
    assert r.exit_code == 0, r.output
    assert "interpreter" in r.output and "ok" in r.output


def test_piped_list_keeps_every_column():
    """Output to a pipe with no COLUMNS set (make demo's, a log's) is laid out 160 wide, not rich's 80: the page-size
    table keeps its headers whole and its scales column (at 80 columns the headers were cut to 'vs bf…' and the
    scales column to nothing)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    r = subprocess.run([str(KVGEN), "list"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    header = next(line for line in r.stdout.splitlines() if "format" in line)
    for name in ("K+V B/tok/head", "page B", "vs bf16", "scales"):
        assert name in header, header
    assert "e8m0 per 32 elements, separate" in r.stdout  # mxfp4's scales, whole


def test_console_width_follows_columns_set_after_it_was_made(monkeypatch):
    """The consoles read COLUMNS at each print, not once when made (rich's own): a test runner's worker, or a caller,
    may import kvgen under one width and print under another (CliRunner's env, a resized pipe)."""
    import io

    from kvgen.consoles import _Console
    monkeypatch.setenv("COLUMNS", "80")
    console = _Console(soft_wrap=True, file=io.StringIO())
    monkeypatch.setenv("COLUMNS", "220")
    assert console.size.width == 220
    monkeypatch.delenv("COLUMNS")
    assert console.size.width == 160  # not a terminal: the pipe width


@pytest.mark.parametrize("extra", [[], ["--dequantize-first"]])
def test_conformance_command(extra):
    """`kvgen test` on a shipped format, fused and with the cache dequantized first: every property passes."""
    r = invoke("test", "q4_0", "--examples", "3", "--device", "cpu", *extra, TRITON_INTERPRET="1")
    assert r.exit_code == 0, r.output
    assert ("attention dequantized first" in r.stdout) == bool(extra), r.stdout
    row = line_with(r.stdout, "q4_0")
    assert row.count("pass") == len(PROPERTIES) == 5 and "FAIL" not in row, r.stdout


@pytest.mark.parametrize("args,option", [
    (["test", "q4_0", "--examples", "0"], "--examples"),
    (["demo", "--seqs", "0"], "--seqs"),
    (["demo", "--context", "-5"], "--context"),
])
def test_counts_below_one_are_usage_errors(args, option):
    r = CliRunner().invoke(cli_main, args)
    assert r.exit_code == 2, r.output
    assert option in r.output and "Traceback" not in r.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
def test_conformance_on_cuda_without_a_gpu_is_a_usage_error():
    """Not a pass of zero cases: the device is refused before any case runs."""
    r = CliRunner().invoke(cli_main, ["test", "fp8_e4m3", "--device", "cuda", "--examples", "1"])
    assert r.exit_code == 2, r.output
    assert "--device" in r.output and "no CUDA device" in r.output
    assert "pass" not in r.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
@pytest.mark.parametrize("args", [["doctor"], ["demo"], ["eval", "fp8_e4m3", "--backend", "kernels"]])
@pytest.mark.parametrize("value", ["0", ""])
def test_compiled_kernels_asked_for_without_a_gpu_is_a_usage_error(args, value):
    """TRITON_INTERPRET=0 (or set empty, which Triton reads the same) without a CUDA device: one line saying so
    (exit 2), no traceback; doctor does not claim the interpreter, or the GPU, runs the kernels."""
    r = CliRunner(env={"TRITON_INTERPRET": value}).invoke(cli_main, args)
    assert r.exit_code == 2, r.output
    assert f"TRITON_INTERPRET={value} asks" in r.output and "no CUDA device" in r.output
    assert "Traceback" not in r.output and "compiled by Triton on the GPU" not in r.output
    assert "interpreter on the CPU (TRITON_INTERPRET=1)" not in r.output and "kvgen demo:" not in r.output


@pytest.mark.parametrize("args", [
    ["schema", "-o", "{d}/no/such/dir/x.json"],
    ["show", "int8_per_token_head", "--png", "{d}/no/such/dir/x.png"],
])
def test_an_output_file_that_cannot_be_written_is_one_line_error(tmp_path, args):
    r = CliRunner().invoke(cli_main, [a.format(d=tmp_path) for a in args])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
    assert f"error: {tmp_path}/no/such/dir/x." in r.stderr and "No such file or directory" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert r.stdout == ""  # refused before the table is printed


def test_a_case_that_cannot_run_is_one_line_error_not_a_pass(monkeypatch):
    """An error inside a case (here torch's AssertionError for CUDA on a CPU build) is neither a pass nor a
    traceback: one line naming the format and the error; --debug shows the traceback."""
    from kvgen import conformance

    def broken(fmt, case, device, **kw):
        raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(conformance, "run_case", broken)
    r = CliRunner().invoke(cli_main, ["test", "fp8_e4m3", "--examples", "1", "--device", "cpu"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
    assert "fp8_e4m3: a conformance case could not run: AssertionError: Torch not compiled" in r.stderr
    assert "pass" not in r.stdout
    r = CliRunner().invoke(cli_main, ["--debug", "test", "fp8_e4m3", "--examples", "1", "--device", "cpu"])
    assert isinstance(r.exception, kvgen.KvgenError)


def test_show_gives_each_regions_byte_start():
    """nvfp4 keeps four regions in a page (block 16, 8 KV heads, head size 128): 16 x 8 cells of 64 B of key codes,
    then of 8 B of key scales, then the values alike: they start at 0, 8192, 9216 and 17408 (by hand)."""
    r = invoke("show", "nvfp4")
    assert r.exit_code == 0, r.output
    starts = {f: int(line_with(r.stdout, f" {f} ").split("│")[3]) for f in ("k_data", "k_scale", "v_data", "v_scale")}
    assert starts == {"k_data": 0, "k_scale": 8192, "v_data": 9216, "v_scale": 17408}, r.stdout


@pytest.mark.parametrize("args, named", [
    (["demo", "--format", "no_such_format"], "--format"),
    (["calibrate", "{d}/acts.npz", "-f", "no_such_format", "-o", "{d}/kv.json"], "--format"),
    (["calibrate", "{d}/acts.npz", "-f", "int8_per_token_head", "-o", "{d}/kv.json"], "--format"),
    (["eval", "bf16", "--backend", "reference", "--query-dtype", "bf16"], "--query-dtype"),
    (["test", "no_such_format", "--examples", "1", "--device", "cpu"], "no_such_format"),
    # a spec path that names nothing (README, "Exit codes")
    (["build", "{d}/nope.yaml", "-o", "{d}/out"], "nope.yaml: no such file"),
    (["validate", "{d}/nope.yaml"], "nope.yaml: no such file"),
    (["show", "{d}/nope.yaml"], "nope.yaml: no such file"),
    (["test", "{d}/nope.yaml", "--examples", "1", "--device", "cpu"], "nope.yaml: no such file"),
])
def test_a_value_an_option_cannot_take_exits_2(tmp_path, args, named):
    # README, "Exit codes": 2 for a usage error, among them an option's value the command cannot take; one line
    r = CliRunner().invoke(cli_main, [a.format(d=tmp_path) for a in args])
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert named in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
