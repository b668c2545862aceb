"""Static KV-cache scales: read them from checkpoints (safetensors, SGLang JSON), write them back, and turn a
compressed-tensors ``kv_cache_scheme`` into a kvgen spec.

Checkpoint names understood (``N`` the layer; any prefix before ``layers.N`` is accepted, e.g.
``model.language_model.layers.N``), in order of preference when a layer has more than one::

    model.layers.N.self_attn.k_scale / v_scale                      compressed-tensors, vLLM
    model.layers.N.self_attn.k_proj.k_scale / v_proj.v_scale        ModelOpt
    model.layers.N.self_attn.k_proj.output_scale / v_proj.output_scale   legacy
    model.layers.N.self_attn.kv_scale                               deprecated: one scale for K and V

A scale of shape ``()``, ``(1,)`` (any shape with one element) is per tensor and becomes a float; a scale of shape
``(num_kv_heads, 1, 1)`` (or ``(num_kv_heads,)``) is per attention head and becomes a 1-D float32 array.

SGLang / vLLM scale JSON (``--quantization-param-path``)::

    {"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"<tp_rank>": {"<layer>": <float>}}}}

one value per layer, used for K and V.

    scales = load_scales("ckpt/", num_layers=32)              # {layer: (k_scale, v_scale)}
    cache = fmt.allocate(..., **scales_for_layer(scales, 0))  # k_scale=..., v_scale=...
"""

from __future__ import annotations

import json
import operator
import re
import warnings
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import numpy as np

from .codegen.errors import KvgenError

Scale = Union[float, np.ndarray]
LayerScales = dict[int, tuple[Scale, Scale]]
PathLike = Union[str, Path]


class ScaleError(KvgenError, ValueError):
    """A scale file that cannot be used: names the file and, where there is one, the tensor or field."""


class MissingScalesWarning(UserWarning):
    """Some layers have no scale in the file: they use 1.0 (as vLLM and SGLang do)."""


# --- names ------------------------------------------------------------------------------------------------------

#: (regex suffix after ``layers.N.self_attn.``, which sides it gives, preference: lower wins)
_FORMS: tuple[tuple[str, str, int], ...] = (
    ("k_scale", "k", 0),
    ("v_scale", "v", 0),
    ("k_proj.k_scale", "k", 1),
    ("v_proj.v_scale", "v", 1),
    ("attn.k_scale", "k", 1),  # vLLM's own parameter names (its Attention module under self_attn)
    ("attn.v_scale", "v", 1),
    ("k_proj.output_scale", "k", 2),
    ("v_proj.output_scale", "v", 2),
    ("kv_scale", "kv", 3),
)
_NAME_RE = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\.(" + "|".join(re.escape(f) for f, _, _ in _FORMS) + r")$"
)
_FORM_INFO = {f: (sides, rank) for f, sides, rank in _FORMS}


def checkpoint_name(layer: int, side: str, prefix: str = "model") -> str:
    """The compressed-tensors / vLLM name of a layer's scale: ``model.layers.N.self_attn.k_scale`` (side "k" or "v")."""
    if side not in ("k", "v"):
        raise ValueError(f"side must be 'k' or 'v', got {side!r}")
    return f"{prefix + '.' if prefix else ''}layers.{int(layer)}.self_attn.{side}_scale"


def parse_scale_name(name: str) -> Optional[tuple[int, str, int]]:
    """``(layer, sides, preference)`` for a KV scale tensor name ("k", "v" or "kv"), or None for any other tensor."""
    m = _NAME_RE.search(name)
    if m is None:
        return None
    sides, rank = _FORM_INFO[m.group(2)]
    return int(m.group(1)), sides, rank


