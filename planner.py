"""KV-cache capacity planning: how many tokens and sequences fit on a GPU in a given format (`kvgen plan`).

The model (every figure comes from these rules, so they can be checked by hand):

Config (a Hugging Face ``config.json``; a nested ``text_config``, as multimodal configs have, is used when present):
  * ``num_hidden_layers`` and ``num_attention_heads`` are required.
  * ``num_key_value_heads``: absent means multi-head attention (= ``num_attention_heads``); 1 is MQA; else GQA.
  * ``head_dim``: absent means ``hidden_size // num_attention_heads``. Gemma-3 configs (``model_type`` gemma3 /
    gemma3_text) leave ``head_dim`` and ``layer_types`` out on the Hub (gemma-3-4b its head counts too) and rely on
    transformers' defaults: head_dim 256, 8 attention and 4 KV heads, and every 6th layer
    (``sliding_window_pattern``) full attention; those defaults are applied here too.
  * Sliding-window layers: from ``layer_types`` (``"sliding_attention"`` / ``"full_attention"``); else, when
    ``use_sliding_window`` is false (Qwen2-style), none; when it is true, the layers from ``max_window_layers`` on;
    else, when ``sliding_window`` is set (Mistral-style), every layer.
  * ``torch_dtype`` (or ``dtype``) is the model dtype: bfloat16 (the default) or float16; skipped layers stay in it
    (format ``bf16`` or ``fp16``).
  A missing required field is a KvgenError naming it.

Tensor parallel (vLLM's rule): with ``tp >= num_kv_heads`` every rank holds 1 KV head (replicated; tp must be a
multiple of num_kv_heads); else each rank holds ``num_kv_heads / tp`` (tp must divide it). As in vLLM,
``num_attention_heads`` must also be divisible by tp. The memory budget is per rank (per GPU): it is what the KV
cache may use on one GPU, after weights and activations, not the card's size.

Pages: a layer's page is ``fmt.page_bytes(block_size, heads_per_rank, head_size)``; layers kept in the model dtype
(``skip``) have the bf16/fp16 page. Mixed layer kinds are padded to the largest page (vLLM pads so that blocks are
interchangeable across layers): ``padded_page = max(pages)``; ``bytes_per_block = num_layers * padded_page``; the
padding waste is ``sum(padded_page - page)`` over the layers.

Capacity: ``num_blocks = budget // bytes_per_block``; ``max_tokens = num_blocks * block_size``;
``bytes_per_token = bytes_per_block / block_size``. Concurrent sequences at context C need ``ceil(C / block_size)``
blocks each: ``max_seqs = num_blocks // ceil(C / block_size)``. KIVI formats also keep a full-precision residual
window per sequence and quantized layer (``fmt.residual_bytes(heads_per_rank, head_size)``), so
``max_seqs = budget // (ceil(C / block_size) * bytes_per_block + residual_per_seq)``, and the blocks are what the
budget holds beside those max_seqs windows: ``num_blocks = (budget - max_seqs * residual_per_seq) //
bytes_per_block`` (an engine allocates exactly ``num_blocks`` pages and ``max_seqs`` residual rows).
Every layer holds the whole context: sliding-window layers are not trimmed to their window (vLLM's hybrid
allocator can do that; this plan is the conservative, uniform-allocator figure).

Gain over bf16 = ``max_tokens / max_tokens(bf16 on every layer, same block size and tp)``.
"""

from __future__ import annotations

import json
import math
import numbers
import operator
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

from .codegen.errors import KvgenError, OptionError, SpecError

__all__ = [
    "ModelShape", "Plan", "PlanError", "capacity_curve", "draw_capacity_png", "kv_heads_per_rank", "make_plan",
    "parse_size", "read_config", "resolve_skip_layers",
]


class PlanError(KvgenError):
    """A plan that cannot be made: a bad config, size, tensor-parallel degree, block size or layer list."""


