"""What the code generator implements today: every valid spec outside it gets a clear "not supported yet" error."""

from __future__ import annotations

from typing import Optional

from .codecs import has_codec
from .errors import NotSupportedYet
from .spec import SIDES, FormatSpec, Granularity

_SUPPORTED_GRANULARITIES = (Granularity.per_tensor, Granularity.per_head, Granularity.per_token_head,
                            Granularity.per_block)


def unsupported(spec: FormatSpec) -> Optional[tuple[str, str]]:
    """The first (field path, reason) this build cannot generate, or None."""
    for side_name in SIDES:
        side = spec.side(side_name)
        if not has_codec(side.element):
            return f"{side_name}.element", f"element {side.element.value} has no codec yet"
        if side.residual is not None:
            return f"{side_name}.residual", "full-precision residual windows are not supported yet"
        if side.zero_point is not None and side.zero_point.dtype != "uint8":
            return f"{side_name}.zero_point.dtype", "only uint8 zero points are supported yet"
        sc = side.scale
        if sc is not None and sc.granularity not in _SUPPORTED_GRANULARITIES:
            return f"{side_name}.scale.granularity", f"granularity {sc.granularity.value} is not supported yet"
    return None


def check_supported(spec: FormatSpec, path: Optional[str] = None, positions: Optional[dict] = None) -> None:
    found = unsupported(spec)
    if found is None:
        return
    field, reason = found
    line = col = None
    if positions:
        loc = tuple(field.split("."))
        while loc and loc not in positions:
            loc = loc[:-1]
        if loc:
            line, col = positions[loc]
    raise NotSupportedYet(reason, path=path, line=line, column=col, field=field)
