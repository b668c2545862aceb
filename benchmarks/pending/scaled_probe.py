"""Probe of nvfp4's scaled division on a GPU: the generated helpers on a few (x, scale) pairs, each step printed."""
import importlib.util
import os

import torch
import triton
import triton.language as tl

spec = importlib.util.spec_from_file_location("nv", os.path.join("generated", "nvfp4", "kernels.py"))
nv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nv)
recip_fast, div_corrected, enc = nv.recip_fast, nv.div_corrected, nv.k_encode_signed


@triton.jit
def probe(x_ptr, s_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i)
    eff = tl.load(s_ptr + i)
    pw = (0x7F000000 - (eff.to(tl.uint32, bitcast=True) & 0x7F800000)).to(tl.float32, bitcast=True)
    sn = eff * pw
    r = recip_fast(sn, True)
    q1 = div_corrected(x, sn, r)
    q = q1 * pw
    tl.store(out_ptr + i * 6 + 0, pw)
    tl.store(out_ptr + i * 6 + 1, sn)
    tl.store(out_ptr + i * 6 + 2, r)
    tl.store(out_ptr + i * 6 + 3, q1)
    tl.store(out_ptr + i * 6 + 4, q)
    tl.store(out_ptr + i * 6 + 5, enc(q, x).to(tl.float32))


x = torch.tensor([-1.9737285375595093, 2.343749523162842, 0.5859375, 312.0, 0.1875, 1.0, 3.0, -5.0], device="cuda")
s = torch.tensor([0.46875, 0.46875, 0.46875, 52.0, 0.03125, 1.0, 1.0, 1.0], device="cuda")
out = torch.empty(8 * 6, device="cuda")
probe[(1,)](x, s, out, 8, enable_fp_fusion=False)
for row, xv, sv in zip(out.view(8, 6).tolist(), x.tolist(), s.tolist()):
    print(f"x {xv:.6g} s {sv:.6g} -> pw {row[0]:.6g} s' {row[1]:.6g} r {row[2]:.6g} q' {row[3]:.6g} q {row[4]:.6g} "
          f"code {int(row[5])} (x / s = {xv / sv:.6g})")
