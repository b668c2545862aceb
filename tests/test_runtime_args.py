"""fmt.write / fmt.attend / fmt.allocate reject bad arguments with a ValueError naming the argument; kvgen.load."""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import kvgen
from kvgen.cli import main as cli_main

SHIPPED = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp8_per_token_head", "int8_per_token_head")

NB, BS, H, HS = 4, 16, 2, 32  # the small cache most tests use: 64 slots


@pytest.fixture(scope="module")
def int8():
    return kvgen.load("int8_per_token_head")


@pytest.fixture(scope="module")
def fp8_static():
    return kvgen.load("fp8_e4m3")


@pytest.fixture
def cache(int8):
    return int8.allocate(NB, BS, H, HS)


def all_zero(cache) -> bool:
    return all(not bool(t.view(torch.uint8).any()) for n, t in cache.tensors.items() if n.endswith("cache"))


def raises_named(arg: str, fn, *fragments: str) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    msg = str(info.value)
    assert msg.startswith(f"{arg}:"), msg
    for frag in fragments:
        assert frag in msg, msg
    return msg


# --------------------------------------------------------------------------------------------------------------
# write


def kv(t=5, h=H, hs=HS, dtype=torch.float32):
    g = torch.Generator().manual_seed(t * 131 + h * 7 + hs)
    return torch.randn(t, h, hs, generator=g).to(dtype), torch.randn(t, h, hs, generator=g).to(dtype)


def _write_cases():
    k, v = kv()
    sm = torch.arange(5)
    noncontig = torch.randn(5, H, 2 * HS)[..., ::2]
    return {
        "key_ndim": ("key", (k[0], v, sm), ("3",)),
        "value_ndim": ("value", (k, v[None], sm), ("3",)),
        "key_heads": ("key", (*kv(h=3), sm), ()),
        "key_head_size": ("key", (*kv(hs=16), sm), ()),
        "key_int32": ("key", (k.to(torch.int32), v, sm), ("int32",)),
        "value_int64": ("value", (k, v.to(torch.int64), sm), ("int64",)),
        "token_counts_differ": ("value", (k, v[:4], sm), ("4",)),
        "value_heads_differ": ("value", (k, torch.randn(5, 1, HS), sm), ()),
        "slot_mapping_short": ("slot_mapping", (k, v, sm[:4]), ("4", "5")),
        "slot_mapping_long": ("slot_mapping", (k, v, torch.arange(6)), ()),
        "slot_mapping_2d": ("slot_mapping", (k, v, sm[None]), ()),
        "slot_mapping_float": ("slot_mapping", (k, v, sm.float()), ("float32",)),
        "slot_out_of_range": ("slot_mapping", (k, v, torch.tensor([0, 1, 2, 3, NB * BS])), (str(NB * BS),)),
        "slot_below_minus_one": ("slot_mapping", (k, v, torch.tensor([0, 1, -2, 3, 4])), ("-2",)),
        "key_last_dim_strided": ("key", (noncontig, v, sm), ("contiguous",)),
        "value_last_dim_strided": ("value", (k, noncontig, sm), ("contiguous",)),
        "key_not_a_tensor": ("key", (k.tolist(), v, sm), ()),
    }


WRITE_CASES = _write_cases()


@pytest.mark.parametrize("case", sorted(WRITE_CASES))
def test_write_rejects(int8, cache, case):
    arg, (key, value, slots), frags = WRITE_CASES[case]
    raises_named(arg, lambda: int8.write(cache, key, value, slots), *frags)
    assert all_zero(cache), "a rejected write must not touch the cache"


def test_write_rejects_cache_of_another_format(int8):
    other = kvgen.load("bf16").allocate(NB, BS, H, HS)
    k, v = kv()
    raises_named("cache", lambda: int8.write(other, k, v, torch.arange(5)), "bf16")
    raises_named("cache", lambda: int8.write("not a cache", k, v, torch.arange(5)))


