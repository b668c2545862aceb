"""Tile experiment (issue 5): attention time (decode, or a chunked prefill) for each tile choice (KV positions per
step / warps / pipeline stages / register cap), per format and shape. On a GPU:

    python benchmarks/tune_tiles.py bf16 fp8_e4m3 int8_per_token_head
    python benchmarks/tune_tiles.py fp8_e4m3 --configs 128/4/2 128/4/2/128 --programs-per-sm 4 8
    python benchmarks/tune_tiles.py int8_per_token_head --shapes 64x8192hs64   # head size 64
    python benchmarks/tune_tiles.py int8_per_token_head_separate --shapes 4x8192q2048   # bench.py's chunked prefill
    (each cell: median us and, in parentheses, the cache bytes read over that time as a fraction of the copy
    bandwidth; a prefill is bound by its dots, so there only the times compare)
    python benchmarks/tune_tiles.py q8_0 --dot-precision fast             # another dot precision (default auto)
    python benchmarks/tune_tiles.py mxfp8 --configs 128/8/2 --prefill-rows 128 --shapes 4x8192q2048  # 128 rows

A config is BLOCK_N/num_warps/num_stages[/maxnreg][p][c|n][s] (p: the next step's block ids loaded one step ahead; c /
n: the value codes converted in their load's layout or not, V_CONVERT_FIRST, by default the runtime's rule; s: the
value dot in two halves of the columns, V_SPLIT, where the format's VALUE_SPLIT allows it); a
register cap below the compiler's choice (255 for most generated kernels) lets more programs share an SM, at the
price of spills (`python benchmarks/sass_count.py` counts
both without a GPU). --programs-per-sm sets the split-KV target. The choice the runtime makes is
kvgen.runtime.kernels.attention_tiles (rules in ATTENTION_TILES); this script overrides it (TILE_OVERRIDE) per run and prints one markdown
row per (format, shape) with time and fraction of copy bandwidth per config.
"""
import argparse
import re
import sys
from pathlib import Path

import kvgen
from kvgen.runtime import kernels as K

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

DEFAULT_CONFIGS = ["64/4/3", "128/4/3", "128/8/3", "64/4/4", "128/4/2", "32/4/4"]


def parse(config: str) -> dict:
    """A config's tiles: BLOCK_N/num_warps/num_stages[/maxnreg] and letters after the numbers: "p" block ids one
    step ahead (PREFETCH_BLOCKS), "c" / "n" the values converted in their load's layout or not (V_CONVERT_FIRST,
    "convert_first" in the dict; without either the runtime's rule decides), "s" / "q" the value dot split in two /
    four (V_SPLIT, "value_split"), "f" every query row in a "live" kernel's decode steps (no FOLD_ROWS: "live_fold"
    False)."""
    m = re.fullmatch(r"([\d/]+)([pcnsqf]*)", config)
    if m is None:
        raise ValueError(f"config {config!r}: BLOCK_N/num_warps/num_stages[/maxnreg] and letters p, c, n, s, q or f")
    parts = [int(x) for x in m[1].split("/") if x]
    if len(parts) not in (3, 4):
        raise ValueError(f"config {config!r}: BLOCK_N/num_warps/num_stages[/maxnreg], 3 or 4 numbers")
    c = dict(BLOCK_N=parts[0], num_warps=parts[1], num_stages=parts[2])
    if len(parts) > 3:
        c["maxnreg"] = parts[3]
    if "p" in m[2]:
        c["prefetch_blocks"] = True
    if "c" in m[2] and "n" in m[2]:
        raise ValueError(f"config {config!r}: 'c' and 'n' exclude each other")
    if "c" in m[2] or "n" in m[2]:
        c["convert_first"] = "c" in m[2]
    if "s" in m[2]:
        c["value_split"] = 2
    if "q" in m[2]:
        c["value_split"] = 4
    if "f" in m[2]:
        c["live_fold"] = False
    return c


def add_prefill_rows_option(ap: argparse.ArgumentParser) -> None:
    """The scripts' --prefill-rows: query rows per prefill program for every call (force_prefill_rows)."""
    ap.add_argument("--prefill-rows", type=int, choices=(64, 128), default=None,
                    help="query rows per prefill program at most, for every config (kvgen.runtime.kernels."
                    "PREFILL_ROWS and RULED_PREFILL_ROWS); by default the rules' rows for 'rt' configs (128 where a "
                    "rule names them) and 64 for the others, which replace the rules")


