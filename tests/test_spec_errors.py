"""Bad specs give a kvgen.SpecError naming file, line (and column) and field; never a pydantic/Jinja traceback.

Expected lines and columns are computed from the YAML text of each case (where the offending key is written),
not from anything kvgen reports about itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import kvgen
from kvgen.cli import main as cli_main

ROOT = Path(kvgen.__file__).resolve().parent
SPECS = ROOT / "specs"
KVGEN = Path(sys.executable).parent / "kvgen"

# words that only show up when a library's error or traceback leaks through
LEAKS = ("Traceback", "pydantic", "errors.pydantic.dev", "jinja", "triton", "ValidationError", "MarkupError")


def line_of(text: str, needle: str, nth: int = 1) -> int:
    """1-based number of the nth line of ``text`` that contains ``needle``."""
    hits = [i + 1 for i, line in enumerate(text.splitlines()) if needle in line]
    assert len(hits) >= nth, f"test bug: {needle!r} not found {nth} time(s)"
    return hits[nth - 1]


def col_of(text: str, needle: str, nth: int = 1) -> int:
    """1-based column where ``needle`` starts on that line."""
    line = text.splitlines()[line_of(text, needle, nth) - 1]
    return line.index(needle) + 1


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def spec_error(path: Path, cls=kvgen.SpecError) -> kvgen.SpecError:
    with pytest.raises(cls) as info:
        kvgen.load_spec(path)
    err = info.value
    msg = str(err)
    assert isinstance(err, kvgen.SpecError)
    assert isinstance(err, kvgen.KvgenError)
    assert str(path) in msg, msg
    for leak in LEAKS:
        assert leak.lower() not in msg.lower(), f"{leak!r} leaked into: {msg}"
    # raised "from None": no pydantic / yaml exception chained underneath (it would print as a second traceback)
    assert err.__cause__ is None
    assert err.__context__ is None or err.__suppress_context__
    return err


def assert_at(err: kvgen.SpecError, path: Path, line: int, column: int | None = None) -> None:
    msg = str(err)
    assert err.line == line, msg
    assert f"{path}:{line}" in msg, msg
    if column is not None:
        assert err.column == column, msg
        assert f"{path}:{line}:{column}" in msg, msg


def assert_field(err: kvgen.SpecError, field: str) -> None:
    assert err.field == field, str(err)
    assert f" {field}:" in str(err), str(err)


# --------------------------------------------------------------------------------------------------------------
# schema errors


NESTED_UNKNOWN = """\
kvgen_spec: 1
name: nested_unknown
# a comment line, so the line number is not just the count of keys
key:
  element: int8
  scale:
    granularity: per_token_head
    bogus: 3
value:
  element: bf16
"""


def test_unknown_nested_key_points_at_its_line_and_column(tmp_path):
    p = write(tmp_path, "nested.yaml", NESTED_UNKNOWN)
    err = spec_error(p)
    assert_at(err, p, line_of(NESTED_UNKNOWN, "bogus:"), col_of(NESTED_UNKNOWN, "bogus:"))
    assert_field(err, "key.scale.bogus")
    assert "unknown" in err.message.lower()


def test_unknown_top_level_key(tmp_path):
    text = "name: top\nkey:\n  element: bf16\nvalue:\n  element: bf16\ncolour: red\n"
    p = write(tmp_path, "top.yaml", text)
    err = spec_error(p)
    assert_at(err, p, 6, 1)
    assert_field(err, "colour")


def test_unknown_key_in_value_side(tmp_path):
    text = "name: v\nkey:\n  element: bf16\nvalue:\n  element: bf16\n  rotaton: {kind: hadamard}\n"
    p = write(tmp_path, "v.yaml", text)
    err = spec_error(p)
    assert_at(err, p, 6, 3)
    assert_field(err, "value.rotaton")


def test_unknown_key_in_flow_mapping(tmp_path):
    text = "name: flow\nkey: {element: int8, scale: {granularity: per_token_head, bogus: 1}}\nvalue: {element: bf16}\n"
    p = write(tmp_path, "flow.yaml", text)
    err = spec_error(p)
    assert_at(err, p, 2, col_of(text, "bogus"))
    assert_field(err, "key.scale.bogus")


# a misspelled required field is both an unknown field and a missing one: the error must point at the typo, where
# the user wrote it, and name the field meant (each case: the shipped spec with one key misspelled)
@pytest.mark.parametrize("right, wrong, field", [
    ("    granularity:", "    granulrity:", "key.scale.granulrity"),
    ("value:", "valeu:", "valeu"),
    ("  element:", "  elemnt:", "key.elemnt"),
])
def test_misspelled_required_field_points_at_the_typo(tmp_path, right, wrong, field):
    text = (SPECS / "q8_0.yaml").read_text(encoding="utf-8")
    assert text.count("\n" + right) == 1, "test bug: the key to misspell is not unique"
    text = text.replace("\n" + right, "\n" + wrong)
    p = write(tmp_path, "typo.yaml", text)
    err = spec_error(p)
    assert_at(err, p, line_of(text, wrong), col_of(text, wrong.strip()))
    assert_field(err, field)
    assert f"did you mean '{right.strip().rstrip(':')}'" in err.message, err.message


ENUM = """\
name: enum_case
key:
  element: int9
