"""Positions that no query of a decode step sees (outside its sliding window) do not reach its output, even when the
value stored there is NaN: docs/SEMANTICS.md, "Non-finite values in attention". The oracle is the same attention
with 0.0 written at that position instead: hidden positions must not matter, so the outputs are equal bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

import kvgen

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def decode_after(name: str, value_at_hidden: float, window: int) -> torch.Tensor:
    """One sequence of 40 tokens written (KIVI: a prefill of 39 then a decode step's token), then one decode query at
    position 39 with ``window``; the value at position 39 - window (just outside the window) is ``value_at_hidden``
    in its first element."""
    fmt = kvgen.load(name)
    gen = torch.Generator().manual_seed(7)
    length, heads, head = 40, 1, 32
    key = torch.randn(length, heads, head, generator=gen)
    value = torch.randn(length, heads, head, generator=gen)
    value[length - 1 - window, 0, 0] = value_at_hidden
    query = torch.randn(1, 2, head, generator=gen)  # 2 query heads over 1 KV head
    key, value, query = key.to(DEVICE), value.to(DEVICE), query.to(DEVICE)
    if fmt.spec.streaming:
        block = 32
        cache = fmt.allocate(num_blocks=3, block_size=block, num_kv_heads=heads, head_size=head, max_seqs=1,
                             device=DEVICE)
        table, sid = i32([[0, 1]]), i32([0])
        for lo, hi in ((0, length - 1), (length - 1, length)):
            fmt.write(cache, key[lo:hi], value[lo:hi], torch.arange(lo, hi, device=DEVICE), seq_ids=sid,
                      query_start_loc=i32([0, hi - lo]), seq_lens=i32([hi]), block_table=table)
        return fmt.attend(query, cache, table, i32([length]), i32([0, 1]), seq_ids=sid, sliding_window=window)
    cache = fmt.allocate(num_blocks=3, block_size=16, num_kv_heads=heads, head_size=head, device=DEVICE)
    fmt.write(cache, key, value, torch.arange(length, device=DEVICE))
    table = i32([[0, 1, 2]])
    return fmt.attend(query, cache, table, i32([length]), i32([0, 1]), sliding_window=window)


@pytest.mark.parametrize("name,window", [("kivi_2bit", 4), ("kivi_2bit", 9), ("bf16", 5), ("fp8_e4m3", 3)])
@pytest.mark.parametrize("hidden", [float("nan"), float("inf")])
def test_decode_ignores_values_outside_its_window(name, window, hidden):
    # KIVI's window of 4 / 9 keeps position 39 - window in the bf16 residual ring, in a step that starts at a key
    # group's boundary before the window (the case that once leaked: 0 * NaN in the value dot)
    got = decode_after(name, hidden, window)
    want = decode_after(name, 0.0, window)
    assert torch.isfinite(want).all()
    assert torch.equal(got, want), (got - want).abs().max()
