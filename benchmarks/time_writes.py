"""Reshape-and-cache times of some formats, in the state benchmarks/bench.py times them (one decode case of the
format first, then each write case built after the allocator's pool is released: bench.write_case), as CUDA-graph
replays. For A/B runs of two trees on one machine: the
script times whichever tree ``kvgen`` imports from and uses that tree's benchmarks/bench.py, so the same file
serves both (`PYTHONPATH=OTHER_TREE_PARENT python benchmarks/time_writes.py ...`).

    python benchmarks/time_writes.py kivi_2bit kivi_4bit --tokens 32768 256 --rounds 2
    python benchmarks/time_writes.py kivi_2bit --flushing 256 64   # KIVI decode steps whose every token flushes a group

Prints one markdown row per (format, token count): median us per round and the fraction of the copy bandwidth
measured in the same run (bytes as bench.py counts them; none for the flushing steps, whose bytes bench.py does not
count).
"""
import argparse
import sys
from pathlib import Path

import torch

import kvgen

sys.path.insert(0, str(Path(kvgen.__file__).resolve().parent / "benchmarks"))
import bench  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("formats", nargs="+")
    ap.add_argument("--tokens", nargs="+", type=int, default=[32768, 256])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--flushing", nargs="*", type=int, default=[],
                    help="KIVI: also decode steps of these many sequences, each of whose new tokens flushes a group "
                         "read back from the residual ring (rows 'N flushing')")
    args = ap.parse_args()
    bench.require_gpu(ap)
    bench.GRAPHS = True
    copy = bench.copy_bandwidth()
    print(f"tree {Path(kvgen.__file__).resolve().parent}; copy bandwidth {copy / 1e9:.0f} GB/s")
    print("| format | tokens | " + " | ".join(f"round {r + 1} us" for r in range(args.rounds)) + " | of copy bw |")
    print("|---|---|" + "---|" * (args.rounds + 1))
    for name in args.formats:
        fmt = kvgen.load(name)
        block = fmt.layout.RESIDUAL["group"] if fmt.spec.streaming else 16
        fn, _ = bench.decode_case(fmt, 64, 8192, block)
        bench.bench(fn)
        del fn
        torch.cuda.empty_cache()
        cases = [(t, False) for t in args.tokens]
        cases += [(t, True) for t in args.flushing] if fmt.spec.streaming else []
        for tokens, flushing in cases:
            fn, moved = bench.write_case(fmt, tokens, block, flushing=flushing)
            times = [bench.bench(fn) for _ in range(args.rounds)]
            best = min(times)
            label = f"{tokens} flushing" if flushing else f"{tokens}"
            print(f"| {name} | {label} | " + " | ".join(f"{t * 1e6:.1f}" for t in times)
                  + (" | - |" if flushing else f" | {moved / best / copy * 100:.0f}% |"), flush=True)
            del fn
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
