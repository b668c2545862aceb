"""KIVI's key fold (issue 5) by head size: decode time with the fold and without it. The runtime folds only at the
padded head sizes in ``kvgen.runtime.kernels.KEY_FOLD_HEADS`` (measured to gain: 128 and 256; 64 lost 2-3%); this
script measures others before they join that list. On a GPU:

    python benchmarks/key_fold_heads.py                      # kivi_2bit and kivi_4bit, heads 64 / 128 / 256
    python benchmarks/key_fold_heads.py kivi_2bit --heads 256 --shape 16x8192

Each row: one format and head size at one shape (sequences x context; 32 query heads over 8 KV heads, block size
the key group), timed as CUDA-graph replays of a planned decode step, with the fold forced on and off. The cache
holds random bytes, as in bench.py (scales among them NaN or inf), so the outputs say nothing: the fold's
correctness at a head size is tests/test_kivi.py's (test_decode_streams_through_the_key_fold).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import kvgen
from kvgen.runtime import kernels as K

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402


def run(fmt, seqs: int, ctx: int, head: int, fold: bool) -> float:
    """Microseconds of one planned decode step (graph replay) with the fold forced on or off."""
    heads = K.KEY_FOLD_HEADS
    K.KEY_FOLD_HEADS = (max(16, 1 << (head - 1).bit_length()),) if fold else ()  # the plan reads it
    try:
        fn, _ = bench.decode_case(fmt, seqs, ctx, fmt.layout.RESIDUAL["group"], head, planned=True, graphs=False)
        assert fn.plan._launch.kwargs["KEY_FOLD"] is fold, "the runtime did not take the forced choice"
        return bench.bench(bench.graphed(fn)) * 1e6
    finally:
        K.KEY_FOLD_HEADS = heads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("formats", nargs="*", default=["kivi_2bit", "kivi_4bit"])
    ap.add_argument("--heads", nargs="+", type=int, default=[64, 128, 256])
    ap.add_argument("--shape", default="64x8192", help="sequences x context")
    args = ap.parse_args()
    bench.require_gpu(ap)
    seqs, ctx = (int(x) for x in args.shape.split("x"))
    print("| format | head | shape | fold us | no fold us | change |")
    print("|---|---|---|---|---|---|")
    for name in args.formats:
        fmt = kvgen.load(name)
        if not getattr(fmt._kernels.module, "KEY_FOLD", False):
            ap.error(f"{name}: its keys are not scaled per channel and token group (no KEY_FOLD)")
        for head in args.heads:
            t_on, t_off = run(fmt, seqs, ctx, head, True), run(fmt, seqs, ctx, head, False)
            print(f"| {name} | {head} | {args.shape} | {t_on:.0f} | {t_off:.0f} | {100 * (t_on / t_off - 1):+.1f}% |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
