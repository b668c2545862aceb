"""The page layout (cache.layout = interleaved, vLLM's Triton backend) and whole-cache write / read.

Rules:
  * One tensor per layer, physical ``[num_blocks, block_size, num_kv_heads, C]``, C the cell in units of
    cache.storage_dtype. The reference handles it as bytes: uint8 ``[num_blocks, block_size, H, cell_bytes]``.
  * A cell (one slot, one KV head) holds, in order: K data (D * bits / 8 bytes, at offset 0); the K scale if the key
    scale is dynamic and inline (at the next multiple of ``scale.align``, default the scale's size); V data (at the
    next multiple of its element's byte size); the V scale likewise. Each field starts where the previous ended,
    rounded up to its own alignment.
  * cell_bytes = the end of the last field rounded up to the largest alignment of any field in the cell; it must be
    a whole number of storage elements. Static scales are not in the page. page_bytes = block_size * H * cell_bytes.
  * A token with slot ``s >= 0`` goes to block ``s // block_size``, offset ``s % block_size``; ``s < 0`` is not
    written. Fields of a cell not covered by a written token keep their bytes. Two tokens with one slot: the last
    one wins in the reference (kernels need not agree).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ._schema import CacheLayout, FormatSpec, SideSpec, StorageDType
from .codes import ELEMENT_BYTES
from .quant import StaticScale, as_float32, decode_side, encode_side, is_dynamic, require_side

STORAGE_BYTES: dict[StorageDType, int] = {
    StorageDType.uint8: 1,
    StorageDType.int8: 1,
    StorageDType.fp16: 2,
    StorageDType.bf16: 2,
    StorageDType.fp32: 4,
}
SIDE_PREFIX = {"key": "k", "value": "v"}


def require_format(spec: FormatSpec) -> None:
    """Raise NotImplementedError for a format outside the first milestone."""
    if spec.cache.layout != CacheLayout.interleaved:
        raise NotImplementedError(f"reference: cache layout {spec.cache.layout.value} is not supported yet")
    require_side(spec.key)
    require_side(spec.value)


def _align_up(n: int, a: int) -> int:
    return -(-n // a) * a


def data_bytes(side: SideSpec, head_size: int) -> int:
    """Bytes of one side's data in a cell: D * bits / 8."""
    return head_size * ELEMENT_BYTES[side.element]


def cell_layout(spec: FormatSpec, head_size: int) -> dict[str, int]:
    """Byte offsets of the fields of one cell and its size.

    Keys: ``k_data``, ``k_scale`` (only with a dynamic inline key scale), ``v_data``, ``v_scale`` (likewise),
    ``cell_bytes``. Example, int8_per_token_head at D=128: k_data 0, k_scale 128, v_data 132, v_scale 260,
    cell_bytes 264.
    """
    require_format(spec)
    if head_size < 1:
        raise ValueError(f"head_size must be >= 1, got {head_size}")
    out: dict[str, int] = {}
    end = 0
    largest_align = 1
    for name in ("key", "value"):
        side = spec.side(name)
        prefix = SIDE_PREFIX[name]
        align = ELEMENT_BYTES[side.element]
        end = _align_up(end, align)
        out[f"{prefix}_data"] = end
        end += data_bytes(side, head_size)
        largest_align = max(largest_align, align)
        if is_dynamic(side):
            assert side.scale is not None
            align = side.scale.inline_align
            end = _align_up(end, align)
            out[f"{prefix}_scale"] = end
            end += side.scale.scale_bytes
            largest_align = max(largest_align, align)
    cell = _align_up(end, largest_align)
    unit = STORAGE_BYTES[spec.cache.storage_dtype]
    if cell % unit:
        raise NotImplementedError(
            f"reference: a {cell}-byte cell is not a whole number of {spec.cache.storage_dtype.value} elements")
    out["cell_bytes"] = cell
    return out


def page_bytes(spec: FormatSpec, block_size: int, num_kv_heads: int, head_size: int) -> int:
    """Bytes of one page (block) of one layer: block_size * num_kv_heads * cell_bytes."""
    return block_size * num_kv_heads * cell_layout(spec, head_size)["cell_bytes"]


def new_cache_bytes(spec: FormatSpec, num_blocks: int, block_size: int, num_kv_heads: int,
                    head_size: int) -> np.ndarray:
    """A zeroed cache as bytes: uint8 ``[num_blocks, block_size, num_kv_heads, cell_bytes]``."""
    cell = cell_layout(spec, head_size)["cell_bytes"]
    return np.zeros((num_blocks, block_size, num_kv_heads, cell), dtype=np.uint8)


