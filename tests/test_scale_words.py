"""Block scales whose row per position is narrower than a 32-bit word (e8m0 scales at head size 64: 2 bytes, at 32:
1 byte) are read in attention from the aligned word that holds the row where the layout keeps every row inside one
word and at the same place in its word for every position (side.jinja's block_scale_codes): the H200 copies words
asynchronously, narrower loads not. These cases take that path and the byte path beside it, and must conform to the
NumPy reference either way (neighbouring heads' scales share the word: a wrong shift reads theirs)."""

from __future__ import annotations

import inspect
import re
import warnings

import pytest
import torch

import kvgen
from kvgen.conformance import Case
from kvgen.runtime import kernels as K

from test_conformance import assert_conforms

FP16_BLOCK_SCALES = """\
kvgen_spec: 1
name: fp8_fp16_block64
description: fp8 e4m3 codes with an fp16 scale per 64 elements in a separate buffer (2-byte scale rows at head 64).
cache:
  layout: split
  storage_dtype: uint8
key: &side
  element: fp8_e4m3
  scale:
    granularity: per_block
    block: 64
    dtype: fp16
    placement: separate
    apply: divide
value: *side
"""


def load(name, tmp_path):
    if name != "fp8_fp16_block64":
        return kvgen.load(name)
    path = tmp_path / f"{name}.yaml"
    path.write_text(FP16_BLOCK_SCALES)
    return kvgen.load(str(path))


WORD_CONDITION = re.compile(r"^\s*if (\(\(HEAD_PAD // \d+ \* \d+\) < 4\) & \(([KV])_SCALE_PAGE .*):$", re.M)


def generated_word_path(fmt, consts: dict) -> dict:
    """Whether each side's generated attention kernel takes the word path (block_scale_codes' condition, as rendered
    into the format's kernels, evaluated on a cache's constexprs): {"K" / "V": bool}."""
    conditions = {m.group(2): m.group(1) for m in WORD_CONDITION.finditer(inspect.getsource(fmt._kernels.module))}
    return {p: bool(eval(cond, {}, dict(consts))) for p, cond in conditions.items()}


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4", "nvfp4", "nvfp4_separate", "q4_0", "q8_0", "fp8_fp16_block64"])
def test_tile_key_follows_the_generated_load(name, tmp_path):
    """kvgen.runtime.kernels.scale_rows_in_words (a tile rule's key: mxfp8's 3 stages at head size 64 pay only when
    its scales arrive as words) agrees with the condition the generated kernel itself tests, for every block-scaled
    shipped layout at head sizes 32-128 and 1-4 KV heads."""
    fmt = load(name, tmp_path)
    rows = fmt._kernels.scale_rows
    assert rows, name
    for head_size in (32, 64, 128):
        if head_size % max(g for g, _ in rows.values()):
            continue  # (fp16 scales per 64 elements need heads of whole blocks)
        for heads in (1, 2, 3, 4):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                consts = fmt._kernel_args(fmt.allocate(2, 16, heads, head_size))[1]
            taken = generated_word_path(fmt, consts)
            assert set(taken) == set(rows), (name, taken)
            narrow = {p: consts["HEAD_PAD"] // g * b < 4 for p, (g, b) in rows.items()}
            want = all(taken[p] or not narrow[p] for p in rows)
            assert K.scale_rows_in_words(consts, rows) == want, (name, head_size, heads, taken, narrow)


# format, head size, KV heads, whether the word path's conditions hold (row under 4 bytes, whole words per position)
CASES = [("mxfp8", 64, 2, True), ("mxfp8", 64, 1, False), ("mxfp8", 32, 4, True), ("mxfp4", 64, 4, True),
         ("mxfp4", 32, 2, False), ("fp8_fp16_block64", 64, 2, True), ("mxfp8", 128, 2, False)]


@pytest.mark.parametrize("name, head_size, heads, words", CASES)
def test_narrow_scale_rows_conform(name, head_size, heads, words, tmp_path):
    fmt = load(name, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(4, 16, heads, head_size)
    consts = fmt._kernel_args(cache)[1]
    assert generated_word_path(fmt, consts) == {"K": words, "V": words}
    # the runtime's tile key says whether the step waits on a byte-wise scale load (rows of 4 bytes never do)
    assert K.scale_rows_in_words(consts, fmt._kernels.scale_rows) == (words or head_size // 32 >= 4)
    for q_lens, seq_lens, splits in (([1, 1, 1], [37, 140, 300], 1), ([1, 1], [150, 45], 2), ([5, 3], [40, 19], 1)):
        assert_conforms(fmt, Case(head_size=head_size, block_size=16, num_kv_heads=heads, group=2, seq_lens=seq_lens,
                                  q_lens=q_lens, dtype=torch.bfloat16, window=None, holes=1, seed=5, k_scale=1.0,
                                  v_scale=1.0, magnitude=3.0, splits=splits))
