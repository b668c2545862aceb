"""The page layout (tensors, regions, cells, fields) and whole-cache write / read.

Rules (docs/SEMANTICS.md, "Layout"):
  * Storage is one or more named tensors, each a sequence of pages (one page = ``block_size`` slots of all
    ``num_kv_heads`` heads). A page is a sequence of regions; a region is ``[block_size, num_kv_heads, cell]``
    (slot-major) and a cell holds one or more fields at fixed offsets.
  * Fields: ``{k,v}_data`` (``ceil(D * bits / 8)`` bytes), ``{k,v}_scale`` (one scale per group, little-endian;
    dynamic sides only), ``{k,v}_zp`` (one zero point per group in its dtype: uint8, or fp16 / fp32 little-endian
    for a float zero point; ``zero_point: beside_scale`` only).
  * Sides are placed key first, then value. The data tensor is ``kv_cache`` (``layout: interleaved``) or
    ``k_cache`` / ``v_cache`` (``split``). Every tensor has an open "cell region" that fields are appended to:
      - unquantized / static-scale side: its data is appended to the open cell region;
      - ``inline``: data, scale, zero point appended to the open cell region;
      - ``separate``: data appended to the open cell region; scale and zero point form the one region of a tensor
        of their own, ``k_scale_cache`` / ``v_scale_cache``;
      - ``page_end``: a region ``[data]`` and a region ``[scale, zero point]`` are appended to the page; they are
        closed, so a later inline / separate side opens a new cell region after them.
  * Alignment: a field starts at the next multiple of its alignment (data: ``data_align``, default its element
    size, at least 1; scale: ``align``, default the scale's size; zero point: its size, so 1 for uint8); a cell
    ends at a multiple of the largest alignment of its fields and of its tensor's storage dtype (= the region's
    alignment). Regions follow
    each other, each starting at a multiple of its alignment; a page ends at a multiple of the largest region
    alignment (this padding between regions and at the page end is zero in every format whose region sizes are
    multiples of the next alignment).
  * Storage dtypes: data tensors ``cache.storage_dtype``; scale tensors fp32 / fp16 / bf16 for those scale dtypes
    without a zero point, else uint8. Shapes in storage elements: one region ``[num_blocks, block_size, H,
    cell / itemsize]``, several ``[num_blocks, page / itemsize]``.
  * The reference keeps every tensor as bytes, uint8 ``[num_blocks, page bytes]`` (any C-contiguous array of the
    same bytes is accepted: the runtime's tensors viewed as uint8, or numpy arrays in the storage dtype).
  * A token with slot ``s >= 0`` goes to block ``s // block_size``, offset ``s % block_size``; ``s < 0`` is not
    written. Bytes not covered by a written token keep their value. Two tokens with one slot: the last one wins in
    the reference (kernels need not agree).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, MutableMapping, Optional, Union

import numpy as np

from ._schema import CacheLayout, FormatSpec, Placement, ScaleDType, SideSpec, StorageDType
from .codes import ELEMENT_BITS, SCALE_BYTES
from .quant import (StaticScale, as_float32, data_bytes, decode_side, encode_side, is_dynamic, require_side,
                    scale_field_bytes, takes_layer_scale, zp_bytes, zp_field_bytes)

STORAGE_BYTES: dict[StorageDType, int] = {
    StorageDType.uint8: 1,
    StorageDType.int8: 1,
    StorageDType.fp16: 2,
    StorageDType.bf16: 2,
    StorageDType.fp32: 4,
}
SCALE_STORAGE: dict[ScaleDType, StorageDType] = {
    ScaleDType.fp32: StorageDType.fp32,
    ScaleDType.fp16: StorageDType.fp16,
    ScaleDType.bf16: StorageDType.bf16,
}
SIDES = ("key", "value")
SIDE_PREFIX = {"key": "k", "value": "v"}

Cache = MutableMapping[str, np.ndarray]


def _align_up(n: int, a: int) -> int:
    return -(-n // a) * a


# --- the layout model -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FieldLayout:
    name: str  # k_data, k_scale, k_zp, v_data, v_scale, v_zp
    offset: int  # bytes from the start of the cell
    nbytes: int
    align: int


@dataclasses.dataclass(frozen=True)
class RegionLayout:
    fields: tuple[FieldLayout, ...]
    cell: int  # bytes per (slot, head)
    align: int  # the largest alignment of its fields and of the tensor's storage dtype


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    name: str
    storage: StorageDType
    regions: tuple[RegionLayout, ...]

    @property
    def itemsize(self) -> int:
        return STORAGE_BYTES[self.storage]

    def region_offsets(self, block_size: int, num_kv_heads: int) -> list[int]:
        """Byte offset of every region in the page."""
        out, end = [], 0
        for r in self.regions:
            end = _align_up(end, r.align)
            out.append(end)
            end += block_size * num_kv_heads * r.cell
        return out

    def page_bytes(self, block_size: int, num_kv_heads: int) -> int:
        last = self.regions[-1]
        end = self.region_offsets(block_size, num_kv_heads)[-1] + block_size * num_kv_heads * last.cell
        return _align_up(end, max(r.align for r in self.regions))

    def shape(self, num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[int, ...]:
        """The tensor's shape in storage elements."""
        if len(self.regions) == 1:
            return (num_blocks, block_size, num_kv_heads, self.regions[0].cell // self.itemsize)
        return (num_blocks, self.page_bytes(block_size, num_kv_heads) // self.itemsize)

    def find(self, field: str) -> Optional[tuple[int, FieldLayout]]:
        for i, r in enumerate(self.regions):
            for f in r.fields:
                if f.name == field:
                    return i, f
        return None


def padding_bytes(region: RegionLayout) -> list[int]:
    """The bytes of a region's cell that no field holds (alignment padding), which writes store as zeros."""
    held = np.zeros(region.cell, bool)
    for f in region.fields:
        held[f.offset:f.offset + f.nbytes] = True
    return [int(i) for i in np.flatnonzero(~held)]


def _data_align(side: SideSpec) -> int:
    if side.data_align is not None:
        return side.data_align
    return max(ELEMENT_BITS[side.element] // 8, 1)


def _scale_align(side: SideSpec) -> int:
    sc = side.scale
    assert sc is not None
    if sc.placement == Placement.inline and sc.align is not None:
        return sc.align
    return SCALE_BYTES[sc.dtype]


def _scale_storage(side: SideSpec) -> StorageDType:
    assert side.scale is not None
    # a zero point in its own field makes the tensor bytes; one in the fp32 scale's low bits keeps it fp32 words
    beside = side.zero_point is not None and side.zero_point.storage == "beside_scale"
    if not beside and side.scale.dtype in SCALE_STORAGE:
        return SCALE_STORAGE[side.scale.dtype]
    return StorageDType.uint8


def _region(fields: list[tuple[str, int, int]], storage: StorageDType) -> RegionLayout:
    out, end, align = [], 0, STORAGE_BYTES[storage]
    for name, nbytes, a in fields:
        end = _align_up(end, a)
        out.append(FieldLayout(name, end, nbytes, a))
        end += nbytes
        align = max(align, a)
    return RegionLayout(tuple(out), _align_up(end, align), align)


def require_format(spec: FormatSpec) -> None:
    """Raise NotImplementedError for a format SEMANTICS.md does not define."""
    if spec.cache.layout not in (CacheLayout.interleaved, CacheLayout.split):
        raise NotImplementedError(f"reference: cache layout {spec.cache.layout.value} is not supported")
    require_side(spec.key)
    require_side(spec.value)


def layout(spec: FormatSpec, head_size: int) -> dict[str, TensorLayout]:
    """Every tensor of a format at ``head_size``: its storage dtype and its regions, cells and fields."""
    require_format(spec)
    if head_size < 1:
        raise ValueError(f"head_size must be >= 1, got {head_size}")
    pending: dict[str, dict] = {}
    for name in SIDES:
        side, p = spec.side(name), SIDE_PREFIX[name]
        t_name = "kv_cache" if spec.cache.layout == CacheLayout.interleaved else f"{p}_cache"
        t = pending.setdefault(t_name, {"storage": spec.cache.storage_dtype, "regions": [], "open": False})
        data = (f"{p}_data", data_bytes(side, head_size), _data_align(side))
        extra: list[tuple[str, int, int]] = []
        placement = None
        if is_dynamic(side):
            assert side.scale is not None
            placement = side.scale.placement
            extra.append((f"{p}_scale", scale_field_bytes(side, head_size), _scale_align(side)))
            if zp_field_bytes(side, head_size):
                extra.append((f"{p}_zp", zp_field_bytes(side, head_size), zp_bytes(side)))

        def open_region() -> list:
            if not t["open"]:
                t["regions"].append([])
                t["open"] = True
            return t["regions"][-1]

        if placement is None or placement == Placement.inline:
            open_region().extend([data] + extra)
        elif placement == Placement.separate:
            open_region().append(data)
            pending[f"{p}_scale_cache"] = {"storage": _scale_storage(side), "regions": [extra], "open": False}
        elif placement == Placement.page_end:
            t["regions"].extend([[data], extra])
            t["open"] = False
        else:  # pragma: no cover - the schema has no other placement
            raise NotImplementedError(f"reference: scale placement {placement} is not supported")
    return {
        name: TensorLayout(name, t["storage"], tuple(_region(r, t["storage"]) for r in t["regions"]))
        for name, t in pending.items()
    }


def tensor_names(spec: FormatSpec) -> list[str]:
    """The names of a format's tensors (they do not depend on the head size)."""
    blocks = [spec.side(n).scale.block for n in SIDES if spec.side(n).scale is not None]
    return list(layout(spec, max([b for b in blocks if b] or [1])))


def _locate(lay: Mapping[str, TensorLayout], field: str) -> Optional[tuple[str, int, FieldLayout]]:
    for t in lay.values():
        found = t.find(field)
        if found is not None:
            return t.name, found[0], found[1]
    return None


# --- sizes ----------------------------------------------------------------------------------------------------------


def page_bytes(spec: FormatSpec, block_size: int, num_kv_heads: int, head_size: int) -> int:
    """Bytes of one page (block) of one layer, all tensors together."""
    return sum(t.page_bytes(block_size, num_kv_heads) for t in layout(spec, head_size).values())


def tensor_page_bytes(spec: FormatSpec, block_size: int, num_kv_heads: int, head_size: int) -> dict[str, int]:
    """Bytes of one page of every tensor."""
    return {n: t.page_bytes(block_size, num_kv_heads) for n, t in layout(spec, head_size).items()}


def tensor_shapes(spec: FormatSpec, num_blocks: int, block_size: int, num_kv_heads: int,
                  head_size: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{tensor name: (shape in storage elements, storage dtype name)}``; dtype names are the StorageDType values
    (``uint8``, ``int8``, ``fp16``, ``bf16``, ``fp32``)."""
    return {n: (t.shape(num_blocks, block_size, num_kv_heads), t.storage.value)
            for n, t in layout(spec, head_size).items()}


def bytes_per_token_head(spec: FormatSpec, head_size: int) -> dict[str, int]:
    """Bytes per (token, KV head): ``key`` / ``value`` = that side's data + scales + zero points (no padding, no
    static scales); ``total`` = the sum of the cell bytes of every region of every tensor (padding included)."""
    lay = layout(spec, head_size)
    out = {}
    for name in SIDES:
        side = spec.side(name)
        out[name] = data_bytes(side, head_size) + scale_field_bytes(side, head_size) + zp_field_bytes(side, head_size)
    out["total"] = sum(r.cell for t in lay.values() for r in t.regions)
    return out


def data_region_cell(spec: FormatSpec, head_size: int) -> RegionLayout:
    """The one region of a one-tensor, one-region format (ValueError otherwise)."""
    lay = layout(spec, head_size)
    if len(lay) != 1 or len(next(iter(lay.values())).regions) != 1:
        raise ValueError(f"format {spec.name} has several tensors or regions ({sorted(lay)}): use layout()")
    return next(iter(lay.values())).regions[0]


def cell_layout(spec: FormatSpec, head_size: int) -> dict[str, int]:
    """Field offsets and ``cell_bytes`` of a format stored as one tensor with one region (``kv_cache``).

    Example, int8_per_token_head at D=128: k_data 0, k_scale 128, v_data 132, v_scale 260, cell_bytes 264.
    """
    region = data_region_cell(spec, head_size)
    out = {f.name: f.offset for f in region.fields}
    out["cell_bytes"] = region.cell
    return out


# --- cache arrays ---------------------------------------------------------------------------------------------------


def new_cache(spec: FormatSpec, num_blocks: int, block_size: int, num_kv_heads: int,
              head_size: int) -> dict[str, np.ndarray]:
    """A zeroed cache: ``{tensor name: uint8 [num_blocks, page bytes of that tensor]}``."""
    return {n: np.zeros((num_blocks, t.page_bytes(block_size, num_kv_heads)), np.uint8)
            for n, t in layout(spec, head_size).items()}


def new_cache_bytes(spec: FormatSpec, num_blocks: int, block_size: int, num_kv_heads: int,
                    head_size: int) -> np.ndarray:
    """One-tensor, one-region formats only: a zeroed ``kv_cache`` as uint8 ``[num_blocks, block_size, H, cell]``."""
    cell = data_region_cell(spec, head_size).cell
    return np.zeros((num_blocks, block_size, num_kv_heads, cell), dtype=np.uint8)


def as_cache_bytes(cache: np.ndarray) -> np.ndarray:
    """View a C-contiguous array of any storage dtype as its bytes ``[..., C * itemsize]`` (no copy)."""
    a = np.asarray(cache)
    if a.dtype == np.uint8:
        return a
    if not a.flags.c_contiguous:
        raise ValueError("the cache array must be C-contiguous")
    return a.view(np.uint8)


def _as_dict(spec: FormatSpec, cache: Union[Cache, np.ndarray]) -> Mapping[str, np.ndarray]:
    if isinstance(cache, np.ndarray):
        return {"kv_cache": cache}
    return cache


def _pages(arr: np.ndarray, num_blocks: int) -> np.ndarray:
    """A uint8 ``[num_blocks, page]`` view of a cache array (writes go through)."""
    a = np.asarray(arr)
    if not a.flags.c_contiguous:
        raise ValueError("every cache array must be C-contiguous")
    out = a.view(np.uint8).reshape(num_blocks, -1)
    if out.size and not np.shares_memory(out, a):
        raise ValueError("cannot view the cache array as bytes without a copy")
    return out


def _region_view(pages: np.ndarray, t: TensorLayout, index: int, block_size: int, num_kv_heads: int) -> np.ndarray:
    start = t.region_offsets(block_size, num_kv_heads)[index]
    cell = t.regions[index].cell
    flat = pages[:, start:start + block_size * num_kv_heads * cell]
    view = flat.reshape(pages.shape[0], block_size, num_kv_heads, cell)
    if view.size and not np.shares_memory(view, pages):
        raise AssertionError("region view is a copy")
    return view


def _check_names(lay: Mapping[str, TensorLayout], cache: Mapping[str, np.ndarray]) -> int:
    """The number of blocks; ValueError when a tensor of the format is missing (other entries are ignored)."""
    missing = sorted(set(lay) - set(cache))
    if missing:
        raise ValueError(f"format has tensors {sorted(lay)}, the cache lacks {missing}")
    blocks = {np.asarray(cache[n]).shape[0] for n in lay}
    if len(blocks) != 1:
        raise ValueError(f"cache tensors disagree on the number of blocks: {sorted(blocks)}")
    return blocks.pop()


def _page_sizes(cache: Mapping[str, np.ndarray], num_blocks: int, names) -> dict[str, int]:
    return {n: np.asarray(cache[n]).nbytes // max(num_blocks, 1) for n in names}


def _check_geometry(lay: Mapping[str, TensorLayout], sizes: dict[str, int], block_size: int,
                    num_kv_heads: int) -> bool:
    return all(lay[n].page_bytes(block_size, num_kv_heads) == sizes[n] for n in lay)


def field_views(spec: FormatSpec, cache: Union[Cache, np.ndarray], block_size: int, num_kv_heads: int,
                head_size: int) -> dict[str, np.ndarray]:
    """Every field of a cache as a uint8 view ``[num_blocks, block_size, H, field bytes]`` (writes go through)."""
    cache = _as_dict(spec, cache)
    lay = layout(spec, head_size)
    num_blocks = _check_names(lay, cache)
    sizes = _page_sizes(cache, num_blocks, lay)
    if not _check_geometry(lay, sizes, block_size, num_kv_heads):
        raise ValueError(f"cache page sizes {sizes} do not match block_size {block_size}, {num_kv_heads} heads, "
                         f"head size {head_size}")
    out = {}
    for t in lay.values():
        pages = _pages(cache[t.name], num_blocks)
        for i, r in enumerate(t.regions):
            view = _region_view(pages, t, i, block_size, num_kv_heads)
            for f in r.fields:
                out[f.name] = view[..., f.offset:f.offset + f.nbytes]
    return out


# --- write / read ---------------------------------------------------------------------------------------------------


def _side_scale(side: SideSpec, name: str, k_scale: StaticScale, v_scale: StaticScale,
                cache: Mapping[str, np.ndarray]) -> StaticScale:
    """The side's static (or global) scale: the argument, else the cache's own ``k_scale`` / ``v_scale`` entry (the
    runtime's ``KVCache.tensors`` carry them), else None (1.0)."""
    arg, key = (k_scale, "k_scale") if name == "key" else (v_scale, "v_scale")
    if arg is None and key in cache and takes_layer_scale(side):
        arg = np.asarray(cache[key], dtype=np.float32)
    return arg


def _infer_block_size(lay: Mapping[str, TensorLayout], sizes: dict[str, int], num_kv_heads: int) -> int:
    first = next(iter(lay))
    bs = 1
    while lay[first].page_bytes(bs, num_kv_heads) <= sizes[first]:
        if _check_geometry(lay, sizes, bs, num_kv_heads):
            return bs
        bs += 1
    raise ValueError(f"no block size gives page sizes {sizes} with {num_kv_heads} heads: pass block_size")


def write(spec: FormatSpec, cache: Union[Cache, np.ndarray], key: np.ndarray, value: np.ndarray,
          slot_mapping: np.ndarray, k_scale: StaticScale = None, v_scale: StaticScale = None, *,
          block_size: Optional[int] = None) -> None:
    """Encode ``key`` / ``value`` (float32 ``[T, H, D]``) into ``cache`` in place at ``slot_mapping`` (``[T]``).

    ``cache``: ``{tensor name: array}`` as :func:`new_cache` makes it (or any C-contiguous arrays holding the same
    bytes; a bare array is taken as ``kv_cache``). ``k_scale`` / ``v_scale``: the static scales of static sides, the
    global scales of ``global_scale`` sides; left out, the cache's own ``k_scale`` / ``v_scale`` entries (as
    ``KVCache.tensors`` holds them), else 1.0; None for other sides. ``block_size`` is inferred from
    the page sizes when left out. Slots < 0 are skipped; a slot past the cache raises IndexError.
    """
    cache = _as_dict(spec, cache)
    key, value = as_float32(key), as_float32(value)
    if key.shape != value.shape or key.ndim != 3:
        raise ValueError(f"key and value must both be [T, H, D], got {key.shape} and {value.shape}")
    num_tokens, num_heads, head_size = key.shape
    lay = layout(spec, head_size)
    num_blocks = _check_names(lay, cache)
    sizes = _page_sizes(cache, num_blocks, lay)
    if block_size is None:
        block_size = _infer_block_size(lay, sizes, num_heads)
    elif not _check_geometry(lay, sizes, block_size, num_heads):
        raise ValueError(f"cache page sizes {sizes} do not match block_size {block_size}, {num_heads} heads, "
                         f"head size {head_size}")
    slots = np.asarray(slot_mapping, dtype=np.int64).reshape(-1)
    if slots.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must have {num_tokens} entries, got {slots.shape}")
    if np.any(slots >= num_blocks * block_size):
        raise IndexError(f"slot {int(slots.max())} is past the cache ({num_blocks} x {block_size} slots)")
    written = slots >= 0
    blocks, offsets = slots[written] // block_size, slots[written] % block_size
    pages = {n: _pages(cache[n], num_blocks) for n in lay}
    for name, x in (("key", key), ("value", value)):
        side, p = spec.side(name), SIDE_PREFIX[name]
        enc = encode_side(side, x, _side_scale(side, name, k_scale, v_scale, cache))
        for field, values in ((f"{p}_data", enc.data), (f"{p}_scale", enc.scale), (f"{p}_zp", enc.zp)):
            if values is None:
                continue
            located = _locate(lay, field)
            assert located is not None, field
            t_name, index, f = located
            view = _region_view(pages[t_name], lay[t_name], index, block_size, num_heads)
            view[blocks, offsets, :, f.offset:f.offset + f.nbytes] = values[written]
    # the written cells' padding (bytes of a cell outside every field) is stored as zeros
    for t in lay.values():
        for index, region in enumerate(t.regions):
            gaps = padding_bytes(region)
            if gaps:
                view = _region_view(pages[t.name], t, index, block_size, num_heads)
                view[blocks[:, None], offsets[:, None], :, np.array(gaps)[None, :]] = 0


def _infer_geometry(spec: FormatSpec, cache: Mapping[str, np.ndarray],
                    block_size: Optional[int], num_kv_heads: Optional[int]) -> tuple[int, int]:
    if block_size is None or num_kv_heads is None:
        for name in tensor_names(spec):
            a = np.asarray(cache[name]) if name in cache else np.zeros(0)
            if a.ndim == 4:  # a one-region tensor in its [num_blocks, block_size, H, C] shape
                block_size = a.shape[1] if block_size is None else block_size
                num_kv_heads = a.shape[2] if num_kv_heads is None else num_kv_heads
                break
    if block_size is None or num_kv_heads is None:
        raise ValueError("pass block_size= and num_kv_heads= (the cache arrays are [num_blocks, page bytes])")
    return block_size, num_kv_heads


def infer_head_size(spec: FormatSpec, cache: Union[Cache, np.ndarray], block_size: int, num_kv_heads: int) -> int:
    """The head size whose page sizes match the cache's; ValueError when none or several do."""
    cache = _as_dict(spec, cache)
    names = tensor_names(spec)
    num_blocks = _check_names({n: None for n in names}, cache)  # type: ignore[misc]
    sizes = _page_sizes(cache, num_blocks, names)
    limit = 8 * max(sizes.values()) // max(block_size * num_kv_heads, 1) + 1  # 1-bit elements at most
    matches = []
    for d in range(1, limit + 1):
        try:
            lay = layout(spec, d)
        except ValueError:  # e.g. a per_block block that does not divide d
            continue
        if _check_geometry(lay, sizes, block_size, num_kv_heads):
            matches.append(d)
    if len(matches) != 1:
        raise ValueError(f"cannot tell the head size from page sizes {sizes} (candidates {matches}): "
                         "pass head_size")
    return matches[0]


def read(spec: FormatSpec, cache: Union[Cache, np.ndarray], k_scale: StaticScale = None,
         v_scale: StaticScale = None, head_size: Optional[int] = None, *, block_size: Optional[int] = None,
         num_kv_heads: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
    """Decode every slot of a cache: ``(K, V)`` float64 ``[num_blocks, block_size, H, D]``, unrotated.

    ``block_size`` / ``num_kv_heads`` may be left out only when a cache array has the 4-D shape of a one-region
    tensor; ``head_size`` may be left out when only one head size gives the cache's page sizes.
    """
    cache = _as_dict(spec, cache)
    block_size, num_kv_heads = _infer_geometry(spec, cache, block_size, num_kv_heads)
    if head_size is None:
        head_size = infer_head_size(spec, cache, block_size, num_kv_heads)
    views = field_views(spec, cache, block_size, num_kv_heads, head_size)
    out = []
    for name in SIDES:
        side, p = spec.side(name), SIDE_PREFIX[name]
        out.append(decode_side(side, views[f"{p}_data"], views.get(f"{p}_scale"), views.get(f"{p}_zp"),
                               _side_scale(side, name, k_scale, v_scale, cache), head_size=head_size))
    return out[0], out[1]
