"""The benchmark scripts time kernels on a CUDA GPU: without one they say so in one line (not a torch traceback),
and point at the static counter that works without a GPU. Skipped where a GPU is present."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import kvgen

ROOT = Path(kvgen.__file__).resolve().parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the scripts would run")
@pytest.mark.parametrize("script,args", [("bench.py", ["--formats", "bf16", "--no-sweep"]),
                                         ("tune_splits.py", ["bf16"]), ("tune_tiles.py", ["bf16", "--cuda-graphs"]),
                                         ("variant_ab.py", ["generated", "fp8_e4m3"]),
                                         ("dequantize_first.py", ["int8_per_token_head"])])
def test_gpu_scripts_name_the_missing_gpu(script, args, tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args, *(
        ["--out", str(tmp_path)] if script == "bench.py" else [])], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "CUDA GPU" in res.stderr and "sass_count.py" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr, res.stderr[-2000:]


def load_script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_profile_summary_adds_bytes_in_their_own_units():
    """ncu gives each metric its own unit: the DRAM bytes moved are the reads plus the writes, each scaled by its
    unit; instructions count per (token or position, KV head)."""
    prof = load_script("profile_decode")
    row = {"gpu__time_duration.sum": "85,000", "dram__bytes_read.sum": "134.22", "dram__bytes_write.sum": "36,864",
           "smsp__inst_executed.sum": "262144", "launch__registers_per_thread": "86",
           "units": {"gpu__time_duration.sum": "nsecond", "dram__bytes_read.sum": "Mbyte",
                     "dram__bytes_write.sum": "Kbyte"}}
    cells = [c.strip() for c in prof.summary("q4_0", row, 1, 32768).split("|")[1:-1]]
    assert cells[:2] == ["q4_0", "85"]
    assert cells[3] == "171"  # 134.22 MB + 36.864 MB
    assert cells[4] == "86"
    assert cells[7] == "1.0"  # 262144 warp instructions over 32768 tokens x 8 KV heads
    unknown = dict(row, units=dict(row["units"], **{"dram__bytes_write.sum": "parsec"}))
    assert [c.strip() for c in prof.summary("q4_0", unknown, 1, 32768).split("|")[1:-1]][3] == "-"


@pytest.mark.parametrize("rate,unit", [("3,682,068,571,428.57", "byte/s"), ("3.68206857142857", "Tbyte/s"),
                                       ("3682.06857142857", "Gbyte/s")])
def test_profile_summary_bytes_from_the_rate_when_no_count(rate, unit):
    """ncu's default sections give DRAM bytes per second, not a count: MB moved is the rate times the kernel time,
    in whatever unit the rate comes."""
    prof = load_script("profile_decode")
    row = {"gpu__time_duration.sum": "67.0", "dram__bytes.sum.per_second": rate,
           "units": {"gpu__time_duration.sum": "usecond", "dram__bytes.sum.per_second": unit}}
    cells = [c.strip() for c in prof.summary("bf16", row, 1, 32768).split("|")[1:-1]]
    assert cells[1] == "67" and cells[3] == "247"  # 3.682e12 B/s x 67e-6 s = 246.7 MB


def test_profile_passes_tiles_and_head_size_to_its_child(monkeypatch, tmp_path):
    """profile_decode.py --tiles / --shape ...hsN: the child process that ncu profiles is told the tiles and head
    size (a profile of the runtime's rule under another name would compare nothing), and bad values are refused."""
    prof = load_script("profile_decode")
    seen = []
    fake_run = lambda cmd, **kw: seen.append(cmd) or subprocess.CompletedProcess(cmd, 1, "", "no ncu here")  # noqa: E731
    monkeypatch.setattr(prof, "subprocess", types.SimpleNamespace(run=fake_run))
    assert prof.profile("ncu", "mxfp8", 64, 8192, tmp_path, tiles="128/4/3/168pc", head_size=64) == {}
    child = seen[0][seen[0].index("--child"):]
    assert child[:4] == ["--child", "mxfp8", "--shape", "64x8192hs64"]
    assert child[child.index("--tiles") + 1] == "128/4/3/168pc"
    prof.profile("ncu", "bf16", 4, 65536, tmp_path)
    assert "--tiles" not in seen[1] and "4x65536" in seen[1]
    for args, says in ((["--tiles", "128/4"], "--tiles"), (["--shape", "64x8192hs"], "--shape"),
                       (["--write", "--tiles", "rt"], "tune_writes.py")):
        res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_decode.py"), *args],
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 2 and says in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]


