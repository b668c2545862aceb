"""kvgen's NumPy reference: the oracle that generated kernels are checked against.

It is written from docs/SEMANTICS.md alone (never from the code generator's templates, layout code or output):
  * :mod:`.codes`      element codes (bf16/fp16/fp32, fp8 e4m3fn/e5m2, fp4 e2m1, int8/4/2, uint8/4/2), packing,
                       scale dtypes (fp32/fp16/bf16/fp8_e4m3/e8m0) and rounding steps;
  * :mod:`.rotation`   the seeded randomized Hadamard rotation (float32 FWHT, float64 inverse);
  * :mod:`.quant`      one side: static / dynamic / global scales, zero points, encode, decode, the error bound;
  * :mod:`.layout`     tensors, regions, cells and fields; whole-cache write and read;
  * :mod:`.attention`  paged attention in float64 (on the unrotated, decoded cache).
Whatever the schema can express but SEMANTICS.md does not define raises ``NotImplementedError("reference: ...")``.

Whole-cache API (a cache is ``{tensor name: array}``, every array viewable as uint8 ``[num_blocks, page bytes]``)::

    cache = new_cache(spec, num_blocks, block_size, H, D)          # {name: zeros uint8 [num_blocks, page]}
    write(spec, cache, key, value, slot_mapping, k_scale, v_scale)  # in place
    K, V = read(spec, cache, k_scale, v_scale, head_size=D, block_size=bs, num_kv_heads=H)
"""

from .attention import attention_mask, paged_attention
from .codes import decode_codes, encode_codes, half_ulp
from .layout import (FieldLayout, RegionLayout, TensorLayout, as_cache_bytes, bytes_per_token_head, cell_layout,
                     field_views, infer_head_size, layout, new_cache, new_cache_bytes, page_bytes, read,
                     tensor_names, tensor_page_bytes, tensor_shapes, write)
from .quant import (SideEncoding, data_bytes, decode_side, dynamic_scale, encode_side, error_bound, rotate_side,
                    unrotate_side)
from .rotation import signs as hadamard_signs

__all__ = [
    "FieldLayout",
    "RegionLayout",
    "SideEncoding",
    "TensorLayout",
    "as_cache_bytes",
    "attention_mask",
    "bytes_per_token_head",
    "cell_layout",
    "data_bytes",
    "decode_codes",
    "decode_side",
    "dynamic_scale",
    "encode_codes",
    "encode_side",
    "error_bound",
    "field_views",
    "hadamard_signs",
    "half_ulp",
    "infer_head_size",
    "layout",
    "new_cache",
    "new_cache_bytes",
    "page_bytes",
    "paged_attention",
    "read",
    "rotate_side",
    "tensor_names",
    "tensor_page_bytes",
    "tensor_shapes",
    "unrotate_side",
    "write",
]
