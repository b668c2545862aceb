"""What the code generator implements today: every valid spec outside it gets a clear "not supported yet" error."""

from __future__ import annotations

from typing import Optional

from .codecs import has_codec
from .errors import NotSupportedYet
from .spec import SIDES, FormatSpec, Granularity, Placement

_SUPPORTED_GRANULARITIES = tuple(Granularity)


def unsupported(spec: FormatSpec) -> Optional[tuple[str, str]]:
    """The first (field path, reason) this build cannot generate, or None."""
    for side_name in SIDES:
        side = spec.side(side_name)
        if not has_codec(side.element):
            return f"{side_name}.element", f"element {side.element.value} has no codec yet"
        sc = side.scale
        if sc is not None and sc.granularity not in _SUPPORTED_GRANULARITIES:
            return f"{side_name}.scale.granularity", f"granularity {sc.granularity.value} is not supported yet"
        if sc is not None and sc.global_scale and side.zero_point is not None and side.zero_point.dtype != "uint8":
            # SEMANTICS.md defines a global scale over integer zero points only; the kernels would ignore it
            return (f"{side_name}.scale.global_scale",
                    f"a global scale with a float ({side.zero_point.dtype}) zero point is not supported yet")
        if spec.streaming and side.rotation is not None:
            return f"{side_name}.rotation", "rotation with a residual window is not supported yet"
        if spec.streaming and sc is not None and sc.granularity.is_static:
            return f"{side_name}.scale.granularity", "static scales with a residual window are not supported yet"
    if spec.streaming and spec.value.scale is not None and spec.value.scale.placement != Placement.inline:
        return "value.scale.placement", "with a residual window, value scales are inline (others not supported yet)"
    if spec.streaming and spec.cache.layout.value != "interleaved":
        return "cache.layout", "with a residual window, the layout is interleaved (split not supported yet)"
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