def test_attention_shapes_parse():
    """The tuning scripts' shapes: SEQSxCONTEXT, optionally qNEW (a chunked prefill's new tokens per sequence) and
    hsHEAD; anything else (or more new tokens than context) ends the script naming the shape."""
    import argparse

    bench = load_script("bench")
    ap = argparse.ArgumentParser(prog="tune")
    got = bench.decode_shapes(ap, ["64x8192", "64x8192hs64", "4x8192q2048", "4x8192q2048hs256"])
    assert got == {"64x8192": (64, 8192, bench.D, 1), "64x8192hs64": (64, 8192, 64, 1),
                   "4x8192q2048": (4, 8192, bench.D, 2048), "4x8192q2048hs256": (4, 8192, 256, 2048)}
    for bad in ("64x", "4x100q200", "64x8192hs", "4x8192hs64q16", "0x8192", "4x8192q0"):
        with pytest.raises(SystemExit):
            bench.decode_shapes(ap, [bad])


def test_tile_configs_parse_and_apply(monkeypatch):
    """tune_tiles.py's configs (also variant_ab.py's and sass_count.py --tiles'): numbers, then letters p (block ids
    one step ahead), c / n (values converted first or not); "rt", "rtc", "rtn" the runtime's own tiles. A config
    outside that syntax is refused with its text, not half-read."""
    from kvgen.runtime import kernels as K

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    tiles = load_script("tune_tiles")
    monkeypatch.setattr(K, "TILE_OVERRIDE", None)
    monkeypatch.setattr(K, "CONVERT_FIRST_OVERRIDE", None)
    assert tiles.parse("64/4/2") == dict(BLOCK_N=64, num_warps=4, num_stages=2)
    assert tiles.parse("128/4/3/168pc") == dict(BLOCK_N=128, num_warps=4, num_stages=3, maxnreg=168,
                                                prefetch_blocks=True, convert_first=True)
    tiles.apply("128/4/2/168n", 8)
    assert K.TILE_OVERRIDE == dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=168, programs_per_sm=8)
    assert K.CONVERT_FIRST_OVERRIDE is False
    for config, convert in (("rtc", True), ("rtn", False), ("rt", None)):
        tiles.apply(config)
        assert K.TILE_OVERRIDE is None and K.CONVERT_FIRST_OVERRIDE is convert, config
    for bad in ("rtp", "128/4/3cn", "128/4", "fast"):
        with pytest.raises(ValueError, match=bad):
            tiles.apply(bad)


