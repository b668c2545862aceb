"""A side's ``data_align``: its codes start at a multiple of that many bytes in the cell.

On the H200 the attention kernel copies K/V codes into shared memory asynchronously, 4 to 16 bytes at a time; a
field that starts at an odd byte offset can only be read byte by byte, synchronously (int8_asym_per_token_head's
values at byte 133 of the cell: benchmarks/RESULTS.md). ``data_align`` lets a spec move them.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import kvgen
from kvgen import reference as R

SPECS = Path(kvgen.__file__).resolve().parent / "specs"


def test_data_align_moves_the_value_codes(tmp_path):
    """K 128 | K scale 4 | K zp 1 puts the values at byte 133; data_align 4 puts them at 136, in the same 272-byte
    cell (V scale at 264 either way), in the generated layout and in the reference's."""
    text = (SPECS / "int8_asym_per_token_head.yaml").read_text()
    assert "data_align" not in text and text.count("  rounding: half_even\n") == 1
    aligned = tmp_path / "asym_aligned.yaml"
    aligned.write_text(text.replace("name: int8_asym_per_token_head", "name: asym_aligned")
                       .replace("  rounding: half_even\n", "  rounding: half_even\n  data_align: 4\n"))
    for fmt, base in ((kvgen.load("int8_asym_per_token_head"), 133), (kvgen.load(str(aligned)), 136)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cache = fmt.allocate(2, 16, 8, 128)
        _, consts = fmt._kernel_args(cache)
        assert (consts["V_DATA_BASE"], consts["V_DATA_CELL"], consts["V_SCALE_BASE"]) == (base, 272, 264), fmt.name
        ref = R.cell_layout(fmt.spec, 128)
        assert (ref["v_data"], ref["cell_bytes"], ref["v_scale"]) == (base, 272, 264), fmt.name