value:
  element: bf16
"""


def test_wrong_enum_value_lists_allowed_values(tmp_path):
    p = write(tmp_path, "enum.yaml", ENUM)
    err = spec_error(p)
    assert_at(err, p, line_of(ENUM, "int9"))
    assert_field(err, "key.element")
    assert "int9" in err.message
    for allowed in ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "uint8"):
        assert f"'{allowed}'" in err.message, err.message


def test_wrong_granularity_value(tmp_path):
    text = "name: g\nkey:\n  element: int8\n  scale:\n    granularity: per_galaxy\nvalue:\n  element: bf16\n"
    p = write(tmp_path, "g.yaml", text)
    err = spec_error(p)
    assert_at(err, p, 5)
    assert_field(err, "key.scale.granularity")
    assert "per_galaxy" in err.message and "per_token_head" in err.message


def test_missing_required_value_side(tmp_path):
    text = "name: missing\nkey:\n  element: bf16\n"
    p = write(tmp_path, "missing.yaml", text)
    err = spec_error(p)
    assert_at(err, p, 1)  # the mapping that lacks it starts on line 1
    assert_field(err, "value")
    assert "missing" in err.message.lower()


def test_missing_nested_required_field_points_at_its_parent(tmp_path):
    text = "name: m2\nkey:\n  element: bf16\nvalue:\n  rounding: half_even\n"
    p = write(tmp_path, "m2.yaml", text)
    err = spec_error(p)
    assert err.field in ("value.element", "value")
    assert err.line in (4, 5), str(err)
    assert "element" in str(err)


@pytest.mark.parametrize("bad", ["Bad-Name", "1abc", "has space", "x" * 65, "def", "class"])
def test_invalid_name(tmp_path, bad):
    text = f"name: '{bad}'\nkey:\n  element: bf16\nvalue:\n  element: bf16\n"
    p = write(tmp_path, "name.yaml", text)
    err = spec_error(p)
    assert_at(err, p, 1, 1)
    assert_field(err, "name")
    assert bad in err.message


@pytest.mark.parametrize("written", ['"abc\\n"', "|\n  abc"])
def test_a_name_ending_in_a_newline_is_invalid(tmp_path, written):
    """'^...$' matched "abc\n": validate said ok and the build failed on the rendered code as "a kvgen bug"."""
    text = f"name: {written}\nkey:\n  element: bf16\nvalue:\n  element: bf16\n"
    p = write(tmp_path, "nl.yaml", text)
    err = spec_error(p)
    assert_at(err, p, 1, 1)
    assert_field(err, "name")
    assert "is not a valid format name" in err.message


def test_name_that_is_not_a_string(tmp_path):
    text = "name: 5\nkey:\n  element: bf16\nvalue:\n  element: bf16\n"
    p = write(tmp_path, "n5.yaml", text)
    err = spec_error(p)
    assert_at(err, p, 1)
    assert_field(err, "name")


QUANT_NO_SCALE = """\
name: q
key:
  element: int8
value:
  element: bf16
"""


def test_quantized_element_without_scale(tmp_path):
    p = write(tmp_path, "q.yaml", QUANT_NO_SCALE)
    err = spec_error(p)
    assert err.field in ("key", "key.element", "key.scale"), str(err)
    assert err.line in (line_of(QUANT_NO_SCALE, "key:"), line_of(QUANT_NO_SCALE, "int8")), str(err)
    assert f"{p}:{err.line}" in str(err)
    assert "int8" in err.message and "scale" in err.message


SCALE_UNQUANT = """\
name: s
key:
  element: bf16
value:
  element: bf16
  scale:
    granularity: per_tensor
