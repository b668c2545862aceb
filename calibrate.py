"""Calibrate static KV-cache scales from sample K/V activations.

Samples: a ``.safetensors`` or ``.npz`` file with one K and one V array per layer, ``[tokens, kv_heads, head_size]``
(more leading dimensions, e.g. ``[batch, tokens, kv_heads, head_size]``, are flattened into tokens). Accepted names
(``N`` the layer; any prefix before ``layers.N`` is fine, and ``self_attn.`` may come after it, e.g.
``model.layers.N.self_attn.k``)::

    layers.N.k    layers.N.key    layers.N.keys    layers.N.k_proj    (keys)
    layers.N.v    layers.N.value  layers.N.values  layers.N.v_proj    (values)

A static scale maps the chosen range onto the element's largest code: ``scale = range / qmax`` (fp8_e4m3 448,
fp8_e5m2 57344, int8 127). Observers pick the range:

* ``absmax``:     max |x|;
* ``percentile``: the given percentile of |x| (clips the rare outliers);
* ``mse``:        a grid of candidate ranges from 0.3 x to 1.0 x absmax, keeping the one whose quantize-dequantize
  round trip through the NumPy reference (the format's own encode / decode) has the least mean squared error.

::

    scales = calibrate(load_samples("acts.npz"), kvgen.load("fp8_e4m3"), observer="mse")
    save_scales(scales, "kv_scales.safetensors")   # or .json (SGLang form)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from .codegen.errors import KvgenError
from .scales import LayerScales, save_json, save_safetensors

OBSERVERS = ("absmax", "percentile", "mse")
#: MSE search: candidate ranges as fractions of absmax
MSE_GRID = np.linspace(0.3, 1.0, 100)
#: MSE search: at most this many tokens per layer and side (evenly spaced) go through the round trip
MSE_MAX_TOKENS = 4096

_SAMPLE_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn\.)?(k|key|keys|k_proj|v|value|values|v_proj)$")


class CalibrationError(KvgenError, ValueError):
    """Samples or a format that calibration cannot use."""


# --- samples ----------------------------------------------------------------------------------------------------


def load_samples(path: Union[str, Path]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """``{layer: (k, v)}`` float32 ``[tokens, kv_heads, head_size]`` from a .safetensors or .npz file."""
    p = Path(path)
    if not p.is_file():
        raise CalibrationError(f"{p}: no such file")
    arrays: dict[str, Any] = {}
    suffix = p.suffix.lower()
    if suffix == ".npz":
        try:
            with np.load(p, allow_pickle=False) as z:
                names = list(z.files)
                for name in names:
                    if _SAMPLE_RE.search(name):
                        arrays[name] = z[name]
        except Exception as exc:
            raise CalibrationError(f"{p}: not a readable .npz file ({exc})") from None
    elif suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(p), framework="numpy") as h:
                names = list(h.keys())
                for name in names:
                    if _SAMPLE_RE.search(name):
                        try:
                            arrays[name] = h.get_tensor(name)
                        except Exception:  # bf16: through torch
                            with safe_open(str(p), framework="pt") as ht:
                                arrays[name] = ht.get_tensor(name).float().numpy()
        except CalibrationError:
            raise
        except Exception as exc:
            raise CalibrationError(f"{p}: not a readable safetensors file ({exc})") from None
    else:
        raise CalibrationError(f"{p}: samples must be .safetensors or .npz")
    if not arrays:
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise CalibrationError(f"{p}: no K/V samples found (expected names like layers.0.k / layers.0.v; the file has "
                               f"{shown or 'nothing'})")
    ks: dict[int, np.ndarray] = {}
    vs: dict[int, np.ndarray] = {}
    for name, a in arrays.items():
        m = _SAMPLE_RE.search(name)
        assert m is not None
        layer, side = int(m.group(1)), m.group(2)[0]
        a = np.asarray(a)
        if a.ndim < 3:
            raise CalibrationError(f"{p}: {name}: shape {a.shape}; expected [tokens, kv_heads, head_size]")
        if not np.issubdtype(a.dtype, np.floating):
            raise CalibrationError(f"{p}: {name}: dtype {a.dtype}; expected floating-point activations")
        a = a.astype(np.float32).reshape((-1,) + a.shape[-2:])
        if a.shape[0] == 0:
            raise CalibrationError(f"{p}: {name}: no tokens")
        if not np.isfinite(a).all():
            raise CalibrationError(f"{p}: {name}: has non-finite values")
        target = ks if side == "k" else vs
        if layer in target:
            raise CalibrationError(f"{p}: {name}: a second {side.upper()} array for layer {layer}")
        target[layer] = a
    only = sorted(set(ks) ^ set(vs))
    if only:
        layer = only[0]
        raise CalibrationError(f"{p}: layer {layer} has {'K' if layer in ks else 'V'} samples but no "
                               f"{'V' if layer in ks else 'K'} samples")
    return {i: (ks[i], vs[i]) for i in sorted(ks)}


# --- observers --------------------------------------------------------------------------------------------------


def _spec(fmt: Any):
    from .codegen.spec import FormatSpec

    if isinstance(fmt, FormatSpec):
        return fmt
    spec = getattr(fmt, "spec", None)
    if isinstance(spec, FormatSpec):
        return spec
    if isinstance(fmt, str):
        from .runtime.loader import load

        return load(fmt).spec
    raise TypeError(f"fmt: expected a kvgen Format, FormatSpec or format name, got {type(fmt).__name__}")


def resolve_per_head(spec, per_head: Optional[bool]) -> bool:
    """``per_head`` as given, or the format's own kind where None; per-head scales for a format of one scale per
    layer are a CalibrationError."""
    fmt_per_head = all(spec.side(s).scale is not None and spec.side(s).scale.granularity.value == "per_head"
                       for s in ("key", "value"))
    if per_head is None:
        return fmt_per_head
    if per_head and not fmt_per_head:
        raise CalibrationError(f"format {spec.name} takes one static scale per layer (per_tensor); per-head scales "
                               "need a per_head format such as fp8_e4m3_per_head")
    return per_head


def check_static_sides(spec) -> None:
    """Raise a CalibrationError unless both sides of the format take static scales."""
    for side_name in ("key", "value"):
        side = spec.side(side_name)
        if side.scale is None or not side.scale.granularity.is_static:
            what = "is stored unquantized" if side.scale is None else \
                f"computes its scales on write ({side.scale.granularity.value})"
            if side.scale is not None and side.scale.global_scale:
                raise CalibrationError(
                    f"format {spec.name}: the {side_name} side's k_scale / v_scale is a per-layer global scale over "
                    f"the block scales it computes on write ({side.scale.granularity.value}); calibrate does not fit "
                    "global scales (yet): take the checkpoint's (kvgen.scales.load_scales) or allocate's 1.0")
            raise CalibrationError(f"format {spec.name}: the {side_name} side {what}; calibration is for static "
                                   "scales (granularity per_tensor or per_head), e.g. fp8_e4m3")


def _ranges_absmax(xr: np.ndarray, per_head: bool) -> np.ndarray:
    a = np.abs(xr)
    return a.max(axis=(0, 2)) if per_head else np.asarray(a.max())


def _ranges_percentile(xr: np.ndarray, per_head: bool, q: float) -> np.ndarray:
    a = np.abs(xr)
    if per_head:
        return np.percentile(a.transpose(1, 0, 2).reshape(a.shape[1], -1), q, axis=1)
    return np.asarray(np.percentile(a, q))


def _to_scale(rng: np.ndarray, qmax: float) -> np.ndarray:
    rng = np.asarray(rng, dtype=np.float64)
    s = rng / qmax
    return np.where(rng > 0, s, 1.0)  # an all-zero layer: any scale works; 1.0 as engines default


def _mse_scales(side, x: np.ndarray, per_head: bool, qmax: float) -> np.ndarray:
    from .reference import decode_side, encode_side, rotate_side

    if x.shape[0] > MSE_MAX_TOKENS:
        x = x[np.linspace(0, x.shape[0] - 1, MSE_MAX_TOKENS).astype(np.int64)]
    h = x.shape[1]
    amax = _ranges_absmax(rotate_side(side, x), per_head)
    per_head_side = side.scale.granularity.value == "per_head"
    best_err = np.full(np.shape(amax), np.inf)
    best = np.asarray(amax, dtype=np.float64).copy()
    x64 = x.astype(np.float64)
    for frac in MSE_GRID:
        s = _to_scale(frac * np.asarray(amax), qmax)
        arg = np.broadcast_to(s, (h,)).astype(np.float32) if per_head_side else np.float32(s.max())
        enc = encode_side(side, x, arg)
        dec = decode_side(side, enc.data, static_scale=arg, head_size=x.shape[-1])
        sq = (dec - x64) ** 2
        err = sq.mean(axis=(0, 2)) if per_head else np.asarray(sq.mean())
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best = np.where(better, frac * np.asarray(amax), best)
    return _to_scale(best, qmax)


def calibrate(samples: dict[int, tuple[np.ndarray, np.ndarray]], fmt: Any, observer: str = "absmax",
              per_head: Optional[bool] = None, percentile: float = 99.99, *,
              progress: bool = False) -> LayerScales:
    """Static scales ``{layer: (k_scale, v_scale)}`` for a static-scale format from sample activations.

    ``samples``: ``{layer: (k, v)}``, each ``[tokens, kv_heads, head_size]``. ``fmt``: a Format (``kvgen.load``), a
    FormatSpec or a format name; both sides must have static scales. ``per_head``: one scale per KV head (1-D
    arrays) instead of one per layer; ``None`` follows the format (per head for ``per_head`` formats). A scale is
    ``range / qmax`` of the side's element; ``progress`` shows a rich progress bar over layers.
    """
    spec = _spec(fmt)
    check_static_sides(spec)
    if observer not in OBSERVERS:
        raise CalibrationError(f"observer {observer!r}: expected one of {', '.join(OBSERVERS)}")
    if not (0 < float(percentile) <= 100):
        raise CalibrationError(f"percentile {percentile}: expected a value in (0, 100]")
    per_head = resolve_per_head(spec, per_head)
    if not samples:
        raise CalibrationError("no samples")
    from .reference import rotate_side

    def one(side_name: str, x: np.ndarray):
        side = spec.side(side_name)
        qmax = float(side.info.qmax)
        if observer == "mse":
            s = _mse_scales(side, x, per_head, qmax)
        else:
            xr = rotate_side(side, x) if side.rotation is not None else x
            rng = _ranges_absmax(xr, per_head) if observer == "absmax" else _ranges_percentile(xr, per_head,
                                                                                                 percentile)
            s = _to_scale(rng, qmax)
        return s.astype(np.float32) if per_head else float(s)

    out: LayerScales = {}
    layers = sorted(samples)
    heads = None

    def run(advance=lambda: None):
        nonlocal heads
        for layer in layers:
            pair = samples[layer]
            k, v = (np.asarray(a, dtype=np.float32) for a in pair)
            for name, a in (("k", k), ("v", v)):
                if a.ndim != 3:
                    raise CalibrationError(f"layer {layer} {name}: shape {a.shape}; expected "
                                           "[tokens, kv_heads, head_size]")
            if heads is None:
                heads = k.shape[1]
            if k.shape[1] != heads or v.shape[1] != heads:
                raise CalibrationError(f"layer {layer}: {k.shape[1]} K / {v.shape[1]} V heads, expected {heads}")
            out[layer] = (one("key", k), one("value", v))
            advance()

    if progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("calibrating ({task.description})"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), transient=False) as bar:
            task = bar.add_task(observer, total=len(layers))
            run(lambda: bar.advance(task))
    else:
        run()
    return out


def save_scales(scales: LayerScales, path: Union[str, Path], *, dtype: str = "float8_e4m3fn",
                tp_size: int = 1) -> None:
    """Write scales as ``.safetensors`` (``model.layers.N.self_attn.k_scale`` / ``v_scale``, the checkpoint names) or
    as ``.json`` (the SGLang form: one value per layer for K and V, the larger of the two; per tensor only)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix == ".safetensors":
        save_safetensors(scales, p)
    elif suffix == ".json":
        save_json(scales, p, dtype=dtype, tp_size=tp_size)
    else:
        raise KvgenError(f"{p}: output must end in .safetensors or .json")
