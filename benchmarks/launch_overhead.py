"""Host-side cost of one kvgen call on a GPU: what a decode step pays per layer when it is not captured in a CUDA graph.

    python benchmarks/launch_overhead.py                      # bf16, fp8_e4m3, int8_per_token_head
    python benchmarks/launch_overhead.py --formats nvfp4 --calls 2000
    python benchmarks/launch_overhead.py --python-only          # any machine, no GPU: kvgen's own Python per call
    python benchmarks/launch_overhead.py --profile --formats fp8_e4m3   # where one attend call's host time goes

For a tiny decode step (4 sequences of 64 tokens, 32 query heads, 8 KV heads, head size 128; the GPU work is a few
microseconds) it prints, per format: the host time of one ``Format.attend`` and one ``Format.write`` call
(back-to-back calls without synchronising, averaged), through kvgen's direct launch of the compiled kernels and
through Triton's own launch, the same step replayed from a CUDA graph (the GPU's time
alone), and the host time of a bare Triton launch of a kernel with one argument (the floor of any Triton launch on
this machine). ``--python-only`` times kvgen's own Python around the launches (argument checks, layout, tile and
split choice) with the kernel launches stubbed out, on CPU tensors, as a GPU run would take it, and the cost of
runtime/launch.py's direct launch of the attention kernel with the binary's launcher stubbed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types
import warnings
from pathlib import Path

import torch
import triton
import triton.language as tl

import kvgen
from kvgen.runtime import launch

FAST = launch.FAST_LAUNCH
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402


@triton.jit
def _empty_kernel(x_ptr):
    tl.store(x_ptr + tl.program_id(0), 1.0)


def host_us(fn, calls: int) -> float:
    """Wall time per call of ``calls`` back-to-back calls, the GPU drained before and after."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def python_only(names: list, calls: int) -> None:
    """kvgen's Python per attend / write call, the kernel launches replaced by no-ops (CPU tensors, compiled mode)."""
    os.environ["TRITON_INTERPRET"] = "0"
    from sass_count import stubbed_launches

    print("| format | attend, us per call | attend through a plan (plan.run on another layer's cache), us per call | "
          "write of 4 tokens, us per call | write through a plan (another layer's cache), us per call | "
          "FastLaunch of the attention kernel, us | the same launch bound (a plan's), us |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        fmt = kvgen.load(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cache = fmt.allocate(8, 16, 8, 128)
        q = torch.randn(4, 32, 128, dtype=torch.bfloat16)
        table = torch.arange(8, dtype=torch.int32).reshape(4, 2)
        lens, starts = torch.full((4,), 20, dtype=torch.int32), torch.arange(5, dtype=torch.int32)
        kv = torch.randn(4, 8, 128, dtype=torch.bfloat16)
        attend = lambda: fmt.attend(q, cache, table, lens, starts, max_query_len=1)  # noqa: E731
        write = lambda: fmt.write(cache, kv, kv, torch.arange(4))  # noqa: E731
        times = []
        with stubbed_launches(fmt):
            plan = fmt.plan_attention(q, cache, table, lens, starts, max_query_len=1)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                layer = fmt.allocate(8, 16, 8, 128)  # another layer's cache: checked on each run, as engines run
            planned = lambda: plan.run(q, layer)  # noqa: E731
            wplan = fmt.plan_write(kv, cache, torch.arange(4))
            planned_write = lambda: wplan.run(layer, kv, kv)  # noqa: E731
            for fn in (attend, planned, write, planned_write):
                for _ in range(100):
                    fn()
                t = time.perf_counter()
                for _ in range(calls):
                    fn()
                times.append((time.perf_counter() - t) / calls * 1e6)
        print(f"| {name} | {times[0]:.1f} | {times[1]:.1f} | {times[2]:.1f} | {times[3]:.1f} | "
              f"{fast_launch_us(fmt, attend, calls):.1f} | {fast_launch_us(fmt, attend, calls, bound=True):.1f} |",
              flush=True)


def fast_launch_us(fmt, attend, calls: int, bound: bool = False) -> float:
    """runtime/launch.py's own cost per call of the attention kernel, with the arguments attend() passes: Triton's
    JITFunction class stands in for the compiled kernel, its compile and the binary's launcher replaced by no-ops
    (the launcher itself costs about what a bare launch of a one-argument kernel does)."""
    from sass_count import _captured
    from triton import knobs
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction

    args, kwargs = _captured(fmt, attend)["paged_attention_kernel"]

    class Binary:
        function = packed_metadata = None

        def run(self, *a):
            pass

    class StandIn(JITFunction):
        def create_binder(self):
            return {}, {}, None, BaseBackend, None

        def run(self, *a, grid, warmup, **k):
            return Binary()

    fast = launch.FastLaunch(StandIn(fmt._kernels.module.paged_attention_kernel.fn))
    if bound:  # a plan's launch: its static arguments bound, the call passes the query, output, strides and cache
        own = {k: kwargs[k] for k in ("stride_qt", "stride_qh", "stride_ot", "stride_oh")
               if k in kwargs}
        own.update({k: v for k, v in kwargs.items() if k.endswith("_ptr") and k.startswith(("k_", "v_"))})
        static = {k: v for k, v in kwargs.items() if k not in own}
        fast, kwargs = fast.bind(**static), own
    saved = launch._TRITON
    # Triton's knobs and specialisation, as on a GPU; no driver here, so device and stream are stubbed
    launch._TRITON = types.SimpleNamespace(current_device=lambda: 0, current_stream=lambda device: 0,
                                           runtime=knobs.runtime, compilation=knobs.compilation,
                                           specialize=native_specialize_impl)
    try:
        fast((1,), *args, **kwargs)
        t = time.perf_counter()
        for _ in range(calls):
            fast((1,), *args, **kwargs)
        return (time.perf_counter() - t) / calls * 1e6
    finally:
        launch._TRITON = saved


def profile(names: list, calls: int, top: int = 18) -> None:
    """cProfile of back-to-back attend calls (the tiny decode step): the functions that take the host's time, in us
    per call (own time and with callees), so the launch path's cost can be split between kvgen, Triton's binder and
    launcher, and torch."""
    import cProfile
    import pstats

    for name in names:
        fmt = kvgen.load(name)
        block = fmt.layout.RESIDUAL["group"] if fmt.spec.streaming else 16
        bench.GRAPHS = False
        attend, _ = bench.decode_case(fmt, 4, 64, block)
        for _ in range(50):
            attend()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            attend()
        prof.disable()
        torch.cuda.synchronize()
        stats = pstats.Stats(prof).stats  # (file, line, function) -> (primitive calls, calls, own s, total s, callers)
        rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
        print(f"\n{name}: attend, {calls} calls, profiled (the profiler itself adds time to each Python call)")
        print("| function | calls per attend | own us per attend | with callees, us per attend |")
        print("|---|---|---|---|")
        for (file, line, func), (_, n, own, total, _) in rows:
            where = f"{Path(file).name}:{line} {func}" if line else func
            print(f"| `{where}` | {n / calls:.1f} | {own / calls * 1e6:.1f} | {total / calls * 1e6:.1f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8_e4m3", "int8_per_token_head"])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--python-only", action="store_true", help="kvgen's own Python per call, launches stubbed")
    ap.add_argument("--profile", action="store_true", help="cProfile of attend calls on the GPU: where the time goes")
    args = ap.parse_args()
    if args.python_only:  # CPU tensors, launches stubbed: any machine
        python_only(args.formats, args.calls)
        return 0
    bench.require_gpu(ap)
    if args.profile:
        profile(args.formats, args.calls)
        return 0
    x = torch.zeros(1, device="cuda")
    print(f"bare Triton launch (one argument): {host_us(lambda: _empty_kernel[(1,)](x), args.calls):.1f} us")
    print(f"torch.empty_like (a [4, 32, 128] bf16 tensor): "
          f"{host_us(lambda: torch.empty((4, 32, 128), dtype=torch.bfloat16, device='cuda'), args.calls):.1f} us")
    print("Host us per call; \"direct\": kvgen's launch of the compiled binary (runtime/launch.py), \"Triton\": "
          "Triton's own launch (KVGEN_FAST_LAUNCH=0)\n")
    print("| format | attend, direct | attend, Triton | attend through a plan, direct | attend, CUDA graph replay | "
          "write 4 tokens, direct | write 4 tokens, Triton | write 4 tokens through a plan, direct |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.formats:
        fmt = kvgen.load(name)
        block = fmt.layout.RESIDUAL["group"] if fmt.spec.streaming else 16
        bench.GRAPHS = False
        attend, _ = bench.decode_case(fmt, 4, 64, block)
        planned, _ = bench.decode_case(fmt, 4, 64, block, planned=True)
        write, _ = bench.write_case(fmt, 4, block)
        planned_write, _ = bench.write_case(fmt, 4, block, planned=True)
        graph = bench.graphed(attend)
        times = {}
        for fast in (True, False):
            launch.FAST_LAUNCH = fast
            times[fast] = host_us(attend, args.calls), host_us(write, args.calls)
        launch.FAST_LAUNCH = FAST
        print(f"| {name} | {times[True][0]:.1f} | {times[False][0]:.1f} | {host_us(planned, args.calls):.1f} | "
              f"{host_us(graph, args.calls):.1f} | {times[True][1]:.1f} | {times[False][1]:.1f} | "
              f"{host_us(planned_write, args.calls):.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
