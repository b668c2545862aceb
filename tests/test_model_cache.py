"""The model-level cache: one format per layer, skip layers in the model dtype, one block table for all layers."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

import kvgen
from kvgen import reference as R

H, D, BS, BLOCKS = 2, 32, 4, 6
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"


def test_skip_layers_padding_and_shared_block_table():
    m = kvgen.model_cache("int8_per_token_head", 4, BLOCKS, BS, H, D, skip_layers=[0, 3], device=DEVICE)
    assert [f.name for f in m.formats] == ["bf16", "int8_per_token_head", "int8_per_token_head", "bf16"]
    # by hand: bf16 cell 2 * 2 * 32 = 128 B, page 4 * 2 * 128 = 1024; int8 cell 32 + 4 + 32 + 4 = 72, page 576
    assert [m.page_bytes(i) for i in range(4)] == [1024, 576, 576, 1024]
    assert m.padded_page_bytes == 1024 and m.padding_bytes == 2 * (1024 - 576)
    # one block table for all layers: every layer writes and reads the same blocks
    rng = np.random.default_rng(0)
    table = torch.tensor([[4, 1, 5]], dtype=torch.int32)
    pos = np.arange(10)
    slots = torch.from_numpy(table[0].numpy()[pos // BS].astype(np.int64) * BS + pos % BS)
    q = torch.from_numpy(rng.standard_normal((1, 2 * H, D)).astype(np.float32))
    for layer in range(4):
        k = torch.from_numpy(rng.standard_normal((10, H, D)).astype(np.float32))
        v = torch.from_numpy(rng.standard_normal((10, H, D)).astype(np.float32))
        m.write(layer, k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE))
        out = m.attend(layer, q.to(DEVICE), table.to(DEVICE), torch.tensor([10], dtype=torch.int32, device=DEVICE),
                       torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)).cpu()
        spec = m.formats[layer].spec
        expected = R.new_cache(spec, BLOCKS, BS, H, D)
        R.write(spec, expected, k.numpy(), v.numpy(), slots.numpy())
        kd, vd = R.read(spec, expected, head_size=D, block_size=BS, num_kv_heads=H)
        ref = R.paged_attention(q.double().numpy(), kd, vd, table.numpy(), np.array([10]), np.array([0, 1]),
                                1 / np.sqrt(D))
        assert np.abs(out.double().numpy() - ref).max() < 1e-4


def test_scales_per_layer_and_one_warning_naming_missing_layers():
    scales = {1: (0.5, 0.25), 2: (2.0, 4.0)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = kvgen.model_cache("fp8_e4m3", 6, BLOCKS, BS, H, D, skip_layers=[5], scales=scales)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "layers 0, 3-4" in messages[0]
    assert float(m.layers[1].tensors["k_scale"]) == 0.5 and float(m.layers[2].tensors["v_scale"]) == 4.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kvgen.model_cache("fp8_e4m3", 2, BLOCKS, BS, H, D, scales={0: (1.0, 1.0), 1: (1.0, 1.0)})
    assert not caught


def test_bad_arguments_name_them():
    with pytest.raises(ValueError, match="skip_layers"):
        kvgen.model_cache("fp8_e4m3", 2, BLOCKS, BS, H, D, skip_layers=[2])
    with pytest.raises(ValueError, match="model_dtype"):
        kvgen.model_cache("fp8_e4m3", 2, BLOCKS, BS, H, D, model_dtype="fp32")
    with pytest.raises(ValueError, match="^num_layers: "):
        kvgen.model_cache("fp8_e4m3", 0, BLOCKS, BS, H, D)
    with pytest.raises(ValueError, match="^scales: "):
        kvgen.model_cache("fp8_e4m3", 2, BLOCKS, BS, H, D, scales="abc")
    with pytest.raises(ValueError, match="^scales: layer 1's entry"):
        kvgen.model_cache("fp8_e4m3", 2, BLOCKS, BS, H, D, scales={1: 0.5})
    # scales that would be dropped without a word: a layer the model lacks, a key that is not an index, scales for
    # a format that computes its own on write, a bool as a skip layer
    for bad in ({7: (1.0, 1.0)}, {"1": (1.0, 1.0)}, {True: (1.0, 1.0)}):
        with pytest.raises(ValueError, match=r"^scales: keys .* are not layer indices in \[0, 3\)"):
            kvgen.model_cache("fp8_e4m3", 3, BLOCKS, BS, H, D, scales=bad)
    with pytest.raises(ValueError, match="^scales: no layer's format takes static scales"):
        kvgen.model_cache("int8_per_token_head", 2, BLOCKS, BS, H, D, scales={0: (1.0, 1.0)})
    with pytest.raises(ValueError, match="^skip_layers: "):
        kvgen.model_cache("fp8_e4m3", 2, BLOCKS, BS, H, D, skip_layers=[True])
    m = kvgen.model_cache("fp8_e4m3", 2, BLOCKS, BS, H, D, scales={0: (1.0, 1.0), 1: (1.0, 1.0)})
    x = torch.zeros(1, H, D)
    for layer in (2, -1, "0", True):  # a layer index past the end, negative, not an int: never another layer's
        with pytest.raises(ValueError, match=r"^layer: .* is not a layer index in \[0, 2\)"):
            m.write(layer, x, x, torch.zeros(1, dtype=torch.int64))
        with pytest.raises(ValueError, match="^layer: "):
            m.page_bytes(layer)


def test_a_step_planned_for_every_layer_runs_like_attend():
    """ModelKVCache.plan_attention: one plan per distinct format (skip layers in bf16 included), run per layer."""
    m = kvgen.model_cache("fp8_e4m3", 3, BLOCKS, BS, H, D, skip_layers=[1], scales={0: (0.5, 0.25), 2: (2.0, 1.0)},
                          device=DEVICE)
    g = torch.Generator().manual_seed(1)
    table = torch.tensor([[2, 0], [5, 3]], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([8, 9, 10, 0, 1, 20, 21, 22, 23, 12], dtype=torch.int64, device=DEVICE)
    for layer in range(3):
        m.write(layer, torch.randn(10, H, D, generator=g).to(DEVICE), torch.randn(10, H, D, generator=g).to(DEVICE),
                slots)
    lens = torch.tensor([5, 5], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 1, 3], dtype=torch.int32, device=DEVICE)
    queries = [torch.randn(3, 2 * H, D, generator=g).to(DEVICE) for _ in range(3)]
    plan = m.plan_attention(queries[0], table, lens, qsl, max_query_len=2)
    for layer in range(3):
        assert torch.equal(plan.run(layer, queries[layer]),
                           m.attend(layer, queries[layer], table, lens, qsl, max_query_len=2))
    with pytest.raises(ValueError, match="^layer: 3 is not a layer index"):
        plan.run(3, queries[0])


def test_a_step_write_planned_for_every_layer_writes_like_write():
    """ModelKVCache.plan_write: one plan per distinct format (the bf16 skip layer's too), run per layer, writes the
    bytes write() writes into a twin model cache."""
    args = ("fp8_e4m3", 3, BLOCKS, BS, H, D)
    kw = dict(skip_layers=[1], scales={0: (0.5, 0.25), 2: (2.0, 1.0)}, device=DEVICE)
    planned, written = kvgen.model_cache(*args, **kw), kvgen.model_cache(*args, **kw)
    g = torch.Generator().manual_seed(2)
    slots = torch.tensor([8, 9, 10, 0, 1, 20, -1, 22], dtype=torch.int64, device=DEVICE)
    layers = [(torch.randn(8, H, D, generator=g).to(DEVICE), torch.randn(8, H, D, generator=g).to(DEVICE))
              for _ in range(3)]
    plan = planned.plan_write(layers[0][0], slots)
    for layer, (key, value) in enumerate(layers):
        plan.run(layer, key, value)
        written.write(layer, key, value, slots)
        for name, t in planned.layers[layer].tensors.items():
            assert torch.equal(t.view(torch.uint8), written.layers[layer].tensors[name].view(torch.uint8)), name
    assert not torch.equal(planned.layers[0].tensors["kv_cache"], planned.layers[2].tensors["kv_cache"])
    with pytest.raises(ValueError, match="^layer: -1 is not a layer index"):
        plan.run(-1, *layers[0])


def test_kivi_with_skip_layers_takes_the_sequence_arguments_for_the_model():
    """A KIVI model with a bf16 skip layer (what `kvgen plan --skip-layers` suggests): the sequence arguments passed
    for the model reach the KIVI layers, the skip layer writes by slot and attends without seq_ids; planned runs
    match the plain calls. A model without a residual-window layer still refuses seq_ids."""
    m = kvgen.model_cache("kivi_2bit", 2, 4, 32, H, D, skip_layers=[1], max_seqs=2, device=DEVICE)
    plain = kvgen.load("bf16")
    g = torch.Generator().manual_seed(3)
    table = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([7, 5], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 7, 12], dtype=torch.int32, device=DEVICE)
    slots = torch.cat([torch.arange(64, 71), torch.arange(96, 101)]).to(DEVICE)  # blocks 2 and 3 from offset 0
    meta = dict(seq_ids=torch.tensor([1, 0], dtype=torch.int32, device=DEVICE), query_start_loc=qsl, seq_lens=lens,
                block_table=table)
    kv = [(torch.randn(12, H, D, generator=g).to(DEVICE), torch.randn(12, H, D, generator=g).to(DEVICE))
          for _ in range(2)]
    plan = m.plan_write(kv[0][0], slots, **meta)
    for layer, (k, v) in enumerate(kv):
        plan.run(layer, k, v)
    twin = kvgen.model_cache("kivi_2bit", 2, 4, 32, H, D, skip_layers=[1], max_seqs=2, device=DEVICE)
    for layer, (k, v) in enumerate(kv):
        twin.write(layer, k, v, slots, **meta)
        for name, t in m.layers[layer].tensors.items():
            assert torch.equal(t.view(torch.uint8), twin.layers[layer].tensors[name].view(torch.uint8)), name
    # the skip layer holds the bf16 keys at the slots
    got = m.layers[1].tensors["kv_cache"].reshape(-1, H, 2 * D)[slots, :, :D].float()
    assert torch.equal(got, kv[1][0].to(torch.bfloat16).float())
    q = torch.randn(12, 2 * H, D, generator=g).to(DEVICE)
    attn = m.plan_attention(q, table, lens, qsl, seq_ids=meta["seq_ids"], max_query_len=7)
    for layer in range(2):
        want = m.attend(layer, q, table, lens, qsl, seq_ids=meta["seq_ids"], max_query_len=7)
        assert torch.equal(attn.run(layer, q), want)
    assert torch.equal(m.attend(1, q, table, lens, qsl, seq_ids=meta["seq_ids"]),
                       plain.attend(q, m.layers[1], table, lens, qsl))
    fp8 = kvgen.model_cache("fp8_e4m3", 2, 4, 32, H, D, skip_layers=[1], scales={0: (1.0, 1.0)}, device=DEVICE)
    with pytest.raises(ValueError, match="seq_ids"):
        fp8.attend(1, q, table, lens, qsl, seq_ids=meta["seq_ids"])


def test_a_model_plan_takes_a_sliding_window_per_layer():
    """Models that mix windowed and full layers: one window per layer (None = full), one plan per distinct format
    and window; each layer's run equals attend() with that layer's window."""
    m = kvgen.model_cache("fp8_e4m3", 3, BLOCKS, BS, H, D, skip_layers=[2], scales={0: (0.5, 0.5), 1: (0.5, 0.5)},
                          device=DEVICE)
    g = torch.Generator().manual_seed(4)
    table = torch.tensor([[2, 0, 4]], dtype=torch.int32, device=DEVICE)
    slots = (table[0, torch.arange(11, device=DEVICE) // BS].long() * BS + torch.arange(11, device=DEVICE) % BS)
    for layer in range(3):
        m.write(layer, torch.randn(11, H, D, generator=g).to(DEVICE), torch.randn(11, H, D, generator=g).to(DEVICE),
                slots)
    lens = torch.tensor([11], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 2 * H, D, generator=g).to(DEVICE)
    windows = [4, None, 4]
    plan = m.plan_attention(q, table, lens, qsl, sliding_window=windows)
    outs = [plan.run(layer, q) for layer in range(3)]
    for layer, w in enumerate(windows):
        assert torch.equal(outs[layer], m.attend(layer, q, table, lens, qsl, sliding_window=w))
    # the window matters: layer 0 with and without it differ
    assert not torch.equal(outs[0], m.attend(0, q, table, lens, qsl))
    with pytest.raises(ValueError, match=r"^sliding_window: 2 entries for 3 layers"):
        m.plan_attention(q, table, lens, qsl, sliding_window=[4, None])


def test_numpy_layer_indices_are_layer_indices():
    """Scales keyed by np.int64 (from a numpy loop over layers) and numpy skip layers are layers, as before."""
    m = kvgen.model_cache("fp8_e4m3", 3, BLOCKS, BS, H, D, skip_layers=[np.int64(2)],
                          scales={np.int64(i): (0.5 * (i + 1), 0.25) for i in range(2)})
    assert m.formats[2].name == "bf16"
    assert float(m.layers[1].tensors["k_scale"].reshape(-1)[0]) == 1.0


def test_numpy_ints_and_loose_arguments_are_taken_or_named():
    """A layer index or layer count from numpy is a number (it was refused as "not a layer index"); no skip layers
    given as None is none; a window that is neither a number nor one per layer, and a bad scale, are named (the
    scale with its layer)."""
    m = kvgen.model_cache("bf16", np.int64(2), BLOCKS, BS, H, D, skip_layers=None)
    k = torch.randn(2, H, D)
    m.write(np.int64(1), k, k, torch.tensor([0, 1]))
    plain = kvgen.model_cache("bf16", 2, BLOCKS, BS, H, D)
    plain.write(1, k, k, torch.tensor([0, 1]))
    assert torch.equal(m.layers[1].tensors["kv_cache"], plain.layers[1].tensors["kv_cache"])
    q = torch.randn(1, H, D)
    table, lens = torch.tensor([[0]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    assert torch.equal(m.attend(np.int32(1), q, table, lens, qsl), plain.attend(1, q, table, lens, qsl))
    for window in (2.0, "3"):
        with pytest.raises(ValueError, match="^sliding_window: expected a positive integer, None, or one entry"):
            m.plan_attention(q, table, lens, qsl, sliding_window=window)
    with pytest.raises(ValueError, match="^skip_layers: expected layer indices, got 5"):
        kvgen.model_cache("bf16", 2, BLOCKS, BS, H, D, skip_layers=5)
    with pytest.raises(ValueError, match="^scales: layer 1: k_scale: "):
        kvgen.model_cache("fp8_e4m3", 2, BLOCKS, BS, H, D, scales={0: (1.0, 1.0), 1: (float("nan"), 1.0)})
