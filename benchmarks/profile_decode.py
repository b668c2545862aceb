"""What limits each format's decode attention on the GPU: Nsight Compute's counters for one attention launch.

    python benchmarks/profile_decode.py                          # a representative set of formats, 64 x 8192
    python benchmarks/profile_decode.py --formats fp8_e4m3 int8_asym_per_token_head --out prof
    python benchmarks/profile_decode.py --write --formats q4_0 kivi_2bit   # reshape-and-cache of 32768 tokens
    python benchmarks/profile_decode.py --formats q8_0 --dot-precision fast  # another dot precision (default auto)
    python benchmarks/profile_decode.py --write --formats nvfp4 --after copy  # the write loaded after the copy
    python benchmarks/profile_decode.py --write --formats nvfp4 --after copy --graphs  # as CUDA-graph replays
    python benchmarks/profile_decode.py --formats int8_per_token_head --tiles 128/4/3/168pc  # other tiles (tune_tiles.py's)
    python benchmarks/profile_decode.py --formats mxfp8 --shape 64x8192hs64     # head size 64

For each format, runs ``ncu`` on a child process that sets up benchmarks/bench.py's decode case (32 query heads,
8 KV heads, head size 128, block size 16; KIVI block 32) and launches attention a few times; the third launch of
the attention kernel is profiled (the first compiles). Prints one markdown table: kernel time, DRAM throughput
(fraction of peak), DRAM bytes moved (read + written), registers, achieved occupancy, issue-slot use, instructions per KV position and the
largest warp stall reasons (cycles per issued instruction) and the three busiest pipes. ncu's raw CSV of every format is kept in --out/ncu_raw.csv.

``--write`` profiles bench.py's write case instead (``--shape`` is then the token count, 32768 by default): the
third reshape-and-cache launch, or for KIVI (one prefill of that many tokens) its flush kernel; instructions are
counted per (token, KV head).

``--after copy`` runs bench.py's copy-bandwidth measurement in the child first and keeps torch's allocator pool as it
leaves it (bench.write_case's ``release_pool=False``): the process state in which a write kernel, first loaded then,
runs up to 2.1x slower as CUDA-graph replays (benchmarks/write_state.py; RESULTS.md, twentieth and twenty-first
sessions). ``--graphs`` launches the case as bench.py's graph replays (ncu profiles the kernel node).

``--tiles CFG`` launches attention with a configuration in benchmarks/tune_tiles.py's notation instead of the
runtime's rule (BLOCK_N/num_warps/num_stages[/maxnreg], "p" block ids ahead, "c" / "n" the values converted first or
not; "rtc" / "rtn": the rule's tiles, converted first or not), so two variants of one format profile side by side.

ncu runs with ``--clock-control none`` (the clocks stay as the driver sets them), so its kernel time is comparable
with bench.py's medians.
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

DEFAULT_FORMATS = ["bf16", "fp8_e4m3", "int8_per_token_head", "int8_per_token_head_separate",
                   "int8_asym_per_token_head", "mixed_k8_v4", "mxfp8", "q8_0", "nvfp4", "int4_per_token_head",
                   "kivi_2bit"]
SECTIONS = ["SpeedOfLight", "LaunchStats", "Occupancy", "WarpStateStats", "MemoryWorkloadAnalysis",
            "ComputeWorkloadAnalysis", "InstructionStats"]
STALL = re.compile(r"smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio$")
# a pipe's busy cycles (or, for pipes without a cycle counter, its instructions) as a fraction of its peak
PIPE = re.compile(r"sm__(?:pipe_(\w+?)_cycles_active|inst_executed_pipe_(\w+?))\.avg\.pct_of_peak_sustained_active$")


def find_ncu() -> str:
    found = shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))), None) \
        or next(iter(glob.glob("/usr/local/cuda*/bin/ncu")), None)
    if not found:
        sys.exit("profile_decode: no ncu (Nsight Compute) on this machine")
    return found


def child(name: str, seqs: int, ctx: int, write: bool, dot_precision: str = "auto", after: str = "nothing",
          graphs: bool = False, tiles: str | None = None, head_size: int | None = None) -> None:
    """Set up one decode case (or write case of ctx tokens) and launch it 4 times (ncu picks one launch)."""
    import torch

    import kvgen

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench
    import tune_tiles

    tune_tiles.apply(tiles)

    bench.DOT = dot_precision
    bench.GRAPHS = graphs
    fmt = kvgen.load(name)
    block = fmt.layout.RESIDUAL["group"] if fmt.spec.streaming else 16
    if after == "copy":
        bench.copy_bandwidth()  # 4 GiB allocated and freed to the pool, which keeps them
    fn, _ = (bench.write_case(fmt, ctx, block, release_pool=after != "copy") if write
             else bench.decode_case(fmt, seqs, ctx, block, head_size or bench.D))
    for _ in range(4):
        fn()
    torch.cuda.synchronize()


def number(row: dict, key: str) -> float | None:
    value = row.get(key, "").replace(",", "")
    try:
        return float(value)
    except ValueError:
        return None


def profile(ncu: str, name: str, seqs: int, ctx: int, out: Path, write: bool = False,
            dot_precision: str = "auto", after: str = "nothing", graphs: bool = False, tiles: str | None = None,
            head_size: int | None = None) -> dict:
    kernel = "regex:reshape_and_cache|kivi_flush" if write else "regex:paged_attention"
    skip = "4" if graphs else "2"  # graphs: 3 warm-up launches, then the replays (ncu profiles a replay's node)
    cmd = [ncu, "--clock-control", "none", "--kernel-name", kernel, "--launch-skip", skip,
           "--launch-count", "1", "--csv", "--page", "raw"]
    for section in SECTIONS:
        cmd += ["--section", section]
    cmd += [sys.executable, str(Path(__file__).resolve()), "--child", name, "--shape",
            str(ctx) if write else f"{seqs}x{ctx}" + (f"hs{head_size}" if head_size else "")]
    cmd += ["--tiles", tiles] if tiles else []
    cmd += ["--write"] if write else ["--dot-precision", dot_precision]
    cmd += ["--after", after] + (["--graphs"] if graphs else [])
    run = subprocess.run(cmd, capture_output=True, text=True)
    with open(out / "ncu_raw.csv", "a") as raw:  # one file for all formats (fewer files to carry back)
        raw.write(f"# {name}{' ' + tiles if tiles else ''}\n{run.stdout}\n")
    lines = run.stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if run.returncode != 0 or start is None:
        sys.stderr.write(f"{name}: ncu failed (rc {run.returncode})\n{run.stderr[-2000:]}\n{run.stdout[-2000:]}\n")
        return {}
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    if len(rows) > 1 and rows[0].get("ID") == "":  # the units row that follows the header
        return {**rows[1], "units": rows[0]}
    return rows[0]


def find(row: dict, *patterns: str) -> float | None:
    """The value of the first metric whose name matches one of ``patterns`` (regular expressions, in order): ncu
    versions name some metrics differently."""
    for pattern in patterns:
        for key in row:
            if re.fullmatch(pattern, key) and number(row, key) is not None:
                return number(row, key)
    return None


def summary(name: str, row: dict, seqs: int, ctx: int) -> str:
    """One markdown row; instructions per (KV position or token, KV head): seqs * ctx of them, 8 KV heads."""
    def cell(value, scale=1.0, fmt="{:.0f}", unit=""):
        return "-" if value is None else fmt.format(value * scale) + unit

    stalls = sorted(((number(row, k) or 0.0, STALL.match(k).group(1)) for k in row if STALL.match(k)), reverse=True)
    top = ", ".join(f"{reason} {v:.1f}" for v, reason in stalls[:4])
    pipes: dict[str, float] = {}
    for key in row:
        match = PIPE.match(key)
        if match and number(row, key) is not None:
            pipe = match.group(1) or match.group(2)
            pipes[pipe] = max(pipes.get(pipe, 0.0), number(row, key))
    busiest = ", ".join(f"{pipe} {v:.0f}%" for pipe, v in sorted(pipes.items(), key=lambda kv: -kv[1])[:3])
    inst = find(row, r"smsp__inst_executed\.sum")
    per_pos = cell(inst, 1 / (seqs * ctx * 8), "{:.1f}")  # warp instructions per (position, KV head)
    time = find(row, r"gpu__time_duration\.sum")
    dram = find(row, r"dram__throughput\.avg\.pct_of_peak_sustained_elapsed", r"gpu__dram_throughput.*pct.*",
                r"dram__.*throughput.*pct.*")
    occupancy = find(row, r"sm__warps_active\.avg\.pct_of_peak_sustained_active")
    issue = find(row, r"smsp__issue_active\.avg\.pct_of_peak_sustained_active", r"sm__inst_issued\.avg\.pct.*",
                 r"smsp__inst_issued\.avg\.pct.*")
    cpi = find(row, r"smsp__average_warp_latency_per_inst_issued\.ratio", r"smsp__average_warps_.*per_inst_issued.*")

    units = row.get("units", {})

    def megabytes(key: str, per_second: bool = False) -> float | None:
        """The metric in MB (or MB/s): ncu gives each its own unit (byte, Kbyte, ... or byte/s, Gbyte/s, ...); None
        where the metric or its unit is missing or unknown."""
        value, unit = number(row, key), units.get(key, "byte" if not per_second else "byte/s")
        unit = unit[:-2] if per_second and unit.endswith("/s") else unit
        scale = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3, "Tbyte": 1e6}.get(unit)
        return None if value is None or scale is None else value * scale

    time_unit = units.get("gpu__time_duration.sum")
    to_us = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(time_unit, 1e-3)
    # DRAM bytes moved, read plus written: the counts where ncu gives both, else its rate times the kernel time
    read, written = megabytes("dram__bytes_read.sum"), megabytes("dram__bytes_write.sum")
    read = None if read is None or written is None else read + written
    rate = megabytes("dram__bytes.sum.per_second", per_second=True)
    if read is None and rate is not None and time is not None:
        read = rate * time * to_us * 1e-6  # MB/s x us -> MB
    return (f"| {name} | {cell(time, to_us)} | {cell(dram, unit='%')} | {cell(read)} | "
            f"{cell(find(row, r'launch__registers_per_thread'))} | {cell(occupancy, unit='%')} | "
            f"{cell(issue, unit='%')} | {per_pos} | {cell(cpi, fmt='{:.1f}')} | {top} | {busiest or '-'} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", default=DEFAULT_FORMATS)
    ap.add_argument("--shape", default=None, help="sequences x context (default 64x8192; 64x8192hs64: head size "
                    "64); with --write, tokens (default 32768)")
    ap.add_argument("--write", action="store_true", help="profile reshape-and-cache (KIVI: its flush) instead")
    ap.add_argument("--out", default="profile_out")
    from kvgen.runtime.kernels import DOT_PRECISIONS

    ap.add_argument("--dot-precision", default="auto", choices=DOT_PRECISIONS,
                    help="attention's dot precision (decode only)")
    ap.add_argument("--after", default="nothing", choices=["nothing", "copy"],
                    help="what the child runs before setting up its case (copy: bench.py's copy measurement, the "
                    "allocator pool kept)")
    ap.add_argument("--graphs", action="store_true", help="launch the case as CUDA-graph replays (bench.py's)")
    ap.add_argument("--tiles", default=None, help="attention's launch in tune_tiles.py's notation (e.g. "
                    "128/4/3/168pc, rtn) instead of the runtime's rule")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    shape = args.shape or ("32768" if args.write else "64x8192")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    head_size = None
    if args.write:
        if not shape.isdigit():
            ap.error(f"--shape {shape!r}: expected a token count")
        seqs, ctx = 1, int(shape)
    else:
        import bench

        seqs, ctx, head_size, q_len = bench.decode_shapes(ap, [shape], "--shape")[shape]
        if q_len != 1:
            ap.error(f"--shape {shape!r}: decode only (one new token per sequence)")
    if args.tiles and args.write:
        ap.error("--tiles: attention's launch; writes take benchmarks/tune_writes.py")
    if args.tiles:
        import tune_tiles

        try:
            tune_tiles.apply(args.tiles)
        except ValueError as e:
            ap.error(f"--tiles: {e}")
        tune_tiles.apply(None)
    if args.child:
        child(args.child, seqs, ctx, args.write, args.dot_precision, args.after, args.graphs, args.tiles, head_size)
        return 0
    ncu = find_ncu()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    what = (f"reshape-and-cache of {ctx} tokens" if args.write
            else f"decode {seqs} x {ctx}{f' at head size {head_size}' if head_size else ''}, bf16 queries, dot "
            f"precision {args.dot_precision}{f', tiles {args.tiles}' if args.tiles else ''}")
    print(f"ncu: {ncu}; {what}; one launch per format", flush=True)
    print(f"| format | kernel us | DRAM of peak | DRAM MB moved | registers | achieved occupancy "
          f"| issue slots busy | warp instr / {'token' if args.write else 'KV position'} and KV head | cycles per "
          "issue | largest stalls (cycles per issued instruction) | busiest pipes (of peak) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.formats:
        row = profile(ncu, name, seqs, ctx, out, args.write, args.dot_precision, args.after, args.graphs,
                      args.tiles, head_size)
        if row:
            print(summary(name, row, seqs, ctx), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "0")
    sys.exit(main())
