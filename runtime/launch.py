"""Launch compiled Triton kernels with less host work per call than ``kernel[grid](...)``.

Triton's own launch binds every argument by name, specialises each one, reads its knobs (environment variables)
and builds a cache key on every call: about 100 us of host time for the attention kernel's 61 arguments on the
H200's host (benchmarks/RESULTS.md), more than the GPU needs for a decode step at short contexts. An engine that
does not capture decode in CUDA graphs pays that per layer.

``FastLaunch`` wraps one ``@triton.jit`` kernel. The first call of each specialisation goes through Triton, which
compiles (or finds) the binary; later calls with the same specialisation call that binary's launcher directly. The
specialisation is Triton's own: the same ``native_specialize_impl`` per runtime argument, with each parameter's
flags (``do_not_specialize``, alignment), plus every constexpr value and every compile option. So two calls share a
binary here only where Triton would have given them the same binary.

``FastLaunch.bind(**static)`` fixes some arguments once (a planned attention call binds everything but the query,
the output, their strides and the cache's tensors): each call then specialises and keys only its own arguments.

Triton's path is kept for the interpreter, while a launch hook is installed (profilers such as proton), for a grid
given as a function, and when ``KVGEN_FAST_LAUNCH=0`` is set (read once, at import). Two checks of Triton's own
launch are not repeated for a reused binary: that the globals a kernel reads have not changed since it was compiled
(generated kernels read none), and a float constexpr's sign of zero (-0.0 and 0.0 share a binary here).
"""

from __future__ import annotations

import os
import types
from itertools import repeat
from operator import itemgetter

FAST_LAUNCH = os.environ.get("KVGEN_FAST_LAUNCH", "1") not in ("0", "")


class FastLaunch:
    """``FastLaunch(jit_fn)(grid, *args, **kwargs)`` launches like ``jit_fn[grid](*args, **kwargs)``."""

    def __init__(self, fn):
        from triton.runtime.jit import JITFunction

        self.fn = fn
        self.compiled_kernel = isinstance(fn, JITFunction)  # not under the interpreter
        self.binaries: dict = {}  # specialisation key -> compiled kernel
        self._signature = None

    def _read_signature(self) -> _Signature:
        if self._signature is None:
            self._signature = _Signature(self.fn.params)
        return self._signature

    def __call__(self, grid, *args, **kwargs):
        if not (FAST_LAUNCH and self.compiled_kernel):
            return self.fn[grid](*args, **kwargs)  # the interpreter, or switched off
        triton = _triton()
        if self.fn.pre_run_hooks or _hooks_installed(triton.runtime) or callable(grid):
            return self.fn[grid](*args, **kwargs)  # hooks to call, or a grid function to evaluate
        sig = self._read_signature()
        device = triton.current_device()
        try:
            if args and not kwargs.keys().isdisjoint(sig.leading[len(args)]):
                raise TypeError("a positional argument given again by keyword")
            merged = {**sig.defaults, **kwargs}
            values = args + sig.by_name[len(args)](merged)  # every parameter, in signature order
            options = frozenset((k, merged[k]) for k in merged.keys() - sig.names)  # compile options
            backend = self.fn.device_caches[device][3]
            specialisation = tuple(map(triton.specialize, repeat(backend), sig.runtime(values), sig.is_const,
                                       sig.specialise, sig.align))
            constexprs = sig.constexprs(values)
            # Triton keys constexprs by their text: 1, True and 1.0 differ there, so their types go in too; so do
            # the knobs its launch adds to the compile options (read per call, as Triton does)
            key = (device, options, constexprs, tuple(map(type, constexprs)), specialisation,
                   kwargs.get("debug", self.fn.debug) or triton.runtime.debug, triton.compilation.instrumentation_mode)
            binary = self.binaries.get(key)
        except (KeyError, IndexError, TypeError):
            # a missing argument or too many (Triton reports them), an unhashable constexpr or option (no cache)
            return self.fn[grid](*args, **kwargs)
        if binary is None:
            binary = self.fn[grid](*args, **kwargs)  # compiles, or finds Triton's cached binary
            self.binaries[key] = binary
            return binary
        return _run(binary, grid, triton.current_stream(device), values)


    def bind(self, **static) -> BoundLaunch:
        """``bind(**static)(grid, *args, **dynamic)`` launches like ``self(grid, *args, **static, **dynamic)``, with
        the static arguments bound, specialised and keyed once: a call specialises only its own arguments (a planned
        attention call: the query, the output and the cache's tensors, every layer)."""
        return BoundLaunch(self, static)


