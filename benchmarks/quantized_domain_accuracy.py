"""What computing attention in the cache's quantized domain would cost in accuracy (issue 5's option, measured before
it is built): the query quantized per row and the probabilities per row and tile of 128 positions, to int8 (for
int8 x int8 tensor-core dots) or to fp8 e4m3 (fp8 x fp8), instead of kvgen's exact products.

    python benchmarks/quantized_domain_accuracy.py [--contexts 1024 4096] [--seeds 3]

Data, formats and metrics as `kvgen eval` (kvgen.evaluate: synthetic RoPE'd keys with outlier channels, peaked
queries, the reference's decoding of K and V). With codes c and a per-token scale s, q . (c s) = (q . c) s, so a dot
on the codes with the scale applied afterwards equals attention on the decoded cache except for what the query and
the probabilities lose when quantized: that is what this script adds, in float64, and reports as the attention
output's relative L2 error against unquantized K/V, next to the exact path's. Values' per-token scales enter the
probabilities before they are quantized, as in kvgen's kernel (relative to the tile's largest).
"""

from __future__ import annotations

import argparse
import math
import sys

import ml_dtypes
import numpy as np

from kvgen import evaluate as E

TILE = 128


def quantize_rows(x: np.ndarray, domain: str) -> np.ndarray:
    """x [..., n] quantized per row (last axis) with scale max|x| / qmax, returned dequantized ("none": x)."""
    if domain == "none":
        return x
    amax = np.abs(x).max(axis=-1, keepdims=True)
    qmax = 127.0 if domain == "int8" else 448.0
    s = np.where(amax > 0, amax / qmax, 1.0)
    if domain == "int8":
        return np.clip(np.rint(x / s), -127, 127) * s
    return (x / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * s


def attention_quantized(q: np.ndarray, k: np.ndarray, v: np.ndarray, v_scale: np.ndarray, domain: str) -> np.ndarray:
    """Attention [Hq, n, D] with the query and the (value-scaled) probabilities quantized to ``domain``."""
    Hq, n, D = q.shape
    H = k.shape[1]
    group = Hq // H
    out = np.empty((Hq, n, D), np.float64)
    for h in range(H):
        qs = quantize_rows(q[h * group:(h + 1) * group].reshape(group * n, D), domain)
        logits = qs @ k[:, h, :].astype(np.float64).T / math.sqrt(D)
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        acc = np.zeros((group * n, D))
        vs = v_scale[:, h]
        codes = v[:, h, :].astype(np.float64) / vs[:, None]  # the value codes (per-token scale taken out)
        for a in range(0, w.shape[1], TILE):
            b = min(a + TILE, w.shape[1])
            top = vs[a:b].max()
            pw = quantize_rows(w[:, a:b] * (vs[a:b] / top)[None, :], domain)
            acc += (pw @ codes[a:b]) * top
        out[h * group:(h + 1) * group] = (acc / w.sum(axis=1, keepdims=True)).reshape(group, n, D)
    return out


def value_scales(spec, v_deq: np.ndarray) -> np.ndarray:
    """[T, H] per-token value scales of a per-token-head format (max |decoded| / qmax), ones otherwise."""
    sc = spec.value.scale
    if sc is not None and sc.granularity.value == "per_token_head":
        amax = np.abs(v_deq).max(axis=2).astype(np.float64)
        return np.where(amax > 0, amax / spec.value.info.qmax, 1.0)
    return np.ones(v_deq.shape[:2])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="*", default=["int8_per_token_head", "fp8_per_token_head", "fp8_e4m3"])
    parser.add_argument("--contexts", nargs="*", type=int, default=[1024, 4096])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    print("| format | context | exact products | int8 query and P | fp8 e4m3 query and P |")
    print("|---|---|---|---|---|")
    for name in args.formats:
        spec = E.resolve_format(name).spec
        for ctx in args.contexts:
            errs = {"exact": [], "int8": [], "fp8": []}
            for seed in range(args.seeds):
                q, k, v = E.synthetic_kv(ctx, seed)
                ref, _ = E.attention(q, k, v)
                kq, vq = E.quantize_kv(spec, k, v)
                exact, _ = E.attention(q, kq, vq)
                errs["exact"].append(E.rel_err(exact, ref))
                vs = value_scales(spec, vq)
                same = attention_quantized(q, kq, vq, vs, "none")  # the factoring alone changes nothing
                assert E.rel_err(same, exact) < 1e-10, E.rel_err(same, exact)
                for domain in ("int8", "fp8"):
                    errs[domain].append(E.rel_err(attention_quantized(q, kq, vq, vs, domain), ref))
                print(f"  {name} @ {ctx} seed {seed} done", file=sys.stderr, flush=True)
            m = {d: float(np.mean(e)) for d, e in errs.items()}
            print(f"| {name} | {ctx:,} | {m['exact']:.3e} | {m['int8']:.3e} ({m['int8'] / m['exact']:.2f}x) | "
                  f"{m['fp8']:.3e} ({m['fp8'] / m['exact']:.2f}x) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
