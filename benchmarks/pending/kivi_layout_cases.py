"""Where write-kivi-layout.patch's flush goes wrong on the GPU (forty-seventh session: the H100 stored other key
bytes than the reference for kivi_4bit, head size 32, fp32 input, a 159-token prefill then one decode token, whose
flush reads its whole group from the residual ring; the interpreter stores the reference's). Runs conformance's
stream check over a grid of formats, head sizes, input dtypes and streams and prints one line per case, so that
the failing cells show which path (the all-new prefill flush or the ring-reading decode flush) and which shapes.

    PYTHONPATH=<tree with the patch> python benchmarks/pending/kivi_layout_cases.py
    python benchmarks/pending/kivi_layout_cases.py --formats kivi_2bit --heads 2 --head-sizes 64 128   # a part
"""
import argparse
import itertools
import sys

import torch

import kvgen
from kvgen.conformance import StreamCase, run_stream

device = "cuda" if torch.cuda.is_available() else "cpu"
streams = {"decode-flush": [[159], [1]], "prefill-flush": [[223]], "chunks": [[150], [20], [30]]}
ap = argparse.ArgumentParser()
ap.add_argument("--formats", nargs="+", default=["kivi_4bit", "kivi_2bit"])
ap.add_argument("--heads", nargs="+", type=int, default=[1, 2])
ap.add_argument("--head-sizes", nargs="+", type=int, default=[32, 64, 128])
args = ap.parse_args()
bad = 0
for name, heads, hs, dtype, (label, steps) in itertools.product(
        args.formats, args.heads, args.head_sizes, (torch.float32, torch.bfloat16), streams.items()):
    case = StreamCase(head_size=hs, block_size=32, num_kv_heads=heads, group=1, steps=steps, dtype=dtype, window=None,
                      pad_rows=0, seed=0)
    result = {k: v for k, v in run_stream(kvgen.load(name), case, device).items() if v}
    bad += bool(result)
    print(f"{name:10s} {heads} heads hs {hs:3d} {str(dtype)[6:]:8s} {label:13s} {'FAIL ' + str(result) if result else 'ok'}",
          flush=True)
print(f"{bad} failing cases")
sys.exit(1 if bad else 0)
