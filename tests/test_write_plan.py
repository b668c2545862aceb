"""Format.plan_write: a batch planned once and run per layer writes write()'s bytes bit for bit, reads the slot
mapping's and sequence metadata's contents at each launch, and rejects inputs or a cache it was not planned for,
naming the argument.

Runs wherever the suite runs (the interpreter on the CPU; compiled kernels with TRITON_INTERPRET=0 on a GPU).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import kvgen

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
BLOCK, KV_HEADS, HEAD = 16, 2, 64


def caches(fmt, blocks: int, n: int, max_seqs: int = 2) -> list:
    """``n`` zeroed caches of one geometry; static scales (per tensor, per head, or a block format's global scale)
    0.5 for keys and 2.0 for values where the format takes them."""
    block = fmt.layout.RESIDUAL["group"] if fmt.layout.RESIDUAL else BLOCK
    kw = {"max_seqs": max_seqs} if fmt.layout.RESIDUAL else {}
    scale = fmt.spec.key.scale
    if scale.granularity.value in ("per_tensor", "per_head") or getattr(scale, "global_scale", False):
        kw.update(k_scale=0.5, v_scale=2.0)
    return [fmt.allocate(blocks, block, KV_HEADS, HEAD, device=DEVICE, **kw) for _ in range(n)]


def inputs(tokens: int, layers: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(tokens, KV_HEADS, HEAD, generator=g).to(torch.bfloat16).to(DEVICE) for _ in range(2))
            for _ in range(layers)]


def position_slots(table, seq_lens, q_lens, block_size: int) -> torch.Tensor:
    """The slot_mapping an engine passes with sequence metadata: new row i of sequence s (``q_lens[s]`` of
    ``seq_lens[s]`` tokens) at position ``seq_lens[s] - q_lens[s] + i``, slot ``table[s, p // bs] * bs + p % bs``."""
    rows = [int(table[s, p // block_size]) * block_size + p % block_size
            for s, (n, q) in enumerate(zip(map(int, seq_lens), map(int, q_lens))) for p in range(n - q, n)]
    return torch.tensor(rows, dtype=torch.int64, device=table.device)


def same_bytes(a, b) -> bool:
    return all(torch.equal(a.tensors[k].view(torch.uint8), b.tensors[k].view(torch.uint8)) for k in a.tensors)


@pytest.mark.parametrize("name", ["fp8_e4m3", "int8_per_token_head", "nvfp4", "int4_per_token_head"])
def test_plan_writes_like_write_on_every_layer(name):
    fmt = kvgen.load(name)
    slots = torch.tensor([5, 40, -1, 17, 3, 63, 22], dtype=torch.int64, device=DEVICE)  # one token skipped
    planned, written = caches(fmt, 4, 3), caches(fmt, 4, 3)
    layers = inputs(slots.shape[0], 3)
    plan = fmt.plan_write(layers[0][0], planned[0], slots)
    for cache, twin, (key, value) in zip(planned, written, layers):
        plan.run(cache, key, value)
        fmt.write(twin, key, value, slots)
        assert same_bytes(cache, twin)
    assert not same_bytes(planned[0], planned[1])  # the layers' inputs differ: so do their bytes
    assert same_bytes(caches(fmt, 4, 1)[0], caches(fmt, 4, 1)[0])  # (the comparison itself sees bytes)


def test_a_plan_takes_int64_slots_only():
    """A plan reads its slot mapping in place at each run: an int32 one, copied to int64 once, would miss the
    engine's updates, so planning refuses it (write() converts it per call)."""
    fmt = kvgen.load("int8_per_token_head")
    slots = torch.tensor([9, 2, 30], dtype=torch.int32, device=DEVICE)
    (cache, twin), [(key, value)] = caches(fmt, 2, 2), inputs(3, 1)
    with pytest.raises(ValueError, match="^slot_mapping: plan_write needs int64 slots"):
        fmt.plan_write(key, cache, slots)
    fmt.write(cache, key, value, slots)
    fmt.plan_write(key, twin, slots.long()).run(twin, key, value)
    assert same_bytes(cache, twin)


def test_runs_read_the_slot_mapping_at_launch():
    """Engines refill the slot mapping in place between steps of one size: a run writes at the new slots."""
    fmt = kvgen.load("fp8_e4m3")
    slots = torch.tensor([1, 2, 3], dtype=torch.int64, device=DEVICE)
    (cache, twin), [(key, value)] = caches(fmt, 2, 2), inputs(3, 1)
    plan = fmt.plan_write(key, cache, slots)
    slots.copy_(torch.tensor([20, 7, 31]))
    plan.run(cache, key, value)
    fmt.write(twin, key, value, torch.tensor([20, 7, 31], device=DEVICE))
    assert same_bytes(cache, twin)


@pytest.mark.skipif(DEVICE != "cpu", reason="the slots' range check runs on host tensors (or with KVGEN_DEBUG)")
def test_a_run_checks_slots_updated_in_place_as_write_does():
    fmt = kvgen.load("fp8_e4m3")
    slots = torch.tensor([1, 2, 3], dtype=torch.int64)
    [cache], [(key, value)] = caches(fmt, 2, 1), inputs(3, 1)
    plan = fmt.plan_write(key, cache, slots)
    slots[1] = cache.num_slots  # one past the end
    with pytest.raises(ValueError, match="^slot_mapping: "):
        plan.run(cache, key, value)


@pytest.mark.skipif(DEVICE != "cpu", reason="the scale checks read host tensors (or run with KVGEN_DEBUG)")
def test_a_run_checks_each_layers_static_scales_as_write_does():
    """A run checks the static scales of the cache it writes (one plan serves layers of different scales): a scale
    set to -1 in place is refused as write() refuses it, and nothing is written."""
    fmt = kvgen.load("fp8_e4m3")
    slots = torch.tensor([1, 2, 3], dtype=torch.int64)
    good, bad = caches(fmt, 2, 2)
    [(key, value)] = inputs(3, 1)
    plan = fmt.plan_write(key, good, slots)
    plan.run(good, key, value)
    bad.tensors["k_scale"].fill_(-1.0)
    before = bad.tensors["kv_cache"].clone()
    with pytest.raises(ValueError, match=r"^cache.tensors\['k_scale'\]: scales must be finite and positive"):
        fmt.write(bad, key, value, slots)
    with pytest.raises(ValueError, match=r"^cache.tensors\['k_scale'\]: scales must be finite and positive"):
        plan.run(bad, key, value)
    assert torch.equal(bad.tensors["kv_cache"], before)


def test_a_cache_given_new_storage_is_written_there():
    """Tensors an engine replaces in the cache, or gives new storage in place (set_), after planning are checked
    again and written through their new storage, not the planned one."""
    fmt = kvgen.load("int8_per_token_head")
    slots = torch.tensor([4, 0, 19], dtype=torch.int64, device=DEVICE)
    (cache, twin), [(key, value)] = caches(fmt, 2, 2), inputs(3, 1)
    plan = fmt.plan_write(key, cache, slots)
    plan.run(cache, key, value)
    old = cache.tensors["kv_cache"]
    cache.tensors["kv_cache"] = torch.zeros_like(old)  # replaced in the dict
    plan.run(cache, key, value)
    fmt.write(twin, key, value, slots)
    assert same_bytes(cache, twin) and torch.equal(old, cache.tensors["kv_cache"])
    fresh = torch.zeros_like(old)
    cache.tensors["kv_cache"].set_(fresh)  # new storage, the same tensor object
    plan.run(cache, key, value)
    assert torch.equal(fresh, twin.tensors["kv_cache"])


def test_a_kivi_plan_writes_like_write_through_the_residual_window():
    """A prefill that flushes groups and fills the ring, then decode steps, each planned once for two layers."""
    fmt = kvgen.load("kivi_2bit")
    group = fmt.layout.RESIDUAL["group"]
    planned, written = caches(fmt, 12, 2), caches(fmt, 12, 2)
    table = torch.arange(1, 11, dtype=torch.int32, device=DEVICE).reshape(2, 5)
    seq_ids = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    lens = [2 * group + 9, group - 3]
    steps = [(lens, lens)] + [([1, 1], [lens[0] + i, lens[1] + i]) for i in (1, 2)]
    for step, (q_lens, seq_lens) in enumerate(steps):
        meta = dict(seq_ids=seq_ids, block_table=table,
                    seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                    query_start_loc=torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device=DEVICE))
        slots = position_slots(table, seq_lens, q_lens, planned[0].block_size)
        layers = inputs(sum(q_lens), 2, seed=step)
        plan = fmt.plan_write(layers[0][0], planned[0], slots, max_query_len=max(q_lens), **meta)
        for cache, twin, (key, value) in zip(planned, written, layers):
            plan.run(cache, key, value)
            fmt.write(twin, key, value, slots, max_query_len=max(q_lens), **meta)
            assert same_bytes(cache, twin)
    assert not same_bytes(planned[0], planned[1])
    # decode steps of one plan, the lengths advanced in place as an engine does
    seq_lens = torch.tensor([lens[0] + 3, lens[1] + 3], dtype=torch.int32, device=DEVICE)
    meta = dict(seq_ids=seq_ids, block_table=table, seq_lens=seq_lens,
                query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE))
    slots = position_slots(table, seq_lens, [1, 1], planned[0].block_size)
    plan = fmt.plan_write(inputs(2, 1)[0][0], planned[0], slots, max_query_len=1, **meta)
    for step in range(group // 2 + 3):  # across a group boundary of the shorter sequence
        (key, value), = inputs(2, 1, seed=10 + step)
        plan.run(planned[0], key, value)
        fmt.write(written[0], key, value, slots, max_query_len=1, **meta)
        assert same_bytes(planned[0], written[0])
        seq_lens += 1
        slots.copy_(position_slots(table, seq_lens, [1, 1], planned[0].block_size))  # in place, as an engine does


def test_a_run_names_what_does_not_match_the_plan():
    fmt = kvgen.load("int8_per_token_head")
    slots = torch.tensor([0, 1, 2], dtype=torch.int64, device=DEVICE)
    [cache], [(key, value)] = caches(fmt, 2, 1), inputs(3, 1)
    plan = fmt.plan_write(key, cache, slots)
    with pytest.raises(ValueError, match=r"^key: \[2, 2, 64\] .*plan was made for \[3, 2, 64\]"):
        plan.run(cache, key[:2], value)
    with pytest.raises(ValueError, match=r"^value: .*float16.*plan again"):
        plan.run(cache, key, value.half())
    with pytest.raises(ValueError, match="^value: the last dimension must be contiguous"):
        plan.run(cache, key, value.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(ValueError, match="^key: expected a torch.Tensor"):
        plan.run(cache, None, value)
    [bigger] = caches(fmt, 3, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other = kvgen.load("fp8_e4m3").allocate(2, BLOCK, KV_HEADS, HEAD, device=DEVICE)
    with pytest.raises(ValueError, match="^cache: .*plan again for this cache"):
        plan.run(bigger, key, value)
    with pytest.raises(ValueError, match="^cache: it was allocated by format fp8_e4m3"):
        plan.run(other, key, value)
    # planning checks what write checks
    with pytest.raises(ValueError, match="^slot_mapping: has 2 entries for 3 tokens"):
        fmt.plan_write(key, cache, slots[:2])
    with pytest.raises(ValueError, match="^seq_lens: format int8_per_token_head writes by slot only"):
        fmt.plan_write(key, cache, slots, seq_lens=torch.ones(1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="^max_query_len: format int8_per_token_head writes by slot only"):
        fmt.write(cache, key, key, slots, max_query_len=3)  # (it was ignored without a word)
    if DEVICE == "cpu":  # the range check reads the slots: on the host only (a GPU copy would synchronise)
        with pytest.raises(ValueError, match="^slot_mapping: "):
            fmt.plan_write(key, cache, torch.tensor([0, 1, 32], device=DEVICE))


def test_an_empty_batch_plans_and_runs():
    fmt = kvgen.load("fp8_e4m3")
    [cache], [(key, value)] = caches(fmt, 2, 1), inputs(0, 1)
    before = {k: t.clone() for k, t in cache.tensors.items()}
    plan = fmt.plan_write(key, cache, torch.zeros(0, dtype=torch.int64, device=DEVICE))
    plan.run(cache, key, value)
    assert all(torch.equal(before[k], t) for k, t in cache.tensors.items())
    with pytest.raises(ValueError, match="^value: "):  # still checked
        plan.run(cache, key, value.half())
    with pytest.raises(ValueError, match="^cache: .*plan again for this cache"):
        plan.run(caches(fmt, 3, 1)[0], key, value)


@pytest.mark.skipif(DEVICE != "cpu", reason="the sequence checks read host tensors (or run with KVGEN_DEBUG)")
def test_a_kivi_write_refuses_two_sequences_on_one_residual_row():
    """Each sequence appends to its own residual row: two of a batch on one row would overwrite each other's
    window, so the write is refused naming seq_ids, and nothing is written."""
    fmt = kvgen.load("kivi_2bit")
    [cache] = caches(fmt, 12, 1)
    before = {k: t.clone() for k, t in cache.tensors.items()}
    (key, value), = inputs(2, 1)
    meta = dict(seq_ids=torch.tensor([1, 1], dtype=torch.int32),
                block_table=torch.arange(1, 11, dtype=torch.int32).reshape(2, 5),
                seq_lens=torch.tensor([1, 1], dtype=torch.int32), query_start_loc=torch.tensor([0, 1, 2],
                                                                                         dtype=torch.int32))
    with pytest.raises(ValueError, match="^seq_ids: sequences 0 and 1 of the batch both append to residual row 1"):
        fmt.write(cache, key, value, torch.zeros(2, dtype=torch.int64), **meta)
    assert all(torch.equal(t, before[k]) for k, t in cache.tensors.items())


def test_kivi_padding_sequences_may_share_a_residual_row():
    """A CUDA graph's padding sequences (0 new tokens) append nothing: they may name any row, one already in the
    batch included (they were refused as "both append"), and the bytes equal the write without them."""
    fmt = kvgen.load("kivi_2bit")
    (key, value), = inputs(2, 1)
    table = torch.arange(1, 11, dtype=torch.int32, device=DEVICE).reshape(2, 5)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    real = dict(seq_ids=i32(0, 1), block_table=table, seq_lens=i32(1, 1), query_start_loc=i32(0, 1, 2))
    padded = dict(seq_ids=i32(0, 1, 0, 0), block_table=torch.cat([table, table]), seq_lens=i32(1, 1, 0, 0),
                  query_start_loc=i32(0, 1, 2, 2, 2))
    slots = torch.tensor([1 * 32, 6 * 32], dtype=torch.int64, device=DEVICE)
    want, got = caches(fmt, 12, 1)[0], caches(fmt, 12, 1)[0]
    fmt.write(want, key, value, slots, **real)
    fmt.write(got, key, value, slots, **padded)
    assert all(torch.equal(t, want.tensors[k]) for k, t in got.tensors.items())


@pytest.mark.skipif(DEVICE != "cpu", reason="the sequence checks read host tensors (or run with KVGEN_DEBUG)")
def test_a_kivi_write_refuses_slots_the_block_table_does_not_give():
    """KIVI places tokens by the sequence metadata; a slot_mapping that disagrees with it (a caller's bookkeeping
    bug) is refused naming the row, its position and both slots, and nothing is written."""
    fmt = kvgen.load("kivi_2bit")
    [cache] = caches(fmt, 12, 1)
    bs = cache.block_size
    before = {k: t.clone() for k, t in cache.tensors.items()}
    (key, value), = inputs(3, 1)
    table = torch.tensor([[4, 2], [7, 9]], dtype=torch.int32)
    meta = dict(seq_ids=torch.tensor([0, 1], dtype=torch.int32), block_table=table,
                seq_lens=torch.tensor([bs + 2, 1], dtype=torch.int32),
                query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32))
    # sequence 0's new positions bs and bs + 1 are in its second block (2): slots 2 * bs and 2 * bs + 1;
    # sequence 1's position 0 is slot 7 * bs
    good = torch.tensor([2 * bs, 2 * bs + 1, 7 * bs], dtype=torch.int64)
    fmt.write(caches(fmt, 12, 1)[0], key, value, good, **meta)  # accepted
    bad = good.clone()
    bad[1] = 4 * bs + 1  # the first block's offset: the position's slot within the wrong block
    with pytest.raises(ValueError, match=rf"^slot_mapping: row 1 \(sequence 0, position {bs + 1}\) has slot "
                                         rf"{4 * bs + 1}, but block_table puts that position at slot {2 * bs + 1}"):
        fmt.write(cache, key, value, bad, **meta)
    assert all(torch.equal(t, before[k]) for k, t in cache.tensors.items())
