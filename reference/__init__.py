"""kvgen's NumPy reference: the oracle that generated kernels are checked against.

It is written from the spec semantics alone (never from the code generator's templates, layout code or output):
  * :mod:`.codes`      element codes (bf16/fp16/fp32, fp8 e4m3fn/e5m2, int8) and rounding steps;
  * :mod:`.quant`      one side: static / dynamic scales, encode, decode, the quantization error bound;
  * :mod:`.layout`     the interleaved page layout, whole-cache write and read;
  * :mod:`.attention`  paged attention in float64.
Anything outside the first milestone raises ``NotImplementedError("reference: ...")``.
"""

from .attention import attention_mask, paged_attention
from .codes import decode_codes, encode_codes, half_ulp
from .layout import as_cache_bytes, cell_layout, data_bytes, new_cache_bytes, page_bytes, read, write
from .quant import decode_side, dynamic_scale, encode_side, error_bound

__all__ = [
    "as_cache_bytes",
    "attention_mask",
    "cell_layout",
    "data_bytes",
    "decode_codes",
    "decode_side",
    "dynamic_scale",
    "encode_codes",
    "encode_side",
    "error_bound",
    "half_ulp",
    "new_cache_bytes",
    "page_bytes",
    "paged_attention",
    "read",
    "write",
]