class PlanOptionError(PlanError, OptionError):
    """A plan option's value that cannot be taken (the command line exits with 2)."""


# ---------------------------------------------------------------------------------------------------- sizes

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: Union[str, int, float], option: str = "--gpu-memory") -> int:
    """Bytes in "80GiB", "80GB", "141GB", "8e10", "512MiB", "1.5 TiB" (decimal kB/MB/GB/TB, binary KiB/MiB/GiB/TiB;
    a bare number is bytes). Anything else is a PlanError naming ``option``."""
    if isinstance(text, numbers.Real) and not isinstance(text, bool):
        value, unit = float(text), ""
        if not math.isfinite(value):
            raise PlanOptionError(f"{option}: {text!r} is not a positive size")
    else:
        m = _SIZE_RE.match(str(text))
        if not m:
            raise PlanOptionError(f"{option}: {text!r} is not a size (examples: 80GiB, 141GB, 512MiB, 8e10)")
        value, unit = float(m.group(1)), m.group(2).lower()
        if unit not in _UNITS:
            raise PlanOptionError(f"{option}: unknown unit {m.group(2)!r} in {text!r} (use B, kB, MB, GB, TB, KiB, "
                                  f"MiB, GiB or TiB)")
    if not math.isfinite(value * _UNITS[unit]):
        raise PlanOptionError(f"{option}: {text!r} is not a positive size")
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise PlanOptionError(f"{option}: {text!r} is not a positive size")
    return size


def _as_int(x) -> Optional[int]:
    """``x`` as an int where it is an integer (numpy's too), not a bool; else None."""
    if isinstance(x, bool):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


# ---------------------------------------------------------------------------------------------------- config

@dataclass(frozen=True)
class ModelShape:
    """What the KV cache needs to know about a model."""

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_size: int
    sliding_layers: tuple = ()
    sliding_window: Optional[int] = None
    dtype: str = "bf16"  # the kvgen format of the model dtype: bf16 or fp16 (None-like "fp32" when float32)

    @property
    def attention(self) -> str:
        if self.num_kv_heads == 1:
            return "MQA"
        return "MHA" if self.num_kv_heads == self.num_attention_heads else "GQA"


_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
           "float32": "fp32", "float": "fp32", "fp32": "fp32"}
_GEMMA3 = ("gemma3", "gemma3_text")


def _int_field(cfg: dict, key: str, where: str) -> int:
    if key not in cfg or cfg[key] is None:
        raise PlanError(f"{where}: missing field {key!r}")
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise PlanError(f"{where}: field {key!r} must be a positive integer, not {v!r}")
    return v


