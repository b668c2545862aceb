"""runtime/launch.py: the direct launch of compiled kernels reuses a binary only where Triton would have chosen the
same one.

On the CPU a real ``JITFunction`` (Triton's class, built directly: the interpreter would otherwise wrap the kernel)
stands in with its compile step recorded instead of run, so the tests see which calls go through Triton and what the
direct launch passes to the binary. On a GPU (``TRITON_INTERPRET=0``) attention through the direct launch equals
attention through Triton's own launch, bit for bit, also for a misaligned query after an aligned one.
"""

from __future__ import annotations

import os
import types

import pytest
import torch
import triton.language as tl
from triton.backends.compiler import BaseBackend
from triton.knobs import HookChain
from triton.runtime.jit import JITFunction

import kvgen
from kvgen.runtime import launch

on_gpu = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "0" or not torch.cuda.is_available(),
                            reason="compiled kernels: run with TRITON_INTERPRET=0 on a GPU")


def kernel_source(x_ptr, y_ptr, n, stride, FLAG: tl.constexpr, m=7, BLOCK: tl.constexpr = 64):
    pass


def kernel_no_spec(x_ptr, n):
    pass


class FakeBinary:
    """What Triton's compile would return: a launcher that records its arguments."""

    function = "function handle"
    packed_metadata = "packed metadata"

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)


class RecordingJIT(JITFunction):
    """Triton's JITFunction with its launch path recorded: each call through Triton returns a new binary."""

    def __init__(self, fn, **kwargs):
        super().__init__(fn, **kwargs)
        self.triton_calls = []

    def create_binder(self):
        return {}, {}, None, BaseBackend, None

    def run(self, *args, grid, warmup, **kwargs):
        binary = FakeBinary()
        self.triton_calls.append((grid, args, kwargs, binary))
        return binary


class Runtime:
    """Triton's knobs as the launch reads them: hooks, debug, the instrumentation mode; and the current device."""

    def __init__(self):
        self.launch_enter_hook = HookChain()
        self.launch_exit_hook = HookChain(reversed=True)
        self.debug = False
        self.instrumentation_mode = ""
        self.device = 0


@pytest.fixture
def fake_driver(monkeypatch):
    from triton._C.libtriton import native_specialize_impl

    runtime = Runtime()
    monkeypatch.setattr(launch, "_TRITON", types.SimpleNamespace(
        current_device=lambda: runtime.device, current_stream=lambda device: 1234, runtime=runtime,
        compilation=runtime, specialize=native_specialize_impl))
    monkeypatch.setattr(launch, "FAST_LAUNCH", True)
    return runtime


def tensor(offset_bytes=0, dtype=torch.float16):
    base = torch.zeros(64, dtype=torch.uint8)
    return base[offset_bytes:offset_bytes + 32].view(dtype)


def test_second_call_launches_the_binary_directly(fake_driver):
    fn = RecordingJIT(kernel_source)
    fast = launch.FastLaunch(fn)
    x, y = tensor(), tensor()
    first = fast((4, 2), x, y, 32, stride=48, FLAG=True, num_warps=4)
    assert len(fn.triton_calls) == 1 and first is fn.triton_calls[0][3]
    again = fast((4, 2), x, y, 64, stride=96, FLAG=True, num_warps=4)  # same classes: divisible by 16, not 1
    assert len(fn.triton_calls) == 1 and again is first
    # grid padded to three, the current stream, no hooks; then every parameter in signature order, defaults filled
    assert first.launches == [(4, 2, 1, 1234, "function handle", "packed metadata", None, None, None,
                               x, y, 64, 96, True, 7, 64)]


@pytest.mark.parametrize("change", [
    dict(n=33),  # no longer divisible by 16
    dict(n=1),  # Triton makes a 1 a constant
    dict(n=2**31),  # 64-bit integer
    dict(x=tensor(2)),  # pointer not 16-byte aligned
    dict(x=tensor(dtype=torch.float32)),  # another element type
    dict(FLAG=False),  # a constexpr
    dict(m=8),  # a default overridden, not divisible by 16 either way: same specialisation...
    dict(BLOCK=128),  # a constexpr default overridden
    dict(num_warps=8),  # a compile option
    dict(num_stages=3),  # an option not given before
])
def test_a_new_specialisation_goes_through_triton(fake_driver, change):
    fn = RecordingJIT(kernel_source)
    fast = launch.FastLaunch(fn)
    args = dict(x_ptr=tensor(), y_ptr=tensor(), n=32, stride=48, FLAG=True, num_warps=4)
    fast((1,), **args)
    renamed = {"x": "x_ptr"}
    changed = dict(args, **{renamed.get(k, k): v for k, v in change.items()})
    fast((1,), **changed)
    if change == dict(m=8):  # 7 and 8 specialise alike (neither is 1 nor divisible by 16): the binary is reused
        assert len(fn.triton_calls) == 1 and fn.triton_calls[0][3].launches
    else:
        assert len(fn.triton_calls) == 2 and not fn.triton_calls[0][3].launches
    fast((1,), **args)  # the first specialisation again: its binary, directly
    assert len(fn.triton_calls) <= 2 and fn.triton_calls[0][3].launches