def test_write_rejects_cache_of_a_same_named_format(tmp_path, monkeypatch):
    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path / "cache"))
    spec = tmp_path / "bf16.yaml"
    # fp32 cells are twice the size of bf16 ones, so the wrong write stays inside the tensor
    spec.write_text("name: bf16\nkey:\n  element: fp32\nvalue:\n  element: fp32\n")
    impostor = kvgen.load(spec)
    foreign = impostor.allocate(2, BS, 1, 16)
    k, v = kv(t=4, h=1, hs=16)
    raises_named("cache", lambda: kvgen.load("bf16").write(foreign, k, v, torch.arange(4)))


def test_write_and_attend_reject_a_misaligned_cache_tensor(int8, cache):
    """A cache tensor replaced by an engine's own storage that starts at an odd address: named, not a fault."""
    t = cache.tensors["kv_cache"]
    storage = torch.zeros(t.numel() * t.element_size() + 16, dtype=torch.uint8)
    shifted = storage[1:1 + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    assert shifted.is_contiguous() and shifted.data_ptr() % 16
    cache.tensors["kv_cache"] = shifted
    k, v = kv()
    raises_named("cache", lambda: int8.write(cache, k, v, torch.arange(5)), "kv_cache", "16 bytes")
    q = torch.zeros(1, 2 * H, HS)
    table, lens, starts = (torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                           torch.tensor([0, 1], dtype=torch.int32))
    raises_named("cache", lambda: int8.attend(q, cache, table, lens, starts), "16 bytes")


def test_write_minus_one_skips_the_token(int8, cache):
    k, v = kv()
    int8.write(cache, k, v, torch.full((5,), -1, dtype=torch.int64))
    assert all_zero(cache)
    int8.write(cache, k, v, torch.tensor([-1, 3, -1, -1, -1], dtype=torch.int32))
    cells = cache.tensors["kv_cache"].view(torch.uint8).reshape(NB * BS, -1)
    written = cells.any(dim=1).nonzero().flatten().tolist()
    assert written == [3]


# --------------------------------------------------------------------------------------------------------------
# attend


@pytest.fixture(scope="module")
def filled(int8):
    """A cache with one sequence of 20 tokens in blocks [2, 0]; 3 query tokens."""
    cache = int8.allocate(NB, BS, H, HS)
    k, v = kv(t=20)
    blocks = [2, 0]
    slots = torch.tensor([blocks[i // BS] * BS + i % BS for i in range(20)])
    int8.write(cache, k, v, slots)
    args = dict(
        query=torch.randn(3, 2 * H, HS),
        block_table=torch.tensor([blocks], dtype=torch.int32),
        seq_lens=torch.tensor([20], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
    )
    return cache, args


def _attend(fmt, cache, args, **over):
    a = dict(args)
    a.update(over)
    return fmt.attend(a.pop("query"), cache, a.pop("block_table"), a.pop("seq_lens"), a.pop("query_start_loc"), **a)


def test_attend_good_arguments_work(int8, filled):
    cache, args = filled
    out = _attend(int8, cache, args)
    assert out.shape == (3, 2 * H, HS) and out.dtype == torch.float32
    assert torch.isfinite(out).all()


I32 = torch.int32
ATTEND_CASES = {
    "query_heads_not_multiple": ("query", dict(query=torch.randn(3, 3, HS)), ("3",)),
    "query_no_heads": ("query", dict(query=torch.randn(3, 0, HS)), ("0 query heads",)),
    "query_head_size": ("query", dict(query=torch.randn(3, 2 * H, 16)), ("16",)),
    "query_ndim": ("query", dict(query=torch.randn(3, 2 * H * HS)), ()),
    "query_int": ("query", dict(query=torch.ones(3, 2 * H, HS, dtype=torch.int32)), ()),
    "block_table_int64": ("block_table", dict(block_table=torch.tensor([[2, 0]], dtype=torch.int64)), ("int64",)),
    "block_table_rows": ("block_table", dict(block_table=torch.tensor([[2, 0], [1, 3]], dtype=I32)), ("2",)),
    "block_table_1d": ("block_table", dict(block_table=torch.tensor([2, 0], dtype=I32)), ()),
    "query_start_loc_length": ("query_start_loc", dict(query_start_loc=torch.tensor([0, 1, 3], dtype=I32)), ()),
    "query_start_loc_end": ("query_start_loc", dict(query_start_loc=torch.tensor([0, 4], dtype=I32)), ("4",)),  # past the 3 rows
    "query_start_loc_start": ("query_start_loc", dict(query_start_loc=torch.tensor([1, 3], dtype=I32)), ()),
    "seq_lens_int64": ("seq_lens", dict(seq_lens=torch.tensor([20], dtype=torch.int64)), ("int64",)),
    "seq_len_below_query_count": ("seq_lens", dict(seq_lens=torch.tensor([2], dtype=I32)), ("2", "3")),
    "seq_len_beyond_capacity": ("seq_lens", dict(seq_lens=torch.tensor([2 * BS + 1], dtype=I32)), ()),
    "seq_len_negative": ("seq_lens", dict(seq_lens=torch.tensor([-3], dtype=I32)), ("negative", "-3")),
    "block_id_too_large": ("block_table", dict(block_table=torch.tensor([[2, NB]], dtype=I32)), (str(NB),)),
    "block_id_negative": ("block_table", dict(block_table=torch.tensor([[-1, 0]], dtype=I32)), ("-1",)),
    "sliding_window_zero": ("sliding_window", dict(sliding_window=0), ("0",)),
    "sliding_window_negative": ("sliding_window", dict(sliding_window=-4), ("-4",)),
    "sliding_window_float": ("sliding_window", dict(sliding_window=2.5), ()),
    "sm_scale_nan": ("sm_scale", dict(sm_scale=float("nan")), ()),
    "sm_scale_bool": ("sm_scale", dict(sm_scale=True), ("True",)),
    "num_splits_bool": ("num_splits", dict(num_splits=True), ("True",)),
    "sm_scale_overflows_fp32": ("sm_scale", dict(sm_scale=1.5e308), ("overflows fp32",)),
    "num_splits_past_the_grid": ("num_splits", dict(num_splits=10 ** 12), ("65535",)),
    "max_query_len_past_the_query": ("max_query_len", dict(max_query_len=2 ** 40), ("3 tokens",)),
    "max_seq_len_past_int32": ("max_seq_len", dict(max_seq_len=2 ** 70), ("int32",)),
    # the rows past the 3 query tokens are named, not the max_query_len the decreasing entries would imply
    "query_start_loc_decreasing": ("query_start_loc", dict(
        query_start_loc=torch.tensor([0, 3, 2], dtype=I32), seq_lens=torch.tensor([20, 20], dtype=I32),
        block_table=torch.tensor([[2, 0], [1, 3]], dtype=I32), max_query_len=3), ("decrease",)),
    "out_wrong_shape": ("out", dict(out=torch.empty(3, 2 * H, HS + 1)), ()),
    "out_wrong_dtype": ("out", dict(out=torch.empty(3, 2 * H, HS, dtype=torch.float16)), ()),
}


@pytest.mark.parametrize("case", sorted(ATTEND_CASES))
def test_attend_rejects(int8, filled, case):
    cache, args = filled
    arg, over, frags = ATTEND_CASES[case]
    raises_named(arg, lambda: _attend(int8, cache, args, **over), *frags)


def test_attend_takes_numpy_scalars_as_python_numbers(int8, filled):
    """Engines read windows and scales from configs held in numpy: np.int64 / np.float32 give the Python numbers'
    output."""
    cache, args = filled
    want = _attend(int8, cache, args, sliding_window=7, sm_scale=0.125, num_splits=2)
    got = _attend(int8, cache, args, sliding_window=np.int64(7), sm_scale=np.float32(0.125), num_splits=np.int32(2))
    assert torch.equal(got, want)


def test_a_window_beyond_int32_is_no_window(int8, filled):
    """Windows of 2**63 or 2**64 (an engine's "no window" sentinel) wrapped or overflowed the kernel's integer
    argument: any window longer than an int32 sequence is the same as none."""
    cache, args = filled
    want = _attend(int8, cache, args)
    for window in (2 ** 31, 2 ** 63, 2 ** 64):
        assert torch.equal(_attend(int8, cache, args, sliding_window=window), want), window


def test_a_plan_of_placeholder_batches_runs_decode_when_filled(int8, filled):
    """README: plan with placeholders (0 new and 0 KV tokens) and fill the batch in place. The plan used to find a
    longest query of 0 and launch nothing on every run; without max_query_len it plans for decode now, and a
    longer query filled in later is named as the plan's (on CPU tensors, where the range checks run)."""
    cache, args = filled
    query = args["query"][:1]
    seq_lens, qsl = torch.zeros(1, dtype=I32), torch.zeros(2, dtype=I32)
    plan = int8.plan_attention(query, cache, args["block_table"], seq_lens, qsl)
    seq_lens[0], qsl[1] = 20, 1
    want = int8.attend(query, cache, args["block_table"], seq_lens, qsl)
    assert torch.equal(plan.run(query, cache, out=torch.full_like(query, 123.0)), want)
    query3, seq_lens[0] = args["query"], 0
    qsl[1] = 0
    plan = int8.plan_attention(query3, cache, args["block_table"], seq_lens, qsl)
    seq_lens[0], qsl[1] = 20, 3
    raises_named("query_start_loc", lambda: plan.run(query3, cache), "longer than the plan's (1",
                 "plan again")


def test_attend_block_ids_past_seq_len_are_not_checked(int8, filled):
    # only the blocks a sequence uses must be valid: padding entries of a block table row may hold anything
    cache, args = filled
    out = _attend(int8, cache, args, block_table=torch.tensor([[2, 0, 999]], dtype=I32))
    assert torch.isfinite(out).all()


def test_attend_rejects_cache_of_another_format(int8, filled):
    _, args = filled
    other = kvgen.load("bf16").allocate(NB, BS, H, HS)
    raises_named("cache", lambda: _attend(int8, other, args))


def test_attend_rejects_max_query_len_below_longest_query():
    fmt = kvgen.load("bf16")
    n = 40
    cache = fmt.allocate(3, BS, 1, 16)
    k, v = kv(t=n, h=1, hs=16)
    fmt.write(cache, k, v, torch.arange(n))
    args = dict(query=torch.randn(n, 1, 16), block_table=torch.tensor([[0, 1, 2]], dtype=I32),
                seq_lens=torch.tensor([n], dtype=I32), query_start_loc=torch.tensor([0, n], dtype=I32))
    out = torch.full((n, 1, 16), float("nan"))
    try:
        _attend(fmt, cache, args, max_query_len=1, out=out)
    except ValueError as exc:
        assert str(exc).startswith("max_query_len:")
        return
    assert not torch.isnan(out).any(), "rows of the output were never written"


# --------------------------------------------------------------------------------------------------------------
# allocate and static scales


def test_dynamic_format_refuses_static_scales(int8):
    raises_named("k_scale", lambda: int8.allocate(NB, BS, H, HS, k_scale=0.5))
    raises_named("v_scale", lambda: int8.allocate(NB, BS, H, HS, v_scale=0.5))


@pytest.mark.parametrize("kwargs, arg", [
    (dict(num_blocks=0), "num_blocks"), (dict(block_size=-16), "block_size"), (dict(num_kv_heads=0), "num_kv_heads"),
    (dict(head_size=8), "head_size"), (dict(head_size=100_000), "head_size"), (dict(num_blocks=2.0), "num_blocks"),
    (dict(block_size=True), "block_size"),
])
def test_allocate_rejects_bad_shapes(int8, kwargs, arg):
    a = dict(num_blocks=NB, block_size=BS, num_kv_heads=H, head_size=HS)
    a.update(kwargs)
    raises_named(arg, lambda: int8.allocate(**a))


@pytest.mark.parametrize("kwargs, arg", [
    (dict(block_size=-16), "block_size"), (dict(num_kv_heads=0), "num_kv_heads"), (dict(head_size=0), "head_size"),
    (dict(head_size=8), "head_size"), (dict(block_size=16.0), "block_size"),
])
@pytest.mark.parametrize("method", ["page_bytes", "page_layout"])
def test_page_size_rejects_what_allocate_rejects(int8, method, kwargs, arg):
    a = dict(block_size=BS, num_kv_heads=H, head_size=HS)
    a.update(kwargs)
    raises_named(arg, lambda: getattr(int8, method)(**a))
    raises_named(arg, lambda: int8.allocate(NB, **a))


def test_page_size_rejects_a_head_size_off_the_scale_block():
    q4_0 = kvgen.load("q4_0")
    raises_named("head_size", lambda: q4_0.page_bytes(BS, H, 48))
    raises_named("head_size", lambda: q4_0.allocate(NB, BS, H, 48))


def test_allocate_rejects_a_device_it_cannot_use(int8):
    raises_named("device", lambda: int8.allocate(NB, BS, H, HS, device="gpu0"))
    raises_named("device", lambda: int8.allocate(NB, BS, H, HS, device="meta"), "meta")  # holds no data to run on
    if not torch.cuda.is_available():  # torch's own error here is an AssertionError that names no argument
        raises_named("device", lambda: int8.allocate(NB, BS, H, HS, device="cuda"))
    else:
        raises_named("device", lambda: int8.allocate(NB, BS, H, HS, device=f"cuda:{torch.cuda.device_count()}"))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_static_scale_must_be_positive_and_finite(fp8_static, bad):
    raises_named("k_scale", lambda: fp8_static.allocate(NB, BS, H, HS, k_scale=bad, v_scale=1.0))
    raises_named("v_scale", lambda: fp8_static.allocate(NB, BS, H, HS, k_scale=1.0, v_scale=bad))


def test_per_tensor_scale_takes_one_value(fp8_static):
    raises_named("k_scale", lambda: fp8_static.allocate(NB, BS, H, HS, k_scale=[1.0, 2.0], v_scale=1.0), "2")


def _warnings_of(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [w for w in caught if issubclass(w.category, UserWarning)]


def test_static_format_without_scales_warns_once(fp8_static):
    cache, ws = _warnings_of(lambda: fp8_static.allocate(NB, BS, H, HS))
    assert len(ws) == 1, [str(w.message) for w in ws]
    msg = str(ws[0].message)
    assert "1.0" in msg and "k_scale" in msg and "v_scale" in msg
    assert ws[0].filename == __file__, "the warning should point at the caller of allocate()"
    assert cache.tensors["k_scale"].tolist() == [1.0]
    assert cache.tensors["v_scale"].tolist() == [1.0]


def test_static_format_with_one_scale_warns_about_the_other(fp8_static):
    cache, ws = _warnings_of(lambda: fp8_static.allocate(NB, BS, H, HS, k_scale=0.25))
    assert len(ws) == 1
    msg = str(ws[0].message)
    assert "v_scale" in msg and "1.0" in msg
    assert "no k_scale" not in msg
    assert cache.tensors["k_scale"].tolist() == [0.25]


def test_static_format_with_scales_does_not_warn(fp8_static):
    cache, ws = _warnings_of(lambda: fp8_static.allocate(NB, BS, H, HS, k_scale=0.5, v_scale=torch.tensor(2.0)))
    assert ws == []
    assert cache.tensors["k_scale"].dtype == torch.float32
    assert cache.tensors["k_scale"].tolist() == [0.5]
    assert cache.tensors["v_scale"].tolist() == [2.0]


PER_HEAD = """\
name: fp8_per_head_test
key:
  element: fp8_e4m3
  scale:
    granularity: per_head
value:
  element: fp8_e4m3
  scale:
    granularity: per_head
"""


@pytest.fixture(scope="module")
def per_head(tmp_path_factory):
    d = tmp_path_factory.mktemp("per_head")
    (d / "fp8_per_head_test.yaml").write_text(PER_HEAD)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVGEN_CACHE_DIR", str(d / "cache"))
        return kvgen.load(d / "fp8_per_head_test.yaml")


def test_per_head_scales(per_head):
    cache, ws = _warnings_of(lambda: per_head.allocate(NB, BS, 4, HS, k_scale=[1.0, 2.0, 3.0, 4.0],
                                                       v_scale=torch.full((4, 1, 1), 0.5)))
    assert ws == []
    assert cache.tensors["k_scale"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert cache.tensors["v_scale"].tolist() == [0.5] * 4
    one, _ = _warnings_of(lambda: per_head.allocate(NB, BS, 4, HS, k_scale=3.0, v_scale=1.0))
    assert one.tensors["k_scale"].tolist() == [3.0] * 4  # one value for every head


@pytest.mark.parametrize("bad", [[1.0, 2.0, 3.0], [1.0] * 5, [1.0, 2.0, -3.0, 4.0], [1.0, 0.0, 1.0, 1.0]])
def test_per_head_scales_rejected(per_head, bad):
    raises_named("k_scale", lambda: per_head.allocate(NB, BS, 4, HS, k_scale=bad, v_scale=1.0))
    raises_named("v_scale", lambda: per_head.allocate(NB, BS, 4, HS, k_scale=1.0, v_scale=bad))


# --------------------------------------------------------------------------------------------------------------
# page_bytes against what allocate really takes, and against the byte layouts worked out by hand


def hand_page_bytes(name: str, bs: int, h: int, hs: int) -> int:
    cell = {
        "bf16": 2 * 2 * hs, "fp16": 2 * 2 * hs,  # K and V, 2 bytes each
        "fp8_e4m3": 2 * hs, "fp8_e5m2": 2 * hs,  # 1 byte each, the scales live in the cache object
        "fp8_per_token_head": 2 * (hs + 4), "int8_per_token_head": 2 * (hs + 4),  # + fp32 scale per side
    }[name]
    return bs * h * cell


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("bs, h, hs", [(16, 8, 128), (16, 2, 64), (32, 1, 80), (8, 4, 96), (1, 3, 16)])
def test_page_bytes_is_allocated_bytes_per_block(name, bs, h, hs):
    fmt = kvgen.load(name)
    nb = 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(nb, bs, h, hs)
    storage = {n: t for n, t in cache.tensors.items() if n not in ("k_scale", "v_scale")}
    allocated = sum(t.numel() * t.element_size() for t in storage.values())
    for t in storage.values():
        assert tuple(t.shape[:3]) == (nb, bs, h)
    assert allocated % nb == 0
    assert fmt.page_bytes(bs, h, hs) == allocated // nb
    assert fmt.page_bytes(bs, h, hs) == hand_page_bytes(name, bs, h, hs)


# --------------------------------------------------------------------------------------------------------------
# kvgen.load


def test_load_unknown_name_lists_the_shipped_formats():
    with pytest.raises(kvgen.KvgenError) as info:
        kvgen.load("no_such_format")
    msg = str(info.value)
    assert "no_such_format" in msg
    for name in SHIPPED:
        assert name in msg


def test_load_missing_yaml(tmp_path, monkeypatch):
    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(kvgen.SpecError):
        kvgen.load(tmp_path / "missing.yaml")


MY_FP16 = """\
name: my_fp16_test
description: fp16 keys and values, built on the fly by a test
key:
  element: fp16
value:
  element: fp16
"""


def reference_attention(q, k, v, q_pos):
    """float64 causal attention of queries at positions q_pos over keys/values [n, kv_heads, hs]."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    mask = torch.arange(k.shape[0])[None, :] > torch.tensor(q_pos)[:, None]
    s = s.masked_fill(mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def write_and_attend(fmt, n=20, h=2, group=2, hs=16):
    bs = 16
    cache = fmt.allocate(4, bs, h, hs)
    k, v = kv(t=n, h=h, hs=hs)
    blocks = [3, 1]
    slots = torch.tensor([blocks[i // bs] * bs + i % bs for i in range(n)])
    fmt.write(cache, k, v, slots)
    q = torch.randn(3, h * group, hs, generator=torch.Generator().manual_seed(5))
    out = fmt.attend(q, cache, torch.tensor([blocks], dtype=I32), torch.tensor([n], dtype=I32),
                     torch.tensor([0, 3], dtype=I32))
    ref = reference_attention(q, k.half(), v.half(), [n - 3, n - 2, n - 1])
    return float((out.double() - ref).norm() / ref.norm())


def test_load_yaml_builds_on_the_fly(tmp_path, monkeypatch):
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("KVGEN_CACHE_DIR", str(cache_dir))
    spec = tmp_path / "my_fp16_test.yaml"
    spec.write_text(MY_FP16)
    fmt = kvgen.load(spec)
    assert fmt.name == "my_fp16_test"
    built = list(cache_dir.rglob("kernels.py"))
    assert len(built) == 1, built  # built into $KVGEN_CACHE_DIR, nowhere else
    assert fmt.page_bytes(16, 2, 16) == 16 * 2 * 2 * 2 * 16
    assert write_and_attend(fmt) < 1e-2


def build_with_cli(spec_text: str, tmp_path: Path, name: str) -> Path:
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(spec_text)
    out = tmp_path / "out"
    r = CliRunner().invoke(cli_main, ["build", str(spec), "-o", str(out)])
    assert r.exit_code == 0, r.output
    return out / name


def test_load_generated_directory(tmp_path):
    d = build_with_cli(MY_FP16.replace("my_fp16_test", "my_fp16_dir"), tmp_path, "my_fp16_dir")
    fmt = kvgen.load(d)
    assert fmt.name == "my_fp16_dir"
    assert write_and_attend(fmt) < 1e-2
    assert kvgen.load(str(d)).name == "my_fp16_dir"


def test_edited_spec_hash_is_stale(tmp_path):
    d = build_with_cli(MY_FP16.replace("my_fp16_test", "my_fp16_stale"), tmp_path, "my_fp16_stale")
    init = d / "__init__.py"
    text = init.read_text()
    edited = re.sub(r'SPEC_HASH = "[0-9a-f]+"', 'SPEC_HASH = "0123456789abcdef"', text)
    assert edited != text
    init.write_text(edited)
    with pytest.raises(kvgen.StaleError) as info:
        kvgen.load(d)
    msg = str(info.value)
    assert str(d) in msg
    assert "kvgen build" in msg


def test_other_kvgen_version_is_stale(tmp_path):
    d = build_with_cli(MY_FP16.replace("my_fp16_test", "my_fp16_version"), tmp_path, "my_fp16_version")
    init = d / "__init__.py"
    edited = re.sub(r'KVGEN_VERSION = "[^"]+"', 'KVGEN_VERSION = "0.0.0-other"', init.read_text())
    init.write_text(edited)
    with pytest.raises(kvgen.StaleError) as info:
        kvgen.load(d)
    assert "kvgen build" in str(info.value)


def test_directory_that_is_not_a_generated_format(tmp_path):
    d = build_with_cli(MY_FP16.replace("my_fp16_test", "my_fp16_partial"), tmp_path, "my_fp16_partial")
    (d / "kernels.py").unlink()
    with pytest.raises(kvgen.KvgenError) as info:
        kvgen.load(d)
    assert "kernels.py" in str(info.value)


def test_load_yaml_again_after_editing_it(tmp_path, monkeypatch):
    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path / "cache"))
    spec = tmp_path / "edited.yaml"
    spec.write_text(MY_FP16.replace("my_fp16_test", "edited_spec").replace("fp16", "bf16"))
    first = kvgen.load(spec)
    assert first.spec.key.element.value == "bf16"
    spec.write_text(MY_FP16.replace("my_fp16_test", "edited_spec"))
    second = kvgen.load(spec)
    assert second.spec.key.element.value == "fp16"


@pytest.mark.parametrize("bad", ["abc", {"a": 1}, 1j, True, [1.0, "x"]])
def test_a_scale_that_is_not_a_number_is_named(fp8_static, bad):
    raises_named("k_scale", lambda: fp8_static.allocate(NB, BS, H, HS, k_scale=bad, v_scale=1.0), "expected a float")


@pytest.mark.parametrize("replace,words", [
    (torch.tensor([-1.0]), "finite and positive"),  # costly check (CPU tensors here), like the global range's
    (torch.tensor([1.0, 2.0]), "expected a contiguous (1,) torch.float32"),
    (torch.tensor([1.0], dtype=torch.float64), "expected a contiguous (1,) torch.float32"),
    (None, "is missing"),
])
def test_static_scales_replaced_in_the_cache_are_checked_on_write(fp8_static, replace, words):
    """Engines load the layer's scales into cache.tensors after allocate: a missing, mis-shaped, mistyped or (where
    costly checks run) non-positive one is an error naming it, and nothing is written."""
    cache = fp8_static.allocate(NB, BS, 1, HS, k_scale=1.0, v_scale=1.0)
    if replace is None:
        del cache.tensors["k_scale"]
    else:
        cache.tensors["k_scale"] = replace
    before = cache.tensors["kv_cache"].clone()
    x = torch.ones(3, 1, HS)
    with pytest.raises(ValueError, match="k_scale") as info:
        fp8_static.write(cache, x, x, torch.arange(3))
    assert words in str(info.value)
    assert torch.equal(cache.tensors["kv_cache"], before)
    # attend reads them too: a NaN or negative scale gave a NaN or negated output without a word
    q, table = torch.ones(1, 1, HS), torch.zeros(1, 1, dtype=torch.int32)
    lens, qsl = torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="k_scale") as info:
        fp8_static.attend(q, cache, table, lens, qsl)
    assert words in str(info.value)


def test_a_cache_too_large_to_allocate_names_num_blocks(fp8_static):
    raises_named("num_blocks", lambda: fp8_static.allocate(2 ** 40, BS, 1, HS, k_scale=1.0, v_scale=1.0),
                 "could not be allocated")


@pytest.mark.parametrize("bad", [123, None, 1.5])
def test_load_names_an_argument_that_is_no_name_or_path(bad):
    with pytest.raises(kvgen.KvgenError, match="^name_or_path: expected a format name"):
        kvgen.load(bad)


def test_allocate_takes_numpy_ints_as_python_ints(int8):
    """Sizes read from a numpy config: the cache holds Python ints (numpy's reached the kernels' launch as
    np.int64, whose missing bit_length crashed the first write)."""
    cache = int8.allocate(np.int64(NB), np.int64(BS), np.int32(H), np.int64(HS))
    assert all(type(v) is int for v in (cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_size))
    x = torch.randn(2, H, HS)
    int8.write(cache, x, x.clone(), torch.tensor([0, 1]))
    kivi = kvgen.load("kivi_2bit")
    assert kivi.allocate(2, 32, H, 32, max_seqs=np.int64(3)).tensors["k_residual"].shape[0] == 3
    raises_named("max_seqs", lambda: kivi.allocate(2, 32, H, 32, max_seqs=True))


def test_format_queries_name_a_bad_argument():
    """describe / residual_bytes / auto_min_new_tokens took what page_bytes refuses (a str head size raised TypeError,
    a group of 0 ZeroDivisionError, -1 heads gave 0 bytes), a side name other than "key" answered for the value side,
    and an empty name loaded the current directory."""
    from kvgen.runtime.dequantize import auto_min_new_tokens

    q4 = kvgen.load("q4_0")
    raises_named("head_size", lambda: q4.describe(16, 1, "16"))
    raises_named("group", lambda: auto_min_new_tokens(q4, group=0))
    raises_named("head_size", lambda: auto_min_new_tokens(q4, head_size=0))
    raises_named("num_kv_heads", lambda: kvgen.load("kivi_2bit").residual_bytes(-1, 16))
    raises_named("side", lambda: q4.static_scale_kind("keys"), "'keys'")
    raises_named("side", lambda: q4.scale_summary("v"))
    with pytest.raises(kvgen.KvgenError, match="no format named ''"):
        kvgen.load("")
