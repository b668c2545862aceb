"""Paged attention in float64 over dequantized caches.

Rules:
  * Sequence ``s`` owns query rows ``query_start_loc[s] .. query_start_loc[s + 1] - 1`` (q_len of them) and has
    ``seq_lens[s]`` KV positions in total, the new tokens included.
  * Query ``i`` (0-based within its sequence) sits at position ``p = seq_len - q_len + i`` and attends KV positions
    ``j`` with ``j <= p`` and, with a sliding window ``W``, ``p - j < W`` (itself and the W - 1 before it).
  * KV position ``j`` lives at block ``block_table[s, j // block_size]``, offset ``j % block_size``.
  * GQA: query head ``h`` uses KV head ``h // (Hq // H)``.
  * out = softmax(sm_scale * q . k) @ v over the attended positions. Rows owned by no sequence are 0.
"""

from __future__ import annotations

from typing import Optional

import numpy as np


def _gather_sequence(cache: np.ndarray, blocks: np.ndarray, seq_len: int) -> np.ndarray:
    """KV positions 0..seq_len-1 of one sequence: ``[seq_len, H, D]``."""
    block_size = cache.shape[1]
    j = np.arange(seq_len)
    return cache[blocks[j // block_size], j % block_size]


def attention_mask(seq_len: int, q_len: int, sliding_window: Optional[int]) -> np.ndarray:
    """Boolean ``[q_len, seq_len]``: True where query i may attend KV position j."""
    p = seq_len - q_len + np.arange(q_len)[:, None]
    j = np.arange(seq_len)[None, :]
    mask = j <= p
    if sliding_window is not None:
        mask &= (p - j) < sliding_window
    return mask


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_table: np.ndarray,
                    seq_lens: np.ndarray, query_start_loc: np.ndarray, sm_scale: float,
                    sliding_window: Optional[int] = None) -> np.ndarray:
    """Attention output float64 ``[num_tokens, Hq, D]``.

    q ``[num_tokens, Hq, D]``; k_cache / v_cache float64 ``[num_blocks, block_size, H, D]`` (already decoded);
    block_table int ``[num_seqs, max_blocks]``; seq_lens ``[num_seqs]``; query_start_loc ``[num_seqs + 1]``.
    """
    q = np.asarray(q, dtype=np.float64)
    k_cache = np.asarray(k_cache, dtype=np.float64)
    v_cache = np.asarray(v_cache, dtype=np.float64)
    block_table = np.asarray(block_table, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    group = num_q_heads // num_kv_heads
    out = np.zeros(q.shape, dtype=np.float64)
    for s, seq_len in enumerate(seq_lens):
        start, stop = int(qsl[s]), int(qsl[s + 1])
        q_len = stop - start
        if q_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(f"sequence {s} has {q_len} queries but only {seq_len} KV positions")
        keys = np.repeat(_gather_sequence(k_cache, block_table[s], int(seq_len)), group, axis=1)  # [L, Hq, D]
        vals = np.repeat(_gather_sequence(v_cache, block_table[s], int(seq_len)), group, axis=1)
        scores = sm_scale * np.einsum("ihd,jhd->hij", q[start:stop], keys)  # [Hq, q_len, L]
        scores = np.where(attention_mask(int(seq_len), q_len, sliding_window)[None], scores, -np.inf)
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        out[start:stop] = np.einsum("hij,jhd->ihd", weights, vals)
    return out
