"""V_SPLIT: decode's P x V dot as two dots of half the value columns each (runtime.kernels.VALUE_SPLIT_OVERRIDE, the
generated VALUE_SPLIT, the kernels' value_dot). Splitting the columns moves no product and no sum: every output
element is the same dot over the same positions, so the attention output must equal the unsplit one bit for bit, in
the interpreter and compiled, with and without KV splits. Where a format's value steps take other dots (block dots,
minima, KIVI) or the call is a prefill, the runtime launches without it."""
from __future__ import annotations

import pytest
import torch

import kvgen
from kvgen.runtime import kernels as K

from test_tiles import DEVICE, decode_case

# one of each way the columns part: 8-bit codes in column pairs (a per-tensor scale, per-position scales with a
# zero point beside them), codes narrower than a byte in even / odd columns (per-position and e4m3 block scales), and
# value blocks whose decode steps stack every block in one dot (q4_0, q8_0: stacked_pv)
SPLIT_FORMATS = {"fp8_e4m3": "pairs", "int8_asym_per_token_head": "pairs", "mixed_k8_v4": "halves",
                 "nvfp4": "halves", "q4_0": "halves", "q8_0": "pairs"}


def attend_both(name: str, ctx: int, monkeypatch, head_size: int = 128, **kwargs) -> dict:
    """{split: [(the launch's V_SPLIT, the output) for 1 and 3 KV splits]} of one decode case, V_SPLIT off, in two
    dots (True) and in four (4)."""
    fmt, q, (cache, table, seq_lens, qsl), ids = decode_case(name, ctx, head_size)
    outs = {}
    for split in (False, True, 4):
        monkeypatch.setattr(K, "VALUE_SPLIT_OVERRIDE", split)
        outs[split] = []
        for splits in (1, 3):
            args = dict(max_query_len=1, num_splits=splits, **ids, **kwargs)
            plan = fmt.plan_attention(q, cache, table, seq_lens, qsl, **args)
            outs[split].append((plan._launch.kwargs["V_SPLIT"], fmt.attend(q, cache, table, seq_lens, qsl, **args)))
    return outs


@pytest.mark.parametrize("name", sorted(SPLIT_FORMATS))
def test_split_value_dot_changes_nothing(name, monkeypatch):
    """Several whole steps and a partial one: V_SPLIT on launches the split kernel and gives the unsplit output."""
    assert kvgen.load(name)._kernels.module.VALUE_SPLIT == SPLIT_FORMATS[name]
    outs = attend_both(name, 2 * 128 + 37, monkeypatch)
    for (off_flag, off), (on_flag, on), (four_flag, four) in zip(outs[False], outs[True], outs[4]):
        assert (off_flag, on_flag, four_flag) == (0, 2, 4), name
        assert torch.equal(off, on), name
        assert torch.equal(off, four), name


@pytest.mark.parametrize("head_size", [16, 48, 256])
def test_split_value_dot_at_other_heads(head_size, monkeypatch):
    """Other head sizes: a padded head (48 in 64 columns), a large one, and a head of 16, whose halves would be
    narrower than a tensor-core dot takes (the kernel then keeps one dot)."""
    for name in ("fp8_e4m3", "nvfp4"):
        outs = attend_both(name, 64 + 37, monkeypatch, head_size)
        for (_, off), (_, on), (_, four) in zip(outs[False], outs[True], outs[4]):
            assert torch.equal(off, on), (name, head_size)
            assert torch.equal(off, four), (name, head_size)


@pytest.mark.parametrize("name", ["kivi_2bit", "bf16"])
def test_formats_without_one_value_dot_never_split(name, monkeypatch):
    """KIVI's value groups, minima and ring, 16-bit values: no VALUE_SPLIT, so the override launches nothing new."""
    assert kvgen.load(name)._kernels.module.VALUE_SPLIT == ""
    outs = attend_both(name, 64 + 5, monkeypatch)
    for flag, _ in outs[True] + outs[4]:
        assert flag == 0, name


BLOCK_KEYS_TOKEN_VALUES = """
kvgen_spec: 1
name: q4_keys_int8_values
description: q4_0's keys (one dot per block) with int8 values scaled per token and head (one dot)
cache: {layout: interleaved, storage_dtype: uint8}
key:
  element: int4
  rounding: half_even
  scale: {granularity: per_block, block: 32, dtype: fp16, placement: inline, apply: divide}
value:
  element: int8
  rounding: half_even
  scale: {granularity: per_token_head, placement: inline}
"""


def test_block_keys_alone_never_split(tmp_path, monkeypatch):
    """Block dots on one side only: the kernel folds no rows (ROW_FOLD ""), so its values never split (value_dot is
    the row folds' helper), and decode runs with the override on (it raised a NameError when VALUE_SPLIT was set)."""
    path = tmp_path / "q4_keys_int8_values.yaml"
    path.write_text(BLOCK_KEYS_TOKEN_VALUES)
    module = kvgen.load(str(path))._kernels.module
    assert (module.ROW_FOLD, module.VALUE_SPLIT) == ("", "")
    outs = attend_both(str(path), 64 + 5, monkeypatch)
    for (off_flag, off), (on_flag, on), (four_flag, four) in zip(outs[False], outs[True], outs[4]):
        assert (off_flag, on_flag, four_flag) == (0, 0, 0)
        assert torch.equal(off, on) and torch.equal(off, four)


def test_prefill_never_splits(monkeypatch):
    """V_SPLIT is decode's (programs of at most DECODE_ROWS rows): a chunk of new tokens launches without it."""
    fmt, q, (cache, table, seq_lens, qsl), ids = decode_case("fp8_e4m3", 96, 128)
    monkeypatch.setattr(K, "VALUE_SPLIT_OVERRIDE", True)
    new = 40
    q = q.repeat_interleave(new, dim=0)
    qsl = torch.arange(qsl.numel(), dtype=torch.int32, device=qsl.device) * new
    plan = fmt.plan_attention(q, cache, table, seq_lens, qsl, max_query_len=new)
    assert plan._launch.kwargs["BLOCK_M"] > K.DECODE_ROWS
    assert plan._launch.kwargs["V_SPLIT"] == 0


def test_tune_tiles_config_letter():
    """tune_tiles.py's "s" asks for two dots, "q" for four (and only they); "f" for every row (live_fold off)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from tune_tiles import parse

    assert parse("128/4/2/128ps") == dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=128, prefetch_blocks=True,
                                         value_split=2)
    assert parse("128/4/2/128pq")["value_split"] == 4
    assert "value_split" not in parse("128/4/2/128pc")
    assert parse("128/4/2/168f") == dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=168, live_fold=False)
    assert "live_fold" not in parse("128/4/2/168ps")


def test_split_counts_other_than_two_or_four_are_refused(monkeypatch):
    """A rule or override asking for 3 dots names the problem instead of launching 2 and reporting 3."""
    fmt, q, (cache, table, seq_lens, qsl), ids = decode_case("nvfp4", 40, 128)
    monkeypatch.setattr(K, "VALUE_SPLIT_OVERRIDE", 3)
    with pytest.raises(ValueError, match="value_split: 3"):
        fmt.plan_attention(q, cache, table, seq_lens, qsl, max_query_len=1)
