"""KIVI: keys quantized per channel over groups of G tokens, values per token, the newest tokens in full precision.

Rules (docs/SEMANTICS.md, "Float zero points" and "KIVI"), for a spec whose key side is ``per_channel_group`` with
``group_tokens: G`` and whose sides share ``residual: {tokens: R, dtype}``:
  * Quantized prefix: a sequence of length L keeps positions ``[0, Q(L))`` quantized in its pages and ``[Q(L), L)``
    in full precision, ``Q(L) = G * floor(max(L - R, 0) / G)``. The state depends on L only.
  * Write (one batch): sequence s owns rows ``query_start_loc[s] .. query_start_loc[s+1] - 1`` at positions
    ``L_old .. L_new - 1`` (``L_new = seq_lens[s]``, ``L_old = L_new - q_len``). Groups ``Q(L_old)/G ..
    Q(L_new)/G - 1`` are quantized from full-precision values: positions ``< L_old`` from the residual buffer (the
    stored, residual-dtype values), positions ``>= L_old`` from the float32 input rows. Each token's codes go to the
    slot of its position ``block_table[s, p // block_size] * block_size + p % block_size``; the key group's scales
    and zero points to the page holding position ``g * G``, group index ``(g * G mod block_size) / G``. Then the new
    tokens with ``p >= Q(L_new)`` are rounded (nearest even) to the residual dtype and stored at ring index
    ``p mod (R + G)`` of row ``seq_ids[s]`` (after the groups were read: a new entry may overwrite a flushed one).
    New tokens below ``Q(L_new)`` never enter the ring; ring entries of positions below ``Q(L)`` are stale and
    meaningless. Rows outside every sequence (padding) are skipped.
  * Key group (channel c, head h, group g): ``lo`` / ``hi`` = min / max over the G tokens, ``s = (hi - lo) / qmax``
    floored and rounded to the scale dtype (``s_q``), ``m`` = ``lo`` in the zero-point dtype, codes
    ``clamp(round((x - m) / s_q), 0, qmax)`` (or ``* (1 / s_q)``), decode ``code * s_q + m`` (quant.float_zp_*).
  * Values: every token is encoded by itself with the value side's own rule (quant.encode_side), usually per_block
    over 32 channels with a float zero point.
  * Page (one tensor ``kv_cache``, uint8 ``[num_blocks, page bytes]``):
      - the cell region ``[block_size, H, cell]``: ``k_data`` (the key codes of the token), then the value side's
        inline fields ``v_data``, ``v_scale``, ``v_zp``, each at the next multiple of its alignment (data: element
        size, at least 1; scale: ``align`` or its size; zero point: its size), the cell ending at the largest
        alignment of its fields and of the storage dtype;
      - the key group region ``[block_size / G, H, entry]``, starting at a multiple of its alignment, ``entry`` =
        D scales (scale dtype) then D zero points (zero-point dtype, at a multiple of its size), ending at the
        largest of the two sizes and the storage dtype's;
      - the page ends at a multiple of the largest region alignment.
  * Residual buffers ``k_residual`` / ``v_residual``: logically ``[max_seqs, R + G, H, D]`` in the residual dtype,
    kept here as their little-endian bytes, uint8 ``[max_seqs, (R + G) * H * D * dtype bytes]`` (what the runtime's
    tensor gives as ``t.view(torch.uint8).reshape(max_seqs, -1)``).
  * Read: positions ``< Q(L)`` decoded from the pages (float64), the rest from the residual buffer (exact).
  * Attention: :func:`.attention.paged_attention`'s rules on the read values (query i at ``L - q_len + i``).
Not defined by SEMANTICS.md (NotImplementedError): rotation, split layout, a value side with per_channel_group or
non-inline scales, a key side without a float zero point.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, MutableMapping, Optional

import ml_dtypes
import numpy as np

from ._schema import CacheLayout, ElementType, FormatSpec, Granularity, Placement, SideSpec
from .attention import paged_attention
from .codes import (ELEMENT_BITS, SCALE_BYTES, decode_codes, decode_scale, element_codes, encode_codes, half_ulp,
                    pack)
from .layout import STORAGE_BYTES, RegionLayout, _align_up, _data_align, _region, _scale_align
from .quant import (as_float32, data_bytes, decode_side, decode_zero, encode_side, error_bound, finite_range, float_zp_bound, sanitize_nan,
                    float_zp_scale, float_zp_values, has_float_zp, is_dynamic, require_side, scale_field_bytes,
                    zp_bytes, zp_field_bytes)

#: numpy dtype of each residual dtype.
RESIDUAL_DTYPES: dict[str, type] = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp32": np.float32}
RESIDUAL_ELEMENT: dict[str, ElementType] = {"bf16": ElementType.bf16, "fp16": ElementType.fp16,
                                             "fp32": ElementType.fp32}

KiviCache = MutableMapping[str, np.ndarray]


# --- the spec -------------------------------------------------------------------------------------------------------


def is_kivi(spec: FormatSpec) -> bool:
    """True when the format keeps a full-precision residual window with per-channel key groups (KIVI)."""
    sc = spec.key.scale
    return spec.key.residual is not None and sc is not None and sc.granularity == Granularity.per_channel_group


def _plain(side: SideSpec) -> SideSpec:
    """The side without its residual window (what the per-token rules of quant.py see)."""
    return side.model_copy(update={"residual": None})


def require_kivi(spec: FormatSpec) -> None:
    """Raise for a spec that is not KIVI, NotImplementedError for KIVI variants SEMANTICS.md does not define."""
    if not is_kivi(spec):
        raise ValueError(f"format {spec.name} is not KIVI (key per_channel_group with a residual window)")
    if spec.value.residual != spec.key.residual:
        raise ValueError("key.residual and value.residual must be the same")
    if spec.cache.layout != CacheLayout.interleaved:
        raise NotImplementedError("reference: KIVI with a split layout is not defined in SEMANTICS.md")
    key, value = spec.key, spec.value
    for name, side in (("key", key), ("value", value)):
        if side.rotation is not None:
            raise NotImplementedError(f"reference: KIVI with a rotation ({name}) is not defined in SEMANTICS.md")
    assert key.scale is not None and key.residual is not None
    if key.scale.placement != Placement.page_end:
        raise ValueError("KIVI key group scales are placed page_end")
    if not has_float_zp(key):
        raise NotImplementedError("reference: KIVI keys without a float zero point are not defined in SEMANTICS.md")
    if key.scale.global_scale:
        raise NotImplementedError("reference: KIVI keys with a global scale are not defined in SEMANTICS.md")
    if key.residual.tokens % key.scale.group_tokens:
        raise ValueError(f"residual tokens {key.residual.tokens} is not a multiple of G {key.scale.group_tokens}")
    vs = value.scale
    if vs is not None:
        if vs.granularity == Granularity.per_channel_group:
            raise NotImplementedError("reference: KIVI values per channel group are not defined in SEMANTICS.md")
        if is_dynamic(value) and vs.placement != Placement.inline:
            raise NotImplementedError("reference: KIVI value scales other than inline are not defined in "
                                      "SEMANTICS.md")
    require_side(_plain(value))


@dataclasses.dataclass(frozen=True)
class KiviParams:
    G: int  # tokens per key group
    R: int  # residual tokens
    residual_dtype: str  # bf16 / fp16 / fp32

    @property
    def ring(self) -> int:
        """Entries of the residual ring per sequence: R + G."""
        return self.R + self.G

    @property
    def residual_itemsize(self) -> int:
        return np.dtype(RESIDUAL_DTYPES[self.residual_dtype]).itemsize


def kivi_params(spec: FormatSpec) -> KiviParams:
    require_kivi(spec)
    assert spec.key.scale is not None and spec.key.residual is not None
    return KiviParams(spec.key.scale.group_tokens, spec.key.residual.tokens, spec.key.residual.dtype)


def quantized_length(L: int, G: int, R: int) -> int:
    """``Q(L) = G * floor(max(L - R, 0) / G)``: positions ``[0, Q(L))`` of a length-L sequence are quantized."""
    return G * (max(int(L) - int(R), 0) // G)


def kivi_q(spec: FormatSpec, L: int) -> int:
    """``Q(L)`` of a KIVI spec."""
    p = kivi_params(spec)
    return quantized_length(L, p.G, p.R)


# --- layout ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KiviLayout:
    """The KIVI page: a cell region ``[block_size, H, cell]`` then a key group region ``[block_size / G, H, entry]``."""

    cell: RegionLayout  # fields k_data, v_data[, v_scale[, v_zp]]
    entry: int  # bytes of one (group, head) entry of the key group region: D scales then D zero points
    entry_align: int
    k_scale_offset: int  # in the entry (0)
    k_scale_bytes: int  # D * scale bytes
    k_zp_offset: int
    k_zp_bytes: int  # D * zero-point bytes
    G: int

    def field(self, name: str):
        for f in self.cell.fields:
            if f.name == name:
                return f
        return None

    def group_region_offset(self, block_size: int, H: int) -> int:
        return _align_up(block_size * H * self.cell.cell, self.entry_align)

    def page_bytes(self, block_size: int, H: int) -> int:
        if block_size % self.G:
            raise ValueError(f"block_size {block_size} is not a multiple of group_tokens {self.G}")
        end = self.group_region_offset(block_size, H) + (block_size // self.G) * H * self.entry
        return _align_up(end, max(self.cell.align, self.entry_align))


def kivi_layout(spec: FormatSpec, head_size: int) -> KiviLayout:
    """The KIVI page layout at ``head_size`` (see the module docstring)."""
    prm = kivi_params(spec)
    D = head_size
    key, value = spec.key, _plain(spec.value)
    storage = spec.cache.storage_dtype
    assert storage is not None and key.scale is not None
    fields = [("k_data", data_bytes(key, D), _data_align(key)),
              ("v_data", data_bytes(value, D), _data_align(value))]
    if is_dynamic(value):
        fields.append(("v_scale", scale_field_bytes(value, D), _scale_align(value)))
        if zp_field_bytes(value, D):
            fields.append(("v_zp", zp_field_bytes(value, D), zp_bytes(value)))
    cell = _region(fields, storage)
    sb, zb = SCALE_BYTES[key.scale.dtype], zp_bytes(key)
    zp_off = _align_up(D * sb, zb)
    align = max(sb, zb, STORAGE_BYTES[storage])
    entry = _align_up(zp_off + D * zb, align)
    return KiviLayout(cell, entry, align, 0, D * sb, zp_off, D * zb, prm.G)


def kivi_page_bytes(spec: FormatSpec, block_size: int, num_kv_heads: int, head_size: int) -> int:
    """Bytes of one KIVI page (codes, value metadata and key group metadata) of one layer."""
    return kivi_layout(spec, head_size).page_bytes(block_size, num_kv_heads)


def kivi_residual_bytes(spec: FormatSpec, num_kv_heads: int, head_size: int) -> int:
    """Bytes of the residual buffers of one sequence, both sides: ``2 * (R + G) * H * D * dtype bytes``."""
    p = kivi_params(spec)
    return 2 * p.ring * num_kv_heads * head_size * p.residual_itemsize


def kivi_residual_shapes(spec: FormatSpec, max_seqs: int, num_kv_heads: int,
                         head_size: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{name: (logical shape [max_seqs, R + G, H, D], residual dtype name)}`` of ``k_residual`` / ``v_residual``."""
    p = kivi_params(spec)
    shape = (max_seqs, p.ring, num_kv_heads, head_size)
    return {"k_residual": (shape, p.residual_dtype), "v_residual": (shape, p.residual_dtype)}