def read_config(config: Union[str, Path, dict], name: Optional[str] = None) -> ModelShape:
    """A ModelShape from a Hugging Face config.json (path) or its parsed dict; see the module docstring."""
    if isinstance(config, dict):
        top, where = config, name or "config"
    else:
        path = Path(config)
        where = str(path)
        try:
            top = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise PlanOptionError(f"--config: {where}: no such file") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PlanOptionError(f"--config: {where}: not a JSON config ({exc})") from None
        if not isinstance(top, dict):
            raise PlanOptionError(f"--config: {where}: not a JSON object")
    cfg = top.get("text_config") if isinstance(top.get("text_config"), dict) else top
    if cfg is not top:
        where += ": text_config"
    model_type = cfg.get("model_type") or top.get("model_type") or ""
    gemma3 = model_type in _GEMMA3

    num_layers = _int_field(cfg, "num_hidden_layers", where)
    if gemma3:  # transformers' Gemma3TextConfig defaults, which the Hub's gemma-3-4b config leaves out
        cfg = {"num_attention_heads": 8, "num_key_value_heads": 4, **{k: v for k, v in cfg.items() if v is not None}}
    num_heads = _int_field(cfg, "num_attention_heads", where)
    kv_heads = _int_field(cfg, "num_key_value_heads", where) if cfg.get("num_key_value_heads") is not None else num_heads
    if num_heads % kv_heads:
        raise PlanError(f"{where}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {kv_heads}")
    if cfg.get("head_dim") is not None:
        head_size = _int_field(cfg, "head_dim", where)
    elif gemma3:
        head_size = 256  # transformers' Gemma3TextConfig default; the Hub configs leave it out
    else:
        if cfg.get("hidden_size") is None:
            raise PlanError(f"{where}: missing field 'head_dim' (or 'hidden_size' to derive it from)")
        head_size = _int_field(cfg, "hidden_size", where) // num_heads

    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise PlanError(f"{where}: field 'layer_types' must list {num_layers} entries (num_hidden_layers)")
        sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    elif gemma3:
        key = "sliding_window_pattern" if cfg.get("sliding_window_pattern") is not None else "_sliding_window_pattern"
        pattern = _int_field(cfg, key, where) if cfg.get(key) is not None else 6
        sliding = tuple(i for i in range(num_layers) if (i + 1) % pattern)
    elif cfg.get("use_sliding_window") is False:
        sliding = ()
    elif cfg.get("use_sliding_window") is True and window:
        start = cfg.get("max_window_layers") or 0
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise PlanError(f"{where}: field 'max_window_layers' must be a layer count (0 or more), not {start!r}")
        sliding = tuple(range(start, num_layers))
    elif window:
        sliding = tuple(range(num_layers))
    else:
        sliding = ()

    raw_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or top.get("torch_dtype") or top.get("dtype") or "bfloat16"
    dtype = _DTYPES.get(str(raw_dtype).replace("torch.", "").lower())
    if dtype is None:
        raise PlanError(f"{where}: field 'torch_dtype' {raw_dtype!r} is not bfloat16, float16 or float32")
    label = name or top.get("_name_or_path")
    if not label and not isinstance(config, dict):
        path = Path(config)
        label = path.parent.resolve().name if path.name == "config.json" else path.stem
    label = label or model_type or "model"
    return ModelShape(name=str(label), num_layers=num_layers, num_attention_heads=num_heads, num_kv_heads=kv_heads,
                      head_size=head_size, sliding_layers=sliding,
                      sliding_window=window if sliding else None, dtype=dtype)


def kv_heads_per_rank(shape: ModelShape, tp: int) -> int:
    """KV heads one tensor-parallel rank holds (vLLM's rule; see the module docstring)."""
    if tp < 1:
        raise PlanOptionError(f"--tp: {tp} must be at least 1")
    if shape.num_attention_heads % tp:
        raise PlanOptionError(f"--tp: {shape.num_attention_heads} attention heads do not split over {tp} ranks "
                              f"(vLLM needs num_attention_heads divisible by tp)")
    if tp >= shape.num_kv_heads:
        if tp % shape.num_kv_heads:
            raise PlanOptionError(f"--tp: {tp} is not a multiple of the {shape.num_kv_heads} KV heads "
                                  f"(each head must be replicated on the same number of ranks)")
        return 1
    if shape.num_kv_heads % tp:
        raise PlanOptionError(f"--tp: {shape.num_kv_heads} KV heads do not split evenly over {tp} ranks")
    return shape.num_kv_heads // tp


def resolve_skip_layers(shape: ModelShape, items: Iterable[Union[str, int]]) -> tuple:
    """Layer indices from ``sliding_window`` and/or indices (strings may be comma-separated lists)."""
    out = set()
    for item in items:
        for tok in (str(item).replace(",", " ").split() if not isinstance(item, int) else [item]):
            if isinstance(tok, int) or tok.lstrip("-").isdigit():
                i = int(tok)
                if not 0 <= i < shape.num_layers:
                    raise PlanOptionError(f"--skip-layers: layer {i} is out of range (the model has {shape.num_layers} "
                                          f"layers: 0 to {shape.num_layers - 1})")
                out.add(i)
            elif tok.lower() in ("sliding_window", "sliding"):
                if not shape.sliding_layers:
                    raise PlanOptionError("--skip-layers: sliding_window given, but the model has no sliding-window "
                                          "layers")
                out.update(shape.sliding_layers)
            else:
                raise PlanOptionError(f"--skip-layers: {tok!r} is neither 'sliding_window' nor a layer index")
    return tuple(sorted(out))