"""


def test_scale_on_unquantized_element(tmp_path):
    p = write(tmp_path, "s.yaml", SCALE_UNQUANT)
    err = spec_error(p)
    assert err.field in ("value", "value.scale"), str(err)
    assert err.line in (line_of(SCALE_UNQUANT, "value:"), line_of(SCALE_UNQUANT, "scale:")), str(err)
    assert f"{p}:{err.line}" in str(err)
    assert "bf16" in err.message and "scale" in err.message


STATIC_PLACEMENT = """\
name: sp
key:
  element: fp8_e4m3
  scale:
    granularity: per_tensor
    placement: inline
value:
  element: bf16
"""


def test_static_scale_with_placement(tmp_path):
    p = write(tmp_path, "sp.yaml", STATIC_PLACEMENT)
    err = spec_error(p)
    assert err.field in ("key.scale", "key.scale.placement"), str(err)
    assert err.line in (line_of(STATIC_PLACEMENT, "scale:"), line_of(STATIC_PLACEMENT, "placement:")), str(err)
    assert f"{p}:{err.line}" in str(err)
    assert "placement" in err.message


PER_BLOCK = """\
name: pb
key:
  element: fp8_e4m3
  scale:
    granularity: per_block
value:
  element: bf16
"""


def test_per_block_without_block(tmp_path):
    p = write(tmp_path, "pb.yaml", PER_BLOCK)
    err = spec_error(p)
    assert err.field in ("key.scale", "key.scale.block", "key.scale.granularity"), str(err)
    assert err.line in (line_of(PER_BLOCK, "scale:"), line_of(PER_BLOCK, "granularity:")), str(err)
    assert "block" in err.message


GROUP_24 = """\
name: g24
cache: {layout: interleaved, storage_dtype: uint8}
key:
  element: uint4
  zero_point: {storage: beside_scale, dtype: fp16}
  scale:
    granularity: per_channel_group
    group_tokens: 24
    dtype: fp16
  residual: {tokens: 48, dtype: bf16}
value:
  element: uint4
  zero_point: {storage: beside_scale, dtype: fp16}
  scale: {granularity: per_block, block: 32, dtype: fp16}
  residual: {tokens: 48, dtype: bf16}
"""


def test_token_group_that_is_not_a_power_of_two(tmp_path):
    p = write(tmp_path, "g24.yaml", GROUP_24)
    err = spec_error(p)
    assert err.field in ("key.scale", "key.scale.group_tokens"), str(err)
    assert err.line in (line_of(GROUP_24, "scale:"), line_of(GROUP_24, "group_tokens:")), str(err)
    assert "power of two" in err.message and "24" in err.message


BLOCK_ON_TOKEN_HEAD = """\
name: b24
key:
  element: int8
  scale:
    granularity: per_token_head
    block: 24
value:
  element: int8
  scale: {granularity: per_token_head}
"""


def test_block_on_a_granularity_without_blocks_says_so_first(tmp_path):
    """'block' on a per-token-head scale is the mistake, whatever its value: the error says it only applies to
    per_block rather than asking for a power of two."""
    p = write(tmp_path, "b24.yaml", BLOCK_ON_TOKEN_HEAD)
    err = spec_error(p)
    assert err.field in ("key.scale", "key.scale.block"), str(err)
    assert "'block' only applies to granularity per_block, not per_token_head" in err.message, str(err)
    assert "power of two" not in err.message


ZP_FLOAT = """\
name: zp
key:
  element: fp8_e4m3
  scale:
    granularity: per_tensor
  zero_point:
    dtype: uint8
value:
  element: bf16
"""


def test_zero_point_on_float_element(tmp_path):
    p = write(tmp_path, "zp.yaml", ZP_FLOAT)
    err = spec_error(p)
    assert err.field == "key.zero_point", str(err)
    assert err.line == line_of(ZP_FLOAT, "zero_point:"), str(err)
    assert "'zero_point' needs an unsigned integer element" in err.message and "fp8_e4m3" in err.message


DATA_ALIGN = """\
name: da
key:
  element: {element}
  data_align: {align}
  scale:
    granularity: per_token_head
value:
  element: bf16
"""


@pytest.mark.parametrize("element, align, words", [("int8", 3, ["power of two", "3"]),
                                                   ("fp32", 2, ["below", "fp32", "4 bytes"])])
def test_bad_data_align(tmp_path, element, align, words):
    text = DATA_ALIGN.format(element=element, align=align).replace(
        "  scale:\n    granularity: per_token_head\n" if element == "fp32" else "\0", "")
    p = write(tmp_path, "da.yaml", text)
    err = spec_error(p)
    assert err.field in ("key", "key.data_align"), str(err)
    assert err.line in (line_of(text, "key:"), line_of(text, "data_align:")), str(err)
    assert all(w in err.message for w in words), err.message


SCALE_ALIGN = """\
name: sa
key:
  element: int8
  scale:
    granularity: per_token_head
    dtype: {dtype}
    align: {align}
