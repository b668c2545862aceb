"""Dequantize-first attention (``Format.attend(..., dequantize_first=True)``).

A chunked prefill reads every cached position once per tile of query rows: 16-32 times for a chunk of 2048 new
tokens, and the fused kernel decodes the codes (and splits them into exact dot terms) each time. Dequantize-first
decodes them once: the format's generated ``dequantize_kernel`` writes the positions the batch reads into a dense
scratch cache of a 16-bit type (the query's, or the one named; the shipped bf16 / fp16 format's layout, the
sequences' blocks one after another), and the dense format's attention runs over it. Each dequantized value is
rounded once to that type (as engines that dequantize before attention do), so the result has the accuracy of a
bf16 / fp16 cache holding the dequantized values (docs/accuracy.md), not "auto"'s exact products: fp16 keeps 3
more bits than bf16 (the int8 formats' values nearly exactly), bf16 the range.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import checks, kernels
from .kernels import triton_cdiv

# positions per dequantize program (compiled; the interpreter takes whole sequences up to 256, fewer programs); for
# a side rotated back by tensor-core dots (the generated ROTATE_BACK_BY_DOT, at ROT_DOT's head sizes) up to a padded
# head of DEQUANT_ROT_DOT_MAX_PAD, DEQUANT_ROT_DOT_BLOCK_N: programs of 64 rows take warpgroup dots (static counts,
# thirty-fourth session, `sass_count.py --dequantize` at head size 128: int4 per token-head 221 -> 91 instructions
# per position-head, the Hadamard format 134 -> 72; 32 rows take mma.sync and move operands between layouts). Larger
# heads keep 32 rows (their [64, HEAD_PAD] operands unmeasured)
DEQUANT_BLOCK_N = 32
DEQUANT_ROT_DOT_BLOCK_N = 64
DEQUANT_ROT_DOT_MAX_PAD = 128
DEQUANT_WARPS = 4
# rotated sides rotate back by tensor-core dots (the kernel's ROT_DOT) at padded heads over this many elements, on the
# CUDA cores below: the dots of a 16-element head gave int4 per token-head wrong values on the H100 (thirty-third
# session, Triton 3.6; tests/test_dequantize_first.py), where dots at 32, 48, 64 and 128 were exact
# (benchmarks/pending/rotate_dot_check.py; the Hadamard format exact at every head). Both sum the same exact products
ROT_DOT_MIN_PAD = 32


DENSE_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# dequantize_first="auto": the dense path where it was measured faster than the fused kernels. Its cost is one pass
# over the cache (the dequantize kernel), whatever the batch; what it saves is what the fused kernel pays over bf16's
# per query row and cached position, which depends on the format's class and grows with the query rows per KV head
# (new tokens x query heads per KV head). AUTO_DENSE_RULES, plain data, the first rule that admits the format wins
# (kernels.rule_matches; None admits anything). Fields: the most terms of a cache-side dot operand (the generated
# DOT_OPERANDS: 2 where a code times its scale is not one fp16 value, as for q4_0's fp16 block scales or KIVI's
# zero points; 0 for exact fp32 dots), block scales, e8m0 block scales, scales computed on write (per token-head,
# per block, per channel group), the dots ("fast" or "auto"), the widest code in bits, keys grouped over positions
# (KIVI's per-channel groups: the generated BLOCK_N_GROUP) -> the fewest new tokens per sequence (the batch's
# average) from which the dense path is taken at AUTO_GROUP query heads per KV head and head size AUTO_HEAD_SIZE,
# None for never. Other groups scale the count inversely (a query of 2 heads per KV head needs twice the tokens); so
# do larger heads (256 needs half the tokens), and smaller heads by the square of the ratio (64 needs four times the
# tokens).
# Measured on an H100 (thirty-seventh session, after the dequantize kernels got 1.3-2.7x faster; benchmarks/
# RESULTS.md; `python benchmarks/dequantize_first.py FORMATS --shape 4x8192qN[hsH] [--query-heads Q]`, chunks of N
# new tokens on each of 4 sequences of 8192, 32 query heads over 8 KV heads of 128 unless named), fused /
# dense-first us:
# - two terms (and block scales): at 32, q4_0 180 / 177, q8_0 209 / 191, kivi_2bit 296 / 185; at 16 in the
#   thirty-fourth session (dense-first has got faster since) q4_0 104 / 176, kivi_2bit 195 / 193. A side of two
#   terms without block scales (KIVI's per-channel keys beside other values) is given the same count, unmeasured;
# - per token-head (one term, no block scales): at 32 every one fused (int8 156 / 190, int8 with its scales apart
#   126 / 189, Hadamard 172 / 204); at 128 int8 411 / 387, Hadamard 484 / 398, int8 apart 366 / 386 (5% lost
#   there, dense from 256: 686 / 585). fp8 per token-head, int8 asym, int4 per token-head and mixed_k8_v4 share
#   the class (2048: dense 1.02-1.03x bf16 against fused 1.27-1.88x), and so do formats of exact fp32 dots (terms 0,
#   fp32 zero points; unmeasured);
# - e8m0 blocks: at 32 fused (mxfp8 145 / 189, mxfp4 132 / 179), at 128 mxfp8 422 / 384, mxfp4 382 / 376;
# - other block-scaled formats of one term (nvfp4, nvfp4_separate): dense at 2048, 3576 / 3298 (bench.py); at 512
#   1030 / 996 and at 1024 1928 / 1829 (thirty-eighth session, against the faster dequantize kernel; the
#   thirty-fourth session's fused kernel was as fast up to 1024 against the old one);
# - static scales (fp8 per tensor / per head / e5m2: fused 0.95x bf16 against 1.01-1.02x dense-first) and the dense
#   formats: never.
# Groups: at 1 query head per KV head and 512 new tokens (the per token-head count scaled) int8 403 / 385, mxfp8
# 410 / 382; at 8 and 64 new tokens, int8 418 / 387, mxfp8 424 / 384. Head sizes: at 64 and 128 new tokens the
# fused kernels win for int8 (233 / 277) and mxfp8 (238 / 277), dense-first for q4_0 (347 / 269) and KIVI (589 /
# 267); at 256 and 128 new tokens dense-first wins for int8 (827 / 724), q4_0 and KIVI (2-4.6x). The thirty-eighth
# session went on: at 64 the one-term fused kernels still win at 256 (int8 428 / 456, mxfp8 431 / 455), 512 (int8
# 790 / 805) and 1024 (int8 1467 / 1490, mxfp8 1450 / 1492), hence the square; at 256, 64 new tokens tie for int8
# (508 / 501; mxfp8 472 / 502) and 16 for q4_0 (351 / 352), where KIVI's dense-first is 2.4x faster (946 / 397),
# hence half the count. Only batches of equal chunks were timed: the batch's average stands for every sequence's,
# so a decode sequence in a mixed batch pays the dense copy of its whole context for one query (one chunk of 1024
# with 31 decodes averages 33 new tokens per sequence). Under "fast" dots the two-term fused kernels take one term
# (thirty-ninth session, H100, `... --dot-precision fast --shape 4x8192qN`): q8_0 wins up to 96 new tokens (148 /
# 190 at 32, 236 / 274 at 64, 335 / 351 at 96; 399 / 391 at 128), q4_0 at 32 (141 / 176; 245 / 224 at 48, 256 /
# 259 at 64, 362 / 337 at 96), hence their own counts by the widest code (8 bits: 128, fewer: 48); KIVI's keys,
# grouped over positions, keep it slower (267 / 185 at 32): the two-term count. Other formats' fast kernels are
# auto's. Also needed: 16-bit queries, "auto" / "fast" dots, and a scratch of at most AUTO_MAX_SCRATCH_BYTES
# (num_seqs x the positions a sequence may hold: max_seq_len, else what the block table addresses).
# `auto_min_new_tokens(fmt)` gives a format's count.
AUTO_DENSE_RULES = (
    # terms, block scales, e8m0 blocks, scales computed on write, dots, widest code bits, keys grouped over positions
    # -> fewest new tokens per sequence
    ((None, None, None, False), None),
    ((2, None, None, None, "fast", (5, 6, 7, 8), False), 128),
    ((2, None, None, None, "fast", None, False), 48),
    ((2,), 32),
    ((None, True, True), 128),
    ((None, True), 512),
    ((None, None), 128),
)
AUTO_GROUP = 4  # the query heads per KV head the counts were measured at
AUTO_HEAD_SIZE = 128  # and the head size
AUTO_MAX_SCRATCH_BYTES = 1 << 30


def dense_blocks(positions: int, table_width: int, block_size: int) -> int:
    """Blocks per sequence of the dense scratch for a bound of ``positions`` per sequence: whole blocks, no more
    than the block table addresses, at least one."""
    return max(1, min(triton_cdiv(positions, block_size), table_width))


def auto_min_new_tokens(fmt, group: int = AUTO_GROUP, head_size: int = AUTO_HEAD_SIZE,
                        dot_precision: str = "auto") -> Optional[int]:
    """The fewest new tokens per sequence, on average, from which dequantize_first="auto" takes the dense path for
    ``fmt`` with ``group`` query heads per KV head at ``head_size`` under ``dot_precision`` (AUTO_DENSE_RULES;
    None: never)."""
    group, head_size = checks.positive_int("group", group), checks.positive_int("head_size", head_size)
    ks = fmt._kernels
    key = (max(terms for _, terms, _ in ks.module.DOT_OPERANDS.values()), ks.block_scaled, ks.pow2_blocks,
           ks.position_scales, "fast" if dot_precision == "fast" else "auto", max(ks.module.CODE_BITS.values()),
           getattr(ks.module, "BLOCK_N_GROUP", None) is not None)
    for rule, fewest in AUTO_DENSE_RULES:
        if kernels.rule_matches(rule, key):
            if fewest is None:
                return None
            # fewest x (AUTO_GROUP / group) x (AUTO_HEAD_SIZE / head_size), squared for heads under AUTO_HEAD_SIZE
            power = 2 if head_size < AUTO_HEAD_SIZE else 1
            scaled = fewest * AUTO_GROUP * AUTO_HEAD_SIZE ** power
            return max(1, -(-scaled // (group * head_size ** power)))
    raise AssertionError("the last rule matches every format")


def auto_dense(fmt, query: torch.Tensor, num_seqs: int, block_table: torch.Tensor, block_size: int,
               num_kv_heads: int, dot_precision: str, max_seq_len: Optional[int]) -> bool:
    """dequantize_first="auto"'s choice for one call (see AUTO_DENSE_RULES): whether to dequantize first. Reads
    nothing from the device: the new tokens are the query's rows (padding rows past the last sequence's included),
    and the scratch is DequantizedLaunch's for ``max_seq_len``, else for what the block table addresses (a plan's;
    ``attend``'s own, sized by the longest sequence, is no larger)."""
    if query.dtype not in DENSE_FORMATS or dot_precision not in ("auto", "fast"):
        return False
    fewest = auto_min_new_tokens(fmt, query.shape[1] // num_kv_heads, query.shape[2], dot_precision)
    if fewest is None or query.shape[0] < fewest * num_seqs:
        return False
    width = block_table.shape[1]
    blocks = dense_blocks(max_seq_len if max_seq_len is not None else width * block_size, width, block_size)
    scratch = num_seqs * blocks * block_size * num_kv_heads * query.shape[2] * 2 * 2  # K and V, 2 bytes each
    return scratch <= AUTO_MAX_SCRATCH_BYTES


def dense_dtype(dequantize_first, query_dtype: torch.dtype) -> Optional[torch.dtype]:
    """The dense cache's type for attend's ``dequantize_first`` argument (None: the fused path): True takes the
    query's type (bf16 / fp16), or a 16-bit torch dtype names it ("auto" is resolved before: True or False)."""
    if dequantize_first is False:
        return None
    if dequantize_first is True:
        if query_dtype not in DENSE_FORMATS:
            raise ValueError(f"dequantize_first: True takes the query's type for the dense cache, which must be bf16 "
                             f"or fp16, got {query_dtype}; name the type instead (dequantize_first=torch.bfloat16 "
                             "or torch.float16)")
        return query_dtype
    if isinstance(dequantize_first, torch.dtype) and dequantize_first in DENSE_FORMATS:
        return dequantize_first
    raise ValueError(f"dequantize_first: expected True, False, \"auto\", torch.bfloat16 or torch.float16, got "
                     f"{dequantize_first!r}")


class DequantizedLaunch:
    """One dequantize-first call: the format's dequantize_kernel into a dense scratch cache, then the dense format's
    planned attention over it. The scratch is allocated once per plan (on the stream current at planning): runs of
    one plan share it, one after another, as layers run.

    The scratch holds ``cap`` positions per sequence (``num_seqs * cap`` in all): ``max_seq_len`` when given (the
    caller's bound on every sequence's length), else, for ``attend``, the batch's longest sequence (one
    device-to-host read) and, for a plan (whose ``seq_lens`` may grow in place between runs), what the block table
    can address. The dense attention reads the sequences' lengths capped at ``cap``; where costly checks run (CPU
    tensors, KVGEN_DEBUG=1) a longer sequence is an error naming max_seq_len."""

    def __init__(self, fmt, query: torch.Tensor, cache, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor, seq_ids: Optional[torch.Tensor], sm_scale: float,
                 sliding_window: Optional[int], max_query_len: int, dot_precision: str, max_seq_len: Optional[int],
                 num_splits: Optional[int], consts: dict, planned: bool, dtype: torch.dtype):
        from .format import rotation_back  # (format imports this module)
        from .loader import load  # the shipped dense formats (loader imports this module's users)

        self.dense = load(DENSE_FORMATS[dtype])
        num_seqs = seq_lens.shape[0]
        bs = cache.block_size
        if max_seq_len is not None:
            self.bound = "max_seq_len"
        elif planned:
            self.bound, max_seq_len = "the block table", block_table.shape[1] * bs
        else:  # one device-to-host read; pass max_seq_len to avoid it
            self.bound, max_seq_len = "the longest sequence", int(seq_lens.max())
        out_blocks = dense_blocks(max_seq_len, block_table.shape[1], bs)
        self.cap = out_blocks * bs
        self.scratch = self.dense.allocate(num_seqs * out_blocks, bs, cache.num_kv_heads, cache.head_size,
                                           device=query.device)
        self.table = torch.arange(num_seqs * out_blocks, dtype=torch.int32,
                                  device=query.device).view(num_seqs, out_blocks)
        self._seq_lens = seq_lens
        self._dense_lens = torch.empty_like(seq_lens)  # seq_lens capped at cap (no read past the dense blocks)
        self._cap_lengths()
        self.plan = self.dense.plan_attention(query, self.scratch, self.table, self._dense_lens, query_start_loc,
                                              sm_scale=sm_scale, sliding_window=sliding_window,
                                              max_query_len=max_query_len, dot_precision=dot_precision,
                                              max_seq_len=self.cap, num_splits=num_splits)
        lay = self.dense.layout.page_layout(bs, cache.num_kv_heads, cache.head_size)
        (tensor,) = lay["page_bytes"]  # the dense formats keep K and V in one tensor, [K | V] per cell
        f_k, f_v = lay["fields"]["k_data"], lay["fields"]["v_data"]
        options = {} if kernels.interpreting() else {"num_warps": DEQUANT_WARPS, "enable_fp_fusion": False}
        self._out = self.scratch.tensors[tensor].view(torch.uint16)
        self._kernel = fmt._kernels.launch("dequantize_kernel")
        extra = {}
        rotations = {p: fmt.spec.side(side).rotation for p, side in (("k", "key"), ("v", "value"))}
        if any(rotations.values()):  # R of each rotated side (the other's pointer is unused)
            mats = {p: rotation_back(rot.seed, cache.head_size, consts["HEAD_PAD"], query.device)
                    for p, rot in rotations.items() if rot}
            extra = {f"{p}_rot_ptr": mats.get(p, next(iter(mats.values()))) for p in rotations}
            extra["ROT_DOT"] = consts["HEAD_PAD"] > ROT_DOT_MIN_PAD
        if kernels.interpreting():
            block_n = min(256, 1 << max(self.cap - 1, 1).bit_length())
        else:
            by_dot = any(getattr(fmt._kernels.module, "ROTATE_BACK_BY_DOT", {}).values())
            block_n = (DEQUANT_ROT_DOT_BLOCK_N if by_dot and extra["ROT_DOT"]
                       and consts["HEAD_PAD"] <= DEQUANT_ROT_DOT_MAX_PAD else DEQUANT_BLOCK_N)
        # positions on the grid's first axis (up to 2**31 - 1 programs; the others take at most 65535)
        self._grid = (triton_cdiv(self.cap, block_n), num_seqs, cache.num_kv_heads)
        if fmt.layout.RESIDUAL is not None:
            res = fmt.layout.RESIDUAL
            extra.update(seq_ids_ptr=seq_ids, TOKEN_GROUP=res["group"], RESIDUAL=res["tokens"], RING=res["ring"])
        self._kwargs = dict(block_table_ptr=block_table, seq_lens_ptr=seq_lens, query_start_loc_ptr=query_start_loc,
                            window=sliding_window or 0, out_blocks=out_blocks,
                            stride_bt=block_table.stride(0), **consts, **extra,
                            OUT_PAGE=lay["page_bytes"][tensor] // 2, OUT_CELL=f_k["cell"] // 2,
                            OUT_K_BASE=f_k["base"] // 2, OUT_V_BASE=f_v["base"] // 2,
                            OUT_BF16=dtype == torch.bfloat16, BLOCK_N=block_n,
                            NATIVE_CASTS=kernels.native_fp8(query.device), **options)

    def dequantize(self, ptrs: dict) -> None:
        """Fill the dense cache with the planned positions of the cache whose pointer arguments are ``ptrs``."""
        self._kernel(self._grid, out_ptr=self._out, **ptrs, **self._kwargs)

    def _cap_lengths(self) -> None:
        """The dense attention's lengths: seq_lens as they read now, capped at the dense cache's positions (a longer
        sequence is an error where the costly checks run)."""
        if checks.costly_checks_on(self._seq_lens) and self._seq_lens.numel():
            longest = int(self._seq_lens.max())
            if longest > self.cap:
                raise ValueError(f"max_seq_len: a sequence of {longest} tokens is longer than the {self.cap} "
                                 f"positions per sequence that dequantize_first's dense cache holds (sized by "
                                 f"{self.bound}): pass a max_seq_len that bounds every sequence")
        torch.clamp(self._seq_lens, max=self.cap, out=self._dense_lens)

    def run(self, query: torch.Tensor, out: torch.Tensor, ptrs: dict) -> None:
        """Dequantize, then attend over the dense cache into ``out``."""
        self._cap_lengths()
        self.dequantize(ptrs)
        self.plan.run(query, self.scratch, out=out)
