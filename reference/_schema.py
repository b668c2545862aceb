"""The spec schema, imported so that the reference works both as ``reference`` (repo root on sys.path) and as
``kvgen.reference`` (installed package). Only the pydantic schema is used: never the code generator."""

from __future__ import annotations

try:  # installed as kvgen.reference
    from ..codegen.spec import (  # type: ignore[import-not-found]
        ApplyScale,
        CacheLayout,
        ElementType,
        FormatSpec,
        Granularity,
        Placement,
        Rounding,
        ScaleDType,
        SideSpec,
        StorageDType,
    )
except ImportError:  # run from the repository root
    from codegen.spec import (  # type: ignore[no-redef]
        ApplyScale,
        CacheLayout,
        ElementType,
        FormatSpec,
        Granularity,
        Placement,
        Rounding,
        ScaleDType,
        SideSpec,
        StorageDType,
    )

__all__ = [
    "ApplyScale",
    "CacheLayout",
    "ElementType",
    "FormatSpec",
    "Granularity",
    "Placement",
    "Rounding",
    "ScaleDType",
    "SideSpec",
    "StorageDType",
]