value:
  element: bf16
"""


@pytest.mark.parametrize("dtype, align, words", [("bf16", 1, ["below", "bf16", "2 bytes"]),
                                                 ("fp32", 2, ["below", "fp32", "4 bytes"])])
def test_inline_scale_align_below_its_size(tmp_path, dtype, align, words):
    """An inline scale at an address that is no multiple of its size would fault on the GPU (misaligned address:
    found by the random specs on the H200), so the spec says so instead."""
    text = SCALE_ALIGN.format(dtype=dtype, align=align)
    err = spec_error(write(tmp_path, "sa.yaml", text))
    assert err.field in ("key.scale", "key.scale.align"), str(err)
    assert err.line in (line_of(text, "scale:"), line_of(text, "align:")), str(err)
    assert all(w in err.message for w in words), err.message


def test_inline_scale_align_at_its_size_builds(tmp_path, monkeypatch):
    import kvgen

    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path / "cache"))
    fmt = kvgen.load(write(tmp_path, "sa.yaml", SCALE_ALIGN.format(dtype="bf16", align=2)))
    assert fmt.spec.key.scale.inline_align == 2


def test_out_of_range_number(tmp_path):
    text = "name: mn\nkey:\n  element: int8\n  scale:\n    granularity: per_token_head\n    min: 0\nvalue:\n  element: bf16\n"
    p = write(tmp_path, "mn.yaml", text)
    err = spec_error(p)
    assert_at(err, p, 6, 5)
    assert_field(err, "key.scale.min")


# --------------------------------------------------------------------------------------------------------------
# file-level errors


def test_invalid_yaml_syntax_reports_the_line(tmp_path):
    text = "name: y\nkey:\n  element: bf16: oops\nvalue:\n  element: bf16\n"
    p = write(tmp_path, "y.yaml", text)
    err = spec_error(p)
    assert_at(err, p, 3)
    assert "YAML" in err.message


def test_tab_indentation_reports_the_line(tmp_path):
    text = "name: t\nkey:\n  element: bf16\nvalue:\n\telement: bf16\n"
    p = write(tmp_path, "t.yaml", text)
    err = spec_error(p)
    assert_at(err, p, 5)
    assert "spaces only" in err.message, err.message


# a key indented off the keys above it: the error is on that line and says it is the indentation
@pytest.mark.parametrize("right, wrong", [("\n    dtype: fp16", "\n   dtype: fp16"),
                                          ("\n  rounding:", "\n   rounding:")])
def test_misindented_key_says_indentation(tmp_path, right, wrong):
    text = (SPECS / "q8_0.yaml").read_text(encoding="utf-8")
    assert text.count(right) == 1, "test bug: the key to shift is not unique"
    text = text.replace(right, wrong)
    p = write(tmp_path, "indent.yaml", text)
    err = spec_error(p)
    assert_at(err, p, line_of(text, wrong.strip()))
    assert "indentation" in err.message, err.message


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"])
def test_empty_file(tmp_path, text):
    p = write(tmp_path, "empty.yaml", text)
    err = spec_error(p)
    assert "empty" in err.message


@pytest.mark.parametrize("text", ["- name: x\n- key: y\n", "just a string\n", "42\n"])
def test_non_mapping_document(tmp_path, text):
    p = write(tmp_path, "nm.yaml", text)
    err = spec_error(p)
    assert "mapping" in err.message
    assert err.line == 1


def test_file_that_does_not_exist(tmp_path):
    p = tmp_path / "nope" / "missing.yaml"
    err = spec_error(p)
    assert "no such file" in err.message.lower()


def test_directory_instead_of_file(tmp_path):
    err = spec_error(tmp_path)
    assert err.message


def test_not_utf8(tmp_path):
    p = tmp_path / "latin1.yaml"
    p.write_bytes("name: caf\xe9\nkey:\n  element: bf16\nvalue:\n  element: bf16\n".encode("latin-1"))
    err = spec_error(p)
    assert "UTF-8" in err.message


DUP_TOP = """\
name: dup
key:
  element: bf16
value:
  element: bf16
name: dup2
"""

DUP_NESTED = """\
name: dup
key:
  element: bf16
  element: fp16
value:
  element: bf16
