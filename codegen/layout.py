"""The byte layout of a format's pages: the one source of truth for templates, page-size calculator and allocator.

A format stores its pages in one or two tensors (``kv_cache`` when K and V are interleaved, as in vLLM; ``k_cache``
and ``v_cache`` when split), each of physical shape ``[num_blocks, block_size, num_kv_heads, cell]``. A *cell* is
the bytes of one (slot, KV head); its *fields* (a side's data, its inline scale, ...) sit at fixed byte offsets.
Because the block and slot axes are outermost, the cell of slot ``s`` (``= block * block_size + offset``) and head
``h`` starts at byte ``(s * num_kv_heads + h) * cell_bytes`` of its tensor.

``plan(spec)`` lists the fields with sizes that are affine in the head size; ``resolve(plan, head_size)`` turns that
into offsets. The generated ``layout.py`` of every format is rendered from the same plan, so the page-size calculator
in generated code, the allocator and the kernels' constexpr offsets cannot disagree.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from .spec import STORAGE_BYTES, CacheLayout, FormatSpec, Granularity, Placement, SIDES


@dataclasses.dataclass(frozen=True)
class FieldPlan:
    """One field of a cell: ``bytes = head_size * per_elem + fixed``, placed at the next multiple of ``align``."""

    name: str  # k_data, k_scale, v_data, v_scale
    tensor: str  # kv_cache, k_cache or v_cache
    per_elem: Fraction  # bytes per head-dimension element
    fixed: int  # bytes independent of the head size
    align: int
    what: str  # human description for headers, `kvgen show` and byte maps

    def nbytes(self, head_size: int) -> int:
        size = self.per_elem * head_size + self.fixed
        if size.denominator != 1:
            raise ValueError(f"{self.name}: head size {head_size} does not give a whole number of bytes")
        return int(size)

    def size_expr(self) -> str:
        """Python expression of the field size in terms of ``head_size`` (rendered into generated code)."""
        parts = []
        if self.per_elem:
            num, den = self.per_elem.numerator, self.per_elem.denominator
            parts.append("head_size" + (f" * {num}" if num != 1 else "") + (f" // {den}" if den != 1 else ""))
        if self.fixed or not parts:
            parts.append(str(self.fixed))
        return " + ".join(parts)


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    tensor: str
    offset: int
    nbytes: int
    what: str


@dataclasses.dataclass(frozen=True)
class CellLayout:
    """Offsets of every field for one head size, and the cell size of each tensor."""

    head_size: int
    fields: dict[str, Field]
    cell_bytes: dict[str, int]  # tensor name -> bytes per (slot, head)
    storage_bytes: int  # bytes of one element of the storage dtype

    def page_bytes(self, block_size: int, num_kv_heads: int) -> int:
        return block_size * num_kv_heads * sum(self.cell_bytes.values())

    def offset(self, name: str) -> int:
        """Offset of a field, or -1 when the format has no such field (e.g. no inline scale)."""
        f = self.fields.get(name)
        return f.offset if f is not None else -1


def _align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def tensor_names(spec: FormatSpec) -> tuple[str, ...]:
    return ("kv_cache",) if spec.cache.layout == CacheLayout.interleaved else ("k_cache", "v_cache")


def plan(spec: FormatSpec) -> list[FieldPlan]:
    """The fields of a cell in storage order."""
    fields: list[FieldPlan] = []
    interleaved = spec.cache.layout == CacheLayout.interleaved
    for side_name in SIDES:
        side = spec.side(side_name)
        p = side_name[0]
        tensor = "kv_cache" if interleaved else f"{p}_cache"
        elem_bytes = max(side.bits // 8, 1)
        fields.append(FieldPlan(f"{p}_data", tensor, Fraction(side.bits, 8), 0, elem_bytes,
                                f"{side_name} codes, {side.element.value}"))
        sc = side.scale
        if sc is not None and sc.granularity == Granularity.per_token_head and sc.placement == Placement.inline:
            fields.append(FieldPlan(f"{p}_scale", tensor, Fraction(0), sc.scale_bytes, sc.inline_align,
                                    f"{side_name} scale, {sc.dtype.value}, one per token and head"))
    return fields


def resolve(fields: list[FieldPlan], head_size: int, storage_bytes: int) -> CellLayout:
    """Place the fields: each at the next multiple of its alignment; a cell ends at the largest alignment."""
    ends: dict[str, int] = {}
    aligns: dict[str, int] = {}
    placed: dict[str, Field] = {}
    for f in fields:
        start = _align_up(ends.get(f.tensor, 0), f.align)
        n = f.nbytes(head_size)
        placed[f.name] = Field(f.name, f.tensor, start, n, f.what)
        ends[f.tensor] = start + n
        aligns[f.tensor] = max(aligns.get(f.tensor, 1), f.align, storage_bytes)
    cells = {t: _align_up(end, aligns[t]) for t, end in ends.items()}
    return CellLayout(head_size, placed, cells, storage_bytes)


def cell_layout(spec: FormatSpec, head_size: int) -> CellLayout:
    return resolve(plan(spec), head_size, STORAGE_BYTES[spec.cache.storage_dtype])


def page_bytes(spec: FormatSpec, block_size: int, num_kv_heads: int, head_size: int) -> int:
    return cell_layout(spec, head_size).page_bytes(block_size, num_kv_heads)


def bytes_per_token_head(spec: FormatSpec, head_size: int) -> dict[str, int]:
    """Bytes one token takes per KV head, for K and V separately (data and inline scales; padding counted once)."""
    cl = cell_layout(spec, head_size)
    k = sum(f.nbytes for f in cl.fields.values() if f.name.startswith("k_"))
    v = sum(f.nbytes for f in cl.fields.values() if f.name.startswith("v_"))
    total = sum(cl.cell_bytes.values())
    return {"key": k, "value": v, "padding": total - k - v, "total": total}