def format_layers(layers: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 7]`` -> ``"0-3, 7"``."""
    xs = sorted(set(int(x) for x in layers))
    parts: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(parts)


# --- values -----------------------------------------------------------------------------------------------------


def _as_scale(value: Any, where: str, num_kv_heads: Optional[int] = None) -> Scale:
    """A float (per tensor) or a 1-D float32 array (per head) from a checkpoint value; ScaleError when unusable."""
    if isinstance(value, bool) or getattr(np.asarray(value), "dtype", None) == np.bool_:
        raise ScaleError(f"{where}: a boolean, not a scale ({value!r})")
    try:
        a = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ScaleError(f"{where}: not a number ({value!r})") from None
    if a.size == 0:
        raise ScaleError(f"{where}: empty scale tensor, shape {tuple(a.shape)}")
    if a.size == 1:
        out: Scale = float(a.reshape(()))
    else:
        # per attention head: (H, 1, 1), (H, 1) or (H,)
        if a.ndim < 1 or any(d != 1 for d in a.shape[1:]):
            raise ScaleError(f"{where}: shape {tuple(a.shape)} is neither one value (per tensor: () or (1,)) nor one "
                             "per KV head ((num_kv_heads, 1, 1))")
        if num_kv_heads is not None and a.shape[0] != num_kv_heads:
            raise ScaleError(f"{where}: {a.shape[0]} per-head scales, but the model has {num_kv_heads} KV heads")
        out = a.reshape(-1).astype(np.float32)
    bad = ~np.isfinite(a)
    if bad.any():
        raise ScaleError(f"{where}: scale is not finite ({a.reshape(-1)[bad.reshape(-1)][0]!r}); a scale must be a "
                         "finite number > 0")
    if (a <= 0).any():
        raise ScaleError(f"{where}: scale must be > 0, got {a.reshape(-1)[(a <= 0).reshape(-1)][0]!r}")
    as_fp32 = np.asarray(out, dtype=np.float32)  # the cache keeps its scales in fp32
    if not np.isfinite(as_fp32).all():
        raise ScaleError(f"{where}: scale overflows float32 ({a.reshape(-1).max()!r})")
    if (as_fp32 == 0).any():
        raise ScaleError(f"{where}: scale rounds to 0 in float32 ({a.reshape(-1).min()!r})")
    return out


def _name_prefix(where: str) -> str:
    """The part of a "file: tensor" scale's tensor name before its ``layers.N``."""
    name = where.split(": ", 1)[-1]
    m = _NAME_RE.search(name)
    return name[:m.start()] if m else name


def _count(name: str, x: Any, least: int) -> int:
    """``x`` as an int of at least ``least`` (numpy's ints too, not bools), or a ValueError naming it."""
    try:
        v = operator.index(x) if not isinstance(x, bool) else None
    except TypeError:
        v = None
    if v is None or v < least:
        raise ValueError(f"{name}: expected an integer of at least {least}, got {x!r}")
    return v