"""


def test_duplicate_top_level_key(tmp_path):
    p = write(tmp_path, "dup.yaml", DUP_TOP)
    err = spec_error(p)
    assert_at(err, p, line_of(DUP_TOP, "name:", 2), 1)
    assert_field(err, "name")
    assert "duplicate" in err.message.lower()


def test_duplicate_nested_key(tmp_path):
    p = write(tmp_path, "dupn.yaml", DUP_NESTED)
    err = spec_error(p)
    assert_at(err, p, line_of(DUP_NESTED, "element: fp16"), 3)
    assert_field(err, "key.element")


# --------------------------------------------------------------------------------------------------------------
# valid, but not implemented yet

KIVI_VALUE = """\
value:
  element: uint2
  zero_point: {storage: beside_scale, dtype: fp16}
  scale:
    granularity: per_block
    block: 32
    dtype: fp16
  residual:
    tokens: 64
"""

NOT_YET = {
    # the KIVI flush never loaded the global scale, and SEMANTICS.md defines it over integer zero points only
    "kivi_key_with_global_scale": ("""\
name: kivi_global
key:
  element: uint2
  zero_point: {storage: beside_scale, dtype: fp16}
  scale:
    granularity: per_channel_group
    group_tokens: 32
    dtype: fp16
    placement: page_end
    global_scale: true
  residual:
    tokens: 64
""" + KIVI_VALUE, "key.scale.global_scale", "global_scale: true"),
    "float_zero_point_with_global_scale": ("""\
name: fzp_global
key:
  element: bf16
value:
  element: uint4
  packing: lsb_first
  zero_point: {storage: beside_scale, dtype: fp16}
  scale:
    granularity: per_block
    block: 16
    dtype: fp16
    global_scale: true
""", "value.scale.global_scale", "global_scale: true"),
    "residual_with_split_layout": ("""\
name: kivi_split
cache:
  layout: split
key:
  element: uint2
  zero_point: {storage: beside_scale, dtype: fp16}
  scale:
    granularity: per_channel_group
    group_tokens: 32
    dtype: fp16
    placement: page_end
  residual:
    tokens: 64
""" + KIVI_VALUE, "cache.layout", "layout: split"),
    "residual_with_rotation": ("""\
name: kivi_rot
key:
  element: uint2
  zero_point: {storage: beside_scale, dtype: fp16}
  scale:
    granularity: per_channel_group
    group_tokens: 32
    dtype: fp16
    placement: page_end
  residual:
    tokens: 64
  rotation:
    seed: 3
""" + KIVI_VALUE, "key.rotation", "rotation:"),
    "residual_with_static_value": ("""\
name: kivi_static
key:
  element: uint2
  zero_point: {storage: beside_scale, dtype: fp16}
  scale:
    granularity: per_channel_group
    group_tokens: 32
    dtype: fp16
    placement: page_end
  residual:
    tokens: 64
value:
  element: int8
  scale:
    granularity: per_tensor
  residual:
    tokens: 64
""", "value.scale.granularity", "granularity: per_tensor"),
}

# what used to be "not supported yet" and is now checked by validation: a residual window goes with KIVI keys
RESIDUAL_RULES = {
    "residual_without_channel_groups": ("""\
name: resid
key:
  element: int8
  scale:
    granularity: per_token_head
  residual:
    tokens: 32
value:
  element: int8
  scale:
    granularity: per_token_head
  residual:
    tokens: 32
""", "per_channel_group"),
    "channel_groups_without_residual": ("""\
name: kivi
key:
  element: uint2
  zero_point: {storage: beside_scale, dtype: fp16}
  scale:
    granularity: per_channel_group
    group_tokens: 32
    placement: page_end
value:
  element: bf16
""", "residual"),
    # docs/fuzz.md, fix 1: KIVI keys' zero point is the group's minimum, a float
    "kivi_key_with_uint8_zero_point": ("""\
name: kivi_u8
key:
  element: uint2
  zero_point: {storage: beside_scale}
  scale:
    granularity: per_channel_group
    group_tokens: 32
    dtype: fp16
    placement: page_end
  residual:
    tokens: 64
""" + KIVI_VALUE, "zero_point with dtype fp16 or fp32"),
    "value_side_residual_only": ("""\
name: vresid
key:
  element: bf16
value:
  element: fp16
  residual:
    tokens: 8
    dtype: fp32
