"""GPU check of the writes' division of integer codes by a group's scale (recip_fast / div_fast, codegen/templates/
kernels.py.jinja; codegen.render.fast_division): compiled, it must round and clamp to the same code as div_rn for
every 2-, 4- and 8-bit integer code range, signed and unsigned, and for e2m1 codes.

    TRITON_INTERPRET=0 python benchmarks/check_fast_div.py   # needs a CUDA device

Every positive fp16 scale from the smallest subnormal (0x0001, 2**-24: the lowest floor a spec can give) to 65504,
and 65536 fp32 scales spread log-uniformly over [2**-30, 2**17] with both ends (render.FAST_SCALE_RANGE: the fp32
and global scales that a tile's test lets through), each against dividends near every code boundary (k + 0.5) * s
for |k| < 256 and e2m1's (0.25, 0.75, ..., 5) * s (a few ulps either side), near 0, the
guard at 2**64, random ones over the code ranges and over every exponent, and +-0 / +-inf / subnormals. Prints the quotients that differ bitwise from div_rn
inside the guarded range 2**-40 <= |x| < 2**64 and the codes that differ anywhere (both must be 0).
"""

import importlib.util
import os
import sys

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("q4_0_kernels", os.path.join(HERE, "..", "generated", "q4_0",
                                                                           "kernels.py"))
gen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen)
recip_fast, div_fast = gen.recip_fast, gen.div_fast


@triton.jit
def div_kernel(x_ptr, s_ptr, q_ptr, ref_ptr, n, PER_S: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i, mask=m, other=1.0)
    s = tl.load(s_ptr + i // PER_S, mask=m, other=1.0)
    tl.store(q_ptr + i, div_fast(x, s, recip_fast(s, True), True), mask=m)
    tl.store(ref_ptr + i, tl.math.div_rn(x, s), mask=m)


def codes(q, qmin, qmax, away):
    # the int codec's rounding: half to even (torch.round), or half away from zero (add +-0.5, truncate), then clamp
    r = torch.trunc(q + torch.where(q >= 0, 0.5, -0.5)) if away else torch.round(q)
    return torch.clamp(r, qmin, qmax)


E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_codes(q):
    # e2m1's code of q: the nearest grid magnitude (ties to the even code), saturated at 6, with q's sign bit
    grid = torch.tensor(E2M1_GRID, device=q.device)
    mids = (grid[1:] + grid[:-1]) / 2
    a = q.abs()
    idx = torch.bucketize(a, mids, right=True)  # mids at or below a: ties round up here
    tie = (idx > 0) & (a == mids[(idx - 1).clamp(min=0)]) & (idx % 2 == 1)
    idx = torch.where(tie, idx - 1, idx).clamp(max=7)
    return idx + 8 * torch.signbit(q).to(idx.dtype)


def main() -> int:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    s = torch.arange(0x0001, 0x7C00, dtype=torch.int32, device=dev).to(torch.int16).view(torch.float16).float()
    lo, hi = 2.0 ** -30, 2.0 ** 17  # render.FAST_SCALE_RANGE
    s32 = torch.exp2(torch.rand(65536, generator=g, device=dev, dtype=torch.float64) * 47.0 - 30.0).float()
    s32 = torch.clamp(s32, lo, hi)
    edges = torch.tensor([lo, hi], device=dev)
    edges = torch.cat([edges, torch.nextafter(edges, torch.tensor([1.0, 0.0], device=dev))])  # and one ulp inside
    s = torch.cat([s, s32, edges])
    per = []
    e2m1 = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=dev)  # e2m1's boundaries
    bound = torch.cat([torch.arange(256, device=dev, dtype=torch.float32) + 0.5, e2m1])  # code boundaries
    near = (bound[None, :] * s[:, None])  # [S, 16], rounded to fp32
    bits = near.view(torch.int32)
    for delta in range(-3, 4):
        per.append((bits + delta).view(torch.float32))
        per.append(-(bits + delta).view(torch.float32))
    per.append((torch.rand(len(s), 96, generator=g, device=dev) * 520.0 - 260.0) * s[:, None])
    e = torch.randint(-149, 128, (len(s), 32), generator=g, device=dev).float()
    per.append(torch.ldexp(torch.rand(len(s), 32, generator=g, device=dev) + 1.0, e - 1)
               * torch.where(torch.rand(len(s), 32, generator=g, device=dev) < 0.5, -1.0, 1.0))
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-45, -1e-45, 1e-38, 2.0**-40, 2.0**-41,
                            2.0**64, -2.0**64, 2.0**64 * (1 - 2.0**-24), 3.3895313892515355e38, -3.3895313892515355e38,
                            65504.0, -65504.0, 1e30, -1e30], device=dev)
    per.append(special[None, :].expand(len(s), -1))
    x = torch.cat(per, dim=1).contiguous()
    per_s = x.shape[1]
    x = x.reshape(-1)
    n = x.numel()
    q = torch.empty_like(x)
    ref = torch.empty_like(x)
    # pad the scales to one per element group of PER_S (the kernel indexes s by i // PER_S)
    div_kernel[(triton.cdiv(n, 1024),)](x, s, q, ref, n, PER_S=per_s, BLOCK=1024)
    torch.cuda.synchronize()
    guarded = (x.abs() >= 2.0**-40) & (x.abs() < 2.0**64)
    bitwise = (q.view(torch.int32) != ref.view(torch.int32)) & guarded & ~(q.isnan() & ref.isnan())
    print(f"{n} quotients over {len(s)} scales (fp16, fp32): {int(bitwise.sum())} differ bitwise from div_rn in the guarded "
          "range")
    bad = 0
    ranges = [(0.0, 3.0), (0.0, 15.0), (0.0, 255.0), (-2.0, 1.0), (-8.0, 7.0), (-128.0, 127.0)]
    for (qmin, qmax) in ranges:
        for away in (False, True):
            diff = codes(q, qmin, qmax, away) != codes(ref, qmin, qmax, away)
            diff &= ~(q.isnan() & ref.isnan())
            bad += int(diff.sum())
            print(f"codes [{qmin:g}, {qmax:g}], {'half away' if away else 'half even'}: {int(diff.sum())} differ")
            if diff.any():
                j = diff.nonzero()[:5, 0]
                print("  x", x[j].tolist(), "s", s[j // per_s].tolist(), "q", q[j].tolist(), "ref", ref[j].tolist())
    diff = (e2m1_codes(q) != e2m1_codes(ref)) & ~(q.isnan() & ref.isnan())
    bad += int(diff.sum())
    print(f"codes e2m1: {int(diff.sum())} differ")
    if diff.any():
        j = diff.nonzero()[:5, 0]
        print("  x", x[j].tolist(), "s", s[j // per_s].tolist(), "q", q[j].tolist(), "ref", ref[j].tolist())
    return 1 if bad or int(bitwise.sum()) else 0


if __name__ == "__main__":
    sys.exit(main())