def force_prefill_rows(rows: int | None) -> None:
    """Make every prefill program hold at most ``rows`` query rows, ruled or not (None: the runtime's choice)."""
    if rows is not None:
        K.PREFILL_ROWS = K.RULED_PREFILL_ROWS = rows


def apply(config: str | None, programs_per_sm: int | None = None) -> None:
    """Make the runtime launch every attention call with ``config`` (None or "rt": its own rules; "rtc" / "rtn": its
    own tiles, the values converted in their load's layout or not)."""
    if config in (None, "rt", "rtc", "rtn"):
        K.TILE_OVERRIDE = None
        K.CONVERT_FIRST_OVERRIDE = {"c": True, "n": False}.get((config or "rt")[2:])
        return
    tiles = parse(config)
    K.CONVERT_FIRST_OVERRIDE = tiles.pop("convert_first", None)
    K.TILE_OVERRIDE = tiles if programs_per_sm is None else dict(tiles, programs_per_sm=programs_per_sm)


def context_lost(e: Exception) -> bool:
    """Whether an error came from the GPU itself (an illegal address, a trap: torch's AcceleratorError, Triton's
    "Triton Error [CUDA]"), after which every later launch of the process fails too; not a compile rejection."""
    return type(e).__name__ == "AcceleratorError" or "[CUDA]" in str(e) or "CUDA error" in str(e)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("formats", nargs="+")
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    ap.add_argument("--programs-per-sm", nargs="+", type=int, default=[4])
    ap.add_argument("--shapes", nargs="+", default=["64x8192", "4x65536"])
    ap.add_argument("--dot-precision", choices=K.DOT_PRECISIONS, default="auto")
    ap.add_argument("--fast-block-dot-bits", type=int, default=None,
                    help="under --dot-precision fast, block-scaled sides with codes of at most this many bits keep "
                    "auto's per-block dots (kvgen.runtime.kernels.FAST_BLOCK_DOT_BITS; default: the runtime's)")
    add_prefill_rows_option(ap)
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="time CUDA-graph replays, each configuration captured on its own (eager calls pay the host's "
                    "per-call work, which outlasts short kernels: 2026-12-04, fp8 at 4 x 65536 read 324 us eager "
                    "where its graph replays took 174)")
    args = ap.parse_args()
    bench.DOT = args.dot_precision
    if args.fast_block_dot_bits is not None:
        K.FAST_BLOCK_DOT_BITS = args.fast_block_dot_bits
    force_prefill_rows(args.prefill_rows)
    bench.require_gpu(ap)
    shapes = bench.decode_shapes(ap, args.shapes)
    # the runtime's own tiles ("rt...") take its own split target: one column each
    cols = [(c, None) for c in args.configs if c.startswith("rt")]
    cols += [(c, pps) for pps in args.programs_per_sm for c in args.configs if not c.startswith("rt")]
    for c, _ in cols:  # every config checked before anything is timed
        try:
            apply(c)
        except ValueError as e:
            ap.error(f"--configs: {e}")
    copy = bench.copy_bandwidth()
    print(f"copy bandwidth {copy / 1e9:.0f} GB/s; dot precision {args.dot_precision}"
          + (f"; fast block dots at <= {K.FAST_BLOCK_DOT_BITS} bits" if args.dot_precision == "fast" else ""))
    print("| format | shape | " + " | ".join(c if pps is None else f"{c} pps {pps}" for c, pps in cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for name in args.formats:
        fmt = kvgen.load(name)
        for shape in args.shapes:
            seqs, ctx, head, q_len = shapes[shape]
            block = 32 if fmt.spec.streaming else 16
            fn, moved = bench.decode_case(fmt, seqs, ctx, block, head, q_len, graphs=False)
            res, lost = [], None
            for c, pps in cols:
                if lost is not None:
                    res.append("not run")
                    continue
                apply(c, pps)
                try:
                    # a graph holds the launch it captured: one per configuration
                    t = bench.bench(bench.graphed(fn) if args.cuda_graphs else fn)
                    res.append(f"{t * 1e6:.0f} ({moved / t / copy * 100:.0f}%)")
                except Exception as e:  # a config the compiler rejects (shared memory, registers)
                    res.append(f"failed: {type(e).__name__}")
                    if context_lost(e):
                        lost = (f"{c}{'' if pps is None else f' pps {pps}'}: {type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}")
            print(f"| {name} | {shape} | " + " | ".join(res) + " |", flush=True)
            if lost is not None:
                sys.exit(f"{name} at {shape}, config {lost}: a CUDA error leaves this process's context unusable, "
                         "so nothing after it was run; time the other configs in a new process")


if __name__ == "__main__":
    main()
