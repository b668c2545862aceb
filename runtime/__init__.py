"""Load generated formats and run their kernels."""

from .format import Format, KVCache
from .loader import load

__all__ = ["Format", "KVCache", "load"]
