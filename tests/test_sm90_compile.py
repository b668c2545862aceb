"""The generated kernels compile for the H200 (sm_90) with Triton's own ptxas, without a GPU.

The interpreter accepts programs the GPU compiler rejects (a tensor-core dot over fewer than 16 elements, for one),
so the CPU suite alone would not notice a template that only breaks compiled code. benchmarks/sass_count.py compiles
each attention kernel in the configuration the runtime launches on a GPU, and --write the reshape-and-cache kernel.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import kvgen

ROOT = Path(kvgen.__file__).resolve().parent
SMALL_GROUP = {  # KIVI with G = 8: steps below a tensor-core dot's 16 positions must keep exact dots
    "name": "kivi_g8",
    "key": {"element": "uint4", "zero_point": {"dtype": "fp16"},
            "scale": {"granularity": "per_channel_group", "group_tokens": 8, "dtype": "fp16", "placement": "page_end"},
            "residual": {"tokens": 32, "dtype": "bf16"}},
    "value": {"element": "uint4", "zero_point": {"dtype": "fp16"},
              "scale": {"granularity": "per_block", "block": 32, "dtype": "fp16"},
              "residual": {"tokens": 32, "dtype": "bf16"}},
}


def sass_count(*args: str, cache: Path) -> str:
    env = dict(os.environ, TRITON_INTERPRET="0", KVGEN_CACHE_DIR=str(cache))
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sass_count.py"), *args], capture_output=True,
                         text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


@pytest.mark.parametrize("half", [0, 1])
def test_attention_kernels_compile_for_sm90(half, tmp_path):
    """Every shipped format and KIVI at G = 8, in two halves (about 25 s each: two test workers share them)."""
    spec = tmp_path / "kivi_g8.yaml"
    spec.write_text(yaml.safe_dump(SMALL_GROUP))
    names = kvgen.shipped_names()[half::2]
    extra = [str(spec)] if half else []
    out = sass_count(*names, *extra, cache=tmp_path / "cache")
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[1:] == names + extra, out


def test_prefill_kernels_of_block_dot_formats_compile_for_sm90(tmp_path):
    """q8_0, q4_0 and KIVI launch their attention kernel with BLOCK_DOTS in decode (the test above) and without it
    in prefill, mxfp8 with RATIO_PAIRS and without it: both variants must compile."""
    names = ["q8_0", "q4_0", "kivi_2bit", "mxfp8"]
    out = sass_count("--prefill", *names, cache=tmp_path / "cache")
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[1:] == names, out


def test_dequantize_kernels_compile_for_sm90(tmp_path):
    """dequantize_first's kernel of every shipped format, as attend launches it for a chunked prefill."""
    out = sass_count("--dequantize", cache=tmp_path / "cache")
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[1:] == kvgen.shipped_names(), out


def test_write_kernels_compile_for_sm90(tmp_path):
    out = sass_count("--write", cache=tmp_path / "cache")
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[1:] == [n for n in kvgen.shipped_names() if not kvgen.load(n).spec.streaming], out


def test_write_kernels_compile_for_sm80_without_fast_division(tmp_path):
    """Before sm_89 (an A100) fp8 converts in software (NATIVE_CASTS off) and with runtime.kernels.FAST_DIV off each
    division is div_rn: the branches these leave (the finite paths of range_first / finite_first, render.py) must
    still define the group's range for the code after them. Both once failed in Triton's front end ("k_am is not
    defined", mxfp8; "k_lo is not defined", int4 per token-head), which the interpreter cannot show."""
    out = sass_count("--arch", "80", "--write", "--no-fast-div", cache=tmp_path / "cache")
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[1:] == [n for n in kvgen.shipped_names() if not kvgen.load(n).spec.streaming], out