# ---------------------------------------------------------------------------------------------------- plan

@dataclass
class Plan:
    """The capacity of one format on one model at one budget (all byte figures per tensor-parallel rank)."""

    format: str
    model: str
    budget_bytes: int
    block_size: int
    tp: int
    num_layers: int
    kv_heads_per_rank: int
    head_size: int
    context: int
    layer_kinds: list  # [{"format", "layers", "num_layers", "page_bytes"}]
    skip_layers: list
    page_bytes: int  # the padded page: max over the layer kinds
    padding_bytes_per_block: int
    padding_fraction: float
    bytes_per_block: int
    bytes_per_token: float
    num_blocks: int
    max_tokens: int
    blocks_per_seq: int
    residual_bytes_per_seq: int
    max_seqs: int
    bf16_max_tokens: int
    gain_vs_bf16: Optional[float]  # None when bf16 does not fit one block
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _load(name):
    from .runtime.loader import load

    try:
        return load(name)
    except SpecError as exc:  # a bad spec file: exit 1, as every command's
        raise PlanError(f"--format: {exc}") from None
    except KvgenError as exc:  # no such format
        raise PlanOptionError(f"--format: {exc}") from None


def _page(fmt, block_size: int, heads: int, head_size: int) -> int:
    res = fmt.layout.RESIDUAL
    if res and block_size % res["group"]:
        raise PlanOptionError(f"--block-size: {block_size} is not a multiple of {fmt.name}'s token group "
                              f"{res['group']}")
    try:
        return fmt.page_bytes(block_size, heads, head_size)
    except ValueError as exc:
        raise PlanError(f"{fmt.name}: {exc}") from None