""", "the same"),
}


@pytest.mark.parametrize("case", sorted(RESIDUAL_RULES))
def test_residual_rules_are_validation_errors(tmp_path, case):
    text, words = RESIDUAL_RULES[case]
    p = write(tmp_path, f"{case}.yaml", text)
    err = spec_error(p, kvgen.SpecError)
    assert not isinstance(err, kvgen.NotSupportedYet)
    assert words in err.message and str(p) in str(err)


@pytest.mark.parametrize("case", sorted(NOT_YET))
def test_not_supported_yet_names_the_field(tmp_path, case):
    text, field, needle = NOT_YET[case]
    p = write(tmp_path, f"{case}.yaml", text)
    # the spec itself is valid ...
    spec = kvgen.load_spec(p, supported=False)
    assert isinstance(spec, kvgen.FormatSpec)
    # ... but this kvgen cannot build it
    err = spec_error(p, kvgen.NotSupportedYet)
    assert_field(err, field)
    assert_at(err, p, line_of(text, needle), col_of(text, needle.split(":")[0]))
    assert "not supported yet" in err.message


# --------------------------------------------------------------------------------------------------------------
# shipped specs

SHIPPED = sorted(SPECS.glob("*.yaml"))


def test_there_are_shipped_specs():
    names = {p.stem for p in SHIPPED}
    assert {"bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp8_per_token_head", "int8_per_token_head"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_spec_validates(path):
    spec = kvgen.load_spec(path)
    assert spec.name == path.stem


# --------------------------------------------------------------------------------------------------------------
# the CLI: `kvgen validate`


def run_kvgen(*args, **env):
    e = dict(os.environ)
    e.update(env)
    return subprocess.run([str(KVGEN), *map(str, args)], capture_output=True, text=True, env=e, timeout=120)


BAD_FOR_CLI = {
    "nested.yaml": (NESTED_UNKNOWN, line_of(NESTED_UNKNOWN, "bogus:")),
    "enum.yaml": (ENUM, line_of(ENUM, "int9")),
    "dup.yaml": (DUP_TOP, line_of(DUP_TOP, "name:", 2)),
    "syntax.yaml": ("name: y\nkey:\n  element: bf16: oops\nvalue:\n  element: bf16\n", 3),
    "notyet.yaml": (NOT_YET["residual_with_split_layout"][0], line_of(NOT_YET["residual_with_split_layout"][0], "layout:")),
}


def test_cli_validate_reports_each_bad_file_with_its_line(tmp_path):
    paths = {name: write(tmp_path, name, text) for name, (text, _) in BAD_FOR_CLI.items()}
    good = SPECS / "bf16.yaml"
    r = run_kvgen("validate", good, *paths.values())
    assert r.returncode == 1, r.stdout + r.stderr
    for leak in LEAKS:
        assert leak not in r.stdout + r.stderr
    for name, (_, line) in BAD_FOR_CLI.items():
        assert f"{paths[name]}:{line}" in r.stderr, r.stderr
        assert str(paths[name]) not in r.stdout
    assert "bf16.yaml" in r.stdout  # the good file is still checked and reported ok


def test_cli_validate_missing_file(tmp_path):
    r = CliRunner().invoke(cli_main, ["validate", str(tmp_path / "no_such.yaml")])
    assert r.exit_code == 2  # a path that names nothing: a usage error (README, "Exit codes")
    assert isinstance(r.exception, SystemExit)
    assert "no_such.yaml" in r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cli_validate_shipped_specs_dir():
    r = CliRunner().invoke(cli_main, ["validate", str(SPECS)])
    assert r.exit_code == 0, r.output
    for p in SHIPPED:
        assert p.name in r.stdout


@pytest.mark.parametrize("name", ["nested.yaml", "enum.yaml", "notyet.yaml"])
def test_cli_validate_clirunner(tmp_path, name):
    text, line = BAD_FOR_CLI[name]
    p = write(tmp_path, name, text)
    r = CliRunner().invoke(cli_main, ["validate", str(p)])
    assert r.exit_code == 1, r.output
    assert isinstance(r.exception, SystemExit)  # not an escaping exception
    assert f"{p}:{line}" in r.stderr


def test_cli_validate_error_text_is_not_rich_markup(tmp_path):
    crash = write(tmp_path, "crash.yaml", 'name: mk\nkey:\n  element: "[/x]"\nvalue:\n  element: bf16\n')
    eaten = write(tmp_path, "eaten.yaml", 'name: mk\nkey:\n  element: "[red]int9"\nvalue:\n  element: bf16\n')
    r = CliRunner().invoke(cli_main, ["validate", str(eaten), str(crash)])
    assert isinstance(r.exception, SystemExit), repr(r.exception)  # anything else is a traceback for the user
    assert r.exit_code == 1
    assert f"{crash}:3" in r.stderr
    assert "[red]int9" in r.stderr  # the value exactly as written in the spec


def test_control_character_reports_the_line(tmp_path):
    text = "name: ctl\nkey:\n  element: bf16\x07\nvalue:\n  element: bf16\n"
    p = write(tmp_path, "ctl.yaml", text)
    err = spec_error(p)
    assert "\n" not in str(err)
    assert "<unicode string>" not in str(err)
    assert_at(err, p, 3)


def test_cli_validate_directory_without_specs(tmp_path):
    (tmp_path / "empty").mkdir()
    r = CliRunner().invoke(cli_main, ["validate", str(tmp_path / "empty")])
    assert isinstance(r.exception, SystemExit)
    assert r.exit_code != 0
    assert "empty" in r.stderr


def test_control_characters_in_free_text_are_rejected(tmp_path):
    # found by the fuzzer: a NUL in the description reached the generated file's header comment
    p = write(tmp_path, "nul.yaml", 'name: x\ndescription: "a\\0b"\nkey: {element: bf16}\nvalue: {element: bf16}\n')
    err = spec_error(p, kvgen.SpecError)
    assert_field(err, "description")
    assert "U+0000" in err.message


@pytest.mark.parametrize("text", ["=\n", "!D\n", "name: x\nkey: !foo {element: bf16}\nvalue: {element: bf16}\n"])
def test_yaml_tags_are_spec_errors(tmp_path, text):
    # found by the fuzzer: YAML's '=' value key and unknown tags escaped as a yaml ConstructorError
    p = write(tmp_path, "tag.yaml", text)
    err = spec_error(p, kvgen.SpecError)
    assert str(p) in str(err) and err.line is not None


def test_a_model_rule_on_one_field_points_at_that_field(tmp_path):
    """A rule checked across a side's scale ('block' must divide head sizes) names the line of `block:`, not of
    `scale:`; the same error on the value side, which is the key's YAML alias, is said to be the same."""
    text = (SPECS / "q8_0.yaml").read_text().replace("block: 32", "block: 24")
    err = spec_error(write(tmp_path, "q.yaml", text))
    assert (err.line, err.field) == (line_of(text, "block: 24"), "key.scale.block")
    assert "power of two" in str(err) and "(the same error at value.scale.block)" in str(err)


