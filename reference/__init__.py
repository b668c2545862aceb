"""kvgen's NumPy reference: the oracle that generated kernels are checked against.

It is written from docs/SEMANTICS.md alone (never from the code generator's templates, layout code or output):
  * :mod:`.codes`      element codes (bf16/fp16/fp32, fp8 e4m3fn/e5m2, fp4 e2m1, int8/4/2, uint8/4/2), packing,
                       scale dtypes (fp32/fp16/bf16/fp8_e4m3/e8m0) and rounding steps;
  * :mod:`.rotation`   the seeded randomized Hadamard rotation (float32 FWHT, float64 inverse);
  * :mod:`.quant`      one side: static / dynamic / global scales, zero points, encode, decode, the error bound;
  * :mod:`.layout`     tensors, regions, cells and fields; whole-cache write and read;
  * :mod:`.attention`  paged attention in float64 (on the unrotated, decoded cache);
  * :mod:`.kivi`       KIVI: keys per channel over G-token groups, a full-precision residual ring, the write stream.
Whatever the schema can express but SEMANTICS.md does not define raises ``NotImplementedError("reference: ...")``.

Whole-cache API (a cache is ``{tensor name: array}``, every array viewable as uint8 ``[num_blocks, page bytes]``)::

    cache = new_cache(spec, num_blocks, block_size, H, D)          # {name: zeros uint8 [num_blocks, page]}
    write(spec, cache, key, value, slot_mapping, k_scale, v_scale)  # in place
    K, V = read(spec, cache, k_scale, v_scale, head_size=D, block_size=bs, num_kv_heads=H)

KIVI (specs with a residual window)::

    cache = kivi_new_cache(spec, num_blocks, block_size, H, D, max_seqs)  # kv_cache, k_residual, v_residual (uint8)
    kivi_write(spec, cache, key, value, slot_mapping, seq_ids, query_start_loc, seq_lens, block_table, block_size)
    K, V = kivi_read(spec, cache, seq_id, seq_len, block_table_row, block_size, H, D)
    out = kivi_attention(spec, cache, q, seq_ids, query_start_loc, seq_lens, block_table, sm_scale, window, bs)
"""

from .attention import attention_mask, paged_attention
from .kivi import (KiviLayout, encode_key_group, is_kivi, kivi_attention, kivi_error_bound, kivi_layout,
                   kivi_new_cache, kivi_page_bytes, kivi_params, kivi_q, kivi_read, kivi_residual_bytes,
                   kivi_residual_shapes, kivi_write, quantized_length, residual_values)
from .codes import decode_codes, encode_codes, half_ulp
from .layout import (FieldLayout, RegionLayout, TensorLayout, as_cache_bytes, bytes_per_token_head, cell_layout,
                     field_views, infer_head_size, layout, new_cache, new_cache_bytes, padding_bytes, page_bytes, read,
                     tensor_names, tensor_page_bytes, tensor_shapes, write)
from .quant import (SideEncoding, data_bytes, decode_side, dynamic_scale, encode_side, error_bound, rotate_side,
                    unrotate_side)
from .rotation import signs as hadamard_signs

__all__ = [
    "FieldLayout",
    "KiviLayout",
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
    "encode_key_group",
    "encode_side",
    "error_bound",
    "field_views",
    "hadamard_signs",
    "half_ulp",
    "infer_head_size",
    "is_kivi",
    "kivi_attention",
    "kivi_error_bound",
    "kivi_layout",
    "kivi_new_cache",
    "kivi_page_bytes",
    "kivi_params",
    "kivi_q",
    "kivi_read",
    "kivi_residual_bytes",
    "kivi_residual_shapes",
    "kivi_write",
    "layout",
    "new_cache",
    "new_cache_bytes",
    "padding_bytes",
    "page_bytes",
    "paged_attention",
    "quantized_length",
    "read",
    "residual_values",
    "rotate_side",
    "tensor_names",
    "tensor_page_bytes",
    "tensor_shapes",
    "unrotate_side",
    "write",
]
