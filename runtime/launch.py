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

Triton's path is kept for the interpreter, while a launch hook is installed (profilers such as proton) and when
``KVGEN_FAST_LAUNCH=0`` is set (read once, at import).
"""

from __future__ import annotations

import os

FAST_LAUNCH = os.environ.get("KVGEN_FAST_LAUNCH", "1") not in ("0", "")


class FastLaunch:
    """``FastLaunch(jit_fn)(grid, *args, **kwargs)`` launches like ``jit_fn[grid](*args, **kwargs)``."""

    def __init__(self, fn):
        from triton.runtime.jit import JITFunction

        self.fn = fn
        self.compiled_kernel = isinstance(fn, JITFunction)  # not under the interpreter
        self.binaries: dict = {}  # specialisation key -> compiled kernel
        self._params = None

    def _signature(self):
        """Names, defaults and specialisation flags of the kernel's parameters, read once."""
        if self._params is None:
            params = self.fn.params
            names = [p.name for p in params]
            missing = object()
            defaults = [p.default if p.has_default else missing for p in params]
            runtime = [(i, p.is_const, not p.do_not_specialize, not p.do_not_specialize_on_alignment)
                       for i, p in enumerate(params) if not p.is_constexpr]
            constexprs = [i for i, p in enumerate(params) if p.is_constexpr]
            self._params = (names, defaults, missing, runtime, constexprs)
        return self._params

    def __call__(self, grid, *args, **kwargs):
        if not (FAST_LAUNCH and self.compiled_kernel) or self.fn.pre_run_hooks or _hooks_installed():
            return self.fn[grid](*args, **kwargs)  # the interpreter, switched off, or hooks to call
        names, defaults, missing, runtime, constexprs = self._signature()
        values = list(args)
        options = dict(kwargs)
        for i in range(len(args), len(names)):
            v = options.pop(names[i], missing)
            if v is missing:
                v = defaults[i]
                if v is missing:  # let Triton report the missing argument
                    return self.fn[grid](*args, **kwargs)
            values.append(v)
        device = _current_device()
        backend = self.fn.device_caches[device][3]
        try:
            key = (device, tuple(sorted(options.items())), tuple(values[i] for i in constexprs),
                   tuple(_specialize(backend, values[i], c, s, a) for i, c, s, a in runtime))
            binary = self.binaries.get(key)
        except TypeError:  # an unhashable constexpr or option: no cache for it
            return self.fn[grid](*args, **kwargs)
        if binary is None:
            binary = self.fn[grid](*args, **kwargs)  # compiles, or finds Triton's cached binary
            self.binaries[key] = binary
            return binary
        g0 = grid[0]
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        binary.run(g0, g1, g2, _current_stream(device), binary.function, binary.packed_metadata, None, None, None,
                   *values)
        return binary


_DRIVER: list = []


def _driver():
    if not _DRIVER:
        from triton.runtime.driver import driver
        from triton import knobs
        from triton._C.libtriton import native_specialize_impl

        active = driver.active
        _DRIVER.extend([active.get_current_device, active.get_current_stream, knobs.runtime, native_specialize_impl])
    return _DRIVER


def _current_device() -> int:
    return _driver()[0]()


def _current_stream(device: int):
    return _driver()[1](device)


def _hooks_installed() -> bool:
    """Whether launch hooks are set (Triton 3.6 keeps empty hook chains; older versions None; a bare function is
    also possible): Triton's path calls them with each launch's metadata."""
    runtime = _driver()[2]
    return any(h is not None and getattr(h, "calls", True) for h in (runtime.launch_enter_hook,
                                                                     runtime.launch_exit_hook))


def _specialize(backend, value, is_const, specialize, align):
    return _driver()[3](backend, value, is_const, specialize, align)
