"""Split experiment (issue 5): decode time for each number of KV splits per program (flash decoding), per format and
shape, timed as CUDA-graph replays (at short contexts an eager call's host work outlasts the kernel). On a GPU:

    python benchmarks/tune_splits.py bf16 fp8_e4m3 kivi_2bit
    python benchmarks/tune_splits.py q4_0 --shapes 4x1024 4x4096 16x2048 --splits 1 2 4 8 16

Each row is one (format, shape): the time of the runtime's own choice (kvgen.runtime.kernels: the rule above
MIN_SPLIT) and the split count it chose, the same for each `--rules` variant of that rule's constants, and the time
of every forced split count (`attend(..., num_splits=N)`); the best in bold:

    python benchmarks/tune_splits.py bf16 --rules FEW_PROGRAMS_PER_SM=0 MIN_FEW_SPLIT=256
"""
import argparse
import re
import sys
from pathlib import Path

import kvgen
from kvgen.runtime import kernels as K

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

DEFAULT_SHAPES = ["4x1024", "4x2048", "4x4096", "16x1024", "1x16384", "64x8192"]
DEFAULT_SPLITS = [1, 2, 4, 8, 16, 32]


def chosen_splits(fmt, seqs: int, ctx: int, block_size: int) -> int:
    """The split count the runtime picks for this decode shape (read off a plan's launch grid)."""
    fn, _ = bench.decode_case(fmt, seqs, ctx, block_size, planned=True, graphs=False)
    return fn.plan._launch.grid[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("formats", nargs="+")
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES)
    ap.add_argument("--splits", nargs="+", type=int, default=DEFAULT_SPLITS)
    ap.add_argument("--rules", nargs="+", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                    help="also time the runtime's rule with these constants of kvgen.runtime.kernels changed, e.g. "
                         "FEW_PROGRAMS_PER_SM=0 (the rule before the ninth session) or MIN_FEW_SPLIT=256")
    args = ap.parse_args()
    bench.require_gpu(ap)
    shapes = []
    for shape in args.shapes:
        m = re.fullmatch(r"(\d+)x(\d+)", shape)
        if m is None:
            ap.error(f"--shapes: {shape!r} is not SEQSxCONTEXT (e.g. 4x1024)")
        shapes.append((shape, int(m[1]), int(m[2])))
    rules = {}
    for rule in args.rules:
        try:
            rules[rule] = {k: int(v) for k, v in (a.split("=") for a in rule.split(","))}
        except ValueError:
            ap.error(f"--rules: {rule!r} is not NAME=VALUE[,NAME=VALUE] with integer values")
        for k in rules[rule]:
            if not isinstance(getattr(K, k, None), int):
                ap.error(f"--rules: kvgen.runtime.kernels has no integer constant {k!r}")
    print("| format | shape | runtime (splits) | " + " | ".join([f"{r} (splits)" for r in rules]
                                                            + [f"{s} splits" for s in args.splits]) + " |")
    print("|---|---|---|" + "---|" * (len(rules) + len(args.splits)))
    for name in args.formats:
        fmt = kvgen.load(name)
        block = fmt.layout.RESIDUAL["group"] if fmt.spec.streaming else 16
        for label, seqs, ctx in shapes:
            fn, _ = bench.decode_case(fmt, seqs, ctx, block, graphs=True)
            times = {"runtime": bench.bench(fn) * 1e6}
            del fn
            chosen = {"runtime": chosen_splits(fmt, seqs, ctx, block)}
            for rule, assign in rules.items():
                saved = {k: getattr(K, k) for k in assign}
                vars(K).update(assign)
                try:
                    fn, _ = bench.decode_case(fmt, seqs, ctx, block, graphs=True)
                    times[rule] = bench.bench(fn) * 1e6
                    chosen[rule] = chosen_splits(fmt, seqs, ctx, block)
                    del fn
                finally:
                    vars(K).update(saved)
            for s in args.splits:
                fn, _ = bench.decode_case(fmt, seqs, ctx, block, graphs=True, num_splits=s)
                times[s] = bench.bench(fn) * 1e6
                del fn
            best = min(times.values())
            cell = lambda t: f"**{t:.1f}**" if t == best else f"{t:.1f}"  # noqa: E731
            ruled = [f"{cell(times[r])} ({chosen[r]})" for r in rules]
            print(f"| {name} | {label} | {cell(times['runtime'])} ({chosen['runtime']}) | "
                  + " | ".join(ruled + [cell(times[s]) for s in args.splits]) + " |", flush=True)


if __name__ == "__main__":
    main()
