"""Accuracy of KV-cache formats on synthetic attention (``kvgen eval``): NumPy reference, or the kernels on a GPU.

For each format and context length, and each seed:
  * synthetic K / V / Q (:func:`synthetic_kv`): keys standard normal with a few outlier channels (x10..x20) and
    RoPE applied; values standard normal; queries a random mix of a few keys of their KV head plus noise, scaled
    to a fixed logit spread, so attention is peaked (GQA: ``num_q_heads`` query heads over ``num_kv_heads``);
  * K and V quantized and decoded by :mod:`kvgen.reference` (:func:`quantize_kv`): per side ``encode_side`` /
    ``decode_side``; a static (per_tensor / per_head) scale is calibrated from the data, ``absmax / qmax`` of the
    element; a global scale (NVFP4) is ``absmax / (qmax * max of the block-scale dtype)``. KIVI formats go through
    ``kivi_write`` / ``kivi_read`` of one sequence, written in chunks, so the newest R..R+G-1 tokens (128..159 for the
    shipped KIVI specs) stay in the residual window's dtype exactly as the format keeps them;
  * attention in float64 on the unquantized (float32) and the decoded K / V, every query attending to every
    position (a decode step), and the metrics of :func:`attention_metrics`.

Metrics (means over seeds): ``attn_rel_l2`` = ||O_q - O|| / ||O|| over all heads and queries; ``cosine`` = mean
cosine of the output vectors; ``topk`` = fraction of the unquantized top-8 attended positions that are in the
quantized top-8; ``key_rel`` / ``value_rel`` = ||X_q - X||_F / ||X||_F.

    from kvgen.evaluate import evaluate
    rows = evaluate(["fp8_e4m3", "int4_per_token_head"], contexts=[1024], seeds=2)
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from .codegen.errors import KvgenError, OptionError

NUM_KV_HEADS = 8
NUM_Q_HEADS = 32
HEAD_SIZE = 128
QUERIES_PER_HEAD = 4
TOP_K = 8
CHUNK = 4096
#: standard deviation of the (unquantized) logits q.k / sqrt(D) of every query: sets how peaked attention is
LOGIT_STD = 3.0


class EvalError(KvgenError):
    """A format that cannot be evaluated (unknown name, or something the reference does not define)."""


class EvalArgumentError(EvalError, OptionError):
    """An argument (a command-line option) eval cannot take: on the command line a usage error, exit 2."""


# --- formats -------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class EvalFormat:
    name: str
    spec: object  # FormatSpec
    source: str  # shipped name or path


def resolve_format(name_or_path: str) -> EvalFormat:
    """A shipped format name, a generated directory or a spec .yaml (read without building kernels)."""
    from .codegen.loader import load_spec

    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml"):
        if not p.is_file():
            raise EvalArgumentError(f"no such spec file: {name_or_path}")
        spec = load_spec(p)
        return EvalFormat(spec.name, spec, str(p))
    from .runtime.loader import load

    fmt = load(name_or_path)  # raises KvgenError (one line) for an unknown name
    return EvalFormat(fmt.spec.name, fmt.spec, name_or_path)


def bytes_per_token_head(spec, head_size: int = HEAD_SIZE) -> float:
    """Cache bytes per (token, KV head) at ``head_size``; KIVI: its page bytes per token and head (the residual
    window, a fixed cost per sequence, is not counted)."""
    from . import reference as R

    if R.is_kivi(spec):
        bs = R.kivi_params(spec).G * 2
        return R.kivi_page_bytes(spec, bs, 1, head_size) / bs
    return float(R.bytes_per_token_head(spec, head_size)["total"])


# --- data ----------------------------------------------------------------------------------------------------------


def rope(x: np.ndarray, positions: np.ndarray, base: float = 10000.0) -> np.ndarray:
    """Rotate pairs (2i, 2i+1) of ``x`` ``[T, H, D]`` by ``pos * base^(-2i/D)``."""
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # [D/2]
    ang = positions.astype(np.float64)[:, None] * inv[None, :]  # [T, D/2]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0::2].astype(np.float64), x[..., 1::2].astype(np.float64)
    out = np.empty(x.shape, np.float64)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out.astype(np.float32)


def synthetic_kv(context: int, seed: int, num_kv_heads: int = NUM_KV_HEADS, num_q_heads: int = NUM_Q_HEADS,
                 head_size: int = HEAD_SIZE, queries_per_head: int = QUERIES_PER_HEAD, outlier_channels: int = 4,
                 mix: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(q [num_q_heads, queries_per_head, D] float64, k [T, H, D] float32, v [T, H, D] float32)``.

    Keys: N(0, 1) with ``outlier_channels`` channels per KV head multiplied by U(10, 20), then RoPE at positions
    0..T-1. Values: N(0, 1). Query: a random positive mix of ``mix`` keys of its KV head plus N(0, 1) noise, then
    scaled so its logits q.k / sqrt(D) over the context have standard deviation LOGIT_STD."""
    rng = np.random.default_rng(seed)
    T, H, D = context, num_kv_heads, head_size
    k = np.empty((T, H, D), np.float32)
    v = np.empty((T, H, D), np.float32)
    gain = np.ones((H, D), np.float32)
    for h in range(H):
        ch = rng.choice(D, outlier_channels, replace=False)
        gain[h, ch] = rng.uniform(10.0, 20.0, outlier_channels)
    for a in range(0, T, CHUNK):  # chunked so float64 temporaries stay small
        b = min(T, a + CHUNK)
        raw = rng.standard_normal((b - a, H, D), dtype=np.float32) * gain
        k[a:b] = rope(raw, np.arange(a, b))
        v[a:b] = rng.standard_normal((b - a, H, D), dtype=np.float32)
    group = num_q_heads // H
    q = np.empty((num_q_heads, queries_per_head, D), np.float64)
    for qh in range(num_q_heads):
        kh = k[:, qh // group, :].astype(np.float64)
        for i in range(queries_per_head):
            pos = rng.choice(T, min(mix, T), replace=False)
            w = rng.uniform(0.5, 1.5, len(pos))
            d = (w[:, None] * kh[pos]).sum(0) / w.sum()
            d = d / np.linalg.norm(d) + rng.standard_normal(D) / math.sqrt(D)
            logits = kh @ d / math.sqrt(D)
            q[qh, i] = d * (LOGIT_STD / max(float(logits.std()), 1e-12))
    return q, k, v


# --- quantization through the reference -----------------------------------------------------------------------------


def calibrated_scale(spec, side_name: str, x: np.ndarray):
    """The static scale of a side from the data: per_tensor ``absmax / qmax``, per_head one per head; a global scale
    ``absmax / (qmax * block-scale max)``; None for a side without a per-layer scale."""
    from .codegen.spec import ELEMENTS, GLOBAL_SCALE_RANGE, Granularity

    side = spec.side(side_name)
    sc = side.scale
    if sc is None:
        return None
    qmax = ELEMENTS[side.element].qmax
    amax_t = float(np.max(np.abs(x)))
    if sc.global_scale:
        smax = {"fp8_e4m3": 448.0, "fp16": 65504.0}.get(getattr(sc.dtype, "value", str(sc.dtype)), None)
        if smax is None or amax_t == 0:
            return 1.0
        lo, hi = GLOBAL_SCALE_RANGE  # what allocate takes
        return min(max(amax_t / (qmax * smax), lo), hi)
    if not sc.granularity.is_static:
        return None
    if sc.granularity == Granularity.per_head:
        amax = np.max(np.abs(x), axis=(0, 2)).astype(np.float64)
        return np.where(amax > 0, amax / qmax, 1.0).astype(np.float32)
    return amax_t / qmax if amax_t > 0 else 1.0


def _quantize_side(spec, side_name: str, x: np.ndarray, chunk: int) -> np.ndarray:
    from . import reference as R

    side = spec.side(side_name)
    s = calibrated_scale(spec, side_name, x)
    out = np.empty(x.shape, np.float32)
    for a in range(0, x.shape[0], chunk):
        b = min(x.shape[0], a + chunk)
        enc = R.encode_side(side, x[a:b], s)
        out[a:b] = R.decode_side(side, enc.data, enc.scale, enc.zp, s, head_size=x.shape[-1])
    return out


def _quantize_kivi(spec, k: np.ndarray, v: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    from . import reference as R

    T, H, D = k.shape
    bs = R.kivi_params(spec).G * 2
    nblocks = -(-T // bs)
    cache = R.kivi_new_cache(spec, nblocks, bs, H, D, 1)
    table = np.arange(nblocks, dtype=np.int64)[None, :]
    for a in range(0, T, chunk):  # successive prefill steps of one sequence
        b = min(T, a + chunk)
        R.kivi_write(spec, cache, k[a:b], v[a:b], np.arange(a, b, dtype=np.int64), np.array([0]),
                     np.array([0, b - a]), np.array([b]), table, bs)
    kq, vq = R.kivi_read(spec, cache, 0, T, table[0], bs, H, D)
    return kq.astype(np.float32), vq.astype(np.float32)


def quantize_kv(spec, k: np.ndarray, v: np.ndarray, chunk: int = CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """Decoded (float32) K and V after a round trip through the format, in the input's basis."""
    from . import reference as R

    try:
        if R.is_kivi(spec):
            return _quantize_kivi(spec, k, v, chunk)
        return _quantize_side(spec, "key", k, chunk), _quantize_side(spec, "value", v, chunk)
    except NotImplementedError as exc:
        raise EvalError(f"{spec.name}: {exc}") from None


# --- attention and metrics ------------------------------------------------------------------------------------------


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, top_k: int = TOP_K) -> tuple[np.ndarray, np.ndarray]:
    """float64 attention of ``q`` ``[Hq, n, D]`` over all T positions of ``k`` / ``v`` ``[T, H, D]`` (GQA: query
    head i reads KV head i // (Hq / H)). Returns ``(out [Hq, n, D], top-k positions [Hq, n, top_k])``."""
    Hq, n, D = q.shape
    H = k.shape[1]
    group = Hq // H
    out = np.empty((Hq, n, D), np.float64)
    top = np.empty((Hq, n, top_k), np.int64)
    for h in range(H):
        qs = q[h * group:(h + 1) * group].reshape(group * n, D)
        logits = (qs @ k[:, h, :].astype(np.float64).T) / math.sqrt(D)  # [group*n, T]
        logits -= logits.max(axis=1, keepdims=True)
        w = np.exp(logits)
        w /= w.sum(axis=1, keepdims=True)
        out[h * group:(h + 1) * group] = (w @ v[:, h, :].astype(np.float64)).reshape(group, n, D)
        kk = min(top_k, w.shape[1])
        top[h * group:(h + 1) * group, :, :kk] = np.argpartition(-w, kk - 1, axis=1)[:, :kk].reshape(group, n, kk)
    return out, top


def rel_err(a: np.ndarray, ref: np.ndarray, chunk: int = CHUNK) -> float:
    """||a - ref|| / ||ref|| (Frobenius), float64, chunked along the first axis."""
    num = den = 0.0
    for i in range(0, a.shape[0], chunk):
        r64 = ref[i:i + chunk].astype(np.float64)
        num += float(np.sum((a[i:i + chunk].astype(np.float64) - r64) ** 2))
        den += float(np.sum(r64 ** 2))
    return math.sqrt(num) / max(math.sqrt(den), 1e-300)


def attention_metrics(out: np.ndarray, top: np.ndarray, out_ref: np.ndarray, top_ref: np.ndarray) -> dict:
    """``attn_rel_l2``, ``cosine`` (mean over output vectors) and ``topk`` agreement."""
    o, r = out.reshape(-1, out.shape[-1]), out_ref.reshape(-1, out_ref.shape[-1])
    cos = (o * r).sum(1) / np.maximum(np.linalg.norm(o, axis=1) * np.linalg.norm(r, axis=1), 1e-300)
    t, tr = top.reshape(-1, top.shape[-1]), top_ref.reshape(-1, top_ref.shape[-1])
    agree = np.mean([len(set(a.tolist()) & set(b.tolist())) / len(b) for a, b in zip(t, tr)])
    return {"attn_rel_l2": rel_err(out, out_ref), "cosine": float(cos.mean()), "topk": float(agree)}


# --- the evaluation -------------------------------------------------------------------------------------------------

METRICS = ("attn_rel_l2", "cosine", "topk", "key_rel", "value_rel")


BACKENDS = ("auto", "reference", "kernels")


def resolve_backend(backend: str) -> str:
    """``auto``: the kernels where a GPU is present, else the reference."""
    if backend not in BACKENDS:
        raise EvalArgumentError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        import torch

        return "kernels" if torch.cuda.is_available() else "reference"
    return backend


def evaluate(formats: Optional[Sequence[str]] = None, contexts: Iterable[int] = (1024, 4096), seeds: int = 3,
             progress: Optional[Callable[[str, int, int], None]] = None, backend: str = "auto",
             dot_precision: str = "auto", query_dtype: str = "fp32", dequantize_first=False) -> list[dict]:
    """One row per (format, context): ``format``, ``source``, ``backend``, ``bytes_per_token_head``, ``context``,
    ``seeds``, ``dot_precision`` (what the attention ran with, see :func:`ran_with`), the mean of every metric over seeds, ``per_seed`` (each metric per seed), and for KIVI
    ``quantized_fraction`` (the share of positions stored quantized; the rest are in the residual window) and
    ``residual_window`` (the spec's ``{"tokens": [R, R + G - 1], "dtype": ...}``: how many newest tokens it keeps).

    ``backend``: ``reference`` attends in float64 on the reference-decoded K / V; ``kernels`` takes the attention
    output from the format's generated kernels (kvgen.evaluate_kernels: written by its reshape-and-cache kernel,
    read by its paged attention, fp32 queries), while top-k agreement and the K / V errors still come from the
    reference decoding (the kernels store the same bytes: the conformance property); ``auto`` picks the kernels
    where a GPU is present. ``dot_precision`` (kernels only): the attention's dots, as ``Format.attend`` takes it;
    "quantized" applies to the formats that offer it (the others run "auto"). ``query_dtype`` (kernels only): the
    queries' type in the kernels' call, fp32, bf16 or fp16; ``dequantize_first`` (kernels only): as
    ``Format.attend``'s, True (a dense cache of the query's type: 16-bit queries) or "bf16" / "fp16" (that type).
    ``progress(format, context, seed)`` is called after every format x context x seed step."""
    from . import reference as R
    from .runtime.loader import shipped_names

    backend = resolve_backend(backend)
    from .runtime.kernels import DOT_PRECISIONS
    if dot_precision not in DOT_PRECISIONS:
        raise EvalArgumentError(f"dot_precision: expected one of {', '.join(DOT_PRECISIONS)}, got {dot_precision!r}")
    if dot_precision != "auto" and backend != "kernels":
        raise EvalArgumentError(f"dot_precision: {dot_precision!r} applies to the kernels backend (--backend kernels); "
                                "the reference attends in float64")
    from .evaluate_kernels import QUERY_DTYPES
    if query_dtype not in QUERY_DTYPES:
        raise EvalArgumentError(f"query_dtype: expected one of {', '.join(QUERY_DTYPES)}, got {query_dtype!r}")
    if (query_dtype != "fp32" or dequantize_first) and backend != "kernels":
        raise EvalArgumentError("query_dtype / dequantize_first apply to the kernels backend (--backend kernels); the "
                                "reference attends in float64")
    if dequantize_first and dot_precision == "quantized":
        raise EvalArgumentError("dequantize_first: runs on dequantized values; dot_precision 'quantized' computes "
                                "on the codes (use auto, fast or ieee)")
    if not (dequantize_first is False or dequantize_first is True or dequantize_first in ("bf16", "fp16")):
        raise EvalArgumentError(f"dequantize_first: expected False, True, 'bf16' or 'fp16', got {dequantize_first!r}")
    if dequantize_first is True and query_dtype == "fp32":
        raise EvalArgumentError("dequantize_first: True takes the query's type for the dense cache, which needs "
                                "bf16 or fp16 queries (--query-dtype bf16 or fp16), or name the type (--dense-dtype "
                                "bf16 or fp16)")
    names = list(formats) if formats else list(shipped_names())
    fmts = [resolve_format(n) for n in names]
    contexts = list(contexts)
    acc: dict[tuple[int, int], dict] = {}
    for ci, ctx in enumerate(contexts):
        for seed in range(seeds):
            q, k, v = synthetic_kv(ctx, seed)
            out_ref, top_ref = attention(q, k, v)
            for fi, f in enumerate(fmts):
                kq, vq = quantize_kv(f.spec, k, v)
                out, top = attention(q, kq, vq)
                if backend == "kernels":
                    from .evaluate_kernels import kernel_attention

                    out = kernel_attention(f.source, q, k, v, dot_precision=dot_precision,
                                           query_dtype=query_dtype, dequantize_first=dequantize_first)
                m = attention_metrics(out, top, out_ref, top_ref)
                m["key_rel"] = rel_err(kq, k)
                m["value_rel"] = rel_err(vq, v)
                row = acc.setdefault((fi, ci), {"per_seed": {x: [] for x in METRICS}})
                for x in METRICS:
                    row["per_seed"][x].append(m[x])
                del kq, vq
                if progress:
                    progress(f.name, ctx, seed)
    rows = []
    for (fi, ci), r in acc.items():
        f, ctx = fmts[fi], contexts[ci]
        row = {"format": f.name, "source": f.source, "backend": backend,
               "dot_precision": ran_with(f, backend, dot_precision),
               "query_dtype": query_dtype if backend == "kernels" else "float64",
               "dequantize_first": dequantize_first,
               "bytes_per_token_head": bytes_per_token_head(f.spec),
               "context": ctx, "seeds": seeds}
        row.update({x: float(np.mean(r["per_seed"][x])) for x in METRICS})
        if R.is_kivi(f.spec):
            p = R.kivi_params(f.spec)
            row["quantized_fraction"] = R.quantized_length(ctx, p.G, p.R) / ctx
            dtype = getattr(p.residual_dtype, "value", p.residual_dtype)
            row["residual_window"] = {"tokens": [p.R, p.R + p.G - 1], "dtype": str(dtype)}
        row["per_seed"] = r["per_seed"]
        rows.append(row)
    rows.sort(key=lambda r: (r["bytes_per_token_head"], r["format"], r["context"]))
    return rows


def ran_with(f, backend: str, dot_precision: str) -> str:
    """The attention's dot precision a row was computed with: "float64" for the reference; for the kernels the one
    asked for, except "quantized" on a format without int8 codes, which runs "auto"."""
    if backend != "kernels":
        return "float64"
    from .runtime.loader import load

    return load(f.source).runs_dot_precision(dot_precision)


def draw_png(rows: list[dict], path: str, metric: str = "attn_rel_l2", where: str = "NumPy reference") -> None:
    """Error against bytes per token-head, one point per format (and context), log y; PNG whatever the suffix.
    ``where``: what computed the attention (the title says it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    contexts = sorted({r["context"] for r in rows})
    markers = "osD^v<>"
    for i, ctx in enumerate(contexts):
        sel = [r for r in rows if r["context"] == ctx]
        ax.scatter([r["bytes_per_token_head"] for r in sel], [max(r[metric], 1e-12) for r in sel],
                   marker=markers[i % len(markers)], label=f"context {ctx:,}", alpha=0.8)
    last = [r for r in rows if r["context"] == contexts[-1]]
    for r in last:
        ax.annotate(r["format"], (r["bytes_per_token_head"], max(r[metric], 1e-12)), fontsize=7,
                    xytext=(4, 2), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("bytes per token and KV head (head size 128)")
    ax.set_ylabel({"attn_rel_l2": "attention output relative L2 error"}.get(metric, metric))
    ax.set_title(f"kvgen eval: accuracy vs cache size (synthetic K/V, {where})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
