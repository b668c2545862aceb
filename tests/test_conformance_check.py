"""conformance.check, the engine of `kvgen test`: its verdict is the properties' alone. A case that cannot run (a
device this process cannot use, an error inside a kernel launch) is an error, never a pass of zero cases."""

from __future__ import annotations

import numpy as np
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


def one_channel_off(monkeypatch, fmt, factor: float) -> None:
    """fmt.attend with channel 1 of every output scaled by ``factor``: a kernel wrong in one channel."""
    attend = type(fmt).attend

    def wrong_attend(self, *args, **kw):
        out = attend(self, *args, **kw)
        out[..., 1] *= factor
        return out

    monkeypatch.setattr(type(fmt), "attend", wrong_attend)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_an_error_in_one_channel_fails_beside_an_outlier_channel(monkeypatch, dtype):
    """The random data holds an outlier channel (20x) and a token of -60 in channel 0: attention's absolute tolerance
    follows each output channel's own values, so a 3% error in an ordinary channel fails (with fp16 queries and the
    head's largest value as its scale it passed)."""
    fmt = kvgen.load("int8_per_token_head")
    case = conformance.Case(head_size=32, block_size=4, num_kv_heads=2, group=2, seq_lens=[13, 6], q_lens=[1, 6],
                            dtype=dtype, window=None, holes=1, seed=0, k_scale=1.0, v_scale=1.0, magnitude=1.0)
    dev = "cpu" if interpreting() else "cuda"
    assert conformance.run_case(fmt, case, dev)["attention"] is None
    one_channel_off(monkeypatch, fmt, 1.03)
    message = conformance.run_case(fmt, case, dev)["attention"]
    assert "above tolerance" in message and ", channel 1:" in message  # the message points at the wrong channel


@pytest.mark.parametrize("name", ["int8_per_token_head", "q4_0", "int8_asym_per_token_head"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_values_seven_decades_apart_conform(monkeypatch, name, dtype):
    """One token's value of 60000 beside 15 tokens whose values are 0.0057 (attention uniform: zero keys): an fp16
    value dot divides the probabilities times their scales by the step's largest, and the small tokens' quotients
    underflow, so channel 1's output is 25% off in fp16. A right kernel: the tolerance's fp16_underflow term covers
    it (the per-channel scale alone did not)."""
    values = iter([False, True])

    def data(rng, shape, magnitude):  # keys first, then values
        x = np.zeros(shape, np.float32)
        if next(values):
            x[1:, :, 1] = 0.0057
            x[0, :, 0] = 60000.0
        return x

    monkeypatch.setattr(conformance, "kv_data", data)
    case = conformance.Case(head_size=32, block_size=16, num_kv_heads=1, group=1, seq_lens=[16], q_lens=[1],
                            dtype=dtype, window=None, holes=0, seed=0, k_scale=1.0, v_scale=1.0, magnitude=1.0)
    assert conformance.run_case(kvgen.load(name), case, "cpu" if interpreting() else "cuda")["attention"] is None
