"""Fuzzed specs (kvgen.fuzz): random YAML documents and mutations of the shipped specs either build a format that
conforms to the reference or are rejected with kvgen's SpecError; nothing else escapes. The long run of 10,000
cases is `python -m kvgen.fuzz --cases 10000` (result in docs/fuzz.md)."""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings

from kvgen.fuzz import check_text, fuzz_texts

CASES = int(os.environ.get("KVGEN_FUZZ_CASES", "150"))


@settings(max_examples=CASES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(text=fuzz_texts())
def test_fuzzed_spec_builds_and_conforms_or_is_rejected(text, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    before = os.environ.get("KVGEN_CACHE_DIR")
    os.environ["KVGEN_CACHE_DIR"] = str(root / "cache")
    try:
        assert check_text(text, root) in ("rejected", "built")
    finally:
        if before is None:
            os.environ.pop("KVGEN_CACHE_DIR", None)
        else:
            os.environ["KVGEN_CACHE_DIR"] = before


def test_block_larger_than_the_test_head_sizes(tmp_path, monkeypatch):
    """A spec whose scale block (128) exceeds the conformance head sizes (16-64) is valid: it builds and conforms at
    a head size of its block (CI's fuzz run found conformance asking for head size 64, which the runtime rejects)."""
    spec = yaml.safe_load((Path(__file__).resolve().parents[1] / "specs" / "nvfp4.yaml").read_text())
    spec["key"]["scale"]["block"] = spec["value"]["scale"]["block"] = 128
    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path / "cache"))
    assert check_text(yaml.safe_dump(spec), tmp_path) == "built"
