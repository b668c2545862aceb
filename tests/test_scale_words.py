"""Block scales whose row per position is narrower than a 32-bit word (e8m0 scales at head size 64: 2 bytes, at 32:
1 byte) are read in attention from the aligned word that holds the row where the layout keeps every row inside one
word and at the same place in its word for every position (side.jinja's block_scale_codes): the H200 copies words
asynchronously, narrower loads not. These cases take that path and the byte path beside it, and must conform to the
NumPy reference either way (neighbouring heads' scales share the word: a wrong shift reads theirs)."""

from __future__ import annotations

import warnings

import pytest
import torch

import kvgen
from kvgen.conformance import Case

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
    for side in "KV":
        scale = fmt.spec.side("key" if side == "K" else "value").scale
        row = head_size // scale.block * (2 if scale.dtype == "fp16" else 1)
        page, base, cell = (consts[f"{side}_SCALE_{f}"] for f in ("PAGE", "BASE", "CELL"))
        holds = row < 4 and page % 4 == 0 and base % row == 0 and cell % row == 0 and heads * cell % 4 == 0
        assert holds == words, (side, row, page, base, cell)
    for q_lens, seq_lens, splits in (([1, 1, 1], [37, 140, 300], 1), ([1, 1], [150, 45], 2), ([5, 3], [40, 19], 1)):
        assert_conforms(fmt, Case(head_size=head_size, block_size=16, num_kv_heads=heads, group=2, seq_lens=seq_lens,
                                  q_lens=q_lens, dtype=torch.bfloat16, window=None, holes=1, seed=5, k_scale=1.0,
                                  v_scale=1.0, magnitude=3.0, splits=splits))