def as_cache_bytes(cache: np.ndarray) -> np.ndarray:
    """View a cache array of any storage dtype ``[..., C]`` as its bytes ``[..., C * itemsize]`` (no copy when the
    array is contiguous, so writes go through)."""
    a = np.asarray(cache)
    if a.dtype == np.uint8:
        return a
    if not a.flags.c_contiguous:
        raise ValueError("the cache array must be C-contiguous")
    return a.view(np.uint8)


def _side_scale(name: str, k_scale: StaticScale, v_scale: StaticScale) -> StaticScale:
    return k_scale if name == "key" else v_scale


def write(spec: FormatSpec, cache_bytes: np.ndarray, key: np.ndarray, value: np.ndarray, slot_mapping: np.ndarray,
          k_scale: StaticScale = None, v_scale: StaticScale = None) -> None:
    """Encode ``key`` / ``value`` (float32 ``[T, H, D]``) into ``cache_bytes`` in place at ``slot_mapping`` (``[T]``).

    ``k_scale`` / ``v_scale`` are the static scales of static sides (``None`` = 1.0); dynamic scales are computed
    and stored inline. Slots < 0 are skipped; a slot past the cache raises IndexError.
    """
    cache = as_cache_bytes(cache_bytes)
    key, value = as_float32(key), as_float32(value)
    if key.shape != value.shape or key.ndim != 3:
        raise ValueError(f"key and value must both be [T, H, D], got {key.shape} and {value.shape}")
    num_tokens, num_heads, head_size = key.shape
    layout = cell_layout(spec, head_size)
    if cache.ndim != 4 or cache.shape[2:] != (num_heads, layout["cell_bytes"]):
        raise ValueError(f"cache bytes must be [blocks, block_size, {num_heads}, {layout['cell_bytes']}], "
                         f"got {cache.shape}")
    slots = np.asarray(slot_mapping, dtype=np.int64).reshape(-1)
    if slots.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must have {num_tokens} entries, got {slots.shape}")
    num_blocks, block_size = cache.shape[:2]
    if np.any(slots >= num_blocks * block_size):
        raise IndexError(f"slot {int(slots.max())} is past the cache ({num_blocks} x {block_size} slots)")
    written = slots >= 0
    blocks, offsets = slots[written] // block_size, slots[written] % block_size
    for name, x in (("key", key), ("value", value)):
        side, prefix = spec.side(name), SIDE_PREFIX[name]
        data, scale = encode_side(side, x, _side_scale(name, k_scale, v_scale))
        start = layout[f"{prefix}_data"]
        cache[blocks, offsets, :, start:start + data.shape[-1]] = data[written]
        if scale is not None:
            start = layout[f"{prefix}_scale"]
            scale_bytes = np.ascontiguousarray(scale.astype("<f4")).view(np.uint8).reshape(*scale.shape, 4)
            cache[blocks, offsets, :, start:start + 4] = scale_bytes[written]


def read(spec: FormatSpec, cache_bytes: np.ndarray, k_scale: StaticScale = None, v_scale: StaticScale = None,
         head_size: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
    """Decode every slot of a cache: ``(K, V)`` float64 ``[num_blocks, block_size, H, D]``.

    ``head_size`` may be left out when only one head size gives the cache's cell size.
    """
    cache = as_cache_bytes(cache_bytes)
    if cache.ndim != 4:
        raise ValueError(f"cache bytes must be [blocks, block_size, H, cell_bytes], got {cache.shape}")
    if head_size is None:
        head_size = infer_head_size(spec, cache.shape[-1])
    layout = cell_layout(spec, head_size)
    if cache.shape[-1] != layout["cell_bytes"]:
        raise ValueError(f"head size {head_size} gives {layout['cell_bytes']}-byte cells, the cache has "
                         f"{cache.shape[-1]}")
    out = []
    for name in ("key", "value"):
        side, prefix = spec.side(name), SIDE_PREFIX[name]
        start = layout[f"{prefix}_data"]
        data = cache[..., start:start + data_bytes(side, head_size)]
        scale: StaticScale = _side_scale(name, k_scale, v_scale)
        if is_dynamic(side):
            start = layout[f"{prefix}_scale"]
            scale = np.ascontiguousarray(cache[..., start:start + 4]).view("<f4")[..., 0].astype(np.float32)
        out.append(decode_side(side, data, scale))
    return out[0], out[1]


def infer_head_size(spec: FormatSpec, cell_bytes: int) -> int:
    """The head size whose cell is ``cell_bytes`` long; ValueError when none or several are."""
    matches = []
    for d in range(1, cell_bytes + 1):
        try:
            if cell_layout(spec, d)["cell_bytes"] == cell_bytes:
                matches.append(d)
        except NotImplementedError:  # a head size whose cell is not whole storage elements
            continue
    if len(matches) != 1:
        raise ValueError(f"cannot tell the head size from a {cell_bytes}-byte cell (candidates {matches}): "
                         "pass head_size")
    return matches[0]
