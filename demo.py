"""`kvgen demo`: one format end to end on a small batch (CPU interpreter or GPU)."""

from __future__ import annotations

import time

import torch

from .runtime.kernels import interpreting
from .runtime.loader import load


def run_demo(console, format_name: str, num_seqs: int, context: int, seed: int = 0) -> float:
    """Write a batch of sequences into a paged cache, attend over it, and compare with unquantized attention."""
    g = torch.Generator().manual_seed(seed)
    device = "cpu" if interpreting() or not torch.cuda.is_available() else "cuda"
    fmt = load(format_name)
    num_kv_heads, group, head_size = 2, 4, 64
    residual = fmt.layout.RESIDUAL
    block_size = residual["group"] if residual else 16  # KIVI pages hold whole token groups
    seq_lens = [max(1, context + 7 * i - 7 * (num_seqs // 2)) for i in range(num_seqs)]
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    mode = "Triton interpreter (CPU)" if device == "cpu" else f"compiled Triton on {torch.cuda.get_device_name()}"
    console.print(f"[bold]kvgen demo[/]: format [cyan]{fmt.name}[/] ({mode}); {num_seqs} sequence{'s' if num_seqs != 1 else ''} of "
                  f"{seq_lens} tokens, {num_kv_heads} KV heads x {group} query heads each, head size {head_size}, "
                  f"block size {block_size}", highlight=False)

    # shuffled physical blocks, as a real block allocator hands them out
    perm = torch.randperm(num_blocks, generator=g)
    block_table = torch.zeros(num_seqs, max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for s, nb in enumerate(blocks_per_seq):
        block_table[s, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
    slot_mapping = torch.cat([
        block_table[s, torch.arange(n) // block_size].to(torch.int64) * block_size + torch.arange(n) % block_size
        for s, n in enumerate(seq_lens)
    ])
    total = int(slot_mapping.numel())
    key = torch.randn(total, num_kv_heads, head_size, generator=g, dtype=torch.float32)
    value = torch.randn(total, num_kv_heads, head_size, generator=g, dtype=torch.float32)
    key[:, :, 3] *= 8.0  # an outlier channel, as RoPE'd keys have

    import warnings

    extra = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the demo has no checkpoint scales; 1.0 is right for unit-scale data
        if residual:
            cache = fmt.allocate(num_blocks, block_size, num_kv_heads, head_size, device=device, max_seqs=num_seqs)
        else:
            cache = fmt.allocate(num_blocks, block_size, num_kv_heads, head_size, device=device)
    t0 = time.perf_counter()
    if residual:  # KIVI: each sequence's prompt is appended to it (sequence metadata as for attention)
        seq_ids = torch.arange(num_seqs, dtype=torch.int32, device=device)
        prompt_qsl = torch.tensor([0] + list(torch.tensor(seq_lens).cumsum(0)), dtype=torch.int32)
        fmt.write(cache, key.to(device, torch.bfloat16), value.to(device, torch.bfloat16), slot_mapping.to(device),
                  seq_ids=seq_ids, query_start_loc=prompt_qsl.to(device),
                  seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), block_table=block_table.to(device))
        extra = {"seq_ids": seq_ids}
    else:
        fmt.write(cache, key.to(device, torch.bfloat16), value.to(device, torch.bfloat16), slot_mapping.to(device))
    t_write = time.perf_counter() - t0

    # attention: the last 4 tokens of each sequence are queries (a chunked-prefill step)
    q_lens = [min(4, n) for n in seq_lens]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), num_kv_heads * group, head_size, generator=g)
    t0 = time.perf_counter()
    out = fmt.attend(query.to(device, torch.bfloat16), cache, block_table.to(device),
                     torch.tensor(seq_lens, dtype=torch.int32, device=device), qsl.to(device), **extra)
    t_attend = time.perf_counter() - t0

    # the same attention on the unquantized bf16 inputs, in float64
    ref = torch.empty(query.shape, dtype=torch.float64)
    start = 0
    for s, n in enumerate(seq_lens):
        k = key[start:start + n].to(torch.bfloat16).double().repeat_interleave(group, dim=1)
        v = value[start:start + n].to(torch.bfloat16).double().repeat_interleave(group, dim=1)
        q = query[qsl[s]:qsl[s + 1]].to(torch.bfloat16).double()
        scores = torch.einsum("qhd,khd->hqk", q, k) / head_size ** 0.5
        pos = torch.arange(n - q_lens[s], n)[:, None]
        scores = scores.masked_fill(torch.arange(n)[None, :] > pos, float("-inf"))
        ref[qsl[s]:qsl[s + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += n
    err = (out.double().cpu() - ref).norm() / ref.norm()
    console.print(f"wrote {total} tokens in {t_write * 1e3:.0f} ms; attention for {int(qsl[-1])} query tokens in "
                  f"{t_attend * 1e3:.0f} ms; cache {cache.nbytes():,} B in {list(cache.tensors)}", highlight=False)
    console.print(f"relative L2 error of attention against unquantized float64: [bold]{float(err):.2e}[/]",
                  highlight=False)
    return float(err)
