"""A write stores its cells whole: the padding between fields and at a cell's end is written as zeros.

The alignment of fields leaves bytes that no field holds (int8 asym's cell: [K 128 | scale 4 | zp 1 | pad 3 | V 128 |
scale 4 | zp 1 | pad 3]). A write that skipped them covered the 32-byte sectors around them only in part, which the
GPU's L2 merges with DRAM's bytes at a read each (an H100 wrote int8 asym at 52% of copy bandwidth that way, 83% with
the padding written; benchmarks/RESULTS.md, thirty-ninth session). docs/SEMANTICS.md states it; the reference
(kvgen.reference) zeroes the padding of the cells it writes, from its own layout, and the kernels must give its bytes.
Caches start filled with a byte that no write produces by accident (0xA5), so a skipped pad or a stray write shows.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import kvgen
from kvgen import reference as R
from kvgen.conformance import format_specs
from kvgen.runtime.kernels import write_pads
from test_random_specs import load_spec_data

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
FILL = 0xA5
BLOCKS, BLOCK_SIZE, HEADS = 3, 4, 2

# a key of uint4 codes and fp32 scales at head size 20: 10 bytes of codes, 2 of padding before the scale (aligned to
# 4), then a zero point and 3 bytes to the value's codes (data_align 4); int8 values with an fp16 scale aligned to 4,
# then 2 bytes to the cell's end
PADDED = """
kvgen_spec: 1
name: padded_cells
cache: {layout: interleaved, storage_dtype: uint8}
key:
  element: uint4
  rounding: half_even
  packing: lsb_first
  zero_point: {storage: beside_scale}
  scale: {granularity: per_token_head, dtype: fp32, placement: inline, apply: divide}
value:
  element: int8
  data_align: 4
  rounding: half_even
  scale: {granularity: per_token_head, dtype: fp16, placement: inline, align: 4, apply: reciprocal_multiply}
"""


def _padding(spec, head_size: int) -> dict:
    """(tensor, region) -> the padding bytes of its cell, from the reference's own layout."""
    return {(t.name, i): R.padding_bytes(r) for t in R.layout(spec, head_size).values()
            for i, r in enumerate(t.regions)}


def _filled_write(fmt, head_size: int, seed: int = 0):
    """Kernel and reference caches filled with FILL, then the same tokens written into both (one with slot -1)."""
    spec = fmt.spec
    rng = np.random.default_rng(seed)
    slots = np.array([9, -1, 2, 5, 0], dtype=np.int64)
    key = (rng.standard_normal((len(slots), HEADS, head_size)) * 3).astype(np.float32)
    value = (rng.standard_normal((len(slots), HEADS, head_size)) * 3).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        cache = fmt.allocate(BLOCKS, BLOCK_SIZE, HEADS, head_size, device=DEVICE)
    for name in R.tensor_names(spec):
        cache.tensors[name].view(torch.uint8).fill_(FILL)
    fmt.write(cache, torch.from_numpy(key).to(DEVICE), torch.from_numpy(value).to(DEVICE),
              torch.from_numpy(slots).to(DEVICE))
    expected = R.new_cache(spec, BLOCKS, BLOCK_SIZE, HEADS, head_size)
    for a in expected.values():
        a.view(np.uint8)[...] = FILL
    R.write(spec, expected, key, value, slots)
    got = {name: cache.tensors[name].view(torch.uint8).reshape(BLOCKS, -1).cpu().numpy() for name in expected}
    want = {name: a.view(np.uint8).reshape(BLOCKS, -1) for name, a in expected.items()}
    return got, want, slots


def _assert_same(got: dict, want: dict, what: str) -> None:
    for name in want:
        diff = np.argwhere(got[name] != want[name])
        assert not len(diff), (f"{what}: {name}: {len(diff)} bytes differ from the reference's; first at (block, "
                               f"byte) {tuple(diff[0])}: kernel {got[name][tuple(diff[0])]:#04x}, reference "
                               f"{want[name][tuple(diff[0])]:#04x}")