@pytest.mark.parametrize("extra,words", [
    ("x: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),  # PyYAML's recursion: a RecursionError before
    ("x: " + "[" * 40 + "]" * 40 + "\n", "nested too deeply"),
    # an alias bomb: 9**8 values from 9 lines (validation never finished before)
    ("a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [" + ", ".join([f"*{p}"] * 9) + "]\n" for p, c in zip("abcdefg", "bcdefgh")),
     "more than 10000 values once aliases expand"),
])
def test_yaml_too_deep_or_too_large_is_a_spec_error(tmp_path, extra, words):
    text = extra + (SPECS / "q8_0.yaml").read_text()
    err = spec_error(write(tmp_path, "big.yaml", text))
    assert words in str(err)


@pytest.mark.parametrize("value", ["true", "32.0", '"32"'])
def test_integer_fields_take_yaml_integers_only(tmp_path, value):
    """YAML's true would have been read as block 1 (and failed as "greater than or equal to 2"), a quoted number as
    the number: both are mistakes the error names."""
    text = (SPECS / "q8_0.yaml").read_text().replace("block: 32", f"block: {value}")
    err = spec_error(write(tmp_path, "q.yaml", text))
    assert (err.line, err.field) == (line_of(text, f"block: {value}"), "key.scale.block")
    assert "valid integer" in str(err)


def test_side_and_whole_spec_rules_point_at_the_field_they_name(tmp_path):
    """Rules checked over a side or the whole spec name the field they found wrong and point at its line: a zero
    point on a signed element at `zero_point:`, a residual window on the key side only at `residual:`."""
    zp = ("kvgen_spec: 1\nname: zpf\nkey:\n  element: int8\n  zero_point:\n    storage: beside_scale\n  scale:\n"
          "    granularity: per_token_head\nvalue:\n  element: int8\n  scale:\n    granularity: per_token_head\n")
    err = spec_error(write(tmp_path, "zp.yaml", zp))
    assert (err.line, err.field) == (line_of(zp, "zero_point:"), "key.zero_point"), str(err)
    res = ("kvgen_spec: 1\nname: resn\nkey:\n  element: int8\n  residual:\n    tokens: 64\n  scale:\n"
           "    granularity: per_token_head\nvalue:\n  element: int8\n  scale:\n    granularity: per_token_head\n")
    err = spec_error(write(tmp_path, "res.yaml", res))
    assert (err.line, err.field) == (line_of(res, "residual:"), "key.residual"), str(err)
    assert str(err).count("key.residual") == 2  # the field, then the message (no quoted prefix left in it)


