"""The byte layout of a format's pages: the one plan that feeds the templates, page-size calculator and allocator.

A format stores each layer in one or more tensors (``kv_cache``; or ``k_cache``/``v_cache``; plus
``k_scale_cache``/``v_scale_cache`` for separate scales), each a sequence of pages (one page = one block of
``block_size`` slots of all ``num_kv_heads`` heads). A page is a sequence of *regions*; a region holds its fields for
every (slot, head) as ``[block_size, num_kv_heads, cell]``, the fields at fixed offsets in the cell (docs/SEMANTICS.md).

``plan(spec)`` assigns every field to a tensor and region with a size affine in the head size; the generated
``layout.py`` (rendered from this plan by templates/layout.py.jinja) resolves offsets for concrete sizes. That
rendered resolver is the only one: the runtime's allocator and the kernels' constexpr offsets both come from it.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from .spec import CacheLayout, FormatSpec, Granularity, Placement, ScaleDType, SideSpec, SIDES

@dataclasses.dataclass(frozen=True)
class FieldPlan:
    """One field: ``bytes = head_size * per_elem + fixed``, at the next multiple of ``align`` in its region's cell."""

    name: str  # k_data, k_scale, k_zp, v_data, v_scale, v_zp
    tensor: str
    region: int  # index of the region in its tensor's page
    per_elem: Fraction
    fixed: int
    align: int
    what: str
    rows_per: int = 1  # tokens per row of its region: 1 (a row per slot) or G (a row per KIVI key group)

    def size_expr(self) -> str:
        """The field size as a Python expression of ``head_size`` (rendered into generated code)."""
        parts = []
        if self.per_elem:
            num, den = self.per_elem.numerator, self.per_elem.denominator
            parts.append("head_size" + (f" * {num}" if num != 1 else "") + (f" // {den}" if den != 1 else ""))
        if self.fixed or not parts:
            parts.append(str(self.fixed))
        return " + ".join(parts)

    def nbytes(self, head_size: int) -> int:
        size = self.per_elem * head_size + self.fixed
        if size.denominator != 1:
            raise ValueError(f"head size {head_size} does not give whole bytes for {self.name}")
        return int(size)


def groups_per_head(side: SideSpec) -> Fraction:
    """Scales per head vector (per_token_head: a constant 1, i.e. 0 per element), as a multiple of the head size
    for per_block (one per block) and per_channel_group (one per channel)."""
    sc = side.scale
    if sc.granularity == Granularity.per_channel_group:
        return Fraction(1)
    return Fraction(1, sc.block) if sc.block else Fraction(0)


def zp_bytes(side: SideSpec) -> int:
    return {"uint8": 1, "fp16": 2, "fp32": 4}[side.zero_point.dtype]


def scale_is_stored(side: SideSpec) -> bool:
    return side.scale is not None and not side.scale.granularity.is_static


def zp_is_stored(side: SideSpec) -> bool:
    return side.zero_point is not None and side.zero_point.storage == "beside_scale"


def _meta_fields(side_name: str, side: SideSpec) -> list[tuple[str, Fraction, int, int, str]]:
    """(name, per_elem, fixed, align, what) of a side's stored scales and zero points."""
    sc = side.scale
    p = side_name[0]
    per_elem = groups_per_head(side)
    fixed = 0 if per_elem else 1
    if sc.granularity == Granularity.per_channel_group:
        what_group = f"one per channel and group of {sc.group_tokens} tokens"
    else:
        what_group = f"one per {sc.block} elements" if sc.block else "one per token and head"
    out = [(f"{p}_scale", per_elem * sc.scale_bytes, fixed * sc.scale_bytes, sc.inline_align,
            f"{side_name} scales, {sc.dtype.value}, {what_group}")]
    if zp_is_stored(side):
        nz = zp_bytes(side)
        kind = "zero points, uint8" if side.zero_point.dtype == "uint8" else f"minimums, {side.zero_point.dtype}"
        out.append((f"{p}_zp", per_elem * nz, fixed * nz, nz, f"{side_name} {kind}, {what_group}"))
    return out


def plan(spec: FormatSpec) -> list[FieldPlan]:
    """Every stored field, in page order within each tensor."""
    interleaved = spec.cache.layout == CacheLayout.interleaved
    regions: dict[str, int] = {}  # tensor -> number of regions so far
    open_cell: dict[str, int] = {}  # tensor -> index of the cell region still taking fields
    fields: list[FieldPlan] = []

    def add(name, tensor, region, per_elem, fixed, align, what, rows_per=1):
        fields.append(FieldPlan(name, tensor, region, Fraction(per_elem), fixed, align, what, rows_per))

    def new_region(tensor: str) -> int:
        regions[tensor] = regions.get(tensor, 0) + 1
        return regions[tensor] - 1

    def cell_region(tensor: str) -> int:
        if tensor not in open_cell:
            open_cell[tensor] = new_region(tensor)
        return open_cell[tensor]

    for side_name in SIDES:
        side = spec.side(side_name)
        p = side_name[0]
        tensor = "kv_cache" if interleaved else f"{p}_cache"
        data = (f"{p}_data", Fraction(side.bits, 8), 0, side.data_align or max(side.bits // 8, 1),
                f"{side_name} codes, {side.element.value}" + (f", {8 // side.bits} per byte" if side.bits < 8 else ""))
        placement = side.scale.placement if scale_is_stored(side) else None
        if side.scale is not None and side.scale.granularity == Granularity.per_channel_group:
            # KIVI keys: codes in the cell; one row of metadata per group of G tokens, in a region of its own
            add(*data[:1], tensor, cell_region(tensor), *data[1:])
            meta_region = new_region(tensor)
            for m in _meta_fields(side_name, side):
                add(m[0], tensor, meta_region, *m[1:], rows_per=side.scale.group_tokens)
            continue
        if placement == Placement.page_end:
            add(*data[:1], tensor, new_region(tensor), *data[1:])
            meta_region = new_region(tensor)
            for m in _meta_fields(side_name, side):
                add(m[0], tensor, meta_region, *m[1:])
            open_cell.pop(tensor, None)  # fields after a page_end side start a new cell region
            continue
        region = cell_region(tensor)
        add(*data[:1], tensor, region, *data[1:])
        if placement == Placement.inline:
            for m in _meta_fields(side_name, side):
                add(m[0], tensor, region, *m[1:])
        elif placement == Placement.separate:
            meta_tensor = f"{p}_scale_cache"
            meta_region = cell_region(meta_tensor)
            for m in _meta_fields(side_name, side):
                add(m[0], meta_tensor, meta_region, *m[1:])
    return fields


def tensor_storage(spec: FormatSpec) -> dict[str, str]:
    """Storage dtype name of every tensor, in the order tensors first appear."""
    out: dict[str, str] = {}
    for f in plan(spec):
        if f.tensor in out:
            continue
        if f.tensor.endswith("_scale_cache"):
            side = spec.side("key" if f.tensor[0] == "k" else "value")
            direct = {ScaleDType.fp32: "fp32", ScaleDType.fp16: "fp16", ScaleDType.bf16: "bf16"}
            out[f.tensor] = "uint8" if zp_is_stored(side) else direct.get(side.scale.dtype, "uint8")
        else:
            out[f.tensor] = spec.cache.storage_dtype.value
    return out