def test_context_lost_tells_gpu_errors_from_compile_rejections(monkeypatch):
    """tune_tiles.py stops at an error of the GPU itself (later launches of the process would fail too), and goes on
    past a configuration the compiler rejects."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    tiles = load_script("tune_tiles")
    accelerator_error = type("AcceleratorError", (RuntimeError,), {})
    assert tiles.context_lost(RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"))
    assert tiles.context_lost(accelerator_error("CUDA error: an illegal memory access was encountered"))
    assert not tiles.context_lost(RuntimeError("out of resource: shared memory, Required: 264192, Hardware limit: "
                                               "232448"))
    assert not tiles.context_lost(ValueError("config '128/4': BLOCK_N/num_warps/num_stages[/maxnreg], 3 or 4 numbers"))


@pytest.mark.parametrize("name", ["kivi_2bit", "int8_per_token_head"])
def test_real_codes_replace_random_bytes(name, monkeypatch):
    """variant_ab.py's caches: bench.py's random bytes hold NaN codes and scales, so outputs would not compare;
    write_real_codes rewrites every sequence through the format's write (KIVI's as prefills, which fill its residual
    window), after which attention over the whole context is finite."""
    import warnings

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench = load_script("bench")
    fmt = kvgen.load(name)
    block = fmt.layout.RESIDUAL["group"] if fmt.spec.streaming else 16
    seqs, ctx, heads, head_size, q_len = 2, 5 * block, 2, 64, 4
    blocks = seqs * ctx // block
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(blocks, block, heads, head_size, **({"max_seqs": seqs} if fmt.spec.streaming else {}))
    torch.manual_seed(0)
    bench.fill_random(cache)
    table = torch.randperm(blocks, dtype=torch.int32).reshape(seqs, -1)
    q = torch.randn(seqs * q_len, 2 * heads, head_size, dtype=torch.bfloat16)
    kw = {"seq_ids": torch.arange(seqs, dtype=torch.int32)} if fmt.spec.streaming else {}
    args = (q, cache, table, torch.full((seqs,), ctx, dtype=torch.int32),
            torch.arange(seqs + 1, dtype=torch.int32) * q_len)
    assert not torch.isfinite(fmt.attend(*args, **kw)).all()  # the random bytes: what the helper is for
    bench.write_real_codes(fmt, cache, table, ctx)
    assert torch.isfinite(fmt.attend(*args, **kw)).all()


def test_flushing_write_steps_flush_a_group_each(monkeypatch):
    """time_writes.py --flushing times KIVI decode steps whose every token flushes a group: bench._write_sequences'
    metadata (flush_len = R + G) puts each sequence one token past a group boundary of the spec's own definition
    (quantized length = (L - R) // G * G, R and G read from the spec), and the write then rewrites every page that
    group lies in."""
    import warnings

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench = load_script("bench")
    fmt = kvgen.load("kivi_2bit")
    R, G = fmt.spec.key.residual.tokens, fmt.spec.key.scale.group_tokens
    seqs, heads, head_size = 2, 1, 64
    per_seq = -(-(R + G) // G) + 1
    meta = bench._write_sequences(seqs, G, seqs * per_seq, flush_len=R + G, device="cpu")
    lens = meta["seq_lens"].tolist()
    assert lens == [R + G] * seqs and meta["query_start_loc"].tolist() == list(range(seqs + 1))
    quantized = lambda n: max(n - R, 0) // G * G  # noqa: E731
    assert all(quantized(n) - quantized(n - 1) == G for n in lens)
    table = meta["block_table"]
    assert table.shape[1] * G >= R + G and len(set(table.flatten().tolist())) == table.numel()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(seqs * per_seq, G, heads, head_size, max_seqs=seqs)
    for t in cache.tensors.values():
        t.view(torch.uint8).fill_(0xFF)
    before = {name: t.view(torch.uint8).clone() for name, t in cache.tensors.items()}
    key = torch.randn(seqs, heads, head_size, dtype=torch.bfloat16)
    slots = bench.sequence_slots(meta, G)
    # sequence s's one new token is its position R + G - 1, in block (R + G - 1) // G of its row
    assert slots.tolist() == [int(table[s, (R + G - 1) // G]) * G + (R + G - 1) % G for s in range(seqs)]
    fmt.write(cache, key, key.clone(), slots, **meta)
    pages = cache.tensors["kv_cache"].view(torch.uint8).reshape(seqs * per_seq, -1)
    changed = (pages != before["kv_cache"].reshape(seqs * per_seq, -1)).any(dim=1)
    # group 0 of each sequence: the first block of its table row
    assert changed[table[:, 0].long()].all(), changed


def test_write_reductions_get_the_shuffles_their_lanes_need():
    """Triton 3.6 lowers a reduction whose axis spans lane bits 0 and 4 to butterfly shuffles over masks 1 and 2
    (benchmarks/pending/reduce_lanes_fault.py), silently wrong, and the interpreter cannot see it: the views that
    give the writes their layouts (load_rows, load_groups) met it at head size 32 in a KIVI flush variant. Static
    (sm_90 PTX, no GPU): first the scan must flag the cut-down kernel (--selftest), then every write kernel of the
    shipped formats, KIVI's flush and residual kernels included, at head size 32 with bf16 inputs (fp32 ones
    compile to other layouts: `python benchmarks/reduce_lanes_scan.py` covers them, and more) must reduce with the
    masks its lanes need."""
    script = str(ROOT / "benchmarks" / "reduce_lanes_scan.py")
    res = subprocess.run([sys.executable, script, "--selftest"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    res = subprocess.run([sys.executable, script, "--kinds", "write,stream", "--heads", "32", "--inputs", "bf16"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    totals = res.stdout.strip().splitlines()[-1]
    assert "BAD 0," in totals and "errors 0" in totals and "ok 0," not in totals, totals


def test_stall_sites_sums_samples_by_reason_and_waiting_opcode(capsys):
    """stall_sites.py reads ncu's SASS source page: samples by reason (the "Not Issued" subsets left out), the share
    of the instruction after each DEPBAR (the copies' wait), samples by opcode (predicates dropped), and the
    instructions listed by their share of all samples, each beside the instruction before it."""
    sites = load_script("stall_sites")
    head = ('"# Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
            '"stall_long_sb","stall_long_sb (Not Issued)","stall_short_sb","stall_short_sb (Not Issued)"')
    page = "\n".join([
        "==PROF== Disconnected from process 1", head,
        '"0x08","DEPBAR.LE SB0, 0x0","0","0","0","0","0","0"',
        '"0x10","BAR.SYNC.DEFER_BLOCKING 0x0","130","120","130","120","0","0"',
        '"0x20","@!P0 HMMA.16816.F32 R64, R28, R64, RZ","60","50","0","0","60","50"',
        '"0x30","HMMA.16816.F32 R80, R28, R80, RZ","1,000","900","200","180","800","720"',
        '"0x40","LDS.64 R24, [R124+UR9+0xf400]","10","8","0","0","10","8"'])
    sites.report("fmt", page, top=2)
    out = capsys.readouterr().out
    assert "stall samples 1200" in out
    assert "by reason: short_sb 72.5%, long_sb 27.5%" in out
    assert "at the copies' wait (the instruction after DEPBAR): 10.8%" in out
    assert "HMMA 88.3%, BAR 10.8%, LDS 0.8%" in out
    listed = [line for line in out.splitlines() if line.startswith("| 0x")]
    assert len(listed) == 2
    assert listed[0].startswith("| 0x30 |") and "83.3%" in listed[0] and "short_sb 800, long_sb 200" in listed[0]
    assert "`@!P0 HMMA.16816.F32 R64" in listed[0]
    assert listed[1].startswith("| 0x10 |") and "10.8%" in listed[1] and "`DEPBAR.LE SB0, 0x0`" in listed[1]
    sites.report("empty", "ncu said nothing useful", top=2)
    assert "no source rows" in capsys.readouterr().out
