"""conformance.check, the engine of `kvgen test`: its verdict is the properties' alone. A case that cannot run (a
device this process cannot use, an error inside a kernel launch) is an error, never a pass of zero cases."""

from __future__ import annotations

import pytest
import torch

import kvgen
from kvgen import conformance
from kvgen.runtime.kernels import interpreting


def test_an_error_inside_a_case_propagates_instead_of_passing(monkeypatch):
    """torch raises AssertionError for CUDA on a CPU build: such an error in a case must not read as the property
    check's own assertion (it once did, and `kvgen test --device cuda` passed with no case run)."""
    def broken(fmt, case, device, **kw):
        raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(conformance, "run_case", broken)
    with pytest.raises(AssertionError, match="Torch not compiled"):
        conformance.check(kvgen.load("fp8_e4m3"), 2, "cpu" if interpreting() else "cuda")


def test_a_failing_property_is_reported_with_its_case(monkeypatch):
    def wrong_bytes(fmt, case, device, **kw):
        return {p: ("bytes differ" if p == "bytes" else None) for p in conformance.PROPERTIES}

    monkeypatch.setattr(conformance, "run_case", wrong_bytes)
    report = conformance.check(kvgen.load("fp8_e4m3"), 2, "cpu" if interpreting() else "cuda")
    assert not report.passed and report.failures["bytes"] == "bytes differ" and report.failing_case is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
def test_a_device_this_process_cannot_use_is_refused():
    fmt = kvgen.load("fp8_e4m3")
    with pytest.raises(ValueError, match="^device: cuda was asked for, but torch sees no CUDA device"):
        conformance.check(fmt, 1, "cuda")
    with pytest.raises(ValueError, match="^device: 'gpu0' is not a device"):
        conformance.check(fmt, 1, "gpu0")


@pytest.mark.parametrize("examples", [0, -3, 2.5, True])
def test_examples_must_be_a_positive_integer(examples):
    with pytest.raises(ValueError, match="^examples: expected a positive integer"):
        conformance.check(kvgen.load("fp8_e4m3"), examples, "cpu")


@pytest.mark.parametrize("corrupt", [
    lambda x: torch.nan_to_num(x, nan=0.0, posinf=float("inf"), neginf=float("-inf")),  # NaN stored as 0 would be
    lambda x: torch.where(x == 0, torch.zeros_like(x), x),  # -0.0 written as +0.0
    lambda x: torch.where(x.abs() < 1e-3, torch.zeros_like(x), x),  # tiny values flushed before the scale
], ids=["nan", "negative_zero", "flush_tiny"])
def test_edge_values_catch_what_random_cases_never_hold(monkeypatch, corrupt):
    """A write that mishandles NaN, signed zeros or values that round to zero passes the random cases (their data
    has none of them) but not edge_bytes, which `kvgen test` runs once per format."""
    fmt = kvgen.load("fp8_per_token_head")
    write = type(fmt).write

    def wrong_write(self, cache, key, value, slot_mapping, **kw):
        return write(self, cache, corrupt(key), corrupt(value), slot_mapping, **kw)

    monkeypatch.setattr(type(fmt), "write", wrong_write)
    report = conformance.check(fmt, 1, "cpu" if interpreting() else "cuda")
    assert report.failures["edge_bytes"] and "bytes differ" in report.failures["edge_bytes"]
    assert not report.passed


def test_edge_values_pass_for_a_shipped_format_and_are_not_checked_for_residual_windows():
    dev = "cpu" if interpreting() else "cuda"
    assert conformance.edge_bytes(kvgen.load("q4_0"), dev) is None
    report = conformance.check(kvgen.load("kivi_2bit"), 1, dev)
    assert report.passed and report.not_checked == ("edge_bytes",)
