"""kvgen's version: recorded in every generated package and checked by the runtime."""

KVGEN_VERSION = "0.1.0"


def generator_fingerprint() -> str:
    """A short hash of the generator itself (codegen's Python and templates): what generated code also depends on
    besides its spec, so caches of specs built from YAML can tell a changed generator apart."""
    import hashlib
    from pathlib import Path

    global _FINGERPRINT
    if _FINGERPRINT is None:
        root = Path(__file__).parent
        h = hashlib.sha256()
        for f in sorted([*root.glob("*.py"), *root.glob("templates/**/*.jinja")]):
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
        _FINGERPRINT = h.hexdigest()[:10]
    return _FINGERPRINT


_FINGERPRINT = None