@pytest.mark.parametrize("head_size", [16, 128])
def test_int8_asym_writes_its_padding_as_zeros(head_size):
    """The shipped format with padding: 3 bytes after each zero point. Written cells hold zeros there; the cells of
    slots not written keep their bytes."""
    fmt = kvgen.load("int8_asym_per_token_head")
    got, want, slots = _filled_write(fmt, head_size)
    _assert_same(got, want, f"int8 asym at head size {head_size}")
    cells = got["kv_cache"].reshape(BLOCKS * BLOCK_SIZE, HEADS, -1)
    pads = _padding(fmt.spec, head_size)[("kv_cache", 0)]
    assert pads == [head_size + 5, head_size + 6, head_size + 7, 2 * head_size + 13, 2 * head_size + 14,
                    2 * head_size + 15]  # after K's zero point (at head_size + 4) and V's, from the spec's fields
    written = slots[slots >= 0]
    assert not cells[written][:, :, pads].any()
    assert (cells[np.setdiff1d(np.arange(BLOCKS * BLOCK_SIZE), written)] == FILL).all()


@pytest.mark.parametrize("head_size", [20, 32])
def test_padding_after_codes_scales_and_zero_points(tmp_path, head_size):
    """Padding after every kind of field: after packed codes (head size 20: 10 bytes, then a 4-byte aligned scale),
    after a zero point, and at the cell's end after an fp16 scale."""
    fmt = load_spec_data(yaml.safe_load(PADDED), tmp_path)
    pads = _padding(fmt.spec, head_size)[("kv_cache", 0)]
    lay = fmt.layout.page_layout(BLOCK_SIZE, HEADS, head_size)["fields"]
    k_data_end = head_size // 2
    assert (k_data_end % 4 != 0) == (head_size == 20)
    assert lay["k_data"]["pad"] == (-k_data_end) % 4 and lay["k_zp"]["pad"] == 3 and lay["v_scale"]["pad"] == 2
    assert len(pads) == sum(f["pad"] for f in lay.values())
    got, want, _ = _filled_write(fmt, head_size, seed=head_size)
    _assert_same(got, want, f"padded_cells at head size {head_size}")


def test_layout_padding_matches_the_reference():
    """The generated layout's per-field padding (what the write kernel zeroes) covers exactly the bytes that the
    reference's layout leaves to no field, region by region, for every shipped format but KIVI (whose slot cells the
    reference does not define) at several head sizes."""
    for name in kvgen.shipped_names():
        fmt = kvgen.load(name)
        if fmt.spec.streaming:
            continue
        for head_size in (16, 48, 64, 128, 256):
            try:
                ref_layout = R.layout(fmt.spec, head_size)
            except ValueError:
                continue  # blocks that do not divide the head
            lay = fmt.layout.page_layout(BLOCK_SIZE, HEADS, head_size)
            regions = {}  # (tensor, the region's start in the page) -> (its fields, its padding bytes)
            for field, f in lay["fields"].items():
                names, gaps = regions.setdefault((f["tensor"], f["base"] - f["offset"]), (set(), set()))
                names.add(field)
                gaps.update(range(f["offset"] + f["bytes"], f["offset"] + f["bytes"] + f["pad"]))
            generated = {frozenset(names): gaps for names, gaps in regions.values()}
            reference = {frozenset(f.name for f in r.fields): set(R.padding_bytes(r))
                         for t in ref_layout.values() for r in t.regions}
            assert generated == reference, (name, head_size, generated, reference)
            pads = write_pads(lay)
            assert pads["PAD_SPAN"] >= max(pads[f"{f.upper()}_PAD"] for f in lay["fields"])


@settings(max_examples=int(os.environ.get("KVGEN_PADDING_SPECS", "12")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                                HealthCheck.filter_too_much])
@given(spec=format_specs(), head_size=st.sampled_from([16, 20, 24, 48]))
def test_random_specs_write_the_reference_bytes_over_filled_caches(spec, head_size, tmp_path_factory):
    """Random valid specs (kvgen.conformance.format_specs) at head sizes that leave padding after packed codes: the
    write over a filled cache gives the reference's bytes, padding and untouched cells included."""
    fmt = load_spec_data(spec, tmp_path_factory.mktemp("spec"))
    assume(not fmt.spec.streaming)  # residual windows: not the reference's (tests/test_kivi_reference.py)
    try:
        R.layout(fmt.spec, head_size)
    except ValueError:
        assume(False)  # a head size the spec's blocks do not divide
    got, want, _ = _filled_write(fmt, head_size)
    _assert_same(got, want, yaml.safe_dump(spec, sort_keys=False))
