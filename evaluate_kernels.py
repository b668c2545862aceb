"""kvgen eval's kernel path: the attention output of a format computed by its generated kernels.

The reference path (kvgen.evaluate) decodes K and V with the NumPy reference and attends in float64. This path
writes the same K and V into a paged cache with the format's reshape-and-cache kernel (static scales calibrated
the same way) and runs its paged-attention kernel on the same queries: one decode step per query, every query a
sequence of its own over the same block table. On a GPU that is the code an engine would run; under the Triton
interpreter (CPU) it is slow and meant for small contexts and tests.
"""

from __future__ import annotations

import math
import warnings

import numpy as np


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# the queries' type in the kernels' call (also the dense cache's, named, for dequantize_first)
QUERY_DTYPES = ("fp32", "bf16", "fp16")


def kernel_attention(source: str, q: np.ndarray, k: np.ndarray, v: np.ndarray, chunk: int = 4096,
                     device: str | None = None, dot_precision: str = "auto", query_dtype: str = "fp32",
                     dequantize_first=False) -> np.ndarray:
    """Attention output ``[Hq, n, D]`` (float64) of queries ``q`` ``[Hq, n, D]`` over all T positions of ``k`` /
    ``v`` ``[T, H, D]`` (float32), through the kernels of format ``source`` (name, directory or spec .yaml).
    ``dot_precision`` as ``Format.attend``; "quantized" falls back to "auto" for a format that does not offer it.
    ``query_dtype``: the queries' type in the call (fp32, bf16 or fp16). ``dequantize_first``: False, True (the
    dense cache of the query's type) or "bf16" / "fp16" (that type), as ``Format.attend``'s."""
    import torch

    from .evaluate import calibrated_scale
    from .runtime.loader import load

    fmt = load(source)
    spec = fmt.spec
    device = device or default_device()
    T, H, D = k.shape
    Hq, n, _ = q.shape
    residual = fmt.layout.RESIDUAL
    block = 2 * residual["group"] if residual else 16
    num_blocks = math.ceil(T / block)
    scales = {}
    for side, arg, x in (("key", "k_scale", k), ("value", "v_scale", v)):
        s = calibrated_scale(spec, side, x)
        if s is not None:
            scales[arg] = torch.as_tensor(np.asarray(s, np.float32).reshape(-1), device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # formats without static scales: none to warn about
        cache = fmt.allocate(num_blocks, block, H, D, device=device, max_seqs=1 if residual else None, **scales)
    table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :]
    for a in range(0, T, chunk):  # successive prefill steps of one sequence, as an engine writes them
        b = min(T, a + chunk)
        key = torch.from_numpy(np.ascontiguousarray(k[a:b])).to(device)
        value = torch.from_numpy(np.ascontiguousarray(v[a:b])).to(device)
        slots = torch.arange(a, b, dtype=torch.int64, device=device)
        if residual:
            fmt.write(cache, key, value, slots, seq_ids=torch.zeros(1, dtype=torch.int32, device=device),
                      query_start_loc=torch.tensor([0, b - a], dtype=torch.int32, device=device),
                      seq_lens=torch.tensor([b], dtype=torch.int32, device=device), block_table=table,
                      max_query_len=b - a)
        else:
            fmt.write(cache, key, value, slots)
    dtypes = dict(zip(QUERY_DTYPES, (torch.float32, torch.bfloat16, torch.float16)))
    query = torch.from_numpy(np.ascontiguousarray(q.transpose(1, 0, 2)).astype(np.float32)).to(device)
    query = query.to(dtypes[query_dtype])
    extra = {"seq_ids": torch.zeros(n, dtype=torch.int32, device=device)} if residual else {}
    if dequantize_first:  # True, or the dense cache's type by name
        extra.update(dequantize_first=dtypes.get(dequantize_first, dequantize_first), max_seq_len=T)
    out = fmt.attend(query, cache, table.expand(n, num_blocks).contiguous(),
                     torch.full((n,), T, dtype=torch.int32, device=device),
                     torch.arange(n + 1, dtype=torch.int32, device=device), max_query_len=1,
                     dot_precision=fmt.runs_dot_precision(dot_precision), **extra)
    return out.double().cpu().numpy().transpose(1, 0, 2)
