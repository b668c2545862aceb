"""Chunked prefill fused against dequantize-first (``Format.attend(..., dequantize_first=True)``) on one GPU.

    python benchmarks/dequantize_first.py [FORMAT ...] [--shape 4x8192q2048] [--query-heads 32] [--out FILE.md]
    python benchmarks/dequantize_first.py --dequant-tiles 64/8 FORMAT ...   # the dequantize kernel's positions
                                                                            # per program / warps (default 32/4)

For each format (default: every shipped one) at bench.py's chunked prefill (2048 new bf16 tokens on each of 4
sequences of 8192; 32 query heads (or --query-heads), 8 KV heads, head size 128, block size 16, KIVI 32), as
planned calls (``plan_attention`` once, ``plan.run`` timed as CUDA-graph replays, as an engine runs each layer):

- fused: the format's paged attention (``dot_precision="auto"``, or ``--dot-precision fast``; the dense
  attention runs under the same precision);
- dequantize-first: the format's dequantize_kernel into a dense bf16 cache, then bf16's attention over it;
- of which the dequantize kernel alone, its bytes (the cells read, bf16 K and V written) and their rate as a
  fraction of the device-to-device copy bandwidth measured in the same run;
- each time against bf16's fused prefill on the same shape, and the largest difference of the two outputs relative
  to the largest output value (the caches hold codes the format's write computed from random bf16 data);
- which of the two ``dequantize_first="auto"`` takes there (kvgen.runtime.dequantize.auto_dense).

Prints a markdown table as it goes; ``--out`` also writes it to a file.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402

import kvgen  # noqa: E402
from kvgen.runtime import dequantize as D  # noqa: E402
from kvgen.runtime.dequantize import auto_dense  # noqa: E402


def set_dequant_tiles(text: str) -> None:
    """Every dequantize program's positions and warps from BLOCK_N/WARPS (kvgen.runtime.dequantize's DEQUANT_BLOCK_N
    / DEQUANT_WARPS, and DEQUANT_ROT_DOT_BLOCK_N, the rows of sides rotated back by dots); ValueError if malformed.
    Also benchmarks/sass_count.py's."""
    try:
        block_n, warps = (int(x) for x in text.split("/"))
    except ValueError:
        block_n = warps = 0
    if block_n < 1 or block_n & (block_n - 1) or warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"{text!r} is not BLOCK_N/WARPS with BLOCK_N a power of two and WARPS one of 1, 2, 4, 8, "
                         "16 (e.g. 64/8)")
    D.DEQUANT_BLOCK_N, D.DEQUANT_WARPS = block_n, warps
    D.DEQUANT_ROT_DOT_BLOCK_N = block_n


