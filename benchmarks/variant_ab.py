"""A/B of a variant of generated attention kernels against the shipped ones (issue 5), on a GPU:

    python benchmarks/variant_ab.py VARIANT_DIR fp8_e4m3 [--configs 128/4/2/168 ...] [--shapes 64x8192 4x65536]
    python benchmarks/variant_ab.py VARIANT_DIR mxfp8 --shapes 64x8192hs64      # head size 64
    python benchmarks/variant_ab.py VARIANT_DIR int8_per_token_head --configs 128/8/2 --prefill-rows 128 \
        --shapes 4x8192q2048                                                     # 128-row chunked prefill

VARIANT_DIR holds generated format packages (a copy of ``generated/NAME`` with its kernels.py edited by hand, or the
output of ``kvgen build -o`` from a changed template). For each format, shape and config (as tune_tiles.py's; "rt":
the runtime's own choice), one cache is built as bench.py builds it and filled by the shipped write; the shipped
kernels and the variant's attend on it with the same query, and the script prints both medians (CUDA-graph replays,
alternating rounds) and the largest difference between their outputs relative to the output's largest value (the
variant must compute the same attention: a difference beyond rounding means it is wrong). Times are in us; the fraction is of the
copy bandwidth measured in the same run.
"""
import argparse
import sys
from pathlib import Path

import torch

import kvgen
from kvgen.runtime import kernels as K

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
from tune_tiles import add_prefill_rows_option, apply, force_prefill_rows  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variant_dir")
    ap.add_argument("formats", nargs="+")
    ap.add_argument("--configs", nargs="+", default=["rt"])
    ap.add_argument("--shapes", nargs="+", default=["64x8192", "4x65536", "256x1024"],
                    help="SEQSxCONTEXT or SEQSxCONTEXThsHEAD (head size; default 128)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dot-precision", choices=K.DOT_PRECISIONS, default="auto",
                    help="both kernels' dot precision (where the format offers it, as bench.py runs it)")
    add_prefill_rows_option(ap)
    args = ap.parse_args()
    shapes = bench.decode_shapes(ap, args.shapes)
    bench.DOT = args.dot_precision
    force_prefill_rows(args.prefill_rows)
    bench.require_gpu(ap)
    bw = bench.copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    print("| format | shape | config | shipped us | variant us | variant / shipped | shipped of copy bw "
          "| variant of copy bw | max diff / max |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.formats:
        shipped = kvgen.load(name)
        variant = kvgen.load(str(Path(args.variant_dir) / name))
        for shape, (seqs, ctx, head_size, q_len) in shapes.items():
            for config in args.configs:
                apply(config)
                block = 32 if shipped.spec.streaming else 16  # KIVI: pages of whole key groups
                fn_a, nbytes = bench.decode_case(shipped, seqs, ctx, block, head_size, q_len, graphs=False)
                q, cache, table, seq_lens, qsl, kw = fn_a.inputs  # the same case through the variant
                bench.write_real_codes(shipped, cache, table, ctx)  # bench.py's random bytes hold NaN codes
                fn_b = lambda: variant.attend(q, cache, table, seq_lens, qsl, **kw)  # noqa: E731
                out_a, out_b = fn_a().float(), fn_b().float()
                # the outputs are finite (real codes); a NaN or inf in one and not the other is counted apart
                both = torch.isfinite(out_a) & torch.isfinite(out_b)
                nan_mismatch = (torch.isfinite(out_a) != torch.isfinite(out_b)).sum().item()
                diff = (((out_a - out_b).abs()[both].max() / out_a.abs()[both].max().clamp_min(1e-30)).item()
                        if both.any() else float("nan"))
                diff = f"{diff:.1e}" + (f", {nan_mismatch} non-finite apart" if nan_mismatch else "")
                ga, gb = bench.graphed(fn_a), bench.graphed(fn_b)
                ta, tb = [], []
                for _ in range(args.rounds):
                    ta.append(bench.bench(ga))
                    tb.append(bench.bench(gb))
                a, b = min(ta), min(tb)
                print(f"| {name} | {shape} | {config} | {a * 1e6:.1f} | {b * 1e6:.1f} | {b / a:.3f} | "
                      f"{nbytes / a / bw:.0%} | {nbytes / b / bw:.0%} | {diff} |", flush=True)
                del fn_a, fn_b, ga, gb, cache
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
