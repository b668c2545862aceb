"""kvgen: a declarative compiler for quantized KV-cache formats.

A YAML spec describes a format; ``kvgen build`` renders it into Triton reshape-and-cache and paged-attention kernels
and a page-size calculator; ``kvgen.load`` gives a format object that allocates, writes and attends::

    import kvgen
    fmt = kvgen.load("int8_per_token_head")
    cache = fmt.allocate(num_blocks=64, block_size=16, num_kv_heads=8, head_size=128, device="cuda")
    fmt.write(cache, key, value, slot_mapping)
    out = fmt.attend(query, cache, block_table, seq_lens, query_start_loc)
"""

import sys as _sys

from .codegen.errors import BuildError, KvgenError, NotSupportedYet, SpecError, StaleError
from .codegen.loader import load_spec
from .codegen.spec import FormatSpec
from .codegen.version import KVGEN_VERSION as __version__
from .runtime.format import Format, KVCache
from .runtime.loader import load, shipped_names
from .runtime.model_cache import ModelKVCache, model_cache
from .runtime.kernels import _choose_mode

# Triton picks interpreted or compiled when it is first imported; without a GPU, kvgen's kernels can only run
# interpreted, so choose that now, while kvgen is imported before triton (e.g. before transformers, which imports
# it). Where triton came first, nothing changes here and the first kernel load says what to do.
if "triton" not in _sys.modules:
    _choose_mode()


def __getattr__(name):
    # the NumPy reference pulls in ml_dtypes; import it only when asked for
    if name == "reference":
        import importlib

        return importlib.import_module(".reference", __name__)
    raise AttributeError(name)


__all__ = [
    "BuildError", "Format", "FormatSpec", "KVCache", "KvgenError", "NotSupportedYet", "SpecError", "StaleError",
    "ModelKVCache", "__version__", "load", "load_spec", "model_cache", "shipped_names",
]
