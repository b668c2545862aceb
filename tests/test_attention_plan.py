"""Format.plan_attention: a batch planned once and run per layer gives attend()'s output bit for bit, reads the batch
tensors' contents at each launch, and rejects a query or cache it was not planned for, naming the argument.

Runs wherever the suite runs (the interpreter on the CPU; compiled kernels with TRITON_INTERPRET=0 on a GPU).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import kvgen

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
BLOCK, HEADS, KV_HEADS, HEAD = 16, 4, 2, 64


def prefill_slots(table, lens, block):
    """Each position of each sequence at the slot its block-table row gives it, sequence after sequence."""
    return torch.cat([table[s, torch.arange(n) // block].long() * block + torch.arange(n) % block
                      for s, n in enumerate(lens)])


def batch(fmt, lens, q_lens, layers=2, seed=0):
    """``layers`` caches of one geometry holding different keys and values, a query per layer and the batch
    tensors (sequences of ``lens`` tokens, ``q_lens`` new ones each)."""
    g = torch.Generator().manual_seed(seed)
    block = fmt.layout.RESIDUAL["group"] if fmt.layout.RESIDUAL else BLOCK
    per_seq = [-(-n // block) for n in lens]
    blocks = sum(per_seq) + 1
    extra = {"max_seqs": len(lens)} if fmt.layout.RESIDUAL else {}
    caches = []
    table = torch.zeros(len(lens), max(per_seq), dtype=torch.int32)
    first = 1  # block 0 stays unused
    for i, n in enumerate(per_seq):
        table[i, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    seq_ids = torch.arange(len(lens), dtype=torch.int32)
    for _ in range(layers):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cache = fmt.allocate(blocks, block, KV_HEADS, HEAD, device=DEVICE, **extra)
        total = sum(lens)
        key = torch.randn(total, KV_HEADS, HEAD, generator=g).to(torch.bfloat16)
        value = torch.randn(total, KV_HEADS, HEAD, generator=g).to(torch.bfloat16)
        if fmt.layout.RESIDUAL:  # one prefill of every sequence through the residual window
            fmt.write(cache, key.to(DEVICE), value.to(DEVICE), prefill_slots(table, lens, block).to(DEVICE),
                      seq_ids=seq_ids.to(DEVICE), seq_lens=seq_lens.to(DEVICE), block_table=table.to(DEVICE),
                      query_start_loc=torch.tensor([0] + list(torch.tensor(lens).cumsum(0)),
                                                   dtype=torch.int32).to(DEVICE),
                      max_query_len=max(lens))
        else:
            fmt.write(cache, key.to(DEVICE), value.to(DEVICE), prefill_slots(table, lens, block).to(DEVICE))
        caches.append(cache)
    queries = [torch.randn(int(qsl[-1]), HEADS, HEAD, generator=g).to(torch.bfloat16).to(DEVICE)
               for _ in range(layers)]
    meta = dict(block_table=table.to(DEVICE), seq_lens=seq_lens.to(DEVICE), query_start_loc=qsl.to(DEVICE))
    if fmt.layout.RESIDUAL:
        meta["seq_ids"] = seq_ids.to(DEVICE)
    return caches, queries, meta


@pytest.mark.parametrize("name,splits", [("fp8_e4m3", None), ("int8_per_token_head", 2), ("nvfp4", None),
                                         ("kivi_2bit", None)])
def test_plan_runs_like_attend_on_every_layer(name, splits):
    fmt = kvgen.load(name)
    caches, queries, meta = batch(fmt, lens=[40, 7, 23], q_lens=[1, 3, 2])
    plan = fmt.plan_attention(queries[0], caches[0], max_query_len=3, num_splits=splits, **meta)
    outs = [plan.run(q, c) for q, c in zip(queries, caches)]
    for q, c, got in zip(queries, caches, outs):
        want = fmt.attend(q, c, max_query_len=3, num_splits=splits, **meta)
        assert torch.equal(got, want)
    assert not torch.equal(outs[0], outs[1])  # the layers' caches differ: so do their outputs
    # into a given output tensor, also for a layer's cache that is not the planned one
    out = torch.empty_like(queries[1])
    assert plan.run(queries[1], caches[1], out=out) is out and torch.equal(out, outs[1])


def test_runs_read_the_batch_tensors_at_launch():
    """Engines update the block table and lengths in place between steps of one shape: a run sees the update."""
    fmt = kvgen.load("fp8_e4m3")
    caches, queries, meta = batch(fmt, lens=[40, 23], q_lens=[1, 1], layers=1)
    plan = fmt.plan_attention(queries[0], caches[0], max_query_len=1, **meta)
    before = plan.run(queries[0], caches[0])
    meta["seq_lens"].copy_(torch.tensor([33, 20], dtype=torch.int32))
    after = plan.run(queries[0], caches[0])
    assert torch.equal(after, fmt.attend(queries[0], caches[0], max_query_len=1, **meta))
    assert not torch.equal(before, after)


def test_a_run_names_what_does_not_match_the_plan():
    fmt = kvgen.load("int8_per_token_head")
    caches, queries, meta = batch(fmt, lens=[20, 9], q_lens=[2, 1], layers=1)
    plan = fmt.plan_attention(queries[0], caches[0], **meta)
    with pytest.raises(ValueError, match=r"^query: \[2, 4, 64\] .*plan was made for \[3, 4, 64\]"):
        plan.run(queries[0][:2], caches[0])
    with pytest.raises(ValueError, match=r"^query: .*float16.*plan again"):
        plan.run(queries[0].half(), caches[0])
    with pytest.raises(ValueError, match="^query: the last dimension must be contiguous"):
        plan.run(queries[0].transpose(1, 2).contiguous().transpose(1, 2), caches[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bigger = fmt.allocate(caches[0].num_blocks + 1, BLOCK, KV_HEADS, HEAD, device=DEVICE)
        other = kvgen.load("fp8_e4m3").allocate(caches[0].num_blocks, BLOCK, KV_HEADS, HEAD, device=DEVICE)
    with pytest.raises(ValueError, match="^cache: .*plan again for this cache"):
        plan.run(queries[0], bigger)
    with pytest.raises(ValueError, match="^cache: it was allocated by format fp8_e4m3"):
        plan.run(queries[0], other)
    with pytest.raises(ValueError, match="^out: "):
        plan.run(queries[0], caches[0], out=torch.empty(3, 4, 32, dtype=torch.bfloat16, device=DEVICE))
    # planning checks what attend checks
    with pytest.raises(ValueError, match="^block_table: has 1 rows for 2 sequences"):
        fmt.plan_attention(queries[0], caches[0], **dict(meta, block_table=meta["block_table"][:1]))


def test_an_empty_batch_plans_and_runs():
    fmt = kvgen.load("fp8_e4m3")
    caches, queries, meta = batch(fmt, lens=[20], q_lens=[1], layers=1)
    empty = queries[0][:0]
    qsl = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    plan = fmt.plan_attention(empty, caches[0], **dict(meta, query_start_loc=qsl, seq_lens=meta["seq_lens"] * 0))
    out = plan.run(empty, caches[0])
    assert out.shape == (0, HEADS, HEAD)
    with pytest.raises(ValueError, match="^out: "):  # still checked
        plan.run(empty, caches[0], out=torch.empty(0, HEADS, HEAD, dtype=torch.float16, device=DEVICE))


def test_a_replaced_cache_tensor_is_read_not_the_planned_one():
    """A cache whose tensors an engine swaps after planning (its own storage, scales loaded late) is checked again
    and read through its new tensors, also when it is the planned cache object."""
    fmt = kvgen.load("fp8_e4m3")
    caches, queries, meta = batch(fmt, lens=[30, 12], q_lens=[1, 2], layers=1)
    cache = caches[0]
    plan = fmt.plan_attention(queries[0], cache, **meta)
    before = plan.run(queries[0], cache)
    cache.tensors["k_scale"] = cache.tensors["k_scale"] * 4
    after = plan.run(queries[0], cache)
    assert torch.equal(after, fmt.attend(queries[0], cache, **meta)) and not torch.equal(before, after)
    cache.tensors["kv_cache"] = cache.tensors["kv_cache"][:1]
    with pytest.raises(ValueError, match="^cache: tensor 'kv_cache' is"):
        plan.run(queries[0], cache)


def test_strided_queries_and_outputs_run_with_their_own_strides():
    fmt = kvgen.load("int8_per_token_head")
    caches, queries, meta = batch(fmt, lens=[25, 17], q_lens=[2, 1], layers=1)
    plan = fmt.plan_attention(queries[0], caches[0], **meta)
    wide = torch.randn(queries[0].shape[0], 2 * HEADS, HEAD, generator=torch.Generator().manual_seed(3))
    view = wide.to(torch.bfloat16).to(DEVICE)[:, 1::2]  # another head stride than the planned query's
    out = torch.zeros(queries[0].shape[0], HEADS + 1, HEAD, dtype=torch.bfloat16, device=DEVICE)
    got = plan.run(view, caches[0], out=out[:, 1:])
    assert torch.equal(got, fmt.attend(view, caches[0], **meta))
    assert torch.count_nonzero(out[:, 0]) == 0  # nothing written outside the view


def test_quantized_domain_and_window_through_a_plan():
    fmt = kvgen.load("int8_per_token_head")
    caches, queries, meta = batch(fmt, lens=[40, 21], q_lens=[2, 3], layers=2)
    kw = dict(dot_precision="quantized", sliding_window=8, num_splits=2, max_query_len=3)
    plan = fmt.plan_attention(queries[0], caches[0], **kw, **meta)
    for q, c in zip(queries, caches):
        assert torch.equal(plan.run(q, c), fmt.attend(q, c, **kw, **meta))


def test_residual_buffers_of_another_size_are_refused():
    fmt = kvgen.load("kivi_2bit")
    caches, queries, meta = batch(fmt, lens=[40, 33], q_lens=[1, 1], layers=1)
    plan = fmt.plan_attention(queries[0], caches[0], **meta)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fewer = fmt.allocate(caches[0].num_blocks, caches[0].block_size, KV_HEADS, HEAD, device=DEVICE, max_seqs=1)
    with pytest.raises(ValueError, match=r"^cache: .*residual rows 1\).*plan again"):
        plan.run(queries[0], fewer)
    fewer.tensors["v_residual"] = fewer.tensors["v_residual"].float()
    with pytest.raises(ValueError, match="^cache: tensor 'v_residual' is"):
        fmt.attend(queries[0], fewer, **meta)


@pytest.mark.skipif(DEVICE != "cpu", reason="the range checks run on host tensors (or with KVGEN_DEBUG)")
@pytest.mark.parametrize("edit,arg", [
    (lambda m: m["seq_lens"].__setitem__(0, 100), "seq_lens"),  # past its block-table row: out of bounds
    (lambda m: m["block_table"].__setitem__((0, 1), 10 ** 6), "block_table"),  # a block the cache lacks
    (lambda m: m["seq_lens"].__setitem__(0, 0), "seq_lens"),  # fewer KV tokens than its new tokens
    (lambda m: m["seq_ids"].__setitem__(1, 7), "seq_ids"),  # a residual row past max_seqs (KIVI)
])
def test_a_run_checks_batch_tensors_updated_in_place_as_attend_does(edit, arg):
    """attend()'s range checks run again at each run where attend would run them: a length or block id changed in
    place after planning is an error naming it, not a read outside the cache (which crashed the interpreter)."""
    fmt = kvgen.load("kivi_2bit" if arg == "seq_ids" else "fp8_e4m3")
    caches, queries, meta = batch(fmt, lens=[40, 23], q_lens=[1, 1], layers=1)
    plan = fmt.plan_attention(queries[0], caches[0], max_query_len=1, **meta)
    plan.run(queries[0], caches[0])
    edit(meta)
    with pytest.raises(ValueError, match=f"^{arg}: "):
        plan.run(queries[0], caches[0])


@pytest.mark.parametrize("name,kwargs", [("fp8_e4m3", {}), ("fp8_e4m3", {"num_splits": 2}),
                                         ("fp8_e4m3", {"dequantize_first": True}), ("q4_0", {}), ("kivi_2bit", {})])
def test_padding_rows_past_the_last_sequence_leave_the_real_rows_alone(name, kwargs):
    """A CUDA-graph-padded batch: the query has rows past query_start_loc[-1]. They are padding: the real rows'
    output is the unpadded batch's bit for bit, from attend() and from a plan (whose padded shape stays fixed)."""
    fmt = kvgen.load(name)
    [cache], [query], meta = batch(fmt, lens=[40, 23], q_lens=[2, 1], layers=1)
    n = query.shape[0]
    padded = torch.cat([query, torch.full((3, HEADS, HEAD), 7.0, dtype=query.dtype, device=DEVICE)])
    want = fmt.attend(query, cache, **meta, **kwargs)
    got = fmt.attend(padded, cache, **meta, **kwargs)
    assert got.shape == padded.shape and torch.equal(got[:n], want)
    plan = fmt.plan_attention(padded, cache, **meta, **kwargs)
    assert torch.equal(plan.run(padded, cache)[:n], want)
    if DEVICE == "cpu":  # the range checks run on host tensors: ending past the query's rows is refused
        with pytest.raises(ValueError, match=r"^query_start_loc: must start at 0 and end at most at the number"):
            fmt.attend(query[:n - 1], cache, **meta, **kwargs)