def test_do_not_specialize_is_respected(fake_driver):
    fn = RecordingJIT(kernel_no_spec, do_not_specialize=["n"])
    fast = launch.FastLaunch(fn)
    fast((1,), tensor(), 16)
    fast((1,), tensor(), 17)  # Triton would not tell these apart: one binary
    assert len(fn.triton_calls) == 1 and len(fn.triton_calls[0][3].launches) == 1


def test_hooks_unhashable_constexprs_and_missing_arguments_take_triton_s_path(fake_driver):
    fn = RecordingJIT(kernel_source)
    fast = launch.FastLaunch(fn)
    args = dict(x_ptr=tensor(), y_ptr=tensor(), n=32, stride=48, FLAG=True)
    fast((1,), **args)
    fake_driver.launch_enter_hook.add(lambda metadata: None)  # e.g. a profiler
    fast((1,), **args)
    assert len(fn.triton_calls) == 2
    fake_driver.launch_enter_hook.calls.clear()
    fast((1,), **dict(args, FLAG=[1]))  # unhashable: no cache entry
    fast((1,), **dict(args, FLAG=[1]))
    assert len(fn.triton_calls) == 4
    fast((1,), tensor(), tensor(), 32)  # stride and FLAG missing: Triton raises its own error (here: records)
    assert len(fn.triton_calls) == 5
    fast((1,), tensor(), tensor(), 32, 48, True, n=32)  # n given twice
    fast((1,), tensor(), tensor(), 32, 48, True, 7, 64, 99)  # one argument too many
    assert len(fn.triton_calls) == 7


def test_switched_off_and_interpreted_kernels_take_triton_s_path(fake_driver, monkeypatch):
    fn = RecordingJIT(kernel_source)
    fast = launch.FastLaunch(fn)
    monkeypatch.setattr(launch, "FAST_LAUNCH", False)
    args = dict(x_ptr=tensor(), y_ptr=tensor(), n=32, stride=48, FLAG=True)
    fast((1,), **args)
    fast((1,), **args)
    assert len(fn.triton_calls) == 2

    calls = []

    class Interpreted:  # not a JITFunction: launched as given
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k))

    monkeypatch.setattr(launch, "FAST_LAUNCH", True)
    launch.FastLaunch(Interpreted())((3,), 1, b=2)
    assert calls == [((3,), (1,), {"b": 2})]


def test_a_bound_launch_passes_what_the_unbound_one_does(fake_driver):
    """FastLaunch.bind: the static arguments fixed once; each call's own arguments go where the unbound call would
    put them, and a binary is reused only for the same specialisation of every argument."""
    fn, plain_fn = RecordingJIT(kernel_source), RecordingJIT(kernel_source)
    fast = launch.FastLaunch(fn)
    bound = fast.bind(n=32, stride=48, FLAG=True, num_warps=4)
    plain = launch.FastLaunch(plain_fn)
    x, y, x2, y2 = tensor(), tensor(), tensor(), tensor()
    first = bound((4, 2), x, y)
    assert len(fn.triton_calls) == 1
    # Triton saw every argument, as the unbound launch passes it
    assert fn.triton_calls[0][1:3] == ((x, y), dict(n=32, stride=48, FLAG=True, num_warps=4))
    # own arguments by keyword too: another layout, whose first call finds the unbound launch's binary
    assert bound((4, 2), x2, y_ptr=y2) is first and len(fn.triton_calls) == 1
    assert bound((4, 2), x2, y2) is first and len(fn.triton_calls) == 1
    plain((4, 2), x, y, 32, stride=48, FLAG=True, num_warps=4)
    plain((4, 2), x2, y2, 32, stride=48, FLAG=True, num_warps=4)
    want = plain_fn.triton_calls[0][3].launches[0]
    assert first.launches == [want, want] and want[9:] == (x2, y2, 32, 48, True, 7, 64)
    # a second binding of the same values (a new plan): no Triton call at all
    assert fast.bind(n=32, stride=48, FLAG=True, num_warps=4)((4, 2), x2, y2) is first
    assert len(fn.triton_calls) == 1 and first.launches[-1] == want


