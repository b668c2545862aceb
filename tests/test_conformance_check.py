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
