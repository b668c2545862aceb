"""Where nvfp4's compiled write with its fast division (FAST_DIV on) writes other bytes than with div_rn per element
(off): field, token, head, byte, the inputs behind it and both bytes. GPU only; used by recip_fast_fault.py."""
import sys

import torch

sys.path.insert(0, "tests")
import kvgen  # noqa: E402
from kvgen.runtime import kernels as K  # noqa: E402
from test_fast_div import e2m1_tokens  # noqa: E402

g = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
gen = torch.Generator().manual_seed(2)
tokens, heads, head = 1024, 4, 128
key, value = (e2m1_tokens(tokens, heads, head, g, gen).cuda() for _ in range(2))
slots = torch.randperm(tokens, generator=gen).cuda()
fmt = kvgen.load("nvfp4")
out = []
for fast in (False, True):
    K.FAST_DIV = fast
    cache = fmt.allocate(tokens // 16, 16, heads, head, device="cuda", k_scale=g, v_scale=g)
    fmt.write(cache, key, value, slots)
    out.append(cache.tensors["kv_cache"].cpu())
lay = fmt.page_layout(16, heads, head)["fields"]
diff = torch.nonzero(out[0] != out[1])
print(f"g {g}: {len(diff)} bytes differ; by field:", {name: int(sum(1 for _, b in diff.tolist()
      if f["base"] <= b < f["base"] + f["cell"] * 16 * heads)) for name, f in lay.items()})
inv = torch.empty_like(slots.cpu())
inv[slots.cpu()] = torch.arange(tokens)
shown = dict.fromkeys(lay, 0)  # the first 8 differing bytes of each field (data and scale cells apart)
for blk, byte in diff.tolist():
    for name, f in lay.items():
        if f["base"] <= byte < f["base"] + f["cell"] * 16 * heads and shown[name] < 8:
            shown[name] += 1
            rel = byte - f["base"]
            cell, within = divmod(rel, f["cell"])
            off, h = divmod(cell, heads)
            tok = int(inv[blk * 16 + off])
            x = (key if name.startswith("k") else value)[tok, h].cpu()
            if name.endswith("data"):
                xs = x[2 * within:2 * within + 2].tolist()
                grp = x[(2 * within) // 16 * 16:(2 * within) // 16 * 16 + 16]
            else:
                grp = x[within * 16:within * 16 + 16]
                xs = []
            print(f"{name} token {tok} head {h} byte {within}: div_rn {int(out[0][blk, byte]):#04x} fast "
                  f"{int(out[1][blk, byte]):#04x} x {xs} group absmax {grp.abs().max().item():.6g}")