def test_own_keywords_in_any_order_among_static_ones(fake_driver):
    """The plan's shape: positional arguments, then keywords out of signature order, statics in between."""
    fn, plain_fn = RecordingJIT(kernel_source), RecordingJIT(kernel_source)
    bound = launch.FastLaunch(fn).bind(n=32, FLAG=True, m=9)
    plain = launch.FastLaunch(plain_fn)
    x, y = tensor(), tensor()
    for _ in range(2):
        bound((2,), x, stride=64, y_ptr=y)
        plain((2,), x, y, 32, 64, True, m=9)
    assert fn.triton_calls[0][3].launches == plain_fn.triton_calls[0][3].launches
    assert fn.triton_calls[0][3].launches[0][9:] == (x, y, 32, 64, True, 9, 64)


def test_a_bound_launch_keys_knobs_devices_and_do_not_specialize(fake_driver):
    fn = RecordingJIT(kernel_source)
    bound = launch.FastLaunch(fn).bind(n=32, stride=48, FLAG=True)
    args = (tensor(), tensor())
    bound((1,), *args)
    for knob, value in (("debug", True), ("instrumentation_mode", "consan"), ("device", 1)):
        setattr(fake_driver, knob, value)  # each changes the binary Triton would choose
        calls = len(fn.triton_calls)
        bound((1,), *args)
        assert len(fn.triton_calls) == calls + 1, knob
    nospec = RecordingJIT(kernel_no_spec, do_not_specialize=["n"])
    b2 = launch.FastLaunch(nospec).bind()
    b2((1,), tensor(), 16)
    b2((1,), tensor(), 17)  # Triton would not tell these apart: one binary, launched directly
    assert len(nospec.triton_calls) == 1 and len(nospec.triton_calls[0][3].launches) == 1


@pytest.mark.parametrize("call", [
    dict(x_ptr=tensor(2)),  # the call's own pointer, not 16-byte aligned: a new binary
    dict(x_ptr=tensor(dtype=torch.float32)),  # another element type
])
def test_a_bound_launch_keys_the_call_s_own_arguments(fake_driver, call):
    fn = RecordingJIT(kernel_source)
    bound = launch.FastLaunch(fn).bind(n=32, stride=48, FLAG=True)
    bound((1,), tensor(), tensor())
    bound((1,), call["x_ptr"], tensor())
    assert len(fn.triton_calls) == 2
    bound((1,), tensor(), tensor())  # the first specialisation: its binary, directly
    assert len(fn.triton_calls) == 2 and fn.triton_calls[0][3].launches


def test_a_bound_launch_falls_back_where_binding_cannot_hold(fake_driver):
    fn = RecordingJIT(kernel_source)
    bound = launch.FastLaunch(fn).bind(x_ptr=tensor(), y_ptr=tensor(), n=32, stride=48)
    bound((1,), FLAG=True)  # a constexpr among the call's own arguments: the unbound FastLaunch (Triton first)
    bound((1,), FLAG=True)  # ... which then launches its binary directly
    assert len(fn.triton_calls) == 1 and len(fn.triton_calls[0][3].launches) == 1
    bound((1,), FLAG=False)  # another constexpr value: another binary
    assert len(fn.triton_calls) == 2
    fake_driver.launch_enter_hook.add(lambda metadata: None)  # a profiler: Triton's path, every call
    bound((1,), FLAG=True)
    assert len(fn.triton_calls) == 3
    fake_driver.launch_enter_hook.calls.clear()
    with pytest.raises(TypeError, match="multiple values for keyword argument 'n'"):
        bound((1,), n=16, FLAG=True)  # n bound and given again
    other = launch.FastLaunch(RecordingJIT(kernel_source)).bind(n=32, stride=48, FLAG=True, num_warps=4)
    other((1,), tensor(), tensor(), num_stages=3)  # an option given per call: unbound
    other((1,), tensor(), tensor(), num_stages=3)
    assert len(other.fast.fn.triton_calls) == 1
    third = launch.FastLaunch(RecordingJIT(kernel_source)).bind(m=7)
    third((1,), tensor(), tensor(), 32, 48, True)  # FLAG, a constexpr, among the call's own (positional): unbound
    third((1,), tensor(), tensor(), 32, 48, True)
    assert len(third.fast.fn.triton_calls) == 1 and len(third.fast.fn.triton_calls[0][3].launches) == 1
    third((1,), tensor(), tensor(), 32, 48, True, 7)  # m given positionally and bound: Triton reports it (records)
    assert len(third.fast.fn.triton_calls) == 2
    fourth = launch.FastLaunch(RecordingJIT(kernel_source)).bind(FLAG=[1], n=32, stride=48)  # unhashable constexpr
    fourth((1,), tensor(), tensor())
    fourth((1,), tensor(), tensor())
    assert len(fourth.fast.fn.triton_calls) == 2  # never cached, as in the unbound launch


