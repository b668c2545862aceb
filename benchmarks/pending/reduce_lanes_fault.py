"""Reproducer of the reduction that write-kivi-layout.patch's flush got wrong at head size 32 (forty-seventh
session), cut down to a few lines: a [T, C] fp32 tile loaded through the view [T // TB, C // CV, TB, CV] (token
a * TB + b, channel c * CV + v; 16-byte vectors) on one warp, permuted back to [T, C] and reduced over its tokens
(axis 0). At T = C = 32 the layout Triton 3.6 gives the reduction's operand has lane bases [[16, 0], [0, 4], [0, 8],
[0, 16], [1, 0]]: a channel's tokens on lane bits 0 and 4, so the reduction needs butterfly shuffles over lane masks
1 and 16. The compiled sm_90 PTX shuffles over masks 2 and 1 instead (statically, on the CPU machine): mask 2 is lane
bit 1, channel c + 4, and lane bit 4 is never combined. At C = 64 the tokens take lane bit 0 alone (mask 1, right).

    python benchmarks/pending/reduce_lanes_fault.py     # per C: the compiled code's lane bases and shuffle masks
                                                        # against the masks they need; on a GPU also the kernel's
                                                        # minima and maxima against torch. Exit 1 where any differ

For a Triton upgrade: where every C matches torch on the GPU, the KIVI flush's views can drop their head-size guard
(write-kivi-layout-prefill.patch takes them only where (T // TB) * (C // CV) >= 32).
"""
import ast
import os
import re
import sys

import torch
import triton
import triton.language as tl

GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"


@triton.jit
def view_min_max(x_ptr, lo_ptr, hi_ptr, T: tl.constexpr, C: tl.constexpr, TB: tl.constexpr, CV: tl.constexpr):
    t = tl.arange(0, T // TB)[:, None, None, None] * TB + tl.arange(0, TB)[None, None, :, None]
    c = tl.arange(0, C // CV)[None, :, None, None] * CV + tl.arange(0, CV)[None, None, None, :]
    x = tl.load(x_ptr + t * C + c)  # [T // TB, C // CV, TB, CV]
    x = tl.reshape(tl.permute(x, (0, 2, 1, 3)), [T, C])
    cc = tl.arange(0, C)
    tl.store(lo_ptr + cc, tl.min(x, axis=0))
    tl.store(hi_ptr + cc, tl.max(x, axis=0))


def compiled(C: int):
    """The kernel compiled for sm_90 as a launch on aligned tensors would specialise it (no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(view_min_max, signature={"x_ptr": "*fp32", "lo_ptr": "*fp32", "hi_ptr": "*fp32", "T": "constexpr",
                                             "C": "constexpr", "TB": "constexpr", "CV": "constexpr"},
                    constexprs={"T": 32, "C": C, "TB": 16, "CV": 4},
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(3)})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    lanes = re.search(r"#linear = #ttg\.linear<\{.*?lane = (\[\[.*?\]\])", k.asm["ttgir"])
    masks = sorted({int(m) for m in re.findall(r"shfl\.sync\.bfly\.b32\s+\S+,\s*\S+,\s*(\d+)", k.asm["ptx"])})
    return (lanes.group(1) if lanes else "?"), masks


def main() -> int:
    bad = 0
    for C in (32, 64, 128):
        lanes, masks = compiled(C)
        # the lanes a channel's tokens span: the lane bits whose basis moves along axis 0 (tokens)
        want = sorted(1 << i for i, b in enumerate(ast.literal_eval(lanes)) if b[0]) if lanes != "?" else None
        bad += masks != want
        line = (f"C = {C:3d}: reduced operand's lane bases {lanes}; butterfly shuffle masks {masks}, the tokens' lane "
                f"bits need {want}" + ("" if masks == want else " (WRONG)"))
        if GPU:
            x = torch.randn(32, C, device="cuda")
            lo, hi = torch.empty(C, device="cuda"), torch.empty(C, device="cuda")
            view_min_max[(1,)](x, lo, hi, T=32, C=C, TB=16, CV=4, num_warps=1)
            wrong = int(((lo != x.min(0).values) | (hi != x.max(0).values)).sum())
            bad += wrong > 0
            line += f"; channels wrong on the GPU: {wrong} of {C}"
        print(line, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