def _capacity(budget, block_size, context, per_block, residual):
    blocks_per_seq = -(-context // block_size)
    max_seqs = budget // (blocks_per_seq * per_block + residual)
    num_blocks = (budget - max_seqs * residual) // per_block  # beside max_seqs residual windows (KIVI)
    return num_blocks, num_blocks * block_size, blocks_per_seq, max_seqs


def make_plan(shape: ModelShape, format_name: str, budget: Union[int, str], *, block_size: int = 16, tp: int = 1,
              context: int = 32768, skip_layers: Sequence = ()) -> Plan:
    """Plan the KV cache of ``shape`` in ``format_name`` with ``budget`` bytes per GPU (see the module docstring)."""
    budget = parse_size(budget)  # sizes as text, and numbers of bytes (checked: positive, finite; whole bytes)
    for option, value in (("--block-size", block_size), ("--context", context), ("--tp", tp)):
        if _as_int(value) is None or _as_int(value) < 1:
            raise PlanOptionError(f"{option}: {value!r} must be an integer of at least 1")
    block_size, context, tp = int(block_size), int(context), int(tp)
    heads = kv_heads_per_rank(shape, tp)
    skip = resolve_skip_layers(shape, skip_layers)
    fmt = _load(format_name)
    page = _page(fmt, block_size, heads, shape.head_size)
    kinds = []
    quant_layers = [i for i in range(shape.num_layers) if i not in skip]
    if skip:
        if shape.dtype not in ("bf16", "fp16"):
            raise PlanOptionError(f"--skip-layers: the model dtype ({shape.dtype}) has no kvgen format; skipped layers "
                                  f"stay in bf16 or fp16")
        skip_fmt = _load(shape.dtype)
        kinds.append(dict(format=skip_fmt.name, layers=list(skip), num_layers=len(skip),
                          page_bytes=_page(skip_fmt, block_size, heads, shape.head_size)))
    if quant_layers:
        kinds.insert(0, dict(format=fmt.name, layers=quant_layers, num_layers=len(quant_layers), page_bytes=page))
    padded = max(k["page_bytes"] for k in kinds)
    waste = sum((padded - k["page_bytes"]) * k["num_layers"] for k in kinds)
    per_block = shape.num_layers * padded
    residual = len(quant_layers) * fmt.residual_bytes(heads, shape.head_size)
    num_blocks, max_tokens, blocks_per_seq, max_seqs = _capacity(budget, block_size, context, per_block, residual)
    bf16_page = _page(_load("bf16"), block_size, heads, shape.head_size)
    bf16_tokens = (budget // (shape.num_layers * bf16_page)) * block_size
    bpt = per_block / block_size
    notes = []
    if waste:
        notes.append(f"layers padded to the {padded:,} B page: {waste:,} B of each {per_block:,} B block is padding")
    if residual:
        notes.append(f"{residual:,} B full-precision residual window per sequence ({len(quant_layers)} layers)")
    if waste and bf16_tokens and max_tokens <= bf16_tokens:
        notes.append(f"padding to the {padded:,} B page cancels {fmt.name}'s saving: no gain over bf16 here")
    if num_blocks == 0:
        notes.append("the budget does not hold one block")
    return Plan(format=fmt.name, model=shape.name, budget_bytes=budget, block_size=block_size, tp=tp,
                num_layers=shape.num_layers, kv_heads_per_rank=heads, head_size=shape.head_size, context=context,
                layer_kinds=kinds, skip_layers=list(skip), page_bytes=padded, padding_bytes_per_block=waste,
                padding_fraction=waste / per_block, bytes_per_block=per_block,
                bytes_per_token=int(bpt) if float(bpt).is_integer() else bpt, num_blocks=num_blocks,
                max_tokens=max_tokens, blocks_per_seq=blocks_per_seq, residual_bytes_per_seq=residual,
                max_seqs=max_seqs, bf16_max_tokens=bf16_tokens,
                gain_vs_bf16=(max_tokens / bf16_tokens) if bf16_tokens else None, notes=notes)


def capacity_curve(plan: Plan, contexts: Sequence[int]) -> list:
    """Max concurrent sequences at each context, with the plan's pages and budget."""
    return [_capacity(plan.budget_bytes, plan.block_size, c, plan.bytes_per_block, plan.residual_bytes_per_seq)[3]
            for c in contexts]


def default_contexts(context: int) -> list:
    """Powers of two from 1K up to at least 128K and the planned context (which is included)."""
    top = max(context, 131072)
    out, c = [], 1024
    while c <= top:
        out.append(c)
        c *= 2
    return sorted(set(out) | {context})


def draw_capacity_png(plans: Sequence[Plan], path: Union[str, Path], contexts: Optional[Sequence[int]] = None) -> Path:
    """A PNG of max concurrent sequences against context, one line per plan (format)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not plans:
        raise PlanError("nothing to draw")
    contexts = list(contexts or default_contexts(plans[0].context))
    p0 = plans[0]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for p in plans:
        ax.plot(contexts, capacity_curve(p, contexts), marker="o", markersize=3,
                label=p.format + (f" ({p.gain_vs_bf16:.2f}x bf16 tokens)" if p.gain_vs_bf16 is not None else ""))
    ax.axvline(p0.context, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("symlog", linthresh=1)
    ax.set_ylim(bottom=0)
    ax.set_xticks(contexts)
    ax.set_xticklabels([f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in contexts], fontsize=8)
    ax.set_xlabel("context (tokens per sequence)")
    ax.set_ylabel("max concurrent sequences")
    skip = f", {len(p0.skip_layers)} layers kept in bf16/fp16" if p0.skip_layers else ""
    ax.set_title(f"{p0.model}: {p0.budget_bytes / 2**30:.1f} GiB per GPU, tp {p0.tp}, block {p0.block_size}{skip}",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path