def kivi_new_cache(spec: FormatSpec, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                   max_seqs: int) -> dict[str, np.ndarray]:
    """A zeroed KIVI cache: ``kv_cache`` uint8 ``[num_blocks, page bytes]``, ``k_residual`` / ``v_residual`` uint8
    ``[max_seqs, (R + G) * H * D * dtype bytes]`` (the little-endian bytes of ``[max_seqs, R + G, H, D]``)."""
    p = kivi_params(spec)
    page = kivi_page_bytes(spec, block_size, num_kv_heads, head_size)
    res = p.ring * num_kv_heads * head_size * p.residual_itemsize
    return {"kv_cache": np.zeros((num_blocks, page), np.uint8),
            "k_residual": np.zeros((max_seqs, res), np.uint8),
            "v_residual": np.zeros((max_seqs, res), np.uint8)}


# --- views ----------------------------------------------------------------------------------------------------------


def _bytes2d(a: np.ndarray, rows: int) -> np.ndarray:
    a = np.asarray(a)
    if not a.flags.c_contiguous:
        raise ValueError("every cache array must be C-contiguous")
    out = a.view(np.uint8).reshape(rows, -1)
    if out.size and not np.shares_memory(out, a):
        raise ValueError("cannot view the cache array as bytes without a copy")
    return out


