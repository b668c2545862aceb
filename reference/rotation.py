"""The randomized Hadamard rotation (``rotation: {kind: hadamard, seed: S}``).

Rules (docs/SEMANTICS.md, "Rotation"):
  * ``b`` = the largest power of two dividing the head size; the head vector is ``D / b`` blocks of ``b``.
  * ``signs = 1 - 2 * numpy.random.default_rng(S).integers(0, 2, size=D)``.
  * ``x' = FWHT_b(x * signs)``, the unnormalized fast Walsh-Hadamard transform of each block in float32, stage by
    stage: for ``h = 1, 2, 4, ..., b/2``, every pair ``(i, i + h)`` with ``i mod 2h < h`` becomes
    ``(x[i] + x[i+h], x[i] - x[i+h])``. Every addition is one float32 round-to-nearest-even.
  * Inverse (for ``read``): ``x = signs * FWHT_b(x') / b``, here in float64.
"""

from __future__ import annotations

import numpy as np


def block_size(head_size: int) -> int:
    """``b``: the largest power of two dividing ``head_size``."""
    if head_size < 1:
        raise ValueError(f"head_size must be >= 1, got {head_size}")
    return head_size & -head_size


def signs(seed: int, head_size: int) -> np.ndarray:
    """The fixed +-1 sign vector (float32 ``[D]``) of a seed and head size."""
    bits = np.random.default_rng(seed).integers(0, 2, size=head_size)
    return (1 - 2 * bits).astype(np.float32)


def fwht(x: np.ndarray, b: int) -> np.ndarray:
    """Unnormalized FWHT of each length-``b`` block of the last axis, in ``x``'s dtype, in the stage order above."""
    x = np.asarray(x)
    d = x.shape[-1]
    if d % b or b & (b - 1):
        raise ValueError(f"block {b} must be a power of two dividing {d}")
    lead = x.shape[:-1]
    y = x.reshape(lead + (d // b, b)).copy()
    h = 1
    while h < b:
        z = y.reshape(lead + (d // b, b // (2 * h), 2, h))
        lo, hi = z[..., 0, :], z[..., 1, :]
        y = np.stack([lo + hi, lo - hi], axis=-2).reshape(lead + (d // b, b))
        h *= 2
    return y.reshape(x.shape)


def rotate(seed: int, x: np.ndarray) -> np.ndarray:
    """``FWHT_b(x * signs)`` of float32 ``[..., D]``, bit-exact float32."""
    x = np.asarray(x, dtype=np.float32)
    d = x.shape[-1]
    return fwht((x * signs(seed, d)).astype(np.float32), block_size(d)).astype(np.float32)


def unrotate(seed: int, x: np.ndarray) -> np.ndarray:
    """The inverse, ``signs * FWHT_b(x) / b``, of ``[..., D]`` values in float64."""
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    b = block_size(d)
    return fwht(x, b) * signs(seed, d).astype(np.float64) / b
