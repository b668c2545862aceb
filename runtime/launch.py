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

    def compiled(self, grid, *args, **kwargs):
        """The binary ``self(grid, *args, **kwargs)`` would launch, compiled (or found in Triton's caches) and loaded,
        without launching it: its registers (``n_regs``) and shared memory (``metadata.shared``) are then known.
        None under the interpreter, or where Triton gives no loaded binary (a compile hook, an error: the launch
        itself will report those)."""
        if not self.compiled_kernel:
            return None
        try:
            binary = self.fn.warmup(*args, grid=grid, **kwargs)
            if hasattr(binary, "result"):  # Triton's asynchronous compile mode: a future
                binary = binary.result()
            if binary is None:  # a cache hook that took the compile
                return None
            binary._init_handles()  # loads the module: sets n_regs
        except Exception:  # noqa: BLE001 - the caller falls back to what it would do without the binary
            return None
        return binary

    def bind(self, **static) -> BoundLaunch:
        """``bind(**static)(grid, *args, **dynamic)`` launches like ``self(grid, *args, **static, **dynamic)``, with
        the static arguments bound, specialised and keyed once: a call specialises only its own arguments (a planned
        attention call: the query, the output and the cache's tensors, every layer)."""
        return BoundLaunch(self, static)


class BoundLaunch:
    """A FastLaunch with some keyword arguments fixed (``FastLaunch.bind``). Its binaries are keyed by the
    specialisation of every runtime argument (the static ones too, re-read each call: a tensor re-pointed in place is
    seen) and the knobs; constexprs and options are fixed by the binding. A specialisation met for the first time
    goes through the unbound FastLaunch, which shares its binaries across bindings (a new plan's first run does not
    compile or bind again). Calls that pass a constexpr or an option themselves, unhashable static constexprs, and
    every case in which FastLaunch takes Triton's path go through the unbound FastLaunch."""

    def __init__(self, fast: FastLaunch, static: dict):
        self.fast = fast
        self.static = static
        self._calls: dict = {}  # (positional count, keyword names) -> _BoundCall, or None: not bindable

    def __call__(self, grid, *args, **dynamic):
        fast = self.fast
        if not (FAST_LAUNCH and fast.compiled_kernel):
            return fast.fn[grid](*args, **self.static, **dynamic)
        triton = _triton()
        if fast.fn.pre_run_hooks or _hooks_installed(triton.runtime) or callable(grid):
            return fast.fn[grid](*args, **self.static, **dynamic)
        shape = (len(args), tuple(dynamic))
        call = self._calls.get(shape, False)
        if call is False:
            call = self._calls[shape] = _BoundCall.make(fast, self.static, *shape)
        if call is None:  # a constexpr or option among the call's own arguments, or a binding error
            return fast(grid, *args, **self.static, **dynamic)
        device = triton.current_device()
        own = args + tuple(dynamic.values())
        try:
            backend = fast.fn.device_caches[device][3]
            spec = tuple(map(triton.specialize, repeat(backend), call.layout.own_runtime(own), *call.layout.own_flags))
            fixed = tuple(map(triton.specialize, repeat(backend), call.static_runtime, *call.layout.static_flags))
            key = (device, spec, fixed, fast.fn.debug or triton.runtime.debug,
                   triton.compilation.instrumentation_mode)
            binary = call.binaries.get(key)
        except (KeyError, IndexError, TypeError):
            return fast(grid, *args, **self.static, **dynamic)
        if binary is None:  # the unbound launch: its binary for this specialisation, compiled or found
            binary = call.binaries[key] = fast(grid, *args, **self.static, **dynamic)
            return binary
        return _run(binary, grid, triton.current_stream(device), call.layout.values(own, call.static_values))


class _BoundCall:
    """One binding's calls of one layout: the static values in the layout's order, and the binaries."""

    @classmethod
    def make(cls, fast: FastLaunch, static: dict, num_args: int, names: tuple):
        sig = fast._read_signature()
        positional = {p.name for p in fast.fn.params[:num_args]}
        if (num_args > len(sig.by_name) - 1 or not set(names) <= sig.names
                or (set(names) | positional) & static.keys()):
            return None  # too many arguments, an unknown or repeated name: the unbound path reports it
        merged = {**sig.defaults, **static}
        layouts = fast.__dict__.setdefault("_bound_layouts", {})
        key = (num_args, names, tuple(merged))
        layout = layouts.get(key, False)
        if layout is False:
            layout = layouts[key] = _BoundLayout.make(fast.fn.params, merged.keys(), num_args, names)
        if layout is None:
            return None
        fixed = [merged[n] for n in layout.constexpr_names] + [merged[k] for k in layout.option_names]
        try:
            hash(tuple(fixed))
        except TypeError:  # an unhashable constexpr or option: never cached, as in the unbound path
            return None
        return cls(layout, tuple(merged[n] for n in layout.static_names),
                   tuple(merged[n] for n in layout.static_runtime_names))

    def __init__(self, layout: _BoundLayout, static_values: tuple, static_runtime: tuple):
        self.layout = layout
        self.static_values = static_values
        self.static_runtime = static_runtime  # specialised again on each call (a tensor re-pointed in place)
        self.binaries: dict = {}


class _BoundLayout:
    """Where a bound call's own arguments go among the kernel's parameters (per kernel, call layout and set of
    static names): getters and each runtime parameter's specialisation flags."""

    @classmethod
    def make(cls, params, static_names, num_args: int, names: tuple):
        order = [p.name for p in params]
        own = order[:num_args] + list(names)
        static = [n for n in static_names if n not in own]
        by_name = {p.name: p for p in params}
        if len(set(own)) != len(own) or any(n not in static_names and n not in own for n in order):
            return None  # a name given twice, or a parameter missing
        if any(by_name[n].is_constexpr for n in own) or "debug" in static_names:
            return None  # the call's own constexprs, or a debug flag per call: the unbound path
        return cls(params, order, own, [n for n in static if n in by_name], [n for n in static if n not in by_name])

    def __init__(self, params, order, own, static_params, option_names):
        by_name = {p.name: p for p in params}
        self.static_names = static_params
        self.option_names = option_names
        self.constexpr_names = [n for n in static_params if by_name[n].is_constexpr]
        position = {n: i for i, n in enumerate(own)}
        position.update({n: len(own) + i for i, n in enumerate(static_params)})
        self._picker = _getter([position[n] for n in order])  # (own + static values) -> signature order
        runtime_own = [n for n in own if not by_name[n].is_constexpr]
        self.own_runtime = _getter([position[n] for n in runtime_own])
        self.own_flags = _flags([by_name[n] for n in runtime_own])
        # the static runtime arguments, specialised on each call as Triton would: a tensor's pointer can change
        # under the same object
        self.static_runtime_names = [n for n in static_params if not by_name[n].is_constexpr]
        self.static_flags = _flags([by_name[n] for n in self.static_runtime_names])

    def values(self, own: tuple, static_values: tuple) -> tuple:
        return self._picker(own + static_values)


def _flags(params) -> tuple:
    """Triton's specialisation flags of these runtime parameters, as lists in the order native_specialize_impl
    takes them (is_const, specialise, align)."""
    return ([p.is_const for p in params], [not p.do_not_specialize for p in params],
            [not p.do_not_specialize_on_alignment for p in params])


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
        self.is_const, self.specialise, self.align = _flags([params[i] for i in runtime])


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
