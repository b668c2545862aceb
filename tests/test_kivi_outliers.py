"""Why KIVI quantizes keys per channel: reconstruction error on keys with outlier channels, after RoPE.

Synthetic keys ``[T = 1024, H = 4, D = 128]``: standard normal, with 4 random channels per head made outliers (times a
factor drawn from U(10, 20)); RoPE rotates every channel pair ``(2i, 2i + 1)`` by ``pos * theta_i``,
``theta_i = 10000^(-2i / D)``. Two outlier models:
  * ``scaled``: the outlier channel is ``f * z`` (zero mean, large spread);
  * ``offset``: the outlier channel is ``f * (+-1 + z / 2)`` (a large value of fixed sign, as KIVI observes in real
    keys before RoPE).
Both groupings are asymmetric with an fp16 scale and an fp16 minimum (docs/SEMANTICS.md "Float zero points"), at the
same bit width:
  * per channel over G = 32 tokens (the KIVI key side, ``encode_key_group``);
  * per token over blocks of 32 channels (the KIVI value side's rule applied to keys).
Figure: relative Frobenius error ``|K_hat - K|_F / |K|_F``, and the same on the non-outlier channels only (outlier
channels and their RoPE partners left out). Printed with ``-s``; ``python tests/test_kivi_outliers.py`` prints the
figures of seeds 0..9 (docs/kivi.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from kvgen import reference as R
from kvgen.codegen.loader import load_spec
from kvgen.codegen.spec import FormatSpec

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = (ROOT / "specs", Path("/work/pending_kivi"))
SEED = 0
T, H, D, N_OUT = 1024, 4, 128, 4


def kivi_spec(bits: int) -> FormatSpec:
    for folder in FOLDERS:
        path = folder / f"kivi_{bits}bit.yaml"
        if path.is_file():
            return load_spec(path, supported=False)
    pytest.skip(f"no spec file for kivi_{bits}bit")


def rope(x: np.ndarray, base: float = 10000.0) -> np.ndarray:
    """Rotate channel pairs (2i, 2i + 1) of ``x`` ``[T, H, D]`` by ``pos * base^(-2i / D)`` (float64)."""
    t, _, d = x.shape
    theta = base ** (-2.0 * np.arange(d // 2) / d)
    ang = np.arange(t)[:, None] * theta[None]
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


def synthetic_keys(seed: int, model: str) -> tuple[np.ndarray, np.ndarray]:
    """(keys float32 [T, H, D] after RoPE, boolean [H, D] mask of the outlier channels and their RoPE partners)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H, D))
    mask = np.zeros((H, D), bool)
    for h in range(H):
        ch = rng.choice(D, N_OUT, replace=False)
        f = rng.uniform(10.0, 20.0, N_OUT)
        if model == "scaled":
            x[:, h, ch] *= f
        else:
            x[:, h, ch] = f * (rng.choice([-1.0, 1.0], N_OUT) + 0.5 * x[:, h, ch])
        mask[h, ch] = True
        mask[h, ch ^ 1] = True  # RoPE mixes each channel with its pair partner
    return rope(x).astype(np.float32), mask


def per_channel(spec: FormatSpec, k: np.ndarray) -> np.ndarray:
    g = spec.key.scale.group_tokens
    out = np.empty(k.shape, np.float64)
    for g0 in range(0, k.shape[0], g):
        enc = R.encode_key_group(spec.key, k[g0:g0 + g])
        out[g0:g0 + g] = enc.codes * enc.s_q.astype(np.float64) + enc.m.astype(np.float64)
    return out


def per_token(spec: FormatSpec, k: np.ndarray) -> np.ndarray:
    side = spec.value.model_copy(update={"residual": None})  # per_block over 32 channels, fp16 scale and min
    enc = R.encode_side(side, k)
    return R.decode_side(side, enc.data, enc.scale, enc.zp)


def figures(bits: int, seed: int, model: str) -> dict[str, float]:
    spec = kivi_spec(bits)
    k, mask = synthetic_keys(seed, model)
    out = {}
    for name, k_hat in (("channel", per_channel(spec, k)), ("token", per_token(spec, k))):
        err = k_hat - k
        out[name] = float(np.linalg.norm(err) / np.linalg.norm(k))
        out[name + "_normal"] = float(np.linalg.norm(err[:, ~mask]) / np.linalg.norm(k[:, ~mask]))
    out["ratio"] = out["token"] / out["channel"]
    return out


#: lower limits of (per-token error) / (per-channel error), somewhat below the measured ratios (seed 0: scaled 1.41 /
#: 1.40 at 2 / 4 bits, offset 2.23 / 2.18; seeds 0..9: scaled 1.36-1.48, offset 2.06-2.50): see docs/kivi.md
MIN_RATIO = {"scaled": 1.3, "offset": 2.0}


@pytest.mark.parametrize("model", ["scaled", "offset"])
@pytest.mark.parametrize("bits", [2, 4])
def test_per_channel_keys_beat_per_token_keys(bits: int, model: str) -> None:
    f = figures(bits, SEED, model)
    print(f"\nkivi_{bits}bit {model} seed {SEED}: per-channel {f['channel']:.4f} (normal channels "
          f"{f['channel_normal']:.4f}), per-token {f['token']:.4f} (normal channels {f['token_normal']:.4f}), "
          f"ratio {f['ratio']:.2f}")
    assert f["ratio"] >= MIN_RATIO[model]
    assert f["token_normal"] >= 1.5 * f["channel_normal"]  # the channels sharing a block with an outlier suffer


def main() -> None:
    print("| bits | outliers | per-channel (G=32) | per-token (32 ch) | ratio | normal ch: per-channel | per-token |")
    print("|---|---|---|---|---|---|---|")
    for bits in (2, 4):
        for model in ("scaled", "offset"):
            rows = [figures(bits, s, model) for s in range(10)]
            f0 = rows[0]
            ratios = [r["ratio"] for r in rows]
            print(f"| {bits} | {model} | {f0['channel']:.4f} | {f0['token']:.4f} | {f0['ratio']:.2f} "
                  f"(seeds 0-9: {min(ratios):.2f}-{max(ratios):.2f}) | {f0['channel_normal']:.4f} | "
                  f"{f0['token_normal']:.4f} |")


if __name__ == "__main__":
    sys.exit(main())