class BoundLaunch:
    """A FastLaunch with some keyword arguments fixed (``FastLaunch.bind``). Binaries are kept per layout of the
    call's own arguments (how many positional, which keywords) and keyed by their specialisation; everything
    else in Triton's key (constexprs, options, the static runtime arguments) is fixed by the binding. Calls that
    pass a constexpr or an option themselves, and every case in which FastLaunch takes Triton's path, go through
    the unbound FastLaunch."""

    def __init__(self, fast: FastLaunch, static: dict):
        self.fast = fast
        self.static = static
        self._layouts: dict = {}  # (positional count, keyword names) -> _BoundLayout, or None: not bindable

    def __call__(self, grid, *args, **dynamic):
        fast = self.fast
        if not (FAST_LAUNCH and fast.compiled_kernel):
            return fast.fn[grid](*args, **self.static, **dynamic)
        triton = _triton()
        if fast.fn.pre_run_hooks or _hooks_installed(triton.runtime) or callable(grid):
            return fast.fn[grid](*args, **self.static, **dynamic)
        shape = (len(args), tuple(dynamic))
        layout = self._layouts.get(shape, False)
        if layout is False:
            layout = self._layouts[shape] = _BoundLayout.make(fast, self.static, len(args), tuple(dynamic))
        if layout is None:  # a constexpr or option among the call's own arguments, or a binding error
            return fast(grid, *args, **self.static, **dynamic)
        device = triton.current_device()
        own = args + tuple(dynamic.values())
        try:
            backend = fast.fn.device_caches[device][3]
            spec = tuple(map(triton.specialize, repeat(backend), layout.own_runtime(own), layout.is_const,
                             layout.specialise, layout.align))
            key = (device, spec, layout.static_spec(triton, backend, device), fast.fn.debug or triton.runtime.debug,
                   triton.compilation.instrumentation_mode)
            binary = layout.binaries.get(key)
        except (KeyError, IndexError, TypeError):
            return fast(grid, *args, **self.static, **dynamic)
        if binary is None:
            binary = fast.fn[grid](*args, **self.static, **dynamic)  # compiles, or finds Triton's cached binary
            layout.binaries[key] = binary
            return binary
        return _run(binary, grid, triton.current_stream(device), layout.values(own))


