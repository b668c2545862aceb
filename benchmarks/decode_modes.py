"""Decode attention time per format and dot precision (issue 5: the quantized compute domain against kvgen's exact
default), on a GPU:

    python benchmarks/decode_modes.py                                  # formats that offer "quantized"
    python benchmarks/decode_modes.py --formats bf16 fp8_e4m3 --modes auto --shapes 64x8192

Prints a markdown table: median time (us), fraction of the copy bandwidth measured in the same run, and the ratio
to the bf16 format's time at the same shape under the runtime's own tile choice. Shapes as benchmarks/bench.py
(32 query heads, 8 KV heads, head size 128, block size 16).
"""
import argparse
import sys
from pathlib import Path

import kvgen
from kvgen.runtime.kernels import DOT_PRECISIONS

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+",
                    default=[n for n in kvgen.shipped_names() if any(kvgen.load(n).quantized_dot.values())])
    ap.add_argument("--modes", nargs="+", default=["auto", "quantized"], choices=DOT_PRECISIONS)
    ap.add_argument("--shapes", nargs="+", default=["64x8192", "4x65536"])
    args = ap.parse_args()
    bench.require_gpu(ap)
    copy = bench.copy_bandwidth()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    bf16 = {}
    for seqs, ctx in shapes:
        bench.DOT = "auto"
        fn, _ = bench.decode_case(kvgen.load("bf16"), seqs, ctx, 16)
        bf16[(seqs, ctx)] = bench.bench(fn)
    print(f"copy bandwidth {copy / 1e9:.0f} GB/s; bf16: "
          + ", ".join(f"{s}x{c} {t * 1e6:.0f} us" for (s, c), t in bf16.items()))
    print("| format | dot precision | " + " | ".join(args.shapes) + " |")
    print("|---|---|" + "---|" * len(shapes))
    for name in args.formats:
        fmt = kvgen.load(name)
        for mode in args.modes:
            cells = []
            for seqs, ctx in shapes:
                bench.DOT = mode
                fn, moved = bench.decode_case(fmt, seqs, ctx, 32 if fmt.spec.streaming else 16)
                t = bench.bench(fn)
                cells.append(f"{t * 1e6:.0f} ({moved / t / copy * 100:.0f}%, {t / bf16[(seqs, ctx)]:.2f}x)")
            print(f"| {name} | {mode} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