def planned_prefill(fmt, seqs: int, ctx: int, q_len: int, head_size: int):
    """(plan.run as a graph replay, dequantize-first plan.run, its dequantize kernel alone, the two plans' outputs
    for comparison, bytes the dequantize kernel moves, whether dequantize_first="auto" would dequantize first) on a
    cache of real codes."""
    res = fmt.layout.RESIDUAL
    block = res["group"] if res else 16
    fn, _ = bench.decode_case(fmt, seqs, ctx, block, head_size, q_len=q_len, graphs=False)
    q, cache, table, seq_lens, qsl, kwargs = fn.inputs
    bench.write_real_codes(fmt, cache, table, ctx)
    kwargs = dict(kwargs, max_seq_len=ctx)  # no device-to-host read for the dense cache's size
    fused = fmt.plan_attention(q, cache, table, seq_lens, qsl, **kwargs)
    first = fmt.plan_attention(q, cache, table, seq_lens, qsl, dequantize_first=True, **kwargs)
    ptrs = fmt._kernel_args(cache)[0]
    out_a, out_b = torch.empty_like(q), torch.empty_like(q)
    launch = first._launch
    cell = fmt.page_bytes(block, bench.HKV, head_size) / block / bench.HKV
    moved = seqs * ctx * bench.HKV * (cell + 2 * head_size * 2)
    auto = auto_dense(fmt, q, seqs, table, block, bench.HKV, kwargs["dot_precision"], ctx)
    return (bench.graphed(lambda: fused.run(q, cache, out=out_a)),
            bench.graphed(lambda: first.run(q, cache, out=out_b)),
            bench.graphed(lambda: launch.dequantize(ptrs)), (out_a, out_b), moved, auto)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("formats", nargs="*")
    ap.add_argument("--shape", default="4x8192q2048", help="SEQSxCONTEXTqNEW[hsHEAD] (default: bench.py's prefill)")
    ap.add_argument("--query-heads", type=int, default=bench.HQ,
                    help=f"query heads over bench.py's {bench.HKV} KV heads (default {bench.HQ}): the group that "
                         "dequantize_first=\"auto\"'s counts scale with")
    ap.add_argument("--dequant-tiles", metavar="BLOCK_N/WARPS",
                    help="the dequantize kernel's positions per program and warps (kvgen.runtime.dequantize's "
                         f"DEQUANT_BLOCK_N / DEQUANT_WARPS, default {D.DEQUANT_BLOCK_N}/{D.DEQUANT_WARPS})")
    ap.add_argument("--dot-precision", choices=("auto", "fast"), default="auto",
                    help="the attention's dots, fused and dense alike (\"auto\"'s counts were measured under auto)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    bench.DOT = args.dot_precision
    if args.dequant_tiles is not None:
        try:
            set_dequant_tiles(args.dequant_tiles)
        except ValueError as exc:
            ap.error(f"--dequant-tiles: {exc}")
    if args.query_heads < 1 or args.query_heads % bench.HKV:
        ap.error(f"--query-heads: {args.query_heads} is not a positive multiple of the {bench.HKV} KV heads")
    bench.require_gpu(ap)
    bench.HQ = args.query_heads
    (seqs, ctx, head_size, q_len), = bench.decode_shapes(ap, [args.shape], "--shape").values()
    names = args.formats or kvgen.shipped_names()
    unknown = sorted(set(names) - set(kvgen.shipped_names()))
    if unknown:
        ap.error(f"unknown formats {unknown}; shipped: {' '.join(kvgen.shipped_names())}")
    copy = bench.copy_bandwidth()
    bf16_fused, *_ = planned_prefill(kvgen.load("bf16"), seqs, ctx, q_len, head_size)
    t_bf16 = bench.bench(bf16_fused)
    rot_rows = D.DEQUANT_ROT_DOT_BLOCK_N
    tiles = f"{D.DEQUANT_BLOCK_N}/{D.DEQUANT_WARPS}" + (f" ({rot_rows} rows rotated back by dots)"
                                                        if rot_rows != D.DEQUANT_BLOCK_N else "")
    lines = [f"Chunked prefill {args.shape}, {bench.HQ} query heads over {bench.HKV} KV heads, {bench.DOT} dots, "
             f"dequantize tiles {tiles} (`python benchmarks/dequantize_first.py {' '.join(sys.argv[1:])}`), "
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Python {platform.python_version()}, "
             f"{datetime.date.today()}; bf16 fused {t_bf16 * 1e6:.0f} us, copy bandwidth {copy / 1e9:.0f} GB/s.",
             "",
             "| format | fused us | vs bf16 | dequantize-first us | vs bf16 | dequantize us | of copy bw | "
             "max diff / max out | \"auto\" takes |",
             "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for name in names:
        fmt = kvgen.load(name)
        fused, first, dequant, (out_a, out_b), moved, auto = planned_prefill(fmt, seqs, ctx, q_len, head_size)
        t_a, t_b, t_d = bench.bench(fused), bench.bench(first), bench.bench(dequant)
        diff = float((out_a.float() - out_b.float()).abs().max() / out_a.float().abs().max().clamp_min(1e-30))
        row = (f"| {name} | {t_a * 1e6:.0f} | {t_a / t_bf16:.2f}x | {t_b * 1e6:.0f} | {t_b / t_bf16:.2f}x | "
               f"{t_d * 1e6:.0f} | {moved / t_d / copy:.0%} | {diff:.2e} | {'dense' if auto else 'fused'} |")
        print(row, flush=True)
        lines.append(row)
        del fused, first, dequant, out_a, out_b
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
