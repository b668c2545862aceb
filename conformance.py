"""Conformance properties of a generated format against the NumPy reference (used by tests and `kvgen test`).

For a format and a random case (shapes, GQA ratio, data with outliers, zero rows and negative values, slot mapping
with -1 holes, shuffled block tables, decode / prefill / chunked prefill, optional sliding window):
  page_bytes   page_bytes() equals the bytes allocate() takes per block, and the reference's own page size;
  bytes        every byte the write kernel stores equals the byte the reference encodes;
  error_bound  decode(encode(x)) stays within the bound the spec implies (reference.error_bound);
  attention    paged attention matches float64 attention on the reference-decoded cache within TOLERANCE.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Callable, Optional

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import reference as R
from .codegen.spec import ELEMENTS, SCALE_BYTES, ElementType
from .runtime.format import Format

PROPERTIES = ("page_bytes", "bytes", "edge_bytes", "error_bound", "attention")
# checked once per format rather than per random case (edge_bytes: NaN, +-inf, signed zeros and values that round to
# zero, subnormals, huge values; not for residual-window formats, whose edge values tests/test_kivi.py covers)
ONCE_PER_FORMAT = ("edge_bytes",)

# |out - ref| <= ATOL * max|V| + RTOL * |ref| per query dtype (max|V|: value_scale, per channel; attention_error adds
# the underflow terms). The kernel's products are exact (fp32 dots, or tensor-core dots of operands held exactly);
# the slack is the output's rounding to the query dtype (the interpreter truncates bf16: 2**-7), fp32 accumulation,
# and the probabilities rounded to fp16 for the value dot (2**-12 relative; two fp16 terms for fp32 queries).
TOLERANCE = {
    torch.float32: (5e-5, 5e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
HEAD_SIZES = (16, 32, 48, 64)
# dot_precision="fast" (one 16-bit term per dot operand): each dequantized key and value, the query and the
# probabilities are rounded once to the dot's type, bf16 for bf16 elements (and KIVI's bf16 ring), else fp16
FAST_UNIT = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


def _fast_unit(side, residual: Optional[str]) -> float:
    """The unit roundoff of a side's dot type under dot_precision="fast" (its ring's, if coarser)."""
    units = [FAST_UNIT["bf16" if side.element.value == "bf16" else "fp16"]]
    if residual in FAST_UNIT:
        units.append(FAST_UNIT[residual])
    return max(units)


def _dot_basis(side, x: np.ndarray) -> tuple:
    """(x as the kernel's dots see it, the factor the dot's result is divided by): rotated sides dot FWHT_b(x * signs)
    (unnormalized, so a dot of two rotated vectors is b times the plain one); others x itself."""
    if side.rotation is None:
        return x, 1
    from .reference import rotation as rot

    d = x.shape[-1]
    b = rot.block_size(d)
    return rot.fwht(x * rot.signs(side.rotation.seed, d).astype(np.float64), b), b


def dense_rounded(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """x (float64) rounded to nearest in fp32, then in bf16 / fp16 (``dtype``), as float64: what dequantize_first's
    dense cache holds of a dequantized value. The kernels dequantize in fp32, and that first rounding decides ties:
    an fp16 input on a bf16 midpoint (one in eight) comes back as code * scale a few fp32 ulps either side of it."""
    import ml_dtypes

    x32 = np.asarray(x).astype(np.float32)
    return x32.astype(ml_dtypes.bfloat16 if dtype == torch.bfloat16 else np.float16).astype(np.float64)


def dense_type(dequantize_first, query_dtype: torch.dtype) -> torch.dtype:
    """The type ``attend(dequantize_first=...)`` rounds each dequantized value to, as the README states it (True
    takes the query's type, or a torch dtype names it); not the runtime's own helper, so the oracle does not share a
    mistake with the code it checks."""
    return query_dtype if dequantize_first is True else dequantize_first


def dense_attention(q: np.ndarray, seqs: list, query_start_loc: np.ndarray, sm_scale: float,
                    window: Optional[int], dtype: torch.dtype) -> np.ndarray:
    """float64 attention as dequantize_first computes it: over each sequence's dequantized keys and values
    (``seqs``: per sequence (K, V) ``[L, H, D]`` in the input basis) rounded once to the dense cache's 16-bit
    ``dtype``."""
    out = np.zeros(q.shape, np.float64)
    for s, (k, v) in enumerate(seqs):
        a, b = int(query_start_loc[s]), int(query_start_loc[s + 1])
        if b == a:
            continue
        L = k.shape[0]
        pages = [dense_rounded(x, dtype).reshape(L, 1, *x.shape[1:]) for x in (k, v)]
        out[a:b] = R.paged_attention(q[a:b], pages[0], pages[1], np.arange(L)[None], np.array([L]),
                                     np.array([0, b - a]), sm_scale, window)
    return out


def value_scale(side, vals: np.ndarray, num_q_heads: int) -> np.ndarray:
    """The scale TOLERANCE's absolute part is relative to, per query head and channel ``[Hq, D]``: the largest
    dequantized value magnitude of the sequence in that channel of the query head's KV head (``vals`` ``[L, H, D]``).
    An output element is a convex combination of its channel's values, so the kernel's roundings (the
    probabilities', each a relative error of one product, and fp32 accumulation) move it by a fraction of that,
    never of another channel's, head's or sequence's values. Where a value is not one product per channel the scale
    is the head's largest value of any channel: a rotated side (rotated back, each element mixes its block's
    channels) and a float zero point (x = code * scale + min: a dot may round the probability times each term
    apart, each as large as the token's range; an integer zero point is subtracted from the code exactly).
    1e-30 where the sequence holds none."""
    L, H, D = vals.shape
    mag = np.abs(vals).max(axis=0) if L else np.zeros((H, D))  # [H, D]
    if side.rotation is not None or _float_zero_point(side):
        mag = np.broadcast_to(mag.max(axis=1, keepdims=True), mag.shape)
    return np.maximum(np.repeat(mag, num_q_heads // H, axis=0), 1e-30)


def probabilities(q: np.ndarray, keys: np.ndarray, sm_scale: float, window: Optional[int]) -> np.ndarray:
    """float64 attention weights ``[t, Hq, L]`` of one sequence's queries ``q`` ``[t, Hq, D]`` (its last t
    positions) over its keys ``[L, H, D]``, with the causal mask and ``window``; GQA by repeating each KV head."""
    group = q.shape[1] // keys.shape[1]
    scores = sm_scale * np.einsum("thd,lhd->thl", q, np.repeat(keys, group, axis=1))
    scores = np.where(R.attention_mask(keys.shape[0], q.shape[0], window)[:, None, :], scores, -np.inf)
    p = np.exp(scores - scores.max(axis=2, keepdims=True))
    return p / p.sum(axis=2, keepdims=True)


def fp16_underflow(spec, q: np.ndarray, keys: np.ndarray, vals: np.ndarray, sm_scale: float,
                   window: Optional[int]) -> np.ndarray:
    """The error fp16 value dots may add where an operand underflows, per query row and head ``[t, Hq, 1]``.

    A value dot in fp16 (every value side but bf16's) may hold each position's probability times its scale, or the
    probabilities of a scale block, divided by the largest of its step or block before the rounding: below 2**-14 that
    rounding's error is absolute, up to 2**-25 of the largest, times a code (at most twice the position's largest
    |value| over the scale: ``code * scale`` of a symmetric range or q4_0's -8). With p the weights and m_l the
    position's largest |value| in the head, each of the n visible positions then moves the output by at most
    2**-24 * max_l (p_l m_l): relative to another token's values, not the channel's (the per-channel scale)."""
    if spec.value.element.value == "bf16" or q.shape[0] == 0 or keys.shape[0] == 0:
        return np.zeros((q.shape[0], q.shape[1], 1))
    group = q.shape[1] // keys.shape[1]
    p = probabilities(np.asarray(q, dtype=np.float64), np.asarray(keys, dtype=np.float64), sm_scale, window)
    row_max = np.repeat(np.abs(vals).max(axis=2), group, axis=1)  # [L, Hq]
    seen = R.attention_mask(keys.shape[0], q.shape[0], window).sum(axis=1)  # [t]
    return (2.0 ** -24 * seen[:, None] * (p * row_max.T[None]).max(axis=2))[:, :, None]


def output_underflow(dtype: torch.dtype) -> float:
    """The output's rounding to the query dtype below its smallest normal number: an absolute error of up to one
    subnormal step (a step, not half of one: the interpreter truncates bf16), which no relative tolerance covers."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


def attention_error(spec, out: np.ndarray, ref: np.ndarray, q: np.ndarray, seqs: list, qsl: np.ndarray,
                    sm_scale: float, window: Optional[int], dtype: torch.dtype, fast: bool) -> Optional[str]:
    """The attention property: None where ``|out - ref|`` is within TOLERANCE for every element, else a message.
    ``seqs``: each sequence's dequantized (K, V) ``[L, H, D]``, whose query rows are ``qsl[s]:qsl[s + 1]`` of ``q``;
    ``window``: the sliding window; ``fast``: dot_precision="fast", whose fast_slack widens each sequence's limit."""
    atol, rtol = TOLERANCE[dtype]
    err = np.abs(out - ref)
    limit = rtol * np.abs(ref) + output_underflow(dtype)
    for s, (keys, vals) in enumerate(seqs):
        rows = slice(int(qsl[s]), int(qsl[s + 1]))
        limit[rows] += atol * value_scale(spec.value, vals, ref.shape[1])
        limit[rows] += fp16_underflow(spec, q[rows], keys, vals, sm_scale, window)
        if fast:
            limit[rows] += fast_slack(spec, q[rows], keys, vals, sm_scale, window)
    if np.all(err <= limit):
        return None
    ratio = err / limit
    t, h, d = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    seq = int(np.searchsorted(qsl, t, side="right")) - 1
    return (f"error {err.max():.3g} above tolerance (the largest; worst ratio {ratio.max():.2f} at query token {t} "
            f"of sequence {seq}, head {h}, channel {d}: {out[t, h, d]:.6g} against {ref[t, h, d]:.6g}, tolerance "
            f"{limit[t, h, d]:.3g}; {int((err > limit).sum())} of {err.size} elements above)")


def fast_slack(spec, q: np.ndarray, keys: np.ndarray, vals: np.ndarray, sm_scale: float,
               window: Optional[int] = None) -> np.ndarray:
    """The extra error dot_precision="fast" may add to the attention of one sequence's queries, ``[t, Hq, D]``: a
    bound on the error of one relative rounding of every dot factor, computed from the float64 attention itself.

    q ``[t, Hq, D]`` (the sequence's last t positions); keys / vals ``[L, H, D]`` the sequence's dequantized cache,
    in the input's basis; ``window``: the sliding window. With u_k / u_v the unit roundoffs of the key / value dots'
    type (the query rounds with u_k, the probabilities with u_v):

    * Scores. A score q . k whose factors each round once moves by at most delta_l = sm_scale * (2u_k + u_k**2) *
      sum_d |q_d| |k_ld| (rotated keys: in the basis the dots use, FWHT of q and k, divided by b). Probabilities p_l
      whose scores move by e_l, |e_l| <= delta_l, become p'_l = p_l exp(e_l) / W with W = sum_l p_l exp(e_l) >=
      sum_l p_l exp(-delta_l) =: w, so the output sum_l p'_l v_l moves by sum_l p_l (exp(e_l) - 1) (v_l - out) / W
      (sum_l p_l (v_l - out) = 0), at most sum_l p_l expm1(delta_l) |v_l - out| / w per element; and p'_l <=
      p_l exp(delta_l) / w =: hi_l.
    * Values and probabilities. Each product p'_l v_l rounds with its factors (a value, or its code times a scale;
      the probability, or it times a scale): the output moves by at most (u_v + u_p + u_v u_p) sum_l hi_l |v_l|. The
      normalizer sums the unrounded probabilities in fp32. Rotated values: the values' rounding bounded per element
      of the rotated output (|FWHT(v)|), which the rotation back (FWHT / b) moves by at most 1/b of its block's
      bounds' sum; the probabilities' in the input basis where one factor scales a position's whole row (no
      block scales), else with the values'.
    * A float zero point (KIVI) rounds x - min and min apart: keys' |k_ld| become twice the largest |k| of the
      elements its scale covers (a group's x - min is at most twice its largest magnitude), values' |v_ld| three
      times (x - min and min).

    fp16 operands below 2**-14 round with an absolute error instead: values' and probabilities', fp16_underflow's
    bound, which attention_error adds for every dot precision; queries' and keys' (at most 2**-25 of the operand's
    unit per product, moving a score by about 1e-7 of the query's magnitude times the head size) within TOLERANCE's
    absolute part, as fp32 accumulation is."""
    residual = spec.key.residual.dtype if spec.key.residual is not None else None
    uk, uv = _fast_unit(spec.key, residual), _fast_unit(spec.value, residual)
    q, keys, vals = (np.asarray(x, dtype=np.float64) for x in (q, keys, vals))
    (t, hq, d), (L, h) = q.shape, keys.shape[:2]
    if t == 0 or L == 0:
        return np.zeros(q.shape)
    group = hq // h
    qb, bk = _dot_basis(spec.key, q)
    kb = np.abs(_dot_basis(spec.key, keys)[0])
    if _float_zero_point(spec.key):
        kb = 2 * _scale_group_max(spec.key, kb)
    delta = sm_scale * (2 * uk + uk * uk) / bk * np.einsum("thd,lhd->thl", np.abs(qb), np.repeat(kb, group, axis=1))
    p = probabilities(q, keys, sm_scale, window)
    w = (p * np.exp(-delta)).sum(axis=2, keepdims=True)
    hi = p * np.exp(delta) / w  # [t, Hq, L]
    v = np.repeat(vals, group, axis=1)  # [L, Hq, D]
    out = np.einsum("thl,lhd->thd", p, v)
    moved = np.stack([np.einsum("hl,lhd->hd", p[i] * np.expm1(delta[i]), np.abs(v - out[i])) for i in range(t)])
    vb, bv = _dot_basis(spec.value, vals)
    vb = np.abs(vb)
    if _float_zero_point(spec.value):
        vb = 3 * _scale_group_max(spec.value, vb)
    up = uv  # the probabilities round to the value dot's type
    if bv == 1:
        return moved / w + (uv + up + uv * up) * np.einsum("thl,lhd->thd", hi, np.repeat(vb, group, axis=1))
    # rotated values: their rounding bounded per element of the rotated output, then rotated back (each element a
    # +-1/b combination of its block's); a probability's rounding, one factor of the position's whole row where the
    # scale covers it, maps back exactly (sum_l p_l eta_l FWHT(v_l) / b = sum_l p_l eta_l v_l)
    shared = spec.value.scale is None or spec.value.scale.granularity.value in ("per_tensor", "per_head",
                                                                               "per_token_head")
    rounded = (uv * (1 + up) + (0.0 if shared else up)) * np.einsum("thl,lhd->thd", hi, np.repeat(vb, group, axis=1))
    blocks = rounded.reshape(t, hq, d // bv, bv).sum(axis=3, keepdims=True) / bv
    rounded = np.broadcast_to(blocks, (t, hq, d // bv, bv)).reshape(t, hq, d)
    if shared:
        rounded = rounded + up * np.einsum("thl,lhd->thd", hi, np.abs(v))
    return moved / w + rounded


def _scale_group_max(side, x: np.ndarray) -> np.ndarray:
    """``x`` ``[L, H, D]`` (magnitudes) with each element replaced by the largest of the elements its dynamic scale
    and zero point cover: a token's head (per_token_head), a block of its channels (per_block), or a channel over a
    group of positions from position 0 (per_channel_group; the last group partial)."""
    L, H, D = x.shape
    g = side.scale.granularity.value
    if g == "per_token_head":
        return np.broadcast_to(x.max(axis=2, keepdims=True), x.shape)
    if g == "per_block":
        n = side.scale.block
        return np.repeat(x.reshape(L, H, D // n, n).max(axis=3), n, axis=2)
    tokens = side.scale.group_tokens
    padded = np.concatenate([x, np.zeros((-L % tokens, H, D))])
    groups = padded.reshape(-1, tokens, H, D).max(axis=1)
    return np.repeat(groups, tokens, axis=0)[:L]


def _float_zero_point(side) -> bool:
    """A zero point stored as a float (KIVI's min): the dots round x - min and min apart."""
    return side.zero_point is not None and side.zero_point.dtype != "uint8"


@dataclasses.dataclass
class Case:
    head_size: int
    block_size: int
    num_kv_heads: int
    group: int
    seq_lens: list
    q_lens: list
    dtype: torch.dtype
    window: Optional[int]
    holes: int
    seed: int
    k_scale: float
    v_scale: float
    magnitude: float
    splits: int = 1  # programs per sequence and KV head along the KV positions (flash decoding)


def head_sizes_for(fmt: Format) -> list:
    """Head sizes the format accepts (a block scale must divide the head size): those of HEAD_SIZES, or where a
    block is larger than all of them, the largest block itself (blocks are powers of two, so it is a multiple of
    every other)."""
    blocks = [fmt.spec.side(s).scale.block for s in ("key", "value")
              if fmt.spec.side(s).scale is not None and fmt.spec.side(s).scale.block]
    return [h for h in HEAD_SIZES if all(h % b == 0 for b in blocks)] or [max(blocks)]


@st.composite
def cases(draw, fmt: Format, max_len: int = 45) -> Case:
    num_seqs = draw(st.integers(1, 3))
    seq_lens = draw(st.lists(st.integers(1, max_len), min_size=num_seqs, max_size=num_seqs))
    mode = draw(st.sampled_from(["decode", "prefill", "chunked"]))
    if mode == "decode":
        q_lens = [1] * num_seqs
    elif mode == "prefill":
        q_lens = list(seq_lens)
    else:
        q_lens = [draw(st.integers(1, n)) for n in seq_lens]
    return Case(
        head_size=draw(st.sampled_from(head_sizes_for(fmt))),
        block_size=draw(st.sampled_from([1, 4, 16])),
        num_kv_heads=draw(st.integers(1, 3)),
        group=draw(st.sampled_from([1, 2, 3, 4])),
        seq_lens=seq_lens,
        q_lens=q_lens,
        dtype=draw(st.sampled_from(list(TOLERANCE))),
        window=draw(st.one_of(st.none(), st.integers(1, 20))),
        holes=draw(st.integers(0, 5)),
        seed=draw(st.integers(0, 2**31 - 1)),
        k_scale=draw(st.sampled_from([1.0, 0.037, 2.5])),
        v_scale=draw(st.sampled_from([1.0, 0.5, 7.25])),
        magnitude=draw(st.sampled_from([1.0, 30.0, 1e-3])),
        splits=draw(st.sampled_from([1, 1, 2, 3])),
    )


def small_case(fmt: Format, seed: int = 0):
    """One fixed small case (no hypothesis): a prefill and a decode step with GQA, for quick smoke checks."""
    head = max(head_sizes_for(fmt))
    if fmt.spec.streaming:
        res = fmt.layout.RESIDUAL
        return StreamCase(head_size=head, block_size=res["group"], num_kv_heads=2, group=2,
                          steps=[[res["tokens"] + 2 * res["group"] + 3, 5], [1, 1]], dtype=torch.float32,
                          window=None, pad_rows=1, seed=seed)
    return Case(head_size=head, block_size=4, num_kv_heads=2, group=2, seq_lens=[13, 6], q_lens=[1, 6],
                dtype=torch.float32, window=None, holes=1, seed=seed, k_scale=0.5, v_scale=2.0, magnitude=1.0)


def kv_data(rng: np.random.Generator, shape: tuple, magnitude: float) -> np.ndarray:
    """Normal data with an outlier channel, exact zeros, an all-zero token and large negative values."""
    x = rng.standard_normal(shape).astype(np.float32) * magnitude
    x[..., rng.integers(0, shape[-1])] *= 20.0
    x[rng.random(shape) < 0.05] = 0.0
    if shape[0] > 2:
        x[rng.integers(0, shape[0])] = 0.0  # a whole token of zeros: its dynamic scale is the floor
        x[rng.integers(0, shape[0]), :, 0] = -60.0 * magnitude
    return x


def edge_tokens(num_kv_heads: int, head_size: int) -> np.ndarray:
    """[16, H, D] float32 tokens of the values random data never holds: all zero; NaN (of both signs) beside normal
    values; +-inf beside normal values; fp32 subnormals; values near fp32's largest; all NaN; all +inf; +-inf
    alternating; NaN beside +-inf; +inf beside -0.0; -0.0 and +0.0 beside one large value; values that round to a
    signed zero beside one of 1.0; odd multiples of 1/16 of both signs; and three ordinary tokens."""
    rng = np.random.default_rng(7)
    shape = (16, num_kv_heads, head_size)
    x = rng.standard_normal(shape).astype(np.float32)
    d = np.arange(head_size)
    sign = np.where(d % 2 == 0, 1.0, -1.0).astype(np.float32)
    x[0] = 0.0
    x[1, :, 1] = np.nan
    x[1, :, 3] = -np.nan
    x[2, :, 1] = np.inf
    x[2, :, 2] = -np.inf
    x[3] = x[3] * np.float32(1e-40)
    x[4] = x[4] * np.float32(1e37)
    x[5] = np.nan
    x[6] = np.inf
    x[7] = np.inf * sign
    x[8] = np.where(d % 3 == 0, np.nan, np.inf * sign).astype(np.float32)
    x[9] = np.where(d % 2 == 0, np.inf, -0.0).astype(np.float32)
    x[10] = np.where(d % 2 == 0, -0.0, 0.0).astype(np.float32)
    x[10, :, 0] = 100.0
    x[11] = (sign * np.float32(1e-6)).astype(np.float32)
    x[11, :, 0] = 1.0
    x[12] = (sign * (d % 4 + 0.5) / 8.0).astype(np.float32)  # 1/16, 3/16, 5/16, 7/16 of both signs
    return x


def edge_bytes(fmt: Format, device: str = "cpu") -> Optional[str]:
    """Write :func:`edge_tokens` as keys and values (static scales 0.5) and compare every byte with the reference's
    encoding; None when equal, else what differs. Residual-window formats: None (not checked here)."""
    if fmt.spec.streaming:
        return None
    head, heads, bs = max(head_sizes_for(fmt)), 2, 4
    x = edge_tokens(heads, head)
    blocks = -(-x.shape[0] // bs) + 1
    slots = np.arange(x.shape[0], dtype=np.int64) + bs  # block 0 stays unwritten
    scales = {key: 0.5 for side, key in (("key", "k_scale"), ("value", "v_scale"))
              if fmt.static_scale_kind(side) is not None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(blocks, bs, heads, head, device=device, **scales)
        xt = torch.from_numpy(x)
        fmt.write(cache, xt.to(device), xt.clone().to(device), torch.from_numpy(slots).to(device))
        expected = R.new_cache(fmt.spec, blocks, bs, heads, head)
        R.write(fmt.spec, expected, x, x, slots, k_scale=scales.get("k_scale"), v_scale=scales.get("v_scale"))
    differ = bytes_differ(cache, expected, blocks)
    return differ and f"edge values (NaN, inf, signed zeros, subnormals, huge; head size {head}): {differ}"


def bytes_differ(cache, expected: dict, blocks: int) -> Optional[str]:
    """Where the kernel-written ``cache`` first differs from the reference's bytes (``expected``, per tensor), or
    None when every byte is equal."""
    for name, want in expected.items():
        got = cache.tensors[name].view(torch.uint8).reshape(blocks, -1).cpu().numpy()
        if not np.array_equal(got, want):
            where = np.argwhere(got != want)
            idx = tuple(int(i) for i in where[0])
            return (f"{name}: {len(where)} bytes differ; first at (block, byte) {idx}: kernel "
                    f"{int(got[idx]):#04x}, reference {int(want[idx]):#04x}")
    return None


def build_batch(case: Case, rng: np.random.Generator):
    """Shuffled block tables, a slot mapping over all tokens with -1 holes, and the data to write."""
    bs = case.block_size
    blocks_needed = [(n + bs - 1) // bs for n in case.seq_lens]
    num_blocks = sum(blocks_needed) + 2
    perm = rng.permutation(num_blocks)
    block_table = np.zeros((len(case.seq_lens), max(blocks_needed) + 1), dtype=np.int32)
    used = 0
    for s, nb in enumerate(blocks_needed):
        block_table[s, :nb] = perm[used:used + nb]
        used += nb
    slots = []
    for s, n in enumerate(case.seq_lens):
        pos = np.arange(n)
        slots.append(block_table[s, pos // bs].astype(np.int64) * bs + pos % bs)
    slots = np.concatenate(slots)
    slots = np.insert(slots, rng.integers(0, len(slots) + 1, size=case.holes), -1)  # tokens to skip
    shape = (len(slots), case.num_kv_heads, case.head_size)
    return num_blocks, block_table, slots, kv_data(rng, shape, case.magnitude), kv_data(rng, shape, case.magnitude)


def static_scales(fmt: Format, case: Case) -> dict:
    """The static scales a case gives the cache: per layer (or global) a float, per head one value per head."""
    out = {"k_scale": None, "v_scale": None}
    for side, name, val in (("key", "k_scale", case.k_scale), ("value", "v_scale", case.v_scale)):
        kind = fmt.static_scale_kind(side)
        if kind is None:
            continue
        if kind.value == "per_head":
            out[name] = [val * (1.0 + 0.5 * h) for h in range(case.num_kv_heads)]
        else:
            out[name] = val
    return out


def run_case(fmt: Format, case: Case, device: str = "cpu", dot_precision: str = "auto",
             dequantize_first=False) -> dict:
    """Check every property on one case; property -> None when it holds, else a message. ``dot_precision`` and
    ``dequantize_first``: attention's (``"fast"`` widens the tolerance by fast_slack; dequantize_first compares
    with dense_attention, the reference-decoded values rounded to the dense type)."""
    result: dict = {p: None for p in PROPERTIES}
    rng = np.random.default_rng(case.seed)
    spec = fmt.spec
    num_blocks, block_table, slots, key, value = build_batch(case, rng)
    scales = static_scales(fmt, case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        cache = fmt.allocate(num_blocks, case.block_size, case.num_kv_heads, case.head_size, device=device,
                             **scales)
    key_t = torch.from_numpy(key).to(case.dtype)
    value_t = torch.from_numpy(value).to(case.dtype)
    fmt.write(cache, key_t.to(device), value_t.to(device), torch.from_numpy(slots).to(device))

    page = fmt.page_bytes(case.block_size, case.num_kv_heads, case.head_size)
    allocated = cache.nbytes()
    ref_page = R.page_bytes(spec, case.block_size, case.num_kv_heads, case.head_size)
    if allocated != page * num_blocks or page != ref_page:
        result["page_bytes"] = (f"page_bytes {page}, allocated {allocated} for {num_blocks} blocks, reference "
                                f"page {ref_page}")

    key32, value32 = key_t.float().numpy(), value_t.float().numpy()
    expected = R.new_cache(spec, num_blocks, case.block_size, case.num_kv_heads, case.head_size)
    R.write(spec, expected, key32, value32, slots, k_scale=scales["k_scale"], v_scale=scales["v_scale"])
    result["bytes"] = bytes_differ(cache, expected, num_blocks)

    k_deq, v_deq = R.read(spec, expected, scales["k_scale"], scales["v_scale"], head_size=case.head_size,
                          block_size=case.block_size, num_kv_heads=case.num_kv_heads)
    written = slots >= 0
    blk, off = slots[written] // case.block_size, slots[written] % case.block_size
    for side, x, deq, s in (("key", key32, k_deq, scales["k_scale"]), ("value", value32, v_deq, scales["v_scale"])):
        bound = R.error_bound(spec.side(side), x[written], s)
        err = np.abs(deq[blk, off] - x[written].astype(np.float64))
        if not np.all(err <= bound):
            worst = np.unravel_index(np.argmax(err - bound), err.shape)
            result["error_bound"] = (f"{side}: error {err[worst]:.4g} above its bound {bound[worst]:.4g} at "
                                     f"(token, head, dim) {tuple(int(i) for i in worst)}")
            break

    qsl = np.concatenate([[0], np.cumsum(case.q_lens)]).astype(np.int32)
    num_q_heads = case.num_kv_heads * case.group
    query = torch.from_numpy(rng.standard_normal((int(qsl[-1]), num_q_heads, case.head_size)).astype(np.float32))
    query = query.to(case.dtype)
    sm_scale = 1.0 / math.sqrt(case.head_size)
    out = fmt.attend(query.to(device), cache, torch.from_numpy(block_table).to(device),
                     torch.tensor(case.seq_lens, dtype=torch.int32, device=device), torch.from_numpy(qsl).to(device),
                     sm_scale=sm_scale, sliding_window=case.window, num_splits=case.splits,
                     dot_precision=dot_precision, dequantize_first=dequantize_first).cpu()
    seqs = []  # each sequence's dequantized keys and values, [L, H, D]
    for s, n in enumerate(case.seq_lens):
        j = np.arange(n)
        blocks, offs = block_table[s, j // case.block_size], j % case.block_size
        seqs.append((k_deq[blocks, offs], v_deq[blocks, offs]))
    if dequantize_first:  # the reference of the dense cache: each dequantized value rounded to the dense type
        ref = dense_attention(query.double().numpy(), seqs, qsl, sm_scale, case.window,
                              dense_type(dequantize_first, case.dtype))
    else:
        ref = R.paged_attention(query.double().numpy(), k_deq, v_deq, block_table, np.array(case.seq_lens), qsl,
                                sm_scale, case.window)
    result["attention"] = attention_error(spec, out.double().numpy(), ref, query.double().numpy(), seqs, qsl,
                                          sm_scale, case.window, case.dtype, dot_precision == "fast")
    return result


class PropertyFailure(AssertionError):
    """A case that broke a property (its message: the properties' results)."""


@dataclasses.dataclass
class Report:
    """Outcome of `check`: examples run and, per property, the message of its minimal failing case (or None)."""

    name: str
    examples: int
    failures: dict
    failing_case: object
    not_checked: tuple = ()  # properties that do not apply to this format (edge_bytes for residual windows)

    @property
    def passed(self) -> bool:
        return not any(self.failures.values())


def check(fmt: Format, examples: int = 20, device: str = "cpu",
          on_example: Optional[Callable[[int], None]] = None, dequantize_first=False) -> Report:
    """Run the properties on ``examples`` random cases; a failure is shrunk by hypothesis to a minimal case.
    ``dequantize_first``: attention through ``Format.attend(..., dequantize_first=...)`` (fp32 query cases take
    bf16 queries where it is True, the query's type)."""
    from .runtime.checks import device_arg
    from .runtime.kernels import _choose_mode, interpreting

    _choose_mode()
    if isinstance(examples, bool) or not isinstance(examples, int) or examples < 1:
        raise ValueError(f"examples: expected a positive integer, got {examples!r}")
    dev = device_arg("device", device)
    if (dev.type == "cuda") == interpreting():
        mode = "interpreted (TRITON_INTERPRET=1)" if interpreting() else "compiled (TRITON_INTERPRET unset or 0)"
        raise ValueError(f"device: {dev} does not match this process's Triton mode, {mode}: the interpreter runs on "
                         "'cpu', compiled kernels on 'cuda'")
    seen = {"n": 0, "case": None, "result": None}

    streaming = fmt.spec.streaming
    strategy = stream_cases(fmt) if streaming else cases(fmt)
    run = run_stream if streaming else run_case

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(case=strategy)
    def prop(case):
        if dequantize_first is True and case.dtype == torch.float32:
            case = dataclasses.replace(case, dtype=torch.bfloat16)
        result = run(fmt, case, device, dequantize_first=dequantize_first)
        seen["n"] += 1
        if on_example:
            on_example(seen["n"])
        if any(result.values()):
            seen["case"], seen["result"] = case, result
            raise PropertyFailure(result)

    try:
        prop()
    except PropertyFailure:  # only the properties' own verdict: any other error is not a pass, and propagates
        pass
    if seen["n"] == 0:
        raise RuntimeError(f"{fmt.name}: no conformance case ran")
    failures = seen["result"] or {p: None for p in PROPERTIES}
    failures["edge_bytes"] = edge_bytes(fmt, device)
    not_checked = ("edge_bytes",) if streaming else ()
    return Report(fmt.name, seen["n"], failures, seen["case"], not_checked)


# --------------------------------------------------------------------------------------------------------------
# Random valid specs across the whole format space: "every spec that validates builds and conforms".
# --------------------------------------------------------------------------------------------------------------
# every element the schema has (a new one is drawn as soon as it exists): quantized ones, and how many bytes the
# unquantized floats take (the rest at most one)
_QUANTIZED = [e.value for e, info in ELEMENTS.items() if info.is_quantized]
_PACKED = [e.value for e, info in ELEMENTS.items() if info.is_quantized and info.bits < 8]
_ELEMENT_BYTES = {e.value: info.bits // 8 for e, info in ELEMENTS.items() if not info.is_quantized}


@st.composite
def side_specs(draw) -> dict:
    """A valid side of a spec, as plain YAML data."""
    element = draw(st.sampled_from(list(_ELEMENT_BYTES) + _QUANTIZED * 3))
    side: dict = {"element": element}
    if draw(st.integers(0, 3)) == 0:
        side["data_align"] = draw(st.sampled_from([a for a in (1, 2, 4, 16) if a >= _ELEMENT_BYTES.get(element, 1)]))
    if draw(st.integers(0, 3)) == 0:
        side["rotation"] = {"kind": "hadamard", "seed": draw(st.integers(0, 1000))}
    if element in _ELEMENT_BYTES:
        return side
    kind = ELEMENTS[ElementType(element)].kind
    asym = kind == "uint"
    if kind in ("int", "uint"):
        side["rounding"] = draw(st.sampled_from(["half_even", "half_away_from_zero"]))
    if element in _PACKED:
        side["packing"] = draw(st.sampled_from(["lsb_first", "msb_first"]))
    grans = ["per_token_head", "per_block"] + ([] if asym else ["per_tensor", "per_head"])
    gran = draw(st.sampled_from(grans))
    scale: dict = {"granularity": gran, "apply": draw(st.sampled_from(["divide", "reciprocal_multiply"]))}
    if gran in ("per_token_head", "per_block"):
        scale["dtype"] = draw(st.sampled_from(["fp32", "fp16", "bf16", "fp8_e4m3", "e8m0"]))
        scale["placement"] = draw(st.sampled_from(["inline", "page_end", "separate"]))
        if scale["placement"] == "inline" and draw(st.booleans()):
            scale["align"] = draw(st.sampled_from([a for a in (1, 2, 4, 8, 16) if a >= SCALE_BYTES[scale["dtype"]]]))
        if gran == "per_block":
            scale["block"] = draw(st.sampled_from([16, 32]))
        scale["min"] = draw(st.sampled_from([1e-6, 1e-3]))
        scale["global_scale"] = draw(st.integers(0, 3)) == 0
    side["scale"] = scale
    if asym:
        low_bits = scale["dtype"] == "fp32" and draw(st.booleans())
        side["zero_point"] = {"storage": "scale_low_bits" if low_bits else "beside_scale"}
    return side


@st.composite
def format_specs(draw) -> dict:
    """A valid spec (plain data) with random K and V sides (the same side half of the time)."""
    key = draw(side_specs())
    value = key if draw(st.booleans()) else draw(side_specs())
    cache: dict = {"layout": draw(st.sampled_from(["interleaved", "split"]))}
    if draw(st.integers(0, 3)) == 0:
        cache["storage_dtype"] = draw(st.sampled_from(["uint8", "int8", "fp16", "bf16", "fp32"]))
    return {"kvgen_spec": 1, "name": "random_spec", "cache": cache, "key": key, "value": value}


# --------------------------------------------------------------------------------------------------------------
# Formats with a residual window (KIVI): a stream of appends, compared with the reference's simulation
# --------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class StreamCase:
    head_size: int
    block_size: int
    num_kv_heads: int
    group: int
    steps: list  # steps[i][s]: tokens sequence s appends at step i (0 = not in that batch)
    dtype: torch.dtype
    window: Optional[int]
    pad_rows: int
    seed: int
    splits: int = 1
    nonfinite: bool = False  # +-inf and NaN in every step (bytes only: no error bound, no attention)


@st.composite
def stream_cases(draw, fmt: Format, max_prefill: Optional[int] = None) -> StreamCase:
    res = fmt.layout.RESIDUAL
    g = res["group"]
    max_prefill = max_prefill or res["tokens"] + 3 * g
    num_seqs = draw(st.integers(1, 3))
    steps = [[draw(st.integers(0, max_prefill)) for _ in range(num_seqs)]]
    for _ in range(draw(st.integers(1, 4))):
        steps.append([draw(st.sampled_from([0, 1, 1, 1, 2, g - 1, g + 3])) for _ in range(num_seqs)])
    steps = [s for s in steps if any(s)] or [[1] * num_seqs]
    blocks = [b for b in (g, 2 * g) if b % g == 0]
    return StreamCase(
        head_size=draw(st.sampled_from([h for h in head_sizes_for(fmt) if h >= 32] or head_sizes_for(fmt))),
        block_size=draw(st.sampled_from(blocks)),
        num_kv_heads=draw(st.integers(1, 2)),
        group=draw(st.sampled_from([1, 2, 4])),
        steps=steps,
        dtype=draw(st.sampled_from(list(TOLERANCE))),
        window=draw(st.one_of(st.none(), st.integers(1, 3 * g))),
        pad_rows=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**31 - 1)),
        splits=draw(st.sampled_from([1, 1, 2, 3])),
    )


def run_stream(fmt: Format, case: StreamCase, device: str = "cpu", dot_precision: str = "auto",
               dequantize_first=False) -> dict:
    """Append the case's steps; after every write compare all stored bytes (pages and residual buffers) with the
    reference's simulation, then compare attention over the final state for each sequence's last new tokens
    (computed with ``dot_precision`` and ``dequantize_first``; ``"fast"`` widens the tolerance by fast_slack,
    dequantize_first compares with dense_attention)."""
    result: dict = {p: None for p in PROPERTIES}
    rng = np.random.default_rng(case.seed)
    spec, bs, H, D = fmt.spec, case.block_size, case.num_kv_heads, case.head_size
    num_seqs = len(case.steps[0])
    total = [sum(step[s] for step in case.steps) for s in range(num_seqs)]
    blocks = [(n + bs - 1) // bs for n in total]
    num_blocks = sum(blocks) + 1
    perm = rng.permutation(num_blocks)
    table = np.zeros((num_seqs, max(max(blocks), 1)), dtype=np.int32)
    used = 0
    for s, nb in enumerate(blocks):
        table[s, :nb] = perm[used:used + nb]
        used += nb
    seq_ids = rng.permutation(num_seqs + 2)[:num_seqs].astype(np.int32)  # residual rows, not in batch order
    cache = fmt.allocate(num_blocks, bs, H, D, device=device, max_seqs=num_seqs + 2)
    expected = R.kivi_new_cache(spec, num_blocks, bs, H, D, num_seqs + 2)
    page = fmt.page_bytes(bs, H, D)
    if page != R.kivi_page_bytes(spec, bs, H, D) or cache.nbytes() != page * num_blocks:
        result["page_bytes"] = f"page_bytes {page}, reference {R.kivi_page_bytes(spec, bs, H, D)}"
    if fmt.residual_bytes(H, D) != R.kivi_residual_bytes(spec, H, D):
        result["page_bytes"] = f"residual_bytes {fmt.residual_bytes(H, D)}, reference {R.kivi_residual_bytes(spec, H, D)}"

    res = fmt.layout.RESIDUAL
    ring_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[res["dtype"]]
    seen = {"key": [[] for _ in range(num_seqs)], "value": [[] for _ in range(num_seqs)]}  # values as encoded
    lens = [0] * num_seqs
    for step in case.steps:
        batch = [s for s in range(num_seqs) if step[s]]
        new_lens = [lens[s] + step[s] for s in range(num_seqs)]
        qsl = np.concatenate([[0], np.cumsum([step[s] for s in batch])]).astype(np.int32)
        rows = int(qsl[-1])
        key = (rng.standard_normal((rows + case.pad_rows, H, D)) * (1 + 9 * (rng.random(D) < 0.1))).astype(np.float32)
        # a few channels of zeros of either sign: channel groups whose minimum is 0 (-0 == +0, so the sign a
        # reduction returns depends on its order unless the format fixes it)
        zero = rng.random(D) < 0.05
        key[:, :, zero] = np.where(rng.random(key[:, :, zero].shape) < 0.5, np.float32(-0.0), np.float32(0.0))
        value = rng.standard_normal((rows + case.pad_rows, H, D)).astype(np.float32)
        if case.nonfinite:
            # head 0: key channel 1 and the values' first 32 channels +-inf in every row (groups with no finite
            # value on both sides), key channel 2 NaN in every third row
            sign = np.where(np.arange(len(key)) % 2 == 0, np.float32(np.inf), np.float32(-np.inf))
            key[:, 0, 1] = sign
            key[::3, 0, 2] = np.nan
            value[:, 0, :min(D, 32)] = sign[:, None]
        slots = np.full(rows + case.pad_rows, -1, dtype=np.int64)  # padding rows at the end: slot -1
        for i, s in enumerate(batch):
            pos = np.arange(lens[s], new_lens[s])
            slots[qsl[i]:qsl[i + 1]] = table[s, pos // bs].astype(np.int64) * bs + pos % bs
        meta = dict(seq_ids=seq_ids[batch], query_start_loc=qsl,
                    seq_lens=np.array([new_lens[s] for s in batch], dtype=np.int32), block_table=table[batch])
        key_t, value_t = torch.from_numpy(key).to(case.dtype), torch.from_numpy(value).to(case.dtype)
        fmt.write(cache, key_t.to(device), value_t.to(device), torch.from_numpy(slots).to(device),
                  **{k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in meta.items()})
        R.kivi_write(spec, expected, key_t.float().numpy(), value_t.float().numpy(), slots, block_size=bs, **meta)
        for i, s in enumerate(batch):  # tokens that go through the ring are encoded from their rounded values
            flushed_now = max(new_lens[s] - res["tokens"], 0) // res["group"] * res["group"]
            for side, t in (("key", key_t), ("value", value_t)):
                x = t[qsl[i]:qsl[i + 1]].float()
                through_ring = torch.arange(lens[s], new_lens[s]) >= flushed_now
                x[through_ring] = x[through_ring].to(ring_dtype).float()
                seen[side][s].append(x.numpy())
        for name, want in expected.items():
            got = cache.tensors[name].view(torch.uint8).reshape(want.shape[0], -1).cpu().numpy()
            if not np.array_equal(got, want) and result["bytes"] is None:
                where = tuple(int(i) for i in np.argwhere(got != want)[0])
                result["bytes"] = (f"after appending {step}: {name} differs first at {where}: kernel "
                                   f"{int(got[where]):#04x}, reference {int(want[where]):#04x}")
        lens = new_lens
    if case.nonfinite:
        return result  # the bytes only: non-finite inputs have no error bound, and attention over them is NaN

    for s in range(num_seqs):  # quantization error of every position within the spec's bound
        if not lens[s]:
            continue
        k_x, v_x = (np.concatenate(seen[side][s]) for side in ("key", "value"))
        k_b, v_b = R.kivi_error_bound(spec, k_x, v_x)
        k_d, v_d = R.kivi_read(spec, expected, int(seq_ids[s]), lens[s], table[s], bs, H, D)
        for side, dec, x, b in (("key", k_d, k_x, k_b), ("value", v_d, v_x, v_b)):
            err = np.abs(dec - x.astype(np.float64))
            if not np.all(err <= b) and result["error_bound"] is None:
                worst = np.unravel_index(np.argmax(err - b), err.shape)
                result["error_bound"] = (f"sequence {s} {side}: error {err[worst]:.4g} above its bound "
                                         f"{b[worst]:.4g} at (position, head, dim) {tuple(int(i) for i in worst)}")

    # attention over the final state for the tokens of the last step
    batch = [s for s in range(num_seqs) if case.steps[-1][s]]
    qsl = np.concatenate([[0], np.cumsum([case.steps[-1][s] for s in batch])]).astype(np.int32)
    num_q_heads = H * case.group
    query = torch.from_numpy(rng.standard_normal((int(qsl[-1]), num_q_heads, D)).astype(np.float32)).to(case.dtype)
    sm_scale = 1.0 / math.sqrt(D)
    seq_lens = np.array([lens[s] for s in batch], dtype=np.int32)
    out = fmt.attend(query.to(device), cache, torch.from_numpy(table[batch]).to(device),
                     torch.from_numpy(seq_lens).to(device), torch.from_numpy(qsl).to(device), sm_scale=sm_scale,
                     sliding_window=case.window, seq_ids=torch.from_numpy(seq_ids[batch]).to(device),
                     num_splits=case.splits, dot_precision=dot_precision, dequantize_first=dequantize_first).cpu()
    seqs = [R.kivi_read(spec, expected, int(seq_ids[s]), lens[s], table[s], bs, H, D) for s in batch]
    if dequantize_first:  # the reference of the dense cache: each dequantized value rounded to the dense type
        ref = dense_attention(query.double().numpy(), seqs, qsl, sm_scale, case.window,
                              dense_type(dequantize_first, case.dtype))
    else:
        ref = R.kivi_attention(spec, expected, query.double().numpy(), seq_ids[batch], qsl, seq_lens, table[batch],
                               sm_scale, case.window, bs, num_kv_heads=H)
    result["attention"] = attention_error(spec, out.double().numpy(), ref, query.double().numpy(), seqs, qsl,
                                          sm_scale, case.window, case.dtype, dot_precision == "fast")
    return result
