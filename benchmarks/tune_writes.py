"""Write-tile experiment (issue 5): reshape-and-cache time at 32768 tokens for each (tokens per program, warps)
choice, per format, timed as CUDA-graph replays (no host launch cost). On a GPU:

    python benchmarks/tune_writes.py bf16 fp8_e4m3 int8_per_token_head
    python benchmarks/tune_writes.py nvfp4 --configs 16/4 32/4 64/8 --tokens 32768 256
    python benchmarks/tune_writes.py q8_0 int8_per_token_head --configs 4/1 --ordered-slots  # slots 0, 1, 2, ...

A config is BLOCK_T/num_warps[/maxnreg]. The runtime's choice is kvgen.runtime.kernels.write_tiles (the
WRITE_TILES rules); this script overrides it (WRITE_OVERRIDE) per run and prints one markdown row per (format,
token count) with median us and the fraction of the copy bandwidth measured in the same run (bytes as
benchmarks/bench.py counts them: the bf16 input read plus the cache bytes written). Streaming formats (KIVI) write
through their flush kernel, whose tile is one key group: for them a config's num_warps and maxnreg become the flush
kernel's compile options (FLUSH_OPTIONS) and its BLOCK_T is ignored; the cache's block size is the group.
"""
import argparse
import sys
from pathlib import Path

import torch

import kvgen
from kvgen.runtime import kernels as K

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

DEFAULT_CONFIGS = ["16/4", "8/2", "16/2", "32/4", "32/8", "64/8", "4/1", "8/1"]


def parse(config: str) -> dict:
    """BLOCK_T/num_warps, or BLOCK_T/num_warps/maxnreg (a register cap)."""
    parts = [int(x) for x in config.split("/")]
    if len(parts) not in (2, 3):
        raise SystemExit(f"--configs {config!r}: expected BLOCK_T/num_warps or BLOCK_T/num_warps/maxnreg")
    return dict(BLOCK_T=parts[0], num_warps=parts[1], maxnreg=parts[2] if len(parts) > 2 else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("formats", nargs="+")
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    ap.add_argument("--tokens", nargs="+", type=int, default=[32768])
    ap.add_argument("--no-decode-first", action="store_true",
                    help="skip the decode case run before each format's writes (see below)")
    ap.add_argument("--ordered-slots", action="store_true",
                    help="paged formats: tokens at slots 0, 1, 2, ... (a prefill into consecutive blocks) instead of "
                    "bench.py's random permutation of the slots")
    args = ap.parse_args()
    bench.require_gpu(ap)
    configs = {c: parse(c) for c in args.configs}
    bench.GRAPHS = True
    copy = bench.copy_bandwidth()
    print(f"copy bandwidth {copy / 1e9:.0f} GB/s; runtime rules (bits, e8m0 blocks) {K.WRITE_TILES}")
    print("| format | tokens | " + " | ".join(args.configs) + " |")
    print("|---|---|" + "---|" * len(configs))
    for name in args.formats:
        fmt = kvgen.load(name)
        block = fmt.layout.RESIDUAL["group"] if fmt.spec.streaming else 16
        if not args.no_decode_first:
            # bench.py times a format's writes after its decode cases; one decode case first puts this script in
            # that state. (The up-to-2x slower writes of a fresh process that this was added for came from the
            # write kernel being loaded while torch's allocator pool held freed blocks: bench.write_case now
            # releases the pool, and the twentieth session measured the same times with and without this case.)
            fn, _ = bench.decode_case(fmt, 64, 8192, block)
            bench.bench(fn)
            del fn
            torch.cuda.empty_cache()
        for tokens in args.tokens:
            res = []
            for c in args.configs:
                if fmt.spec.streaming:
                    K.FLUSH_OPTIONS = {k: v for k, v in configs[c].items() if k != "BLOCK_T" and v is not None}
                else:
                    K.WRITE_OVERRIDE = configs[c]
                try:
                    fn, moved = bench.write_case(fmt, tokens, block, ordered_slots=args.ordered_slots)
                    t = bench.bench(fn)
                    del fn  # freed before the next config's case (write_case releases the pool: its docstring)
                    res.append(f"{t * 1e6:.0f} ({moved / t / copy * 100:.0f}%)")
                except Exception as e:  # a config the compiler rejects
                    res.append(f"failed: {type(e).__name__}")
                finally:
                    K.WRITE_OVERRIDE, K.FLUSH_OPTIONS = None, {}
            print(f"| {name} | {tokens} | " + " | ".join(res) + " |", flush=True)


if __name__ == "__main__":
    main()