class _BoundLayout:
    """Where a bound call's own arguments go among the kernel's parameters, and the static rest."""

    @classmethod
    def make(cls, fast: FastLaunch, static: dict, num_args: int, names: tuple):
        sig = fast._read_signature()
        params = fast.fn.params
        order = [p.name for p in params]
        own = order[:num_args] + list(names)
        if len(set(own)) != len(own) or not set(own) <= sig.names or set(own) & set(static):
            return None  # an argument given twice, or not a parameter: the unbound path reports it
        merged = {**sig.defaults, **static}
        missing = [n for n in order if n not in merged and n not in own]
        options = {k: v for k, v in merged.items() if k not in sig.names}
        if missing or options.keys() & set(names) or any(params[order.index(n)].is_constexpr for n in own):
            return None
        if "debug" in options:  # a per-call debug flag: keep Triton's handling of it
            return None
        return cls(fast, params, order, own, merged)

    def __init__(self, fast, params, order, own, merged):
        self.fast = fast
        own_index = {n: i for i, n in enumerate(own)}
        static_names = [n for n in order if n not in own_index]
        # values(own): every parameter in signature order from (own arguments) + (static values)
        self._static_values = tuple(merged[n] for n in static_names)
        position = {n: i for i, n in enumerate(own)}
        position.update({n: len(own) + i for i, n in enumerate(static_names)})
        self._picker = _getter([position[n] for n in order])
        runtime_own = [n for n in own if not params[order.index(n)].is_constexpr]
        self.own_runtime = _getter([own_index[n] for n in runtime_own])
        self.is_const = [params[order.index(n)].is_const for n in runtime_own]
        self.specialise = [not params[order.index(n)].do_not_specialize for n in runtime_own]
        self.align = [not params[order.index(n)].do_not_specialize_on_alignment for n in runtime_own]
        static_runtime = [n for n in static_names if not params[order.index(n)].is_constexpr]
        self._static_runtime = [(merged[n], params[order.index(n)]) for n in static_runtime]
        self._static_specs: dict = {}  # device -> specialisation of the static runtime arguments
        self.binaries: dict = {}

    def values(self, own: tuple) -> tuple:
        return self._picker(own + self._static_values)

    def static_spec(self, triton, backend, device) -> tuple:
        spec = self._static_specs.get(device)
        if spec is None:
            spec = self._static_specs[device] = tuple(
                triton.specialize(backend, v, p.is_const, not p.do_not_specialize, not p.do_not_specialize_on_alignment)
                for v, p in self._static_runtime)
        return spec


def _run(binary, grid, stream, values: tuple):
    """The binary's launcher on a grid of up to three dimensions, no launch hooks; returns the binary."""
    binary.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, binary.function,
               binary.packed_metadata, None, None, None, *values)
    return binary


class _Signature:
    """A kernel's parameters as getters: read once, then every call binds its arguments with C-level operations."""

    def __init__(self, params):
        names = [p.name for p in params]
        self.names = frozenset(names)
        self.leading = [frozenset(names[:i]) for i in range(len(names) + 1)]  # the first i parameters
        self.defaults = {p.name: p.default for p in params if p.has_default}
        # by_name[i]: the values of parameters i.. from a dict of keyword arguments, as a tuple
        self.by_name = [_getter(names[i:]) for i in range(len(names) + 1)]
        runtime = [i for i, p in enumerate(params) if not p.is_constexpr]
        self.runtime = _getter(runtime)
        self.constexprs = _getter([i for i, p in enumerate(params) if p.is_constexpr])
        # Triton's flags per runtime parameter, as its binder passes them to native_specialize_impl
        self.is_const = [params[i].is_const for i in runtime]
        self.specialise = [not params[i].do_not_specialize for i in runtime]
        self.align = [not params[i].do_not_specialize_on_alignment for i in runtime]


def _getter(keys: list):
    """A function of a mapping (or sequence) returning its items at ``keys`` as a tuple (also for zero or one key)."""
    if not keys:
        return lambda m: ()
    if len(keys) == 1:
        key = keys[0]
        return lambda m: (m[key],)
    return itemgetter(*keys)


_TRITON: types.SimpleNamespace | None = None


def _triton() -> types.SimpleNamespace:
    """The pieces of Triton a launch reads, looked up once (its driver exists only where a GPU does)."""
    global _TRITON
    if _TRITON is None:
        from triton import knobs
        from triton._C.libtriton import native_specialize_impl
        from triton.runtime.driver import driver

        active = driver.active
        _TRITON = types.SimpleNamespace(current_device=active.get_current_device,
                                        current_stream=active.get_current_stream, runtime=knobs.runtime,
                                        compilation=knobs.compilation, specialize=native_specialize_impl)
    return _TRITON


def _hooks_installed(runtime) -> bool:
    """Whether launch hooks are set (Triton 3.6 keeps empty hook chains; older versions None; a bare function is
    also possible): Triton's path calls them with each launch's metadata."""
    return any(h is not None and getattr(h, "calls", True) for h in (runtime.launch_enter_hook,
                                                                     runtime.launch_exit_hook))
