"""A side's ``data_align``: its codes start at a multiple of that many bytes in the cell, and every shipped format
keeps its codes where compiled kernels can copy them with wide loads.

On the H200 the attention kernel copies K/V codes into shared memory asynchronously, 4 to 16 bytes at a time; a
field that starts at an odd byte offset can only be read byte by byte, synchronously (int8_asym_per_token_head's
values at byte 133 of the cell: 1.9x int8_per_token_head's decode time, benchmarks/RESULTS.md).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import kvgen
from kvgen import reference as R

SPECS = Path(kvgen.__file__).resolve().parent / "specs"


def consts_of(fmt, head_size: int = 128) -> dict:
    streaming = fmt.spec.streaming
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(2, 32 if streaming else 16, 8, head_size, **({"max_seqs": 1} if streaming else {}))
    return fmt._kernel_args(cache)[1]


@pytest.mark.parametrize("name", kvgen.shipped_names())
@pytest.mark.parametrize("head_size", [64, 128])
def test_shipped_code_fields_are_word_aligned(name, head_size):
    consts = consts_of(kvgen.load(name), head_size)
    for side in "KV":
        offsets = {f: consts[f"{side}_DATA_{f}"] for f in ("BASE", "CELL", "PAGE")}
        assert all(v % 4 == 0 for v in offsets.values()), f"{name} {side} codes: {offsets}"


def test_data_align_moves_the_value_codes(tmp_path):
    """K 128 | K scale 4 | K zp 1 puts the values at byte 133; the shipped spec's data_align 4 puts them at 136, in
    the same 272-byte cell (V scale at 264 either way), in the generated layout and in the reference's."""
    text = (SPECS / "int8_asym_per_token_head.yaml").read_text()
    assert text.count("  data_align: 4\n") == 1
    packed = tmp_path / "asym_packed.yaml"
    packed.write_text(text.replace("name: int8_asym_per_token_head", "name: asym_packed")
                      .replace("  data_align: 4\n", ""))
    for fmt, base in ((kvgen.load(str(packed)), 133), (kvgen.load("int8_asym_per_token_head"), 136)):
        consts = consts_of(fmt)
        assert (consts["V_DATA_BASE"], consts["V_DATA_CELL"], consts["V_SCALE_BASE"]) == (base, 272, 264), fmt.name
        ref = R.cell_layout(fmt.spec, 128)
        assert (ref["v_data"], ref["cell_bytes"], ref["v_scale"]) == (base, 272, 264), fmt.name
