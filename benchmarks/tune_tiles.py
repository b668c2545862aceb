"""Tile experiment (issue 5): decode time at 64 x 8192 and 4 x 65536 for each tile choice (KV positions per step /
warps / pipeline stages), for the formats named on the command line. On a GPU:

    python benchmarks/tune_tiles.py bf16 fp8_e4m3 int8_per_token_head

The choice the runtime makes is kvgen.runtime.kernels.ATTENTION_TILES; this script overrides it per run.
"""
import sys
from pathlib import Path

import kvgen
from kvgen.runtime import kernels as K

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
copy = bench.copy_bandwidth()
configs = [dict(BLOCK_N=64, num_warps=4, num_stages=3), dict(BLOCK_N=128, num_warps=4, num_stages=3),
           dict(BLOCK_N=128, num_warps=8, num_stages=3), dict(BLOCK_N=64, num_warps=4, num_stages=4),
           dict(BLOCK_N=128, num_warps=4, num_stages=2), dict(BLOCK_N=32, num_warps=4, num_stages=4)]
for name in sys.argv[1:]:
    fmt = kvgen.load(name)
    for shape in [(64, 8192), (4, 65536)]:
        fn, moved = bench.decode_case(fmt, *shape, 16)
        res = []
        for c in configs:
            K.ATTENTION_TILES.clear()
            K.ATTENTION_TILES[None] = c
            t = bench.bench(fn)
            res.append(f"{c['BLOCK_N']}/{c['num_warps']}/{c['num_stages']}: {t*1e6:.0f}us {moved/t/copy*100:.0f}%")
        print(name, shape, " | ".join(res), flush=True)
