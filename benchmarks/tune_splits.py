"""Split experiment (issue 5): decode time for each number of KV splits per program (flash decoding), per format and
shape, timed as CUDA-graph replays of a planned step (at short contexts an eager call's host work outlasts the
kernel; the ninth session's runs 3-4 replayed `attend` calls, the same kernels). On a GPU:

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


def timed(fmt, seqs: int, ctx: int, block_size: int, num_splits: int | None = None) -> tuple[float, int]:
    """Microseconds of one decode step as a CUDA-graph replay of its plan, and the split count the plan launches
    (its grid's third axis; ``num_splits`` None: the runtime's choice)."""
    fn, _ = bench.decode_case(fmt, seqs, ctx, block_size, planned=True, graphs=False, num_splits=num_splits)
    return bench.bench(bench.graphed(fn)) * 1e6, fn.plan._launch.grid[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("formats", nargs="+")
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES)
    ap.add_argument("--splits", nargs="*", type=int, default=DEFAULT_SPLITS,
                    help="forced split counts to time (none: the runtime's rule and --rules only)")
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
    print("| " + " | ".join(["format", "shape", "runtime (splits)"] + [f"{r} (splits)" for r in rules]
                            + [f"{s} splits" for s in args.splits]) + " |")
    print("|---|---|---|" + "---|" * (len(rules) + len(args.splits)))
    for name in args.formats:
        fmt = kvgen.load(name)
        block = fmt.layout.RESIDUAL["group"] if fmt.spec.streaming else 16
        for label, seqs, ctx in shapes:
            times, chosen = {}, {}
            times["runtime"], chosen["runtime"] = timed(fmt, seqs, ctx, block)
            for rule, assign in rules.items():
                saved = {k: getattr(K, k) for k in assign}
                vars(K).update(assign)
                try:
                    times[rule], chosen[rule] = timed(fmt, seqs, ctx, block)
                finally:
                    vars(K).update(saved)
            for s in args.splits:
                times[s], _ = timed(fmt, seqs, ctx, block, s)
            best = min(times.values())
            cell = lambda t: f"**{t:.1f}**" if t == best else f"{t:.1f}"  # noqa: E731
            ruled = [f"{cell(times[r])} ({chosen[r]})" for r in rules]
            print("| " + " | ".join([name, label, f"{cell(times['runtime'])} ({chosen['runtime']})"] + ruled
                                    + [cell(times[s]) for s in args.splits]) + " |", flush=True)


if __name__ == "__main__":
    main()