def test_write_kernels_of_fp32_inputs_compile_for_sm90(tmp_path):
    """fp32 inputs change the write's layouts (the GPU tests of the divisions write fp32 tokens): nvfp4's scaled
    division and q4_0's hoisted one compile for them too, and --dump leaves each kernel's PTX and SASS."""
    out = sass_count("--write", "--input", "fp32", "--dump", str(tmp_path / "asm"), "nvfp4", "q4_0",
                     cache=tmp_path / "cache")
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[1:] == ["nvfp4", "q4_0"], out
    # nvfp4's 1 / s' is div_rn's, not recip_fast's inline rcp.approx (every code saturated on sm_90 with it: the
    # forty-first session, benchmarks/RESULTS.md); q4_0's hoisted reciprocal is recip_fast's
    assert "rcp.approx" not in (tmp_path / "asm" / "nvfp4.ptx").read_text()
    assert "rcp.approx.ftz.f32" in (tmp_path / "asm" / "q4_0.ptx").read_text()


# Found on the H200 by tests/test_random_specs.py (2026-12-01): 2-bit keys at head size 48 (16 bytes a row) beside
# 8-bit values aborted Triton's compiler in chunked prefill ("Illegal shared layout") at 128 positions a step
# (runtime.kernels.NARROW_ROW_BYTES keeps such kernels at 64).
NARROW_KEY_ROWS = {
    "name": "narrow_key_rows",
    "cache": {"layout": "interleaved"},
    "key": {"element": "int2", "data_align": 16, "rotation": {"kind": "hadamard", "seed": 0},
            "rounding": "half_even", "packing": "lsb_first", "scale": {"granularity": "per_tensor", "apply": "divide"}},
    "value": {"element": "fp8_e5m2", "rotation": {"kind": "hadamard", "seed": 0},
              "scale": {"granularity": "per_tensor", "apply": "divide"}},
}


def test_prefill_with_narrow_packed_rows_compiles_for_sm90(tmp_path):
    spec = tmp_path / "narrow_key_rows.yaml"
    spec.write_text(yaml.safe_dump(NARROW_KEY_ROWS))
    out = sass_count("--prefill", "--head-size", "48", str(spec), cache=tmp_path / "cache")
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[1:] == [str(spec)], out


def test_byte_aligned_codes_load_asynchronously_for_sm90(tmp_path):
    """The software pipeline's asynchronous copies carry every byte the decode loop of the 16-byte-row formats reads:
    codes 16 bytes at a time, per-token scales in words, and no plain global load but the step's block ids (a plain
    load stalls each step for the memory's latency: mxfp8's 2-byte scale rows at head size 64 load that way)."""
    names = ["bf16", "fp8_e4m3", "int8_per_token_head_separate", "mxfp8"]
    out = sass_count(*names, cache=tmp_path / "cache")
    rows = {cells[1].strip(): cells[-2].strip() for cells in (line.split("|") for line in out.splitlines()
                                                              if line.startswith("| ") and "---" not in line)}
    for name in names:
        assert rows[name], (name, out)
        loads = dict(item.rsplit(" ", 1) for item in rows[name].split(", "))
        plain = {op: int(n) for op, n in loads.items() if not op.startswith("LDGSTS")}
        assert sum(plain.values()) <= 1 and set(plain) <= {"LDG.E"}, (name, loads)  # the block ids, if any
        assert "LDGSTS.E.BYPASS.128" in loads, (name, loads)
        if name in ("int8_per_token_head_separate", "mxfp8"):  # per-token / per-block scales: 4-byte copies
            assert "LDGSTS.E" in loads, (name, loads)


def test_narrow_scale_rows_load_asynchronously_for_sm90(tmp_path):
    """mxfp8's and mxfp4's e8m0 scale rows at head size 64 (2 bytes) are read as the words that hold them
    (side.jinja's block_scale_codes): asynchronous copies, no plain load but the block ids."""
    out = sass_count("--head-size", "64", "mxfp8", "mxfp4", cache=tmp_path / "cache")
    rows = {cells[1].strip(): cells[-2].strip() for cells in (line.split("|") for line in out.splitlines()
                                                              if line.startswith("| ") and "---" not in line)}
    for name in ("mxfp8", "mxfp4"):
        loads = dict(item.rsplit(" ", 1) for item in rows[name].split(", "))
        plain = {op: int(n) for op, n in loads.items() if not op.startswith("LDGSTS")}
        assert sum(plain.values()) <= 1 and set(plain) <= {"LDG.E"}, (name, loads)
