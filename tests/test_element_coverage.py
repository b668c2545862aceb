"""Every element type of the schema is complete everywhere it must be: a codec whose facts the templates use, the
NumPy reference's own tables (stated there, not taken from the schema), and the random specs of `kvgen test`'s
generator. A new element missing from one of them fails here, by name, rather than as a KeyError in a build."""

from __future__ import annotations

import pytest

from kvgen.codegen.codecs import element_codec, has_codec
from kvgen.codegen.render import render_files
from kvgen.codegen.spec import ELEMENTS, ElementType, FormatSpec
from kvgen.conformance import _PACKED, _QUANTIZED
from kvgen.reference import codes


def side_of(element: ElementType) -> dict:
    info = ELEMENTS[element]
    if not info.is_quantized:
        return {"element": element.value}
    side = {"element": element.value, "scale": {"granularity": "per_token_head"}}
    if info.kind == "uint":
        side["zero_point"] = {}
    return side


@pytest.mark.parametrize("element", list(ElementType), ids=lambda e: e.value)
def test_every_element_has_a_codec_and_builds(element):
    info = ELEMENTS[element]
    assert has_codec(element)
    spec = FormatSpec.model_validate({"name": f"cover_{element.value}", "key": side_of(element),
                                      "value": side_of(element)})
    codec = element_codec(spec.key)
    assert codec.bits == info.bits
    if info.is_quantized:  # the facts dot_operand / fixed_block_shift / the NaN rule read from the codec
        assert 0 < codec.significand <= info.bits and codec.code_step is not None
        assert codec.nan_as_zero == (element not in codes.NAN_CODES)  # the reference's own list of NaN codes
    files = render_files(spec)
    assert {"__init__.py", "layout.py", "kernels.py"} <= set(files)


@pytest.mark.parametrize("element", list(ElementType), ids=lambda e: e.value)
def test_every_element_is_in_the_references_tables_and_the_spec_generator(element):
    info = ELEMENTS[element]
    assert codes.ELEMENT_BITS[element] == info.bits
    if info.kind in ("float", "fp"):
        assert element in codes.FLOAT_FORMAT and element in codes.FLOAT_MAX
    if info.is_quantized:
        assert codes.CODE_RANGE[element] == (info.qmin, info.qmax)
        assert element in codes.QMAX
        assert element.value in _QUANTIZED
        assert (element.value in _PACKED) == (info.bits < 8)
        assert element in (codes.LOWBIT_FLOATS | codes.INTEGERS)
    else:
        assert element in codes.FLOAT_DTYPES