def _views(spec: FormatSpec, cache: Mapping[str, np.ndarray], block_size: int, H: int, D: int
           ) -> tuple[KiviLayout, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(layout, cells [nb, bs, H, cell], groups [nb, bs / G, H, entry], k_res [S, R+G, H, D*isz], v_res)."""
    lay = kivi_layout(spec, D)
    p = kivi_params(spec)
    for name in ("kv_cache", "k_residual", "v_residual"):
        if name not in cache:
            raise ValueError(f"a KIVI cache has kv_cache, k_residual and v_residual; {name} is missing")
    kv = np.asarray(cache["kv_cache"])
    num_blocks = kv.shape[0]
    pages = _bytes2d(kv, num_blocks)
    page = lay.page_bytes(block_size, H)
    if pages.shape[1] != page:
        raise ValueError(f"kv_cache pages are {pages.shape[1]} bytes, the layout says {page} (block_size "
                         f"{block_size}, {H} heads, head size {D})")
    cells = pages[:, :block_size * H * lay.cell.cell].reshape(num_blocks, block_size, H, lay.cell.cell)
    off = lay.group_region_offset(block_size, H)
    n_groups = block_size // p.G
    groups = pages[:, off:off + n_groups * H * lay.entry].reshape(num_blocks, n_groups, H, lay.entry)
    res = []
    for name in ("k_residual", "v_residual"):
        a = np.asarray(cache[name])
        r = _bytes2d(a, a.shape[0])
        want = p.ring * H * D * p.residual_itemsize
        if r.shape[1] != want:
            raise ValueError(f"{name} rows are {r.shape[1]} bytes, want (R + G) * H * D * itemsize = {want}")
        res.append(r.reshape(a.shape[0], p.ring, H, D * p.residual_itemsize))
    return lay, cells, groups, res[0], res[1]


def residual_values(spec: FormatSpec, residual: np.ndarray, num_kv_heads: int, head_size: int) -> np.ndarray:
    """A residual buffer (bytes) as float64 ``[max_seqs, R + G, H, D]``."""
    p = kivi_params(spec)
    r = _bytes2d(np.asarray(residual), np.asarray(residual).shape[0])
    vals = decode_codes(RESIDUAL_ELEMENT[p.residual_dtype], r.reshape(r.shape[0], p.ring, num_kv_heads, -1))
    return vals


# --- key groups -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class KeyGroupEncoding:
    """One key group of G tokens: ``data`` uint8 ``[G, H, key data bytes]`` (each token's packed codes),
    ``scale`` uint8 ``[H, D * scale bytes]``, ``zp`` uint8 ``[H, D * zp bytes]``, ``s_q`` / ``m`` float32 ``[H, D]``,
    ``codes`` uint8 ``[G, H, D]`` (unpacked)."""

    data: np.ndarray
    scale: np.ndarray
    zp: np.ndarray
    s_q: np.ndarray
    m: np.ndarray
    codes: np.ndarray


def encode_key_group(side: SideSpec, x: np.ndarray) -> KeyGroupEncoding:
    """Encode float32 ``x`` ``[G, H, D]`` (G consecutive positions) per channel and head."""
    x = as_float32(x)
    x = sanitize_nan(side, x)
    s_q, m, stored, zp_stored = float_zp_scale(side, *finite_range(x, axis=0))  # [H, D]
    v = float_zp_values(side, x, s_q[None], m[None])
    codes = element_codes(side.element, v, side.rounding)
    data = pack(codes, ELEMENT_BITS[side.element], side.packing)
    return KeyGroupEncoding(data, stored, zp_stored, s_q, m, codes)


def key_group_bound(side: SideSpec, x: np.ndarray) -> np.ndarray:
    """Bound on ``|decoded - x|`` per element ``[G, H, D]`` of one key group of float32 ``x`` (see
    quant.float_zp_bound: half a step, plus how far ``m``'s rounding or ``s_q``'s pushes values out of range, plus the
    float32 slack)."""
    x = as_float32(x)
    x = sanitize_nan(side, x)
    s_q, m, _, _ = float_zp_scale(side, *finite_range(x, axis=0))
    return float_zp_bound(side, x, s_q[None], m[None])


# --- write ----------------------------------------------------------------------------------------------------------


def _slot(block_table_row: np.ndarray, p: np.ndarray, block_size: int) -> np.ndarray:
    return block_table_row[p // block_size] * block_size + p % block_size


def kivi_write(spec: FormatSpec, cache: KiviCache, key: np.ndarray, value: np.ndarray, slot_mapping: np.ndarray,
               seq_ids: np.ndarray, query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray,
               block_size: int, num_kv_heads: Optional[int] = None, head_size: Optional[int] = None) -> None:
    """One KIVI write step, in place (see the module docstring).

    ``key`` / ``value`` float32 (or bf16 / fp16) ``[T, H, D]``; ``slot_mapping`` ``[T]``: for rows inside a sequence
    it must equal the slot of the row's position (ValueError otherwise), rows outside every sequence are skipped
    whatever their slot; ``seq_ids`` / ``seq_lens`` ``[S]``; ``query_start_loc`` ``[S + 1]``; ``block_table``
    ``[S, max_blocks]``. A sequence id may appear once per batch.
    """
    key, value = as_float32(key), as_float32(value)
    if key.shape != value.shape or key.ndim != 3:
        raise ValueError(f"key and value must both be [T, H, D], got {key.shape} and {value.shape}")
    T, H, D = key.shape
    if num_kv_heads is not None and num_kv_heads != H or head_size is not None and head_size != D:
        raise ValueError(f"key is [T, {H}, {D}], expected H={num_kv_heads}, D={head_size}")
    prm = kivi_params(spec)
    G, ring = prm.G, prm.ring
    if block_size % G:
        raise ValueError(f"block_size {block_size} is not a multiple of group_tokens {G}")
    lay, cells, groups, k_res, v_res = _views(spec, cache, block_size, H, D)
    num_blocks = cells.shape[0]
    res_el = RESIDUAL_ELEMENT[prm.residual_dtype]
    kside, vside = spec.key, _plain(spec.value)
    f_k = lay.field("k_data")
    v_fields = [(f, lay.field(f)) for f in ("v_data", "v_scale", "v_zp") if lay.field(f) is not None]

    slots_in = np.asarray(slot_mapping, dtype=np.int64).reshape(-1)
    if slots_in.shape != (T,):
        raise ValueError(f"slot_mapping must have {T} entries, got {slots_in.shape}")
    sids = np.asarray(seq_ids, dtype=np.int64).reshape(-1)
    lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    qsl = np.asarray(query_start_loc, dtype=np.int64).reshape(-1)
    bt = np.asarray(block_table, dtype=np.int64)
    S = lens.shape[0]
    if sids.shape != (S,) or qsl.shape != (S + 1,):
        raise ValueError(f"{S} sequences need {S} seq_ids and {S + 1} query_start_loc entries")
    if np.any(np.diff(qsl) < 0) or qsl[0] < 0 or qsl[-1] > T:
        raise ValueError(f"query_start_loc {qsl.tolist()} is not a non-decreasing range of rows 0..{T}")
    if len(set(sids.tolist())) != S:
        raise ValueError(f"a sequence id appears twice in one batch: {sids.tolist()}")
    if np.any(sids < 0) or np.any(sids >= k_res.shape[0]):
        raise IndexError(f"seq_ids {sids.tolist()} outside the residual buffers' {k_res.shape[0]} rows")

    for s in range(S):
        start, stop = int(qsl[s]), int(qsl[s + 1])
        q_len, L_new = stop - start, int(lens[s])
        if q_len == 0:
            continue
        if q_len > L_new:
            raise ValueError(f"sequence {s} has {q_len} new tokens but seq_len {L_new}")
        L_old = L_new - q_len
        row = bt[s]
        if -(-L_new // block_size) > row.shape[0]:
            raise ValueError(f"sequence {s} of length {L_new} needs more than {row.shape[0]} blocks")
        new_pos = np.arange(L_old, L_new)
        want = _slot(row, new_pos, block_size)
        if not np.array_equal(slots_in[start:stop], want):
            raise ValueError(f"sequence {s}: slot_mapping {slots_in[start:stop].tolist()} differs from the block "
                             f"table's slots {want.tolist()}")
        sid = int(sids[s])
        q_old, q_new = quantized_length(L_old, G, prm.R), quantized_length(L_new, G, prm.R)
        # 1. flush: groups that become quantized, from the full-precision values (read before the ring is written)
        if q_new > q_old:
            pos = np.arange(q_old, q_new)
            old = pos < L_old
            kx = np.empty((pos.size, H, D), np.float32)
            vx = np.empty((pos.size, H, D), np.float32)
            for x, res, src in ((kx, k_res, key), (vx, v_res, value)):
                x[old] = decode_codes(res_el, res[sid, pos[old] % ring]).astype(np.float32)
                x[~old] = src[start + pos[~old] - L_old]
            slots = _slot(row, pos, block_size)
            if np.any(slots < 0) or np.any(slots >= num_blocks * block_size):
                raise IndexError(f"sequence {s}: a slot of positions {q_old}..{q_new - 1} is outside the cache")
            blk, off = slots // block_size, slots % block_size
            venc = encode_side(vside, vx)
            for name, f in v_fields:
                vals = {"v_data": venc.data, "v_scale": venc.scale, "v_zp": venc.zp}[name]
                cells[blk, off, :, f.offset:f.offset + f.nbytes] = vals
            for g0 in range(q_old, q_new, G):
                i = g0 - q_old
                kenc = encode_key_group(kside, kx[i:i + G])
                cells[blk[i:i + G], off[i:i + G], :, f_k.offset:f_k.offset + f_k.nbytes] = kenc.data
                gb, gi = int(blk[i]), int(off[i]) // G
                groups[gb, gi, :, lay.k_scale_offset:lay.k_scale_offset + lay.k_scale_bytes] = kenc.scale
                groups[gb, gi, :, lay.k_zp_offset:lay.k_zp_offset + lay.k_zp_bytes] = kenc.zp
        # 2. the new tokens that stay in full precision -> the ring
        keep = new_pos >= q_new
        if keep.any():
            p = new_pos[keep]
            rows = start + p - L_old
            k_res[sid, p % ring] = encode_codes(res_el, key[rows])
            v_res[sid, p % ring] = encode_codes(res_el, value[rows])


# --- read -----------------------------------------------------------------------------------------------------------


def kivi_read(spec: FormatSpec, cache: Mapping[str, np.ndarray], seq_id: int, seq_len: int,
              block_table_row: np.ndarray, block_size: int, num_kv_heads: int,
              head_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(K, V)`` float64 ``[seq_len, H, D]`` of one sequence: positions ``< Q(L)`` decoded from the pages, the rest
    from the residual buffers (row ``seq_id``)."""
    H, D, L = num_kv_heads, head_size, int(seq_len)
    prm = kivi_params(spec)
    lay, cells, groups, k_res, v_res = _views(spec, cache, block_size, H, D)
    row = np.asarray(block_table_row, dtype=np.int64).reshape(-1)
    q = quantized_length(L, prm.G, prm.R)
    K = np.zeros((L, H, D), np.float64)
    V = np.zeros((L, H, D), np.float64)
    if q:
        pos = np.arange(q)
        slots = _slot(row, pos, block_size)
        blk, off = slots // block_size, slots % block_size
        c = cells[blk, off]  # [q, H, cell]
        kside, vside = spec.key, _plain(spec.value)
        assert kside.scale is not None
        f = lay.field("k_data")
        codes = decode_codes(kside.element, c[..., f.offset:f.offset + f.nbytes], D, kside.packing)  # [q, H, D]
        meta = groups[blk, off // prm.G]  # [q, H, entry]: each position's group entry
        s_q = decode_scale(kside.scale.dtype, meta[..., lay.k_scale_offset:lay.k_scale_offset + lay.k_scale_bytes])
        m = decode_zero(kside, meta[..., lay.k_zp_offset:lay.k_zp_offset + lay.k_zp_bytes])
        K[:q] = codes * s_q.astype(np.float64) + m.astype(np.float64)
        fv = {n: lay.field(n) for n in ("v_data", "v_scale", "v_zp")}
        part = {n: (None if fl is None else c[..., fl.offset:fl.offset + fl.nbytes]) for n, fl in fv.items()}
        V[:q] = decode_side(vside, part["v_data"], part["v_scale"], part["v_zp"], head_size=D)
    if L > q:
        res_el = RESIDUAL_ELEMENT[prm.residual_dtype]
        idx = np.arange(q, L) % prm.ring
        K[q:] = decode_codes(res_el, k_res[int(seq_id), idx])
        V[q:] = decode_codes(res_el, v_res[int(seq_id), idx])
    return K, V


def kivi_attention(spec: FormatSpec, cache: Mapping[str, np.ndarray], q: np.ndarray, seq_ids: np.ndarray,
                   query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray, sm_scale: float,
                   sliding_window: Optional[int], block_size: int,
                   num_kv_heads: Optional[int] = None) -> np.ndarray:
    """Attention output float64 ``[num_tokens, Hq, D]`` over the state after the write (rules of
    :func:`.attention.paged_attention`: query i of sequence s at position ``seq_len - q_len + i``, causal, optional
    sliding window, GQA); rows owned by no sequence are 0. ``num_kv_heads`` defaults to what the residual buffers'
    row size gives."""
    q = np.asarray(q, dtype=np.float64)
    D = q.shape[-1]
    prm = kivi_params(spec)
    H = num_kv_heads
    if H is None:
        res = np.asarray(cache["k_residual"])
        H = res.nbytes // max(res.shape[0], 1) // (prm.ring * D * prm.residual_itemsize)
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    lens = np.asarray(seq_lens, dtype=np.int64)
    bt = np.asarray(block_table, dtype=np.int64)
    out = np.zeros(q.shape, np.float64)
    for s in range(lens.shape[0]):
        start, stop = int(qsl[s]), int(qsl[s + 1])
        if stop == start:
            continue
        L = int(lens[s])
        K, V = kivi_read(spec, cache, int(seq_ids[s]), L, bt[s], block_size, H, D)
        n = max(-(-L // block_size), 1)
        kc = np.zeros((n * block_size, H, D))
        vc = np.zeros((n * block_size, H, D))
        kc[:L], vc[:L] = K, V
        out[start:stop] = paged_attention(q[start:stop], kc.reshape(n, block_size, H, D),
                                          vc.reshape(n, block_size, H, D), np.arange(n)[None],
                                          np.array([L]), np.array([0, stop - start]), sm_scale, sliding_window)
    return out


# --- error bound ----------------------------------------------------------------------------------------------------


def kivi_error_bound(spec: FormatSpec, key: np.ndarray, value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-element bounds float64 ``[L, H, D]`` on ``|kivi_read - x|`` for one sequence whose full-precision values
    (as the encoder saw them: residual-dtype values for tokens that passed through the ring) are ``key`` / ``value``
    ``[L, H, D]``: key groups per :func:`key_group_bound`, values per quant.error_bound, positions ``>= Q(L)`` half
    an ulp of the residual dtype (0 for fp32)."""
    prm = kivi_params(spec)
    key, value = as_float32(key), as_float32(value)
    L = key.shape[0]
    q = quantized_length(L, prm.G, prm.R)
    bk = np.zeros(key.shape, np.float64)
    bv = np.zeros(value.shape, np.float64)
    for g0 in range(0, q, prm.G):
        bk[g0:g0 + prm.G] = key_group_bound(spec.key, key[g0:g0 + prm.G])
    if q:
        bv[:q] = error_bound(_plain(spec.value), value[:q])
    res_el = RESIDUAL_ELEMENT[prm.residual_dtype]
    for b, x in ((bk, key), (bv, value)):
        if res_el != ElementType.fp32:
            b[q:] = half_ulp(res_el, np.abs(x[q:].astype(np.float64)))
    return bk, bv


__all__ = [
    "KeyGroupEncoding", "KiviLayout", "KiviParams", "RESIDUAL_DTYPES", "encode_key_group", "is_kivi",
    "key_group_bound", "kivi_attention", "kivi_error_bound", "kivi_layout", "kivi_new_cache", "kivi_page_bytes",
    "kivi_params", "kivi_q", "kivi_read", "kivi_residual_bytes", "kivi_residual_shapes", "kivi_write",
    "quantized_length", "require_kivi", "residual_values",
]