def _rank_slice(scale: Scale, where: str, num_kv_heads: Optional[int], tp_rank: int,
                tp_size: Optional[int] = None) -> Scale:
    """A per-head scale checked against the rank's ``num_kv_heads``: all heads of a model of that many, or under
    tensor parallelism (a multiple of it in the checkpoint) rank ``tp_rank``'s consecutive slice. With ``tp_size``
    above the checkpoint's heads, each head is replicated on ``tp_size / heads`` consecutive ranks (vLLM's rule):
    rank r holds head ``r // (tp_size / heads)``."""
    if isinstance(scale, float) or num_kv_heads is None:
        return scale
    total = scale.shape[0]
    if tp_size is not None and tp_size > total:
        if tp_size % total:
            raise ScaleError(f"{where}: tp_size {tp_size} is not a multiple of the checkpoint's {total} KV heads "
                             "(each head is replicated on tp_size / heads ranks)")
        if num_kv_heads != 1:
            raise ScaleError(f"{where}: at tp_size {tp_size} over {total} KV heads a rank holds one (replicated) "
                             f"head, not num_kv_heads={num_kv_heads}")
        return scale[tp_rank // (tp_size // total)][None].copy()
    if scale.shape[0] == num_kv_heads and tp_size in (None, 1):
        return scale
    if total % num_kv_heads == 0 and 0 <= tp_rank < total // num_kv_heads and \
            tp_size in (None, total // num_kv_heads):
        return scale[tp_rank * num_kv_heads:(tp_rank + 1) * num_kv_heads].copy()
    if tp_size is not None and total % num_kv_heads == 0:
        raise ScaleError(f"{where}: {total} per-head scales give {total // num_kv_heads} ranks of {num_kv_heads} "
                         f"KV heads, not tp_size {tp_size}")
    raise ScaleError(f"{where}: {total} per-head scales, but the model has {num_kv_heads} KV heads"
                     + (f" (and tp_rank {tp_rank} is past its {total // num_kv_heads} ranks; with more ranks than "
                        "KV heads, pass tp_size= so that each rank gets the head it replicates)"
                        if total % num_kv_heads == 0 else ""))


def _safetensor_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ScaleError(f"{path}: no *.safetensors files in this directory")
        return files
    if not path.exists():
        raise ScaleError(f"{path}: no such file or directory")
    return [path]


def _read_tensor(handle: Any, fallback: Any, name: str) -> np.ndarray:
    try:
        return np.asarray(handle.get_tensor(name))
    except Exception:  # e.g. bf16, which NumPy cannot hold: read through torch and widen
        t = fallback().get_tensor(name)
        return t.float().numpy()


_ZERO_POINT_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:[kv]_proj\.)?[kv]_zero_point$")


def _read_safetensors(path: Path, prefix: Optional[str] = None
                      ) -> dict[tuple[int, str], list[tuple[int, str, Any, str]]]:
    """Every KV scale in the file(s): ``{(layer, side): [(preference, "file:tensor", value, sides), ...]}``; with
    ``prefix``, only tensors whose names start with it. An asymmetric scheme's zero points raise ScaleError: kvgen's
    static scales are symmetric, and such a checkpoint's scales were fitted to a range with an offset."""
    try:
        from safetensors import safe_open
    except ImportError:  # pragma: no cover
        raise KvgenError("reading safetensors needs the 'safetensors' package: pip install safetensors") from None
    found: dict[tuple[int, str], list] = {}
    for f in _safetensor_files(path):
        try:
            handle_cm = safe_open(str(f), framework="numpy")
        except Exception as exc:
            raise ScaleError(f"{f}: not a readable safetensors file ({exc})") from None
        with handle_cm as handle:
            pt: list = []

            def torch_handle(f=f, pt=pt):
                if not pt:
                    pt.append(safe_open(str(f), framework="pt"))
                return pt[0]

            for name in handle.keys():
                if prefix is not None and not name.startswith(prefix):
                    continue
                if _ZERO_POINT_RE.search(name) and np.any(np.asarray(_read_tensor(handle, torch_handle, name),
                                                                        dtype=np.float64) != 0):
                    raise ScaleError(f"{f}: {name}: a zero point: the checkpoint's KV scheme is asymmetric, and "
                                     "kvgen's static scales are symmetric (its scales were fitted with an offset); "
                                     "calibrate symmetric scales instead (kvgen calibrate)")
                parsed = parse_scale_name(name)
                if parsed is None:
                    continue
                layer, sides, rank = parsed
                where = f"{f}: {name}"
                value = _read_tensor(handle, torch_handle, name)
                for s in ("k", "v") if sides == "kv" else (sides,):
                    found.setdefault((layer, s), []).append((rank, where, value, sides))
    return found


def _read_json(path: Path, tp_rank: int) -> dict[int, tuple[Any, str]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ScaleError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ScaleError(f"{path}: not a JSON scale file ({exc})") from None
    kv = data.get("kv_cache") if isinstance(data, dict) else None
    if not isinstance(kv, dict):
        raise ScaleError(f"{path}: kv_cache: missing; expected {{\"kv_cache\": {{\"dtype\": ..., \"scaling_factor\": "
                         "{\"<tp_rank>\": {\"<layer>\": <float>}}}}}")
    sf = kv.get("scaling_factor")
    if not isinstance(sf, dict):
        raise ScaleError(f"{path}: kv_cache.scaling_factor: missing or not a mapping of tp rank -> layer -> scale")
    rank = sf.get(str(tp_rank))
    if rank is None:
        raise ScaleError(f"{path}: kv_cache.scaling_factor: no entry for tp rank {tp_rank} (has "
                         f"{', '.join(map(str, sf)) or 'none'})")
    if not isinstance(rank, dict):
        raise ScaleError(f"{path}: kv_cache.scaling_factor.{tp_rank}: not a mapping of layer -> scale")
    out: dict[int, tuple[Any, str]] = {}
    for key, value in rank.items():
        where = f"{path}: kv_cache.scaling_factor.{tp_rank}.{key}"
        try:
            layer = int(key)
        except (TypeError, ValueError):
            raise ScaleError(f"{where}: layer {key!r} is not an integer") from None
        if layer < 0:
            raise ScaleError(f"{where}: negative layer index")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ScaleError(f"{where}: not a number ({value!r})")
        out[layer] = (value, where)
    return out


def load_scales(path: PathLike, num_layers: int, tp_rank: int = 0, *,
                num_kv_heads: Optional[int] = None, prefix: Optional[str] = None,
                skip_layers: Iterable[int] = (), tp_size: Optional[int] = None) -> LayerScales:
    """Static K and V scales of every layer ``0 .. num_layers - 1``: ``{layer: (k_scale, v_scale)}``.

    ``path``: a ``.safetensors`` file, a directory of ``*.safetensors`` shards, or an SGLang-style ``.json`` (for
    which ``tp_rank`` picks the rank's entry). A scale is a float (per tensor) or a 1-D float32 array (per KV head;
    checked against ``num_kv_heads`` when given: the rank's KV heads under tensor parallelism, so a checkpoint's
    ``tp * num_kv_heads`` per-head scales give rank ``tp_rank`` its slice; with more ranks than the checkpoint's KV
    heads, pass ``tp_size``: each rank gets the head it replicates, vLLM's rule). Layers without a scale get 1.0, with one
    :class:`MissingScalesWarning` naming them (but ``skip_layers``, which a model cache keeps in the model dtype); a
    file with no KV scale at all is a :class:`ScaleError` (a wrong file, or names kvgen does not read);
    scales of layers ``>= num_layers`` (e.g. MTP layers) are ignored. ``prefix`` keeps only tensors whose names start with it (``"model.language_model."``): a checkpoint of several
    sub-models, each with its ``layers.N``, is refused without it rather than mixed. Bad shapes, non-finite or
    non-positive values and an asymmetric scheme's zero points raise :class:`ScaleError` naming the file and tensor.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers: expected a positive integer, got {num_layers!r}")
    tp_rank = _count("tp_rank", tp_rank, 0)
    num_kv_heads = None if num_kv_heads is None else _count("num_kv_heads", num_kv_heads, 1)
    tp_size = None if tp_size is None else _count("tp_size", tp_size, 1)
    if tp_size is not None and num_kv_heads is None:
        raise ValueError("tp_size: slices per-head scales by the rank's KV heads: pass num_kv_heads= too")
    if tp_size is not None and tp_rank >= tp_size:
        raise ValueError(f"tp_rank: {tp_rank} is not a rank of tp_size {tp_size}")
    p = Path(path)
    k: dict[int, Scale] = {}
    v: dict[int, Scale] = {}
    if p.suffix.lower() == ".json" and not p.is_dir():
        for layer, (value, where) in _read_json(p, tp_rank).items():
            if layer < num_layers:
                k[layer] = v[layer] = _as_scale(value, where, num_kv_heads)
    else:
        for (layer, side), entries in _read_safetensors(p, prefix).items():
            if layer >= num_layers:
                continue
            rank, where, value, _ = min(entries, key=lambda e: e[0])
            tensor = where.split(": ", 1)[-1]
            clash = [e for e in entries if e[1] != where and e[1].split(": ", 1)[-1] == tensor
                     and not np.array_equal(np.asarray(e[2], dtype=np.float64), np.asarray(value, dtype=np.float64))]
            if clash:  # one tensor in two shards, with two values: no way to tell which is the model's
                raise ScaleError(f"layer {layer}'s {side} scale {tensor} is in two files with different values: "
                                 f"{where.split(': ', 1)[0]} and {clash[0][1].split(': ', 1)[0]}")
            # each sub-model's preferred name form (its prefix: the name before "layers.N"); two sub-models giving
            # different scales for one layer index are refused, whatever name forms they use
            best: dict[str, tuple] = {}
            for e in sorted(entries, key=lambda e: e[0]):
                best.setdefault(_name_prefix(e[1]), e)
            rivals = [e for e in best.values() if e[1] != where
                      and not np.array_equal(np.asarray(e[2], dtype=np.float64), np.asarray(value, dtype=np.float64))]
            if rivals:
                raise ScaleError(f"layer {layer}'s {side} scale is given twice, differently: {where} and {rivals[0][1]} "
                                 "(sub-models with layers of their own?); pass prefix= to pick one, e.g. "
                                 "prefix=\"model.language_model.\"")
            (k if side == "k" else v)[layer] = _rank_slice(_as_scale(value, where, None), where, num_kv_heads,
                                                            tp_rank, tp_size)
    skip = set(skip_layers)
    if not k and not v and any(i not in skip for i in range(num_layers)):
        if p.suffix.lower() == ".json" and not p.is_dir():
            where = f"for layers 0..{num_layers - 1} in tp rank {tp_rank}'s entry"
        else:
            forms = ", ".join(f"layers.N.self_attn.{f}" for f, _, _ in _FORMS)
            where = (f"under prefix {prefix!r} " if prefix else "") + f"(kvgen reads {forms})"
        raise ScaleError(f"{p}: no KV-cache scale found {where}: not a checkpoint with static KV scales? (a format "
                         "that needs them and has none takes 1.0 without this file)")
    miss_k = [i for i in range(num_layers) if i not in k and i not in skip]
    miss_v = [i for i in range(num_layers) if i not in v and i not in skip]
    if miss_k or miss_v:
        def layers(xs):
            return f"layer{'s' if len(xs) > 1 else ''} {format_layers(xs)}"

        if miss_k == miss_v:
            what = f"no KV-cache scales for {layers(miss_k)}"
        else:
            parts = []
            if miss_k:
                parts.append(f"no k_scale for {layers(miss_k)}")
            if miss_v:
                parts.append(f"no v_scale for {layers(miss_v)}")
            what = "; ".join(parts)
        warnings.warn(f"{p}: {what} (of {num_layers}); using 1.0 there", MissingScalesWarning, stacklevel=2)
    return {i: (k.get(i, 1.0), v.get(i, 1.0)) for i in range(num_layers)}


def scales_for_layer(scales: LayerScales, layer: int) -> dict[str, Scale]:
    """``{"k_scale": ..., "v_scale": ...}`` of one layer, to pass to ``fmt.allocate(..., **that)``."""
    try:
        ks, vs = scales[layer]
    except KeyError:
        raise KvgenError(f"no scales for layer {layer} (have layers {format_layers(scales)})") from None
    return {"k_scale": ks, "v_scale": vs}


# --- writing ----------------------------------------------------------------------------------------------------


def _check_scales(scales: LayerScales) -> None:
    if not scales:
        raise KvgenError("no scales to write")
    for layer, pair in scales.items():
        for side, s in zip("kv", pair):
            _as_scale(s, f"layer {layer} {side}_scale")


def save_safetensors(scales: LayerScales, path: PathLike, prefix: str = "model") -> None:
    """Write ``model.layers.N.self_attn.k_scale`` / ``v_scale`` float32 tensors: shape ``(1,)`` per tensor,
    ``(num_kv_heads, 1, 1)`` per head (the compressed-tensors shapes)."""
    from safetensors.numpy import save_file

    _check_scales(scales)
    tensors = {}
    for layer in sorted(scales):
        for side, s in zip("kv", scales[layer]):
            a = np.asarray(s, dtype=np.float32)
            a = a.reshape(1) if a.size == 1 and a.ndim <= 1 else a.reshape(-1, 1, 1)
            tensors[checkpoint_name(layer, side, prefix)] = np.ascontiguousarray(a)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "pt", "producer": "kvgen"})


#: kvgen element -> the dtype string of the scale JSON
JSON_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "fp8_e4m3fnuz": "float8_e4m3fnuz",
               "int8": "int8"}


def save_json(scales: LayerScales, path: PathLike, dtype: str = "float8_e4m3fn", tp_size: int = 1) -> None:
    """Write the SGLang / vLLM scale JSON: one value per layer for K and V (the larger of the two, so that
    neither side clips more than its own scale would), the same for every tp rank ``0 .. tp_size - 1``."""
    _check_scales(scales)
    per_layer = {}
    for layer in sorted(scales):
        ks, vs = scales[layer]
        if np.asarray(ks).size != 1 or np.asarray(vs).size != 1:
            raise KvgenError(f"layer {layer}: per-head scales do not fit the scale JSON (one value per layer); "
                             "write .safetensors instead")
        per_layer[str(layer)] = max(float(np.asarray(ks).reshape(())), float(np.asarray(vs).reshape(())))
    data = {"kv_cache": {"dtype": dtype, "scaling_factor": {str(r): dict(per_layer) for r in range(tp_size)}}}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


# --- compressed-tensors kv_cache_scheme -> spec ------------------------------------------------------------------

_SCALE_DTYPES = {
    "float32": "fp32", "fp32": "fp32", "torch.float32": "fp32",
    "float16": "fp16", "fp16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "bfloat16": "bf16", "bf16": "bf16", "torch.bfloat16": "bf16",
    "float8_e4m3fn": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "torch.float8_e4m3fn": "fp8_e4m3",
}
_KNOWN_FIELDS = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
                 "actorder", "scale_dtype", "zp_dtype", "observer", "observer_kwargs"}


class SchemeError(KvgenError, ValueError):
    """A kv_cache_scheme kvgen cannot express: names the config file and the field."""


def find_kv_cache_scheme(config: Any, path: str = "<config>") -> dict:
    """The ``kv_cache_scheme`` of a HF config.json (``quantization_config`` or the older ``compression_config``),
    of a bare quantization_config, or a bare scheme."""
    if not isinstance(config, dict):
        raise SchemeError(f"{path}: expected a JSON object (a HF config.json)")
    if "num_bits" in config:
        return config
    for key in ("quantization_config", "compression_config"):
        qc = config.get(key)
        if isinstance(qc, dict) and "kv_cache_scheme" in qc:
            scheme = qc["kv_cache_scheme"]
            if scheme is None:
                raise SchemeError(f"{path}: {key}.kv_cache_scheme is null: the KV cache is not quantized")
            if not isinstance(scheme, dict):
                raise SchemeError(f"{path}: {key}.kv_cache_scheme: expected an object, got {type(scheme).__name__}")
            return scheme
    if "kv_cache_scheme" in config:
        return find_kv_cache_scheme({"quantization_config": config}, path)
    raise SchemeError(f"{path}: no quantization_config.kv_cache_scheme (the checkpoint does not quantize its KV "
                      "cache with compressed-tensors)")


def _suggest_name(element: str, granularity: str, block: Optional[int]) -> str:
    return f"ct_{element}_{granularity}" + (str(block) if block else "")


def scheme_to_spec(scheme: dict, *, name: Optional[str] = None, path: str = "<config>",
                   field_prefix: str = "kv_cache_scheme") -> tuple[dict, list[str]]:
    """A kvgen spec (as a dict) for a compressed-tensors kv_cache_scheme, and notes for the file header.

    Raises :class:`SchemeError` naming the field for what kvgen cannot express.
    """
    notes: list[str] = []

    def err(field: str, msg: str) -> SchemeError:
        return SchemeError(f"{path}: {field_prefix}.{field}: {msg}")

    unknown = sorted(set(scheme) - _KNOWN_FIELDS)
    if unknown:
        notes.append(f"ignored unknown field(s): {', '.join(unknown)}")
    bits = scheme.get("num_bits", 8)
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise err("num_bits", f"expected an integer, got {bits!r}")
    qtype = scheme.get("type", "int")
    if qtype not in ("int", "float"):
        raise err("type", f"{qtype!r} is not supported (int or float)")
    symmetric = scheme.get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise err("symmetric", f"expected true or false, got {symmetric!r}")
    dynamic = scheme.get("dynamic", False)
    if dynamic not in (True, False, "local"):
        raise err("dynamic", f"{dynamic!r} is not supported (true, false or \"local\")")
    group_size = scheme.get("group_size")
    strategy = scheme.get("strategy")
    if strategy is None:
        strategy = "group" if group_size is not None else "tensor"
    for field in ("actorder", "block_structure"):
        if scheme.get(field) is not None:
            raise err(field, f"{scheme[field]!r} does not apply to a KV cache (kvgen supports null only)")

    # element
    if qtype == "float":
        element = {8: "fp8_e4m3", 4: "fp4_e2m1"}.get(bits)
        if element is None:
            raise err("num_bits", f"{bits}-bit float is not supported (8: fp8_e4m3, 4: fp4_e2m1)")
        if not symmetric:
            raise err("symmetric", "an asymmetric float scheme is not supported (floats are symmetric)")
    else:
        if bits not in (8, 4):
            raise err("num_bits", f"{bits}-bit int is not supported (8 or 4)")
        element = f"{'' if symmetric else 'u'}int{bits}"

    # granularity
    scale: dict[str, Any] = {}
    block = None
    if strategy in ("tensor", "attn_head"):
        if dynamic:
            raise err("dynamic", f"a dynamic scale with strategy {strategy!r} is not supported (static per-tensor / "
                      "per-head scales come from the checkpoint; use strategy token for dynamic scales)")
        if not symmetric:
            raise err("symmetric", f"false with static strategy {strategy!r}: kvgen's zero points are computed on "
                      "write (dynamic token or group strategies only)")
        scale["granularity"] = "per_tensor" if strategy == "tensor" else "per_head"
        sd = scheme.get("scale_dtype")
        if sd is not None and _SCALE_DTYPES.get(str(sd)) != "fp32":
            notes.append(f"scale_dtype {sd}: static scales are read as fp32")
    elif strategy in ("token", "group", "tensor_group"):
        if dynamic is False:
            raise err("dynamic", f"false with strategy {strategy!r}: static per-token or per-group KV scales cannot "
                      "exist (the cache is written at run time); kvgen needs dynamic: true")
        if strategy == "token":
            if group_size is not None:
                raise err("group_size", "does not apply to strategy 'token'")
            scale["granularity"] = "per_token_head"
        else:
            if group_size is None:
                raise err("group_size", f"strategy {strategy!r} needs group_size")
            if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2 or \
                    group_size & (group_size - 1):
                raise err("group_size", f"{group_size!r}: kvgen's blocks are powers of two >= 2 along the head "
                          "dimension")
            block = group_size
            scale["granularity"] = "per_block"
            scale["block"] = group_size
        sd = scheme.get("scale_dtype")
        if strategy == "tensor_group":
            if element != "fp4_e2m1":
                raise err("strategy", "'tensor_group' (a global scale above block scales) is supported for 4-bit "
                          "float (NVFP4) only")
            dtype = "fp8_e4m3" if sd is None else _SCALE_DTYPES.get(str(sd))
            if dtype != "fp8_e4m3":
                raise err("scale_dtype", f"{sd!r}: NVFP4 block scales are float8_e4m3fn")
        else:
            if element == "fp4_e2m1":
                raise err("strategy", f"{strategy!r} with 4-bit float is not supported (NVFP4 is tensor_group, "
                          "group_size 16)")
            dtype = "fp32" if sd is None else _SCALE_DTYPES.get(str(sd))
            if dtype is None:
                raise err("scale_dtype", f"{sd!r} is not supported (float32, float16, bfloat16, float8_e4m3fn)")
        scale["dtype"] = dtype
        scale["placement"] = "inline" if strategy != "tensor_group" else "page_end"
        if dtype == "fp32" and strategy == "token":
            scale["align"] = 4
        if strategy == "tensor_group":
            scale["global_scale"] = True
    else:
        raise err("strategy", f"{strategy!r} is not supported for a KV cache (tensor, attn_head, token, group, "
                  "tensor_group)")
    scale["apply"] = "divide"  # compressed-tensors quantizes x / scale

    side: dict[str, Any] = {"element": element}
    if qtype == "int":
        side["rounding"] = "half_even"  # torch.round
    if not symmetric:
        zd = scheme.get("zp_dtype")
        if zd is not None and str(zd).replace("torch.", "") not in ("int8", "uint8"):
            raise err("zp_dtype", f"{zd!r} is not supported (an integer zero point, stored as uint8)")
        side["zero_point"] = {"storage": "beside_scale", "dtype": "uint8"}
    side["scale"] = scale
    if scheme.get("observer") is not None:
        notes.append(f"observer {scheme['observer']} (calibration only; `kvgen calibrate` has absmax, percentile, "
                     "mse)")
    spec_name = name or _suggest_name(element, scale["granularity"], block)
    description = (f"Imported from a compressed-tensors kv_cache_scheme: {bits}-bit {qtype}, strategy {strategy}, "
                   f"{'symmetric' if symmetric else 'asymmetric'}, {'dynamic' if dynamic else 'static'}"
                   + (f", group_size {group_size}" if group_size is not None else "") + ".")
    spec = {
        "kvgen_spec": 1,
        "name": spec_name,
        "description": description,
        "origin": f"compressed-tensors kv_cache_scheme in {Path(path).name}",
        "cache": {"layout": "interleaved"},
        "key": side,
        "value": json.loads(json.dumps(side)),  # a copy: no YAML anchors
    }
    return spec, notes


def import_scheme(config_path: PathLike, name: Optional[str] = None) -> str:
    """Spec YAML text (validated) for the kv_cache_scheme of a HF ``config.json``, with a comment header."""
    import yaml

    from .codegen.errors import SpecError
    from .codegen.loader import load_spec_text

    p = Path(config_path)
    try:
        config = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SchemeError(f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SchemeError(f"{p}: not a JSON config ({exc})") from None
    scheme = find_kv_cache_scheme(config, str(p))
    prefix = "kv_cache_scheme"
    if isinstance(config, dict):
        for key in ("quantization_config", "compression_config"):
            if isinstance(config.get(key), dict) and config[key].get("kv_cache_scheme") is scheme:
                prefix = f"{key}.kv_cache_scheme"
    spec, notes = scheme_to_spec(scheme, name=name, path=str(p), field_prefix=prefix)
    header = [f"# Imported by `kvgen import-scheme` from {p} ({prefix}):",
              f"#   {json.dumps(scheme, sort_keys=True)}"]
    header += [f"# Note: {n}" for n in notes]
    text = "\n".join(header) + "\n" + yaml.safe_dump(spec, sort_keys=False, width=120)
    try:
        load_spec_text(text, f"<spec imported from {p}>")
    except SpecError as exc:
        raise SchemeError(f"{p}: {prefix}: the imported spec is not buildable: {exc}") from None
    return text