@on_gpu
@pytest.mark.parametrize("name", ["fp8_e4m3", "int8_per_token_head", "nvfp4"])
def test_direct_launch_matches_triton_s_launch(name, monkeypatch):
    """Decode and a two-split long context, aligned and misaligned queries (a binary specialised for 16-byte
    aligned pointers must not see the misaligned one), through both launch paths."""
    fmt = kvgen.load(name)
    torch.manual_seed(0)
    num_seqs, ctx, hkv, hq, d, bs = 3, 1500, 2, 8, 128, 16
    blocks = num_seqs * -(-ctx // bs)
    scales = {f"{s[0]}_scale": 0.05 for s in ("key", "value") if fmt.static_scale_kind(s) is not None}
    cache = fmt.allocate(blocks, bs, hkv, d, device="cuda", **scales)
    kv = torch.randn(2, blocks * bs, hkv, d, device="cuda")
    fmt.write(cache, kv[0], kv[1], torch.arange(blocks * bs, device="cuda"))
    table = torch.arange(blocks, dtype=torch.int32, device="cuda").reshape(num_seqs, -1)
    seq_lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda")
    buffer = torch.randn(num_seqs * hq * d + 1, dtype=torch.bfloat16, device="cuda")
    aligned = buffer[:-1].view(num_seqs, hq, d)
    misaligned = buffer[1:].view(num_seqs, hq, d)  # 2 bytes past a 16-byte boundary
    results = {}
    for fast in (True, False):
        monkeypatch.setattr(launch, "FAST_LAUNCH", fast)
        for label, q in (("aligned", aligned), ("misaligned", misaligned)):
            for splits in (1, 2):
                for repeat in range(2):  # the second call of each is the direct one
                    out = fmt.attend(q, cache, table, seq_lens, qsl, max_query_len=1, num_splits=splits)
                results[fast, label, splits] = out
    torch.cuda.synchronize()
    for (fast, label, splits), out in results.items():
        if fast:
            assert torch.equal(out, results[False, label, splits]), (name, label, splits)


def test_what_triton_tells_apart_and_python_does_not(fake_driver):
    """1, True and 1.0 are equal in Python but different constexprs (and binaries) in Triton; the debug and
    instrumentation knobs and the current device also choose the binary."""
    fn = RecordingJIT(kernel_source)
    fast = launch.FastLaunch(fn)
    args = dict(x_ptr=tensor(), y_ptr=tensor(), n=32, stride=48)
    for flag in (1, True, 1.0):
        fast((1,), **args, FLAG=flag)
    assert len(fn.triton_calls) == 3
    fake_driver.debug = True
    fast((1,), **args, FLAG=1)
    fake_driver.debug = False
    fake_driver.instrumentation_mode = "consan"
    fast((1,), **args, FLAG=1)
    fake_driver.instrumentation_mode = ""
    fake_driver.device = 1
    fast((1,), **args, FLAG=1)
    assert len(fn.triton_calls) == 6
    fake_driver.device = 0
    fast((1,), **args, FLAG=1)  # as the first call: its binary, directly
    assert len(fn.triton_calls) == 6 and fn.triton_calls[0][3].launches


def test_alignment_flag_grid_functions_and_pre_run_hooks(fake_driver):
    fn = RecordingJIT(kernel_no_spec, do_not_specialize_on_alignment=["x_ptr"])
    fast = launch.FastLaunch(fn)
    fast((1,), tensor(), 16)
    fast((1,), tensor(2), 16)  # alignment not specialised for x_ptr: one binary
    assert len(fn.triton_calls) == 1 and len(fn.triton_calls[0][3].launches) == 1
    fast(lambda meta: (1,), tensor(), 16)  # a grid function: Triton evaluates it
    fn.add_pre_run_hook(lambda *a, **k: None)
    fast((1,), tensor(), 16)
    assert len(fn.triton_calls) == 3