@pytest.mark.parametrize("kwargs", [{}, {"num_splits": 2}, {"dequantize_first": True}])
def test_a_batch_of_padding_sequences_only_runs_on_every_path(kwargs):
    """A CUDA-graph warm-up batch: every sequence has 0 new and 0 KV tokens. attend() and a plan accept it on every
    path (dequantize_first refused it, naming a max_query_len of 0 the caller never passed). Every row is padding,
    whose output is unspecified (README), so only the call is checked."""
    fmt = kvgen.load("int8_per_token_head")
    [cache], _, meta = batch(fmt, lens=[5, 3], q_lens=[1, 1], layers=1)
    meta = dict(meta, seq_lens=torch.zeros(2, dtype=torch.int32, device=DEVICE),
                query_start_loc=torch.zeros(3, dtype=torch.int32, device=DEVICE))
    query = torch.randn(3, HEADS, HEAD).to(torch.float16).to(DEVICE)
    out = torch.empty_like(query)
    assert fmt.attend(query, cache, **meta, **kwargs, out=out) is out
    plan = fmt.plan_attention(query, cache, **meta, **kwargs)
    assert plan.run(query, cache, out=out) is out


@pytest.mark.parametrize("name,kwargs", [("fp8_e4m3", {}), ("fp8_e4m3", {"num_splits": 2}),
                                         ("q4_0", {"dequantize_first": True}), ("kivi_2bit", {})])
def test_a_column_slice_of_a_wider_block_table_reads_like_its_copy(name, kwargs):
    """Engines keep one wide block table and pass a slice of its columns: the kernels read it through its row
    stride, so the slice gives its contiguous copy's output, from attend() and from a plan (it was refused)."""
    fmt = kvgen.load(name)
    [cache], [query], meta = batch(fmt, lens=[40, 23], q_lens=[2, 1], layers=1)
    table = meta["block_table"]
    wide = torch.full((table.shape[0], table.shape[1] + 5), 10 ** 6, dtype=torch.int32, device=table.device)
    wide[:, :table.shape[1]] = table
    sliced = wide[:, :table.shape[1]]
    assert not sliced.is_contiguous()
    want = fmt.attend(query, cache, **meta, **kwargs)
    assert torch.equal(fmt.attend(query, cache, **dict(meta, block_table=sliced), **kwargs), want)
    plan = fmt.plan_attention(query, cache, **dict(meta, block_table=sliced), **kwargs)
    assert torch.equal(plan.run(query, cache), want)
