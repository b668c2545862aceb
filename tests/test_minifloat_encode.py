"""The generated e2m1 encode (codegen/templates/codecs/minifloat.py.jinja: the least of one fma per binade) against
the reference's codes (ml_dtypes), on the values where a rounding could go wrong: every fp32 within a few thousand
ulps of each grid value and each midpoint between neighbours (the ties), the binade edges, zeros, subnormals, values
past the saturation point and infinities, both signs; and random finite values of every exponent. Runs the kernel
code itself, in the interpreter on the CPU and compiled on a GPU (fma rounding once there, twice here).
benchmarks/check_e2m1_encode.py checks the same lines for all 2**32 fp32 patterns with NumPy."""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

import kvgen
from kvgen.reference.codes import element_codes
from kvgen.codegen.spec import ElementType

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
ULPS = 2048  # fp32 patterns on each side of every point


@triton.jit
def _encode(x_ptr, out_ptr, n, encode: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(out_ptr + i, encode(x), mask=i < n)


def hard_values() -> np.ndarray:
    points = set(GRID) | {(a + b) / 2 for a, b in zip(GRID, GRID[1:])} | {7.0, 8.0, 12.0, 2.0 ** 24}
    centres = np.array(sorted(points), dtype=np.float32).view(np.int32)
    near = (centres[:, None] + np.arange(-ULPS, ULPS + 1, dtype=np.int32)[None, :]).ravel()
    near = near[near >= 0].view(np.float32)
    special = np.array([0.0, 1e-45, 1e-40, 2.0 ** -126, 2.0 ** -30, 1e30, 3.4e38, np.inf], dtype=np.float32)
    rng = np.random.default_rng(0)
    spread = rng.integers(0, 0x7F800000, 1 << 16, dtype=np.int64).astype(np.uint32).view(np.float32)
    magnitudes = np.concatenate([near, special, spread])
    return np.concatenate([magnitudes, -magnitudes])


def generated_encoder():
    fmt = kvgen.load("nvfp4")
    assert fmt.spec.key.element == ElementType.fp4_e2m1
    return fmt._kernels.module.k_encode


def test_e2m1_encode_rounds_as_the_reference():
    x = hard_values()
    device = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available() else "cpu"
    xs = torch.from_numpy(x).to(device)
    out = torch.empty(x.size, dtype=torch.uint8, device=device)
    block = 1024
    _encode[(triton.cdiv(x.size, block),)](xs, out, x.size, generated_encoder(), block)
    got = out.cpu().numpy()
    want = element_codes(ElementType.fp4_e2m1, x)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{bad.size} of {x.size} values encode differently, e.g. {x[bad[:4]].tolist()} -> "
                           f"{got[bad[:4]].tolist()}, reference {want[bad[:4]].tolist()}")


def test_envelope_lines_are_the_binades():
    """The lines the template renders come from the codec's own numbers: one per binade, factor 2**(mant - e),
    constant 1.5 * 2**23 plus an even offset; the bit encoder stays for fp8 (many binades, special values)."""
    from kvgen.codegen.codecs import _minifloat

    lines = _minifloat("fp4_e2m1").params["envelope"]  # binades [0, 2), [2, 4), [4, 8): steps 0.5, 1, 2
    assert [k for k, _ in lines] == [2.0, 1.0, 0.5]
    assert [c - 1.5 * 2 ** 23 for _, c in lines] == [0, 2, 4]
    assert _minifloat("fp8_e4m3").params["envelope"] == []
    assert _minifloat("fp8_e5m2").params["envelope"] == []


@triton.jit
def _encode_times(q_ptr, p_ptr, out_ptr, n, encode_times: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    q = tl.load(q_ptr + i, mask=i < n, other=0.0)
    p = tl.load(p_ptr + i, mask=i < n, other=1.0)
    tl.store(out_ptr + i, encode_times(q, p, q), mask=i < n)


def test_e2m1_encode_with_a_power_of_two_folded_in():
    """encode_signed_times(q, p, q) (the scaled fast division's encode: the power of two p = 2**-E folded into the
    lines' factors) gives the reference's code of the fp32 product q * p, for p over the range the write can take
    ([2**-61, 2**61]): q near every grid point and tie of the scaled grid, products below fp32's normal range
    (rounded to subnormals or to 0 on their own), past its top (inf), inf q, and NaN q compiled (saturated, q's
    sign; the interpreter's minimum keeps NaN). Products by powers of two are exact in the interpreter's fma too."""
    rng = np.random.default_rng(1)
    pows = np.array([-61, -40, -24, -3, 0, 1, 7, 40, 61])
    base = hard_values()
    qs, ps = [], []
    for e in pows:
        p = np.float32(2.0 ** float(e))
        qs.append((base.astype(np.float64) / float(p)).astype(np.float32))  # the grid scaled back: ties survive
        qs.append(rng.integers(0, 0xFF800000, 1 << 14, dtype=np.int64).astype(np.uint32).view(np.float32))
        ps += [np.full(qs[-2].size, p, np.float32), np.full(qs[-1].size, p, np.float32)]
    q, p = np.concatenate(qs), np.concatenate(ps)
    with np.errstate(over="ignore", invalid="ignore"):
        v = q * p  # fp32: exact, or rounded into the subnormals, or inf
    device = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available() else "cpu"
    if device == "cpu":  # the interpreter's minimum keeps NaN (compiled, min drops it): NaN q on the GPU only
        q, p, v = q[~np.isnan(q)], p[~np.isnan(q)], v[~np.isnan(q)]
    nan = np.isnan(v)
    out = torch.empty(q.size, dtype=torch.uint8, device=device)
    block = 1024
    module = kvgen.load("nvfp4")._kernels.module
    _encode_times[(triton.cdiv(q.size, block),)](torch.from_numpy(q).to(device), torch.from_numpy(p).to(device),
                                                 out, q.size, module.k_encode_signed_times, block)
    got = out.cpu().numpy()
    # a NaN product (a NaN q) saturates with q's sign, as encode_signed's does; otherwise the reference's code
    want = element_codes(ElementType.fp4_e2m1, np.where(nan, np.float32(0), v))
    want = np.where(nan, 7 | ((q.view(np.uint32) >> 28) & 8).astype(np.uint8), want)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{bad.size} of {q.size} differ, e.g. q {q[bad[:4]].tolist()} p {p[bad[:4]].tolist()} -> "
                           f"{got[bad[:4]].tolist()}, reference {want[bad[:4]].tolist()}")
