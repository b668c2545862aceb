"""Every bf16 bit pattern written by the compiled fp16 format's write, against the reference (GPU only): which inputs
give other fp16 bytes than kvgen.reference's. From the repository root: python3 benchmarks/pending/bf16_into_fp16.py"""
import numpy as np
import torch

import kvgen
from kvgen import reference as R

fmt = kvgen.load("fp16")
bits = np.arange(65536, dtype=np.uint16)
x = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).reshape(1024, 1, 64)
cache = fmt.allocate(64, 16, 1, 64, device="cuda")
fmt.write(cache, x.cuda(), x.cuda(), torch.arange(1024, device="cuda"))
got = cache.tensors["kv_cache"].view(torch.uint8).reshape(64, -1).cpu().numpy()
want = R.new_cache(fmt.spec, 64, 16, 1, 64)
R.write(fmt.spec, want, x.float().numpy(), x.float().numpy(), np.arange(1024))
want = want["kv_cache"]
g16 = got.reshape(1024, 2, 64, 2).view(np.uint16)[:, 0, :, 0].ravel()
w16 = want.reshape(1024, 2, 64, 2).view(np.uint16)[:, 0, :, 0].ravel()
bad = np.nonzero(g16 != w16)[0]
print(f"{len(bad)} of 65536 bf16 inputs differ (keys)")
for i in bad[:: max(1, len(bad) // 24)][:24]:
    v = float(x.reshape(-1)[i])
    print(f"bf16 {bits[i]:#06x} ({v:.6g}): kernel fp16 {g16[i]:#06x} "
          f"({np.uint16(g16[i]).view(np.float16)}), reference {w16[i]:#06x} ({np.uint16(w16[i]).view(np.float16)})")