def test_a_scale_floor_that_rounds_to_zero_in_fp32_is_refused(tmp_path):
    text = (SPECS / "q8_0.yaml").read_text().replace("    placement: inline\n",
                                                      "    placement: inline\n    min: 1.0e-300\n")
    err = spec_error(write(tmp_path, "m.yaml", text))
    assert (err.line, err.field) == (line_of(text, "min: 1.0e-300"), "key.scale.min")
    assert "rounds to 0 in fp32" in str(err)


def test_every_error_of_a_spec_is_listed_with_its_line(tmp_path):
    """One run shows every mistake, each named by its field and line, not the first and a count of the rest; an
    unknown field gets the schema's nearest name, a value of the wrong type is quoted."""
    text = ("name: many\nkey:\n  element: int8\n  scale:\n    granularity: per_token_head\n    dtpye: fp16\n"
            "value:\n  element: int8\n  scale:\n    granularity: per_block\n    block: abc\n  colour: red\n")
    p = write(tmp_path, "many.yaml", text)
    err = spec_error(p)
    assert_at(err, p, line_of(text, "dtpye"), col_of(text, "dtpye"))
    assert "did you mean 'dtype'?" in err.message
    assert f"value.scale.block (line {line_of(text, 'block: abc')})" in err.message and "'abc'" in err.message
    assert f"value.colour (line {line_of(text, 'colour')})" in err.message
    assert "more error" not in err.message


SIDE_WITH = "name: a\nkey: {{element: int8, scale: {{granularity: per_block, {field}}}}}\nvalue: {{element: bf16}}\n"


@pytest.mark.parametrize("field,words", [
    ("block: 010", "YAML 1.1 reads '010' as 8"), ("block: 0x10", "reads '0x10' as 16"),
    ("block: 1:30", "reads '1:30' as 90"), ("block: 3_2", "reads '3_2' as 32"),
    ("block: 32, min: 1_0.5", "reads '1_0.5' as 10.5"),
    ("block: 32, min: true", "valid number"), ("block: 32, min: '0.5'", "valid number"),
])
def test_numbers_yaml_would_read_otherwise_are_named(tmp_path, field, words):
    """YAML 1.1 took 010 as 8, 0x10 as 16, 3_2 as 32 and 1:30 as 90 without a word; the floor took true as 1.0 and a
    quoted "0.5" as 0.5."""
    text = SIDE_WITH.format(field=field)
    p = write(tmp_path, "n.yaml", text)
    err = spec_error(p)
    assert words in err.message and err.line == 2, err


def test_an_exponent_without_a_dot_is_a_number(tmp_path):
    """min: 1e-6 (YAML 1.2's float, a string to YAML 1.1) is the floor 1.0e-6, the same spec."""
    a = kvgen.load_spec(write(tmp_path, "a.yaml", SIDE_WITH.format(field="block: 32, min: 1e-6")))
    b = kvgen.load_spec(write(tmp_path, "b.yaml", SIDE_WITH.format(field="block: 32, min: 1.0e-6")))
    assert a.key.scale.min == 1e-6 and a.spec_hash() == b.spec_hash()
    c = kvgen.load_spec(write(tmp_path, "c.yaml", SIDE_WITH.format(field="block: 32, min: +.5") + "origin: 1e5\n"))
    assert c.key.scale.min == 0.5 and c.origin == "1e5"  # +.5 a number (YAML 1.2); text fields keep their text


@pytest.mark.parametrize("version", ["true", "1.0"])
def test_spec_version_is_the_integer_1(tmp_path, version):
    p = write(tmp_path, "v.yaml", f"kvgen_spec: {version}\nname: a\nkey: {{element: bf16}}\nvalue: {{element: bf16}}\n")
    err = spec_error(p)
    assert_field(err, "kvgen_spec")
    assert "is the integer 1" in err.message


def test_yaml_errors_keep_what_the_parser_was_reading(tmp_path):
    """A second document said only "but found another document"; an unclosed quote pointed at the end of the file."""
    p = write(tmp_path, "two.yaml", "name: a\nkey: {element: bf16}\nvalue: {element: bf16}\n---\nname: b\n")
    err = spec_error(p)
    assert "expected a single document in the stream, but found another document" in err.message
    assert_at(err, p, 4, 1)
    p = write(tmp_path, "quote.yaml", 'name: "abc\nkey: {element: bf16}\nvalue: {element: bf16}\n')
    err = spec_error(p)
    assert "while scanning a quoted scalar" in err.message
    assert_at(err, p, 1, 7)
