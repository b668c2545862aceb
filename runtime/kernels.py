"""Import a generated package's Triton kernels and launch them: grids and tile sizes, nothing per-format."""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from typing import NamedTuple, Optional

import torch

try:
    from ..codegen.errors import KvgenError
except ImportError:
    from codegen.errors import KvgenError
from .launch import BoundLaunch, FastLaunch
from .occupancy import resident_programs, wave_splits

LOG2E = 1.4426950408889634


def interpreting() -> bool:
    """Whether Triton kernels run under the CPU interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def no_kernel_mode() -> str | None:
    """Why no kernel can run in this process, or None: TRITON_INTERPRET=0 asks for compiled kernels, which need a
    CUDA device torch can see."""
    value = os.environ.get("TRITON_INTERPRET")
    if value in ("", "0") and not torch.cuda.is_available():  # set, and not asking for the interpreter
        return (f"TRITON_INTERPRET={value} asks for compiled kernels, but torch sees no CUDA device: unset it to run "
                "the kernels in Triton's interpreter on the CPU")
    return None


def _choose_mode() -> None:
    """Without a GPU, kernels can only run interpreted: say so before the first @triton.jit is decorated.

    Triton decides at import time (its own library functions are decorated then), so this must happen before
    ``import triton``; a process that imported triton first on a machine without a GPU gets a clear error.
    """
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        if "triton" in sys.modules:
            raise KvgenError("there is no GPU, so kvgen's kernels must run in Triton's CPU interpreter, but triton "
                             "was imported before kvgen could select it: set TRITON_INTERPRET=1 in the environment "
                             "(or import kvgen before triton)")
        os.environ["TRITON_INTERPRET"] = "1"


# Launch configuration of the attention kernel on a GPU, chosen by what shapes the kernel's work, per call:
#   bits   the widest stored code in bits;
#   terms  the most fp16 / bf16 terms of a cache operand that goes to tensor cores (0: exact fp32 dots only, as for
#          dot_precision="ieee"; 1 also for int8 dots and for per-block dots on the codes (q8_0 / q4_0 in decode,
#          BLOCK_DOTS); 2: hi + lo, e.g. q8_0's codes times block ratios in prefill);
#   block  whether block scales enter the operand;
#   split  which of the tensor-core dots' other operands take two terms (a second dot, more registers): 0 none;
#          1 the query (rotated queries from bf16 / fp16 input: the Hadamard format, int4 per token-head); 2 the
#          probabilities; 3 both (fp32 queries). False / True in a rule match 0 / 1 (Python's equality); a tuple
#          in a rule matches any of its values;
#   rows   the query rows a program holds (BLOCK_M): 16 in decode (one query token, or up to 16 / GROUP of them);
#          prefill holds 64, or 128 where a rule of 128 rows names them (RULED_PREFILL_ROWS; GQA groups over 64
#          fill 128 rows in decode too and take those rules, untimed there), and needs the registers a cap would
#          take (the decode caps made the chunked prefill of 4 x 2048 tokens 35-40% slower on the H200);
#   head   the padded head size (HEAD_PAD): bf16 / fp16 at 64 has a rule of its own since the sixth session (half the
#          bytes per position: twice the positions per step pay, 295 -> 279 us at 64 x 8192), the measured classes
#          below at 64 and 128 since the twenty-fourth; other head sizes take a class's rule for any head.
#   wide   every side's code rows start at multiples of 16 bytes in the page (cell, base and page sizes), so the
#          compiled kernel copies them 16 bytes at a time: fp8 per tensor and int8 with separate scales, not vLLM's
#          inline-scale cells of 132 bytes a side.
#   e8m0   block scales are powers of two (MX formats): the codes' ratios cost less arithmetic than nvfp4's e4m3
#          scales, and more copies in flight pay where nvfp4 stays issue-bound;
#   block dots  the call takes one dot per scale block (BLOCK_DOTS: q8_0 and q4_0 in decode; since block-rows, on the
#          FOLD_ROWS rows a decode fills: q8_0 255 registers, q4_0 143 at head size 128, GROUP 4);
#   scale words  no block-scale row is loaded byte-wise (scale_rows_in_words; rules that leave it out admit both);
#   position scales  some side's scales are computed on write (per token-head, per block, per channel group), not
#          static per tensor / head: fp8 per tensor and int8 separate differ only there (128-row prefill: 0.91x
#          against 1.37x their 64-row time).
# prefetch_blocks: the kernel's PREFETCH_BLOCKS (block ids loaded one step ahead), which lets a third stage
# double-buffer the K/V copies. H200, 2026-12-04 (benchmarks/RESULTS.md, twenty-second session; `python
# benchmarks/tune_tiles.py fp8_e4m3 int8_per_token_head_separate --configs 128/4/2/168 128/4/3/168p
# --programs-per-sm 4 8 --cuda-graphs`): fp8_e4m3 349 -> 330 us at 64 x 8192, 183 -> 175 at 4 x 65536, 200 -> 191 at
# 256 x 1024 (split target 4 programs per SM; 8 gave 335 / 179 / 189), int8 separate 415 -> 404, 215 -> 211; the
# inline-scale cells ran 1.4-1.5x slower with 3 stages (benchmarks/variant_ab.py), so they keep 2. With the values
# converted first (V_CONVERT_FIRST; twenty-fourth session, runs 4-6: `python benchmarks/tune_tiles.py mxfp4
# int4_per_token_head --configs rtc 128/4/3/168pc 128/4/2/168pc ... --shapes 64x8192 4x65536 256x1024
# --cuda-graphs`): mxfp4 with 3 stages, block ids ahead and 168 registers 443 -> 413 us at 64 x 8192, 228 -> 212 at
# 4 x 65536, 238 -> 221 at 256 x 1024 (nvfp4 lost 6% with the same tiles, mxfp8 1-3%: the e8m0 key); int4 per
# token-head with 168 registers and block ids ahead 672 -> 632, 344 -> 312, 393 -> 373 (a 128-register cap spills:
# 1.06-1.28x slower). Both at head size 128 only (measured there; head size 256 has rules of its own). Head
# size 64 (runs 7-8, `--shapes 64x8192hs64`): the 8-bit formats with per-tensor or per-token scales and nvfp4 with 3
# stages, block ids ahead and 168 registers (fp8 215 -> 189 us, int8 separate 284 -> 249, int8 / fp8 per token-head
# 333 / 327 -> 308 / 305, nvfp4 281 -> 252), mxfp4 and int4 per token-head with 2 stages and 128 registers (336 ->
# 284, 361 -> 307; no spills at head size 64); mxfp8 level with 2 stages and 128 registers (306 against 307 us),
# slower with 3 stages (354), keeps its rule. q4_0's per-block dots, 7-10% slower at head size 128 with nvfp4's new
# tiles there, keep their rule (the block dots key). Twenty-fifth session, run 5 (`python benchmarks/tune_tiles.py
# FORMATS --configs rt 128/4/3/168p ... --shapes 64x8192hs64 --cuda-graphs`): at head size 64 the rotated-key format
# takes the 3-stage tiles too (402 -> 322 us; its second query term spilled under the cap at head size 128 only), and
# so do the per-block dots of q4_0 (353 -> 328) and q8_0 (487 -> 473); mixed_k8_v4, int8 asym, nvfp4_separate, mxfp8,
# int8 / fp8 per token-head, mxfp4 and int4 per token-head gained at most 3% from 2-3 stages, 64 positions per step
# or 8 warps (mxfp4 2.8% with block ids ahead, 285 -> 277 us, mixed_k8_v4 2% with 128/4/2/128: one run each, kept as
# they were; the rest level or slower). KIVI at head size 64 (run 6; no key fold there) with 2 stages: kivi_2bit 1074 ->
# 720 us at 64 positions per step and 128 registers, kivi_4bit 1098 -> 723 at 128 positions; at head size 128 (key
# fold) 2 stages at 64 positions were mixed (run 7: 0-5% faster at 64 x 8192 and 4 x 65536, kivi_4bit 3% slower at
# 256 x 1024) and stay out. The rotated-key rule is for a query alone in two terms (bf16 / fp16 queries: split 1);
# fp32 queries keep the class rule of before. Not timed at head size 64, following their class's rule: the
# "quantized" domain's int8 dots, fp8 per head / e5m2, and "fast" on q4_0 / q8_0 (the block-dots rule with fast's
# entries over it).
# Twenty-sixth session (benchmarks/RESULTS.md; `python benchmarks/tune_tiles.py FORMATS --configs ... --shapes
# 16x8192hs256 [4x65536hs256] --cuda-graphs`, runs 3-7): head size 256, never swept before, spilled under the head-128
# rules (mxfp8 1563 us at 16 x 8192: 255 registers, one side loaded plainly). bf16 316 -> 267 us at 32 positions per
# step, 3 stages, block ids ahead (507 us at 4 x 65536, 99% of copy bandwidth); fp8 317 -> 217 and int8 separate 336
# -> 234 at 128 positions, 2 stages, block ids ahead, no cap; int8 per token-head 438 -> 327 at 64 positions, 2
# stages, no cap (fp8 per token-head 321 with it); mxfp8 1563 -> 327 at 64 positions, 2 stages, block ids ahead, 255
# registers (336 without the last two); nvfp4, mxfp4 and int4 per token-head were fastest with their rules (329,
# 314, 413 us). Not timed at head size 256, following these rules by their keys: fp16 (bf16's), fp8 per head / e5m2
# and int8 separate's quantized domain (fp8's), int8 asym, mixed_k8_v4 and the quantized domain of the inline-scale
# cells and the Hadamard format (int8 per token-head's). With its e8m0 scale rows read as words (side.jinja's
# block_scale_codes; the key's scale words: not with an odd number of KV heads, where those tiles ran slower),
# mxfp8 at head size 64 takes 3 stages, block ids ahead and 168 registers (run 1, `benchmarks/variant_ab.py`: 308 ->
# 283 us at 64 x 8192, 166 -> 145 at 4 x 65536). Chunked prefill (64 query rows, head size 128; runs 2, 4 and 5 at 4
# x 8192 with 2048 new tokens each): bf16 4383 -> 3987 us with 128 positions per step, 2 stages and block ids ahead;
# nvfp4 4949 -> 4402 and mxfp4 5615 -> 4940 with 128, 3 stages and block ids ahead (nvfp4_separate 4388 with that
# rule; fp16 untimed); the 8-bit formats kept the old 128/4/2 (int8 separate 4618, fp8 / int8 per token-head 4585 /
# 4760; mxfp8 5731, 1.2% behind 64/4/2).
# Twenty-seventh session (benchmarks/RESULTS.md): head size 256 with the values converted first (the rules'
# convert_first; `python benchmarks/tune_tiles.py FORMATS --configs rt 64/4/2pc 64/4/2/168pc 128/4/2pc 64/4/2/255pc
# --shapes 16x8192hs256 4x65536hs256 --cuda-graphs`, run 2), at 16 x 8192 / 4 x 65536: fp8 218 -> 180 / 403 -> 337 us
# and int8 separate 232 -> 208 / 438 -> 395 at 64 positions per step, 168 registers; mxfp8 328 -> 228 / 612 -> 444
# at 64 positions, no cap; nvfp4 328 -> 250 / 630 -> 491 and mxfp4 312 -> 244 / 594 -> 483 at 64 positions, 168
# registers; int4 per token-head 416 -> 335 / 775 -> 617 at 128 positions (bf16 263 / 498: rule kept). Untimed
# there, following these rules: fp8 per head / e5m2, nvfp4_separate, and int8 separate's quantized domain (int8
# dots: not converted first, but 64 positions and the cap). Chunked prefill at 128 query rows (RULED_PREFILL_ROWS,
# run 3): the rules of 128 rows below; untimed, following them: fp8 per head / e5m2 (fp8's), kivi_4bit (q4_0's).
# Twenty-eighth session (benchmarks/RESULTS.md; runs 2-5): chunked prefill in 128-row programs at head sizes 64 and
# 256 (`python benchmarks/tune_tiles.py FORMATS --configs 128/8/2 64/8/2 --prefill-rows 128 --shapes 4x8192q2048hs64
# 4x8192q2048hs256 --cuda-graphs`, against the 64-row rules): at 256 bf16 12112 -> 7510 us (64/8/2), fp8 10659 ->
# 6887, mxfp8 20986 -> 9438, nvfp4 9977 -> 8889, mxfp4 14667 -> 11319 (128/8/2), q4_0 25163 -> 20162 and kivi_2bit
# 121360 -> 68622 (64/8/2); at 64 fp8 2717 -> 2620 and q4_0 5411 -> 4776 (128/8/2), int4 per token-head 5848 -> 5393
# (64/8/2); int4 per token-head at 256, bf16 / mxfp8 / nvfp4 at 64 keep 64 rows. Decode at head size 256 with the
# values converted first and block ids ahead, at 16 x 8192 / 4 x 65536: q4_0 560 -> 385 / 1088 -> 826 us at 128
# positions per step (64: 428 / 811, mixed), q8_0 727 -> 548 / 1417 -> 1042 at 64, kivi_2bit 984 -> 910 / 1801 -> 1666 and kivi_4bit 994 ->
# 900 at 64. Untimed, following these by their keys: fp16 (bf16's), fp8 per head / e5m2 (fp8's); timed with the
# rules alone (no time before): kivi_4bit's prefill (q4_0's rule at 64: 7343 us; KIVI's at 256: 71787) and
# nvfp4_separate's at 256 (8905). Also untimed: "fast" on q4_0 / q8_0 at 256, whose FAST_RATIO_TILES entries now
# replace the new rules' (static counts, `sass_count.py --fast --head-size 256 q4_0 q8_0`: 29.5 -> 25.7 and 36.2 ->
# 23.5 instructions per position, spills 0.6 / 1.4 -> 0.2 / 0, but 5 / 9 block-scale loads waited on each step).
# Twenty-ninth session (benchmarks/RESULTS.md, run 4): "fast" at 256 timed, q4_0 311 / 580 us and q8_0 281 / 525
# (auto 385 / 826, 548 / 1042); int8 separate's chunked prefill at 256 in 128-row programs, 13542 -> 11578 us on
# 128/8/2 (64/8/2: 13524). Untimed, following it by its key: int8 separate's quantized domain (int8 dots, any query
# type). int8 per token-head ran 15104 -> 13887 on 64/8/2 there, but its key admits fp8 per token-head, int8 asym and
# mixed_k8_v4, untimed: no rule yet (benchmarks/pending/README.md).
# Thirty-second session (benchmarks/RESULTS.md): with the per-position scale words spread over the program's threads
# (load_per_position; `bash benchmarks/pending/next_session.sh rowspread` / `rowspread128`), 128-row programs on
# 128/8/2 at head size 256 against the rules before: int8 per token-head 15031 -> 10622 us, fp8 per token-head 14373
# -> 10492, int8 separate 11323 -> 8708, int8 asym 17126 -> 10769, Hadamard 19835 -> 13621, int4 per token-head
# 21850 -> 14893, mixed_k8_v4 15710 -> 10261; at head size 128 int8 separate 4623 -> 4286 (its 64-row rule's time
# from `benchmarks/dequantize_first.py` in the same session). int8 asym at 128 (6059 -> 4871) shares its key with
# int8 / fp8 per token-head and mixed_k8_v4, which lost there (4757 -> 5066, 4587 -> 4854, 4747 -> 4989): 64 rows.
# Thirty-third session, on an H100 (no H200 was lent; prefill is bound by the dots and the SMs, which the two share;
# benchmarks/RESULTS.md): with the mask-free steps merged since, that key's formats gained at head size 128 in
# 128-row programs on 128/8/2 against their 64-row 128/4/2 (`python benchmarks/tune_tiles.py FORMATS --configs rt /
# 128/8/2 / 128/4/2 [--prefill-rows 128 / 64] --shapes 4x8192q2048 --cuda-graphs`): int8 per token-head 4401 -> 4135
# us, fp8 per token-head 4218 -> 4113, mixed_k8_v4 4233 -> 4127, int8 asym 5732 -> 4162; the Hadamard format (a
# two-term query: split 1) lost, 5438 -> 5606, and keeps 64 rows under auto and fast (its quantized domain, int8
# dots with one query term, follows the rule untimed, as at 256); at head size 64 three lost (int8 per token-head
# 2723 -> 3122) and int8 asym was level (3089 -> 3080): 64 rows there.
# First matching rule wins (None matches anything). BLOCK_N: KV positions per step; maxnreg: a register cap (the
# compiler otherwise takes 255 registers, two programs per SM); programs_per_sm: the split-KV target; convert_first
# (optional): the rule's own V_CONVERT_FIRST, in place of convert_values_first's conditions; value_split (optional,
# decode): the P x V dot in 2 or 4 dots (V_SPLIT); live_fold (optional, default True): False keeps every query row in
# a "live" kernel's paged steps (live_fold_rows). The tuned rules
# were measured on the H200 with benchmarks/tune_tiles.py in decode at 64 x 8192 and 4 x 65536 with bf16 queries
# (benchmarks/RESULTS.md, 2026-11-30; the format named was measured, the others follow its rule); the last two keep
# the configuration used before that measurement, also for the prefills not named. The interpreter takes 128
# positions per step.
# Forty-ninth session (H100, benchmarks/RESULTS.md; `python benchmarks/tune_tiles.py int8_per_token_head_separate
# --dot-precision quantized --configs rt 128/4/2/128 --shapes 64x8192 4x65536 256x1024 --cuda-graphs`): int8 separate's
# quantized domain (int8 dots: its value codes are the dot's operand, not staged as fp16) compiles at 2 stages and 128
# registers without spills, 37 KiB of shared memory: 4 programs per SM instead of 3, 462 -> 423 us at 64 x 8192 (79%
# -> 87% of copy bandwidth; 422 again), 237 -> 224 at 4 x 65536, 292 -> 258 at 256 x 1024. The inline-scale cells'
# quantized domain was not faster so (int8 per token-head 508 -> 522 us at 64 x 8192; the Hadamard format 273 -> 290
# at 4 x 65536) and keeps its rule: the rule's int8-dots field is its own.
# Fifty-first session (H100, benchmarks/results_2026-12-07_h100_s51.md; `python benchmarks/tune_tiles.py FORMATS
# --configs rt CONFIG --shapes 64x8192 4x65536 256x1024 --cuda-graphs`), with decode's paged steps on the rows the
# launch fills (fold_rows' stacked blocks for q8_0 / q4_0, live_fold_rows' 8 of 16 for the formats of one dot per
# side) and the value dot in halves where a rule says value_split: at head size 128 q4_0 and nvfp4 (nvfp4_separate
# following, untimed) at 2 stages, block ids ahead, 128 registers, the value dot in halves (q4_0 574 -> 457 / 300 ->
# 240 / 328 -> 269 us; nvfp4 440 -> 405 / 221 -> 223 / 251 -> 232); mxfp4 the same (404 -> 398 / 209 -> 206 / 223
# -> 215, against its 3-stage rule); q8_0 capped at 168 (573 -> 539 / 296 -> 259 / 329 -> 299); kivi_4bit at 128
# registers (main's kernel: 1227 -> 1067 / 622 -> 531 / 810 -> 790; kivi_2bit mixed, kept); the rotated-key format
# with bf16 / fp16 queries at 168 (524 -> 526 / 267 -> 251 / 353 -> 310). fp8 per token-head ran slower on 8 rows
# (499 -> 539 / 257 -> 273 / 292 -> 304 us; statically it spills 0.1 loads / stores a position on 8 rows under the
# 168 cap, int8 per token-head none) and keeps every row at head size 128 (live_fold=False; the key's last
# field: low-bit float codes); at 64 and 256 the earlier rules catch it and it folds, untimed. At head size 64 (64 x 8192 only, 128/4/2/128p against the rules' tiles): int8 separate 270 -> 248 and
# mxfp8 329 -> 296 at 2 stages, 128 registers; q4_0 287 -> 260 at 3 stages, 128 registers. Not faster and not taken:
# quarters for int8 separate (412 -> 461 us) and mxfp8 (463 -> 453, within noise), 64-position steps at 5 or 6
# programs per SM (benchmarks/pending/README.md's occupancy), int8 per token-head / int8 asym at 128 registers.
# Fifty-second session (H100, benchmarks/results_2026-12-07_h100_s52.md; `bash benchmarks/pending/next_session.sh
# merged51time`): q8_0's 168-register rule with 8 programs per SM as the split target, 541 -> 504 / 259 -> 261 /
# 302 -> 301 us (at head size 64 its rule's 4 stayed faster: 321 / 167 against 333 / 171 at 8).
DECODE_ROWS = 16
# Prefill programs of more query rows than this run the whole steps every row sees in a loop of their own, without
# the causal / window mask (the kernel's MASK_FREE_STEPS); decode (one new token per sequence, whatever the rows:
# GQA groups over 16 fill more) and programs of up to this many rows keep one masked loop. H200, thirty-second
# session (benchmarks/RESULTS.md; `bash benchmarks/pending/next_session.sh maskfree`, the loops for every program):
# chunked prefill at 4 x 8192 with 2048 new tokens 0.82-0.95x the time for all eight formats timed (bf16 3960 ->
# 3244 us), decode at 64 x 8192 / 4 x 65536 mixed: 0.96-0.99x for int8 separate, nvfp4, mxfp4, q4_0 and KIVI,
# 1.01-1.02x for bf16 and fp8, 1.04-1.05x for int8 per token-head
MASK_FREE_ROWS = DECODE_ROWS
# attention's dot precisions (Format.attend): "auto" exact products on tensor cores where the operands allow, else
# fp32; "ieee" exact fp32 dots; "quantized" int8 dots on int8 codes; "fast" one 16-bit term per operand
DOT_PRECISIONS = ("auto", "ieee", "quantized", "fast")
ATTENTION_TILES = (
    # bits, terms, block, split, rows, head, wide, e8m0, block dots[, scale words[, position scales[, int8 dots[,
    # float codes]]]] -> tiles
    ((8, 1, False, False, 16, 128, True, None, None, None, None, True), dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=128, programs_per_sm=4)),  # int8 separate's quantized domain
    ((8, 1, False, False, 16, 128, True, None, None), dict(BLOCK_N=128, num_warps=4, num_stages=3, maxnreg=168, programs_per_sm=4, prefetch_blocks=True)),  # fp8, int8 separate
    ((16, 1, None, False, 16, 64, None, None, None), dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=168, programs_per_sm=8)),  # bf16, hs 64
    ((8, 1, False, False, 16, 64, True, None, None, None, True, False), dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=128, programs_per_sm=4, prefetch_blocks=True)),  # int8 separate, hs 64
    ((8, 1, False, False, 16, 64, None, None, None), dict(BLOCK_N=128, num_warps=4, num_stages=3, maxnreg=168, programs_per_sm=4, prefetch_blocks=True)),  # fp8, int8 separate, int8 / fp8 per token-head, hs 64
    ((4, 1, True, False, 16, 64, None, True, None), dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=128, programs_per_sm=4)),  # mxfp4, hs 64
    ((4, 1, True, False, 16, 64, None, None, False), dict(BLOCK_N=128, num_warps=4, num_stages=3, maxnreg=168, programs_per_sm=4, prefetch_blocks=True)),  # nvfp4 (not q4_0's block dots), hs 64
    ((4, 1, False, (1, 2, 3), 16, 64, None, None, None), dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=128, programs_per_sm=4)),  # int4 per token-head, hs 64
    ((8, 1, False, 1, 16, 64, None, None, None), dict(BLOCK_N=128, num_warps=4, num_stages=3, maxnreg=168, programs_per_sm=4, prefetch_blocks=True)),  # rotated keys (Hadamard, bf16 / fp16 queries), hs 64
    ((4, 1, True, False, 16, 64, None, False, True), dict(BLOCK_N=128, num_warps=4, num_stages=3, maxnreg=128, programs_per_sm=4, prefetch_blocks=True)),  # q4_0 (block dots), hs 64
    (((4, 8), 1, True, False, 16, 64, None, False, True), dict(BLOCK_N=128, num_warps=4, num_stages=3, maxnreg=168, programs_per_sm=4, prefetch_blocks=True)),  # q4_0, q8_0 (block dots), hs 64
    ((2, 2, True, False, 16, 64, None, None, True), dict(BLOCK_N=64, num_warps=4, num_stages=2, maxnreg=128, programs_per_sm=4)),  # kivi_2bit, hs 64
    ((4, 2, True, False, 16, 64, None, None, True), dict(BLOCK_N=128, num_warps=4, num_stages=2, programs_per_sm=4)),  # kivi_4bit, hs 64
    ((8, 1, True, False, 16, 64, None, True, None, True), dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=128, programs_per_sm=4, prefetch_blocks=True)),  # mxfp8, hs 64, scale rows as words
    ((16, 1, None, False, 16, 256, None, None, None), dict(BLOCK_N=32, num_warps=4, num_stages=3, programs_per_sm=4, prefetch_blocks=True)),  # bf16, hs 256
    ((8, 1, False, False, 16, 256, True, None, None), dict(BLOCK_N=64, num_warps=4, num_stages=2, maxnreg=168, programs_per_sm=4, prefetch_blocks=True, convert_first=True)),  # fp8, int8 separate, hs 256
    ((8, 1, False, False, 16, 256, False, None, None), dict(BLOCK_N=64, num_warps=4, num_stages=2, programs_per_sm=4)),  # int8 / fp8 per token-head, hs 256
    ((8, 1, True, False, 16, 256, None, True, None), dict(BLOCK_N=64, num_warps=4, num_stages=2, programs_per_sm=4, prefetch_blocks=True, convert_first=True)),  # mxfp8, hs 256
    ((4, 1, True, False, 16, 256, None, None, False), dict(BLOCK_N=64, num_warps=4, num_stages=2, maxnreg=168, programs_per_sm=4, prefetch_blocks=True, convert_first=True)),  # nvfp4, mxfp4, hs 256
    ((4, 1, False, 1, 16, 256, None, None, None), dict(BLOCK_N=128, num_warps=4, num_stages=2, programs_per_sm=4, prefetch_blocks=True, convert_first=True)),  # int4 per token-head (bf16 / fp16 queries), hs 256
    ((4, 1, True, False, 16, 256, None, False, True), dict(BLOCK_N=128, num_warps=4, num_stages=2, programs_per_sm=4, prefetch_blocks=True, convert_first=True)),  # q4_0 (block dots), hs 256
    ((8, 1, True, False, 16, 256, None, False, True), dict(BLOCK_N=64, num_warps=4, num_stages=2, programs_per_sm=4, prefetch_blocks=True, convert_first=True)),  # q8_0 (block dots), hs 256
    (((2, 4), 2, True, False, 16, 256, None, None, True), dict(BLOCK_N=64, num_warps=4, num_stages=2, programs_per_sm=4, prefetch_blocks=True, convert_first=True)),  # KIVI, hs 256
    ((16, 1, None, False, 64, 128, None, None, None), dict(BLOCK_N=128, num_warps=4, num_stages=2, programs_per_sm=4, prefetch_blocks=True)),  # bf16, prefill, hs 128
    ((4, 1, True, False, 64, 128, None, None, False), dict(BLOCK_N=128, num_warps=4, num_stages=3, programs_per_sm=4, prefetch_blocks=True)),  # nvfp4, mxfp4, prefill, hs 128
    ((8, 1, False, False, 128, (64, 128, 256), True, None, None, None, False), dict(BLOCK_N=128, num_warps=8, num_stages=2, programs_per_sm=4)),  # fp8 per tensor / per head / e5m2, prefill of 128 rows, hs 64-256
    ((8, 1, False, False, 128, (128, 256), True, None, None, None, True), dict(BLOCK_N=128, num_warps=8, num_stages=2, programs_per_sm=4)),  # int8 separate, prefill of 128 rows, hs 128 / 256
    ((8, 1, False, (0, 1), 128, 256, False, None, None, None, True), dict(BLOCK_N=128, num_warps=8, num_stages=2, programs_per_sm=4)),  # int8 / fp8 per token-head, int8 asym, Hadamard, mixed_k8_v4, prefill of 128 rows, hs 256
    ((8, 1, False, 0, 128, 128, False, None, None, None, True), dict(BLOCK_N=128, num_warps=8, num_stages=2, programs_per_sm=4)),  # int8 / fp8 per token-head, int8 asym, mixed_k8_v4 (Hadamard only in its quantized domain), prefill of 128 rows, hs 128
    ((4, 1, False, 1, 128, 256, None, None, None), dict(BLOCK_N=128, num_warps=8, num_stages=2, programs_per_sm=4)),  # int4 per token-head, prefill of 128 rows, hs 256
    ((8, 1, True, False, 128, (128, 256), None, True, None), dict(BLOCK_N=128, num_warps=8, num_stages=2, programs_per_sm=4)),  # mxfp8, prefill of 128 rows, hs 128 / 256
    ((8, 2, True, False, 128, 128, None, None, None), dict(BLOCK_N=128, num_warps=8, num_stages=2, programs_per_sm=4)),  # q8_0, prefill of 128 rows, hs 128
    ((4, 1, False, 1, 128, (64, 128), None, None, None), dict(BLOCK_N=64, num_warps=8, num_stages=2, programs_per_sm=4)),  # int4 per token-head, prefill of 128 rows, hs 64 / 128
    (((2, 4), 2, True, False, 128, (128, 256), None, None, None), dict(BLOCK_N=64, num_warps=8, num_stages=2, programs_per_sm=4)),  # q4_0, KIVI, prefill of 128 rows, hs 128 / 256
    ((4, 2, True, False, 128, 64, None, None, None), dict(BLOCK_N=128, num_warps=8, num_stages=2, programs_per_sm=4)),  # q4_0, kivi_4bit, prefill of 128 rows, hs 64
    ((16, 1, None, False, 128, 256, None, None, None), dict(BLOCK_N=64, num_warps=8, num_stages=2, programs_per_sm=4)),  # bf16, prefill of 128 rows, hs 256
    ((4, 1, True, False, 128, 256, None, None, False), dict(BLOCK_N=128, num_warps=8, num_stages=2, programs_per_sm=4)),  # nvfp4, mxfp4, prefill of 128 rows, hs 256
    ((16, 1, None, False, 16, None, None, None, None), dict(BLOCK_N=64, num_warps=4, num_stages=3, maxnreg=128, programs_per_sm=8)),  # bf16
    ((8, 1, False, False, 16, None, False, None, False, None, True, None, True), dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=168, programs_per_sm=8, live_fold=False)),  # fp8 per token-head: every row
    ((8, 1, False, False, 16, None, None, None, None), dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=168, programs_per_sm=8)),  # fp8
    ((8, 1, True, False, 16, 128, None, False, True), dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=168, programs_per_sm=8)),  # q8_0 (block dots), hs 128
    ((8, 1, True, None, 16, None, None, None, None), dict(BLOCK_N=128, num_warps=4, num_stages=2, programs_per_sm=8)),  # mxfp8
    ((8, 2, True, None, 16, None, None, None, None), dict(BLOCK_N=128, num_warps=4, num_stages=2, programs_per_sm=8)),  # q8_0
    ((4, 1, True, False, 16, 128, None, True, None), dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=128, programs_per_sm=4, prefetch_blocks=True, value_split=2)),  # mxfp4, hs 128
    ((4, 1, True, False, 16, 128, None, False, None), dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=128, programs_per_sm=4, prefetch_blocks=True, value_split=2)),  # nvfp4, q4_0 (block dots), hs 128
    ((4, 1, True, False, 16, None, None, None, None), dict(BLOCK_N=128, num_warps=4, num_stages=2, programs_per_sm=8)),  # nvfp4, mxfp4
    ((4, 1, False, (1, 2, 3), 16, 128, None, None, None), dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=168, programs_per_sm=4, prefetch_blocks=True)),  # int4 per token-head, hs 128
    ((4, 1, False, (1, 2, 3), 16, None, None, None, None), dict(BLOCK_N=128, num_warps=4, num_stages=2, programs_per_sm=4)),  # int4 per token-head
    ((4, 2, True, False, 16, 128, None, None, True), dict(BLOCK_N=64, num_warps=4, num_stages=3, maxnreg=128, programs_per_sm=4)),  # kivi_4bit, hs 128
    ((2, 2, True, False, 16, 128, None, None, True), dict(BLOCK_N=64, num_warps=4, num_stages=3, maxnreg=168, programs_per_sm=8)),  # kivi_2bit, hs 128 (the 168 registers it compiled to before its key codes took the code-major order; timed only with that order: s53, H100, 1095 -> 861 us at 64 x 8192)
    ((None, 2, True, False, 16, None, None, None, None), dict(BLOCK_N=64, num_warps=4, num_stages=3, programs_per_sm=8)),  # KIVI (q4_0 before per-block dots)
    ((8, 1, False, 1, 16, 128, False, False, False), dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=168, programs_per_sm=4)),  # rotated keys (Hadamard, bf16 / fp16 queries), hs 128
    ((8, None, None, None, None, None, None, None, None), dict(BLOCK_N=128, num_warps=4, num_stages=2, programs_per_sm=4)),  # other 8-bit
    ((None, None, None, None, None, None, None, None, None), dict(BLOCK_N=64, num_warps=4, num_stages=3, programs_per_sm=4)),  # the rest
)
# (block ids one step ahead there too, so the CPU suite runs the path that compiled fp8 decode takes)
INTERPRETER_TILES = {"BLOCK_N": 128, "prefetch_blocks": True}
# KV splits (flash decoding): a grid of (sequence, query tile, KV head) programs is split along the KV positions so
# that it fills the GPU, at the cost of a reduction over the splits' partial results. The split targets the tile
# rule's programs_per_sm, each split at least MIN_SPLIT positions; and, as a floor for few sequences, at least
# FEW_PROGRAMS_PER_SM programs per SM, each split at least MIN_FEW_SPLIT positions (short contexts, where MIN_SPLIT
# alone left most SMs idle). H200, ninth session (benchmarks/RESULTS.md, `python benchmarks/tune_splits.py`): at 4 x
# 1024 bf16 25 -> 17 us, q8_0 39 -> 21, KIVI 94 -> 67; at 1 x 8192 bf16 29 -> 24; two programs per SM alone (no
# programs_per_sm target) lost up to 10% at 4 x 32768 and 4 x 65536 (KIVI aside), so it is a floor, not the target.
MIN_SPLIT = 512
FEW_PROGRAMS_PER_SM = 2
MIN_FEW_SPLIT = 128
# Decode then raises the split count where waves of the kernel's resident programs end sooner (runtime/occupancy.py:
# fp8_e4m3 at 4 x 65536 198 -> 183 us on the H200, 33 -> 37 splits at 3 programs per SM). 0: the rule above alone.
WAVE_SPLITS = 1
# KIVI's key fold (KEY_FOLD: per-channel group scales folded into the query in decode) at these padded head sizes.
# H200, eleventh session (benchmarks/RESULTS.md; benchmarks/key_fold_heads.py): decode took 10-16% less time at head
# size 128 and 9-14% less at 256, 2-3% more at 64
KEY_FOLD_HEADS = (128, 256)
# dot_precision="fast" in decode: block-scaled sides with codes of at most this many bits keep auto's dot per block
# (BLOCK_DOTS, exact); wider ones take one dot on the codes times their block ratios, rounded once to the dot type.
# 0: none keeps them. H200, decode at 64 x 8192: fourteenth session (run 2; ratios multiplied in fp32), q8_0 1044 us
# with block dots, 730 without, q4_0 772 with, 816 without (then 4); fifteenth session (run 2; ratios multiplied in
# fp16 since fast-fp16-ratios), q4_0 776 -> 725 us without, kivi_2bit 1496 -> 1403, kivi_4bit 1503 -> 1428, and
# at 4 x 65536 / 256 x 1024 level or faster (benchmarks/RESULTS.md). Since the stacked blocks (fold_rows, fifty-first
# session) auto's block dots are the faster: H100, fifty-second session (`python benchmarks/tune_tiles.py q4_0 q8_0
# kivi_2bit kivi_4bit --dot-precision fast --fast-block-dot-bits 0|8 --configs rt --shapes 64x8192 4x65536 256x1024
# --cuda-graphs`), without -> with block dots: q8_0 619 -> 539 / 317 -> 259 / 335 -> 301 us, q4_0 578 -> 458 / 295 ->
# 240 / 282 -> 270, kivi_2bit 1225 -> 1111 / 617 -> 520 / 867 -> 859, kivi_4bit 1485 -> 1067 / 731 -> 530 / 906 ->
# 801: auto's times, with auto's exact per-block products. So every block-scaled side of 8 bits or fewer keeps them.
FAST_BLOCK_DOT_BITS = 8
# dot_precision="fast" in decode where auto takes per-block dots on both sides and fast multiplies the codes by their
# block ratios instead (BLOCK_DOTS off: q8_0, q4_0; not KIVI): these replace entries of auto's tiles, by the widest code in bits. H200,
# fifteenth session run 3 (`python benchmarks/tune_tiles.py q8_0 q4_0 --dot-precision fast`): q8_0 with a
# 168-register cap (3 programs per SM, no spills) 666 -> 609 us at 64 x 8192, 342 -> 321 at 4 x 65536; q4_0 at 64
# positions per step, 3 stages, 128 registers (4 programs per SM) 721 -> 707 and 395 -> 361. Entries: (bits, padded
# head or None for any, what replaces). At head size 128 they restore the whole launch those timings had (auto's rule
# then: 128/4/2 with 8 programs per SM as the split target, no block ids ahead, no value split), since auto's own
# rules there changed in the fifty-first session. They apply only where FAST_BLOCK_DOT_BITS drops the block dots
# (since the fifty-second session an experiment's setting: tune_tiles.py --fast-block-dot-bits 0)
FAST_RATIO_TILES = (
    (8, 128, dict(maxnreg=168, programs_per_sm=8)),
    (8, None, dict(maxnreg=168)),
    (4, 128, dict(BLOCK_N=64, num_stages=3, maxnreg=128, programs_per_sm=8, prefetch_blocks=False, value_split=0)),
    (4, None, dict(BLOCK_N=64, num_stages=3, maxnreg=128)),
)
# Triton 3.6 fails to compile (an "Illegal shared layout" abort in TritonGPUOptimizeDotOperands) the warpgroup dots
# (from WGMMA_ROWS query rows per program) of a kernel where one side packs its row into fewer than NARROW_ROW_BYTES
# bytes and the step holds 128 positions: found on the H200 by tests/test_random_specs.py (2-bit keys at head size
# 48, padded to 64: 16 bytes a row), reproduced for sm_90 without a GPU (tests/test_sm90_compile.py). 2-bit sides
# at head 64 compile at 32 rows and at 64 positions a step, so such kernels take at most NARROW_ROW_BLOCK_N.
WGMMA_ROWS = 64
NARROW_ROW_BYTES = 32
NARROW_ROW_BLOCK_N = 64
# experiments and tests: tiles used for every format instead of the rules above (None: the rules)
TILE_OVERRIDE: dict | None = None
# Value operands in decode: a P x V dot reduces over the step's positions, which are the cache tile's rows, so the
# compiler rearranges the value tile through shared memory. Left alone, Triton moves a code's conversion to the dot
# type after that rearrangement (it moves fewer bytes), and Hopper has no transposing shared-memory load for 8-bit
# elements: each thread then gathers its codes one byte at a time (LDS.U8: one per position and warp for an 8-bit
# side, with the moves that pack them). V_CONVERT_FIRST keeps the conversion in the layout the codes were loaded in
# (the kernel's keep_layout), so 16-bit values are stored and read back transposed by ldmatrix. Static counts
# (benchmarks/sass_count.py, sm_90, decode at 64 x 8192): fp8_e4m3 8.2 -> 5.9 instructions per position, int8
# separate 11.3 -> 8.7, mxfp8 16.0 -> 12.2 (and 255 -> 165 registers), the 4-bit formats 6-11% fewer. The
# staging buffer of an 8-bit side takes 32 KiB of shared memory at 128 positions of head size 128 (mxfp8 16 KiB more;
# the 4-bit formats' and KIVI's tiles went through shared memory before, and take no more). H200, decode at 64 x 8192
# as graph replays (benchmarks/RESULTS.md, twenty-third session, run 3: `python benchmarks/tune_tiles.py FORMAT
# --configs rtn rtc --cuda-graphs`; fp8 and int8 separate with their rule's tiles, 128/4/3/168pn / pc): mxfp8 640 ->
# 463 us, nvfp4 568 -> 451, mxfp4 567 -> 446, int4 per token-head 829 -> 677, mixed_k8_v4 752 -> 631, q4_0 777 ->
# 702, int8 separate 405 -> 389, KIVI 1496 -> 1413, fp8 332 -> 330 (2 programs per SM instead of 3: the staging
# buffer); alike at 4 x 65536 and, but for fp8 and int8 separate (not timed there), at 256 x 1024. vLLM's
# inline-scale cells (8-bit codes in 4-byte aligned rows) ran 1.22-1.53x slower with it (run 2; the Hadamard format
# 544 -> 751 us in run 3), so 8-bit value codes take it only in rows of 16-byte multiples (q8_0's 34-byte blocks, 1044
# -> 1012 us with it, are left out with them). Decode only: chunked prefill gained nothing with it (twenty-fourth
# session, run 7: its warpgroup dots already read converted values from shared memory; the inline-scale cells 15%
# slower); and heads of at most CONVERT_FIRST_MAX_HEAD: at 256 the staging buffer leaves fp8, int8 separate and
# mxfp8 1 program per SM at 128 positions per step (static counts); the head-256 rules of the twenty-seventh session
# turn it on themselves at 64 positions per step (int4 per token-head at 128; convert_first: fp8 218 -> 180 us,
# mxfp8 328 -> 228 at 16 x 8192). Head size
# 64 was timed with it in the twenty-fourth session's full run (every format it applies to faster than before:
# benchmarks/RESULTS.md).
# CONVERT_FIRST_OVERRIDE (experiments: tune_tiles.py's "c" / "n" configs) sets it for every call whose values can
# take it.
CONVERT_FIRST_OVERRIDE: bool | None = None
CONVERT_FIRST_MAX_HEAD = 128
# V_SPLIT (formats whose generated VALUE_SPLIT is set, decode only): the P x V dot as two dots of half the value
# columns each, so that the staging buffer of converted values above takes half the shared memory (16 KiB at 128
# positions of head size 128; s49, static, sm_90 with decode-rows.patch: at 128/4/2/128p fp8 72 -> 56 KiB, 4
# programs per SM instead of 3, 5.1 -> 5.6 instructions per position; mixed_k8_v4 65 -> 49 KiB, 8.0 -> 8.1;
# mxfp4 / nvfp4 57 / 58 -> 41 / 42 KiB, 11.4 / 11.8). In four dots of a quarter each (value_split 4), 8 KiB (s50,
# static, the same tiles: int8 separate 57 -> 49 KiB, 3 -> 4 programs per SM, 7.9 -> 8.3 instructions per position;
# mxfp8 57 -> 49, 3 -> 4, 11.8 -> 12.1; their two halves still left 57 KiB, 1 KiB over 4 programs' share). Off unless
# a tile rule's value_split entry (True or 2: two dots; 4) or VALUE_SPLIT_OVERRIDE (tune_tiles.py's "s" / "q"
# configs) asks for it.
VALUE_SPLIT_OVERRIDE: bool | int | None = None
# reshape_and_cache, compiled: tokens per program and warps (the interpreter takes 64 tokens per program), by the
# widest stored code in bits and whether block scales are e8m0 (powers of two: the write multiplies by their exact
# reciprocal); first matching rule wins. One warp holds each head's row, so per token-head reductions stay in the
# warp. H200 (benchmarks/RESULTS.md; benchmarks/tune_writes.py), writes of 32768 tokens: against 16 tokens on 4
# warps, int8 / fp8 per token-head take 100 -> 84 / 82 us, the other formats within 4% (seventh session); at 8
# tokens per program mxfp4 takes 83 -> 77-78 us, and every other format measured as long or longer (int4 per
# token-head 128 -> 192, nvfp4 103 -> 125; twelfth session, run 1). WRITE_OVERRIDE replaces them in experiments.
WRITE_TILES = (
    # bits, e8m0 block scales -> tiles
    ((4, True), dict(BLOCK_T=8, num_warps=1)),  # mxfp4
    ((None, None), dict(BLOCK_T=4, num_warps=1)),
)
WRITE_OVERRIDE: dict | None = None


def rule_matches(rule: tuple, key: tuple) -> bool:
    """Whether a tile rule's fields all admit the launch's key: None admits anything, a tuple any of its values,
    anything else its own value (False / True also admit 0 / 1); a rule shorter than the key admits anything in the
    fields it leaves out."""
    assert len(rule) <= len(key), (rule, key)
    return all(r is None or (k in r if isinstance(r, tuple) else r == k) for r, k in zip(rule, key))


# The write kernel stores every byte of the cells it writes, the padding after a field (to the next field's alignment
# or the cell's end) as zeros (docs/SEMANTICS.md). A 32-byte sector that a write covers only in part makes the GPU's
# L2 read it from DRAM to merge it: int8 asym's cell [K 128 | scale 4 | zp 1 | pad 3 | V 128 | scale 4 | zp 1 | pad
# 3] wrote 32768 tokens in 130 us (52% of copy bandwidth) on an H100 with its pads left alone, in 84 us (80%) with
# them written as bytes and 82 us (83%) with each zero point and its pad stored as one word (side.jinja's zp_word;
# benchmarks/RESULTS.md, thirty-ninth session)
PAD_FIELDS = ("k_data", "k_scale", "k_zp", "v_data", "v_scale", "v_zp")


def write_pads(lay: dict) -> dict:
    """The write kernel's padding constexprs for a page layout (the generated layout's ``page_layout``): per field F,
    F_PAD_AT (bytes from the field's start to its padding) and F_PAD (the padding's bytes; 0 for none or no such
    field), and PAD_SPAN, a power of two at least every F_PAD (the width of the kernel's zero stores)."""
    out, span = {}, 1
    for name in PAD_FIELDS:
        f = lay["fields"].get(name)
        out[f"{name.upper()}_PAD_AT"] = f["bytes"] if f else 0
        out[f"{name.upper()}_PAD"] = f["pad"] if f else 0
        span = max(span, out[f"{name.upper()}_PAD"])
    out["PAD_SPAN"] = _next_pow2(span)
    return out


def write_tiles(code_bits: dict, pow2_blocks: bool) -> dict:
    """The reshape-and-cache launch of a compiled format (a new dict: BLOCK_T, num_warps, optional maxnreg)."""
    if WRITE_OVERRIDE is not None:
        return dict(WRITE_OVERRIDE)
    key = (max(code_bits.values()), pow2_blocks)
    for rule, tiles in WRITE_TILES:
        if rule_matches(rule, key):
            return dict(tiles)
    raise AssertionError("the last rule matches every format")


def attention_tiles(code_bits: dict, dots: dict, block_scaled: bool, block_m: int = DECODE_ROWS,
                    head_pad: int = 128, wide: bool = False, pow2_blocks: bool = False,
                    scale_words: bool = True, position_scales: bool = False, float_codes: bool = False) -> dict:
    """The launch configuration of a format's attention kernel for one call's dot constexprs ``dots`` and query rows
    per program ``block_m`` and padded head size ``head_pad``; ``wide``: every side's code rows start at multiples of
    16 bytes (``wide_rows``); ``pow2_blocks``: some side's block scales are e8m0. A new dict: BLOCK_N, num_warps,
    num_stages, optional maxnreg, prefetch_blocks and convert_first, programs_per_sm; ``scale_words``: no block-scale
    row is loaded byte-wise (``scale_rows_in_words``); ``position_scales``: some side's scales are computed on write
    (per token-head, per block, per channel group), not static per tensor or head; ``float_codes``: some side's codes
    are low-bit floats (fp8, fp4), not integers."""
    if interpreting():
        return dict(INTERPRETER_TILES, programs_per_sm=4)
    if TILE_OVERRIDE is not None:
        return dict({"programs_per_sm": 4}, **TILE_OVERRIDE)
    rule, tiles = tile_rule(attention_key(code_bits, dots, block_scaled, block_m, head_pad, wide, pow2_blocks,
                                          scale_words, position_scales, float_codes))
    tiles = dict(tiles)
    if block_m >= WGMMA_ROWS and head_pad * min(code_bits.values()) // 8 < NARROW_ROW_BYTES:
        tiles["BLOCK_N"] = min(tiles["BLOCK_N"], NARROW_ROW_BLOCK_N)
    return tiles


def fold_rows(dots: dict, block_m: int, group: int, query_tokens: int, key_groups: int, value_blocks: int,
              key_blocks: int = 0) -> int:
    """The kernel's FOLD_ROWS: the query rows that the paged steps of a decode with stacked blocks carry, the first of
    the tile's ``block_m``: every row ``query_tokens`` query tokens of ``group`` heads can fill (decode: ``group``),
    as a power of two, and at least what fills a tensor-core dot's 16 rows with the values' ``value_blocks`` blocks
    stacked (stacked_pv) and with the keys' rows: the key fold's two terms of ``key_groups`` token groups
    (group_scores; KIVI: KEY_FOLD with the values' BLOCK_DOTS), or, where ``key_groups`` is 0, the keys'
    ``key_blocks`` blocks stacked (stacked_scores; q8_0, q4_0: BLOCK_DOTS on both sides). The tile's other rows hold
    no query (row_mask). ``block_m`` (every row) otherwise.
    Static counts (benchmarks/sass_count.py, sm_90, decode at 64 x 8192, GROUP 4: 4 rows of 16): kivi_2bit 27.1 ->
    15.7 instructions per position (247 -> 168 registers, 2 -> 3 programs per SM), kivi_4bit 27.0 -> 15.1 (250 ->
    179 registers, 2 programs per SM). H100 (forty-seventh session, tune_tiles.py with CUDA graphs): kivi_2bit
    1380-1411 -> 1110 us at 64 x 8192, 695 -> 521 at 4 x 65536, 938 -> 853 at 256 x 1024, 902 -> 722 at head size
    256; kivi_4bit 1388-1408 -> 1227, 709 -> 614, 903 -> 809, 885 -> 718; head size 64 level. q8_0 / q4_0
    (stacked_scores / stacked_pv): 15.9 -> 10.8 and 13.5 -> 9.6 instructions per position statically (254 -> 255
    and 237 -> 143 registers, 2 -> 2 and 2 -> 3 programs per SM); head size 256 33.9 -> 22.7 and 27.3 -> 17.9
    (spills 0.4 / 2.1 -> 0 / 0.4), head size 64 9.4 -> 7.0 and 8.1 -> 6.2; H100 (fifty-first session), on the tiles
    of their rules before: 1048 -> 573 and 698 -> 575 us at 64 x 8192 (539 and 457 on their new rules)."""
    if not dots.get("BLOCK_DOTS") or not (dots.get("KEY_FOLD") if key_groups else key_blocks):
        return block_m
    keys = 16 // (2 * key_groups) if key_groups else 16 // key_blocks
    return min(block_m, max(_next_pow2(group * query_tokens), keys, 16 // value_blocks))


# kernels of one dot per side (ROW_FOLD "live": no blocks or key fold): the paged steps carry BLOCK_M / 2 of 16 rows
# where the launch's queries fill no more (live_fold_rows), unless the tile rule says live_fold=False; False here:
# every row for every kernel (experiments switch it off)
LIVE_FOLD = True


def live_fold_rows(block_m: int, group: int, query_tokens: int, live_fold: bool = True) -> int:
    """The FOLD_ROWS of a kernel of one dot per side (ROW_FOLD "live": no blocks or key fold): the paged steps carry
    the tile's first 8 rows alone (live_rows) where the tile has 16 and ``query_tokens`` query tokens of ``group``
    heads fill no more than 8; ``block_m`` (every row) otherwise. 8 of 16: the rows of one register of a 16-row
    tensor-core dot's result (the other register holds rows 8 to 15), so taking them selects registers and
    repeating them for the value dot copies registers, no lanes; 4 rows cost shuffles across lanes and carry no
    fewer registers. Static counts (benchmarks/sass_count.py, sm_90, decode at 64 x 8192, GROUP 4) in instructions
    per position: int4_per_token_head 10.9 -> 9.5, mixed_k8_v4 9.2 -> 8.0, int8_asym_per_token_head 11.8 -> 10.1,
    int8_per_token_head_hadamard_k 10.5 -> 9.1, int8_per_token_head 11.0 -> 9.5, fp8_per_token_head 9.4 -> 8.2,
    nvfp4 12.9 -> 12.1, mxfp4 12.9 -> 11.6, mxfp8 12.2 -> 11.0. H100, fifty-first session (tune_tiles.py with CUDA
    graphs, each format on its rule's tiles; benchmarks/results_2026-12-07_h100_s51.md), with the q8_0 / q4_0 block
    rows of fold_rows, at 64 x 8192: int8 per token-head 517 -> 487 us, int8 asym 535 -> 496, Hadamard 559 -> 522,
    int4 per token-head 632 -> 608, mixed_k8_v4 646 -> 627, mxfp8 477 -> 459, mxfp4 419 -> 404, nvfp4 454 -> 434,
    fp8 and bf16 level; fp8 per token-head alone slower (499 -> 539, 257 -> 273 at 4 x 65536, 292 -> 304 at 256 x
    1024): its rule keeps every row (``live_fold`` False)."""
    if not (LIVE_FOLD and live_fold) or block_m != 16 or group * query_tokens > block_m // 2:
        return block_m
    return block_m // 2


def attention_key(code_bits: dict, dots: dict, block_scaled: bool, block_m: int, head_pad: int, wide: bool,
                  pow2_blocks: bool, scale_words: bool, position_scales: bool, float_codes: bool = False) -> tuple:
    """The fields ATTENTION_TILES' rules match, for attention_tiles' arguments."""
    bits = max(code_bits.values())
    terms, split = 0, 0
    for side, x in (("K", "Q"), ("V", "P")):
        mode = dots[f"DOT_{side}"]
        if mode == 3:  # int8 dots on the codes
            terms = max(terms, 1)
        elif mode != 0:  # the call's terms: per-block dots (BLOCK_DOTS) take the codes alone, one term
            terms = max(terms, dots[f"{side}_TERMS"])
            split |= (dots[f"{x}_TERMS"] > 1) << (x == "P")  # bit 0 the query's, bit 1 the probabilities'
    int8_dots = 3 in (dots["DOT_K"], dots["DOT_V"])  # the quantized domain
    return (bits, terms, block_scaled, split, DECODE_ROWS if block_m <= DECODE_ROWS else block_m, head_pad, wide,
            pow2_blocks, bool(dots.get("BLOCK_DOTS")), scale_words, position_scales, int8_dots, float_codes)


_TILE_RULE_MEMO: dict = {}  # key -> (rule, tiles), for the table _TILE_RULE_MEMO_OF
_TILE_RULE_MEMO_OF = None


def tile_rule(key: tuple) -> tuple:
    """The first rule of ATTENTION_TILES that admits ``key``, and its tiles. Remembered per key (scanning the
    rules was nearly half of an eager attend's host time) for as long as ATTENTION_TILES is the same tuple."""
    global _TILE_RULE_MEMO_OF
    if _TILE_RULE_MEMO_OF is not ATTENTION_TILES:  # replaced, e.g. by an experiment: forget what was found
        _TILE_RULE_MEMO.clear()
        _TILE_RULE_MEMO_OF = ATTENTION_TILES
    found = _TILE_RULE_MEMO.get(key)
    if found is None:
        found = next(((rule, tiles) for rule, tiles in ATTENTION_TILES if rule_matches(rule, key)), None)
        if found is None:
            raise AssertionError("the last rule matches every kernel")
        _TILE_RULE_MEMO[key] = found
    return found


def rows_ruled(code_bits: dict, dots: dict, block_scaled: bool, block_m: int, head_pad: int, wide: bool,
               pow2_blocks: bool, scale_words: bool, position_scales: bool, float_codes: bool = False) -> bool:
    """Whether the tile rule of a program of ``block_m`` query rows names that many rows itself (a rule of its own,
    not one that admits any rows): how prefill programs of RULED_PREFILL_ROWS rows are chosen. Never in the
    interpreter or under TILE_OVERRIDE (experiments choose the rows by PREFILL_ROWS)."""
    if interpreting() or TILE_OVERRIDE is not None:
        return False
    rule, _ = tile_rule(attention_key(code_bits, dots, block_scaled, block_m, head_pad, wide, pow2_blocks,
                                      scale_words, position_scales, float_codes))
    return len(rule) > 4 and rule[4] == block_m


def scale_rows_in_words(consts: dict, scale_rows: dict) -> bool:
    """Whether every block-scaled side's scale row (a position's scales of one KV head) that is narrower than 4 bytes
    is read from the aligned 32-bit word holding it, which the compiled loop copies asynchronously; rows of 1-2 bytes
    that the layout does not keep inside one word load byte-wise, waited on every step (H200: mxfp8 at head size 64,
    308 against 284 us). ``scale_rows``: {"K" / "V": (elements per scale, bytes per scale)}. The same condition as
    codegen/templates/side.jinja's ``block_scale_codes``, which chooses the load (tests/test_scale_words.py
    checks they agree)."""
    for p, (group, unit) in scale_rows.items():
        row = consts["HEAD_PAD"] // group * unit
        page, base, cell = (consts[f"{p}_SCALE_{f}"] for f in ("PAGE", "BASE", "CELL"))
        if row < 4 and not (page % 4 == 0 and base % row == 0 and cell % row == 0
                            and consts["NUM_KV_HEADS"] * cell % 4 == 0):
            return False
    return True


def wide_rows(consts: dict, sides: str = "KV") -> bool:
    """Whether every side's code rows (of ``sides``, by default both) start at multiples of 16 bytes in the cache (the
    layout constants of a launch: page, base and cell of each side's data), so that compiled kernels copy them 16
    bytes at a time."""
    return all(consts[f"{p}_DATA_{f}"] % 16 == 0 for p in sides for f in ("PAGE", "BASE", "CELL"))


def convert_values_first(code_bits: dict, dots: dict, block_m: int, head_pad: int, wide_values: bool,
                         rule: bool | None = None) -> bool:
    """The kernel's V_CONVERT_FIRST for one call: whether the value codes are converted to the dot type in the
    layout they were loaded in, before the compiler rearranges them into the dot's operand layout (CONVERT_FIRST).
    ``rule``: the call's tile rule's own choice (a ``convert_first`` entry of ATTENTION_TILES), which replaces the
    conditions on rows, head size and row width, never what the operands allow."""
    if interpreting() or dots["DOT_V"] not in (1, 2) or code_bits["v"] >= 16:
        return False
    if CONVERT_FIRST_OVERRIDE is not None:
        return CONVERT_FIRST_OVERRIDE
    if rule is not None:
        return rule
    return (block_m <= DECODE_ROWS and head_pad <= CONVERT_FIRST_MAX_HEAD
            and (code_bits["v"] < 8 or wide_values))


def fast_ratio_tiles(code_bits: dict, block_dots: dict, head_pad: int = 128) -> dict:
    """What replaces auto's tiles in a "fast" decode call whose block ratios multiply the codes where auto takes
    per-block dots on both sides (FAST_RATIO_TILES; ``block_dots``: the sides that can; nothing for KIVI, whose
    keys fold their scales instead, nor in the interpreter or under TILE_OVERRIDE)."""
    if interpreting() or TILE_OVERRIDE is not None or not all(block_dots.get(s) for s in ("k", "v")):
        return {}
    bits = max(code_bits.values())
    return next((dict(t) for b, h, t in FAST_RATIO_TILES if b == bits and h in (None, head_pad)), {})


_CAPABILITY: dict = {}
# Compiled writes divide integer codes by their group's scale through a per-group reciprocal where the side allows it
# (codegen.render.fast_division; recip_fast / div_fast in the generated kernels: div.rn's own fast path with the
# reciprocal hoisted): the same codes as div_rn (H200, thirteenth session: benchmarks/check_fast_div.py over every fp16
# scale, tests/test_fast_div.py and the conformance suite compiled). nvfp4's e2m1 codes ("scaled", forty-first
# session) divide by each group's scale split into s' in [1, 2) and a power of two, 1 / s' from div_rn once per group
# (recip_fast there made every code saturate: benchmarks/pending/recip_fast_fault.py). The interpreter always divides
# with div_rn.
# H200: KIVI's prefill write of 32768 tokens 347 -> 218 us (kivi_2bit); q4_0's 86 -> 85 us (benchmarks/RESULTS.md).
FAST_DIV = True
# KIVI's flush (one program per key group of G tokens and KV head, K and V): warps per program by the elements one
# program holds, G * HEAD_PAD per side, at FLUSH_ELEMENTS_PER_WARP each (2 warps at G = 32, head size 128). H200,
# 32768-token prefill write, head size 128 (benchmarks/RESULTS.md, eighteenth session): 2 warps 112 us, 4 warps 130,
# 8 warps 200 (kivi_2bit; kivi_4bit 109 / 130 / 202): the flush is issue-bound, and fewer warps issue fewer
# instructions (less cross-warp reduction and layout traffic). Capped at FLUSH_MAXNREG registers (193 / 225 uncapped
# at 2 warps; no spills at 168): 5 programs per SM instead of 4, kivi_2bit 112 -> 99 us, kivi_4bit 109 -> 108 (128
# registers: 101 and 132). FLUSH_OPTIONS overrides the choice (tune_writes.py).
FLUSH_ELEMENTS_PER_WARP = 2048
FLUSH_MAXNREG = 168
FLUSH_OPTIONS: dict = {}


def flush_options(group: int, head_pad: int) -> dict:
    """Compile options of KIVI's flush kernel for key groups of ``group`` tokens and heads padded to ``head_pad``."""
    if FLUSH_OPTIONS:
        return dict(FLUSH_OPTIONS)
    return {"num_warps": min(max(group * head_pad // FLUSH_ELEMENTS_PER_WARP, 1), 8), "maxnreg": FLUSH_MAXNREG}


def native_fp8(device: torch.device | None) -> bool:
    """Compiled code may convert fp8 with the hardware (sm_89 and newer; Triton rejects e4m3 before that)."""
    if interpreting() or device is None or device.type != "cuda":
        return False
    cap = _CAPABILITY.get(device.index)
    if cap is None:
        cap = _CAPABILITY[device.index] = torch.cuda.get_device_capability(device)
    return cap >= (8, 9)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


class AttentionLaunch(NamedTuple):
    """A planned attention call (KernelSet.plan_attend): the attention kernel's grid and every argument but the
    query, the output and the cache's tensors; the split scratch; the reduction's constexprs (None: one split)."""

    grid: tuple
    kwargs: dict
    part: Optional[torch.Tensor]
    ml: Optional[torch.Tensor]
    reduce: Optional[dict]


class WriteLaunch(tuple):
    """A planned write (KernelSet.plan_write / plan_write_streaming): its kernel launches in order, each (grid,
    kernel name, every argument but the inputs, their strides and the cache's tensors)."""

    def __new__(cls, *launches):
        return super().__new__(cls, launches)


class KernelSet:
    """The kernels module of one generated package, imported on first use."""

    def __init__(self, package: types.ModuleType, block_scaled: bool = False, pow2_blocks: bool = False,
                 scale_rows: dict | None = None, position_scales: bool = False, float_codes: bool = False):
        self.package = package
        self.position_scales = position_scales  # a side's scales are computed on write: enters the tile choice
        self.float_codes = float_codes  # a side's codes are low-bit floats (fp8, fp4): enters the tile choice
        self.block_scaled = block_scaled  # a side's scale covers blocks of elements: enters the tile choice
        self.pow2_blocks = pow2_blocks  # ... in e8m0: enters the write's and attention's tile choices
        # block-scaled sides: {"K" / "V": (elements per scale, bytes per scale)}, for scale_rows_in_words
        self.scale_rows = dict(scale_rows or {})
        self._module = None
        self._dot_modes: dict = {}  # (query dtype, precision, rotated keys, head pad, device) -> constexprs
        self._launchers: dict = {}  # kernel name -> FastLaunch

    @property
    def module(self) -> types.ModuleType:
        if self._module is None:
            _choose_mode()
            name = f"{self.package.__name__}.kernels"
            mod = sys.modules.get(name)
            if mod is None:
                path = os.path.join(os.path.dirname(self.package.__file__), "kernels.py")
                spec = importlib.util.spec_from_file_location(name, path)
                mod = importlib.util.module_from_spec(spec)
                sys.modules[name] = mod
                try:
                    spec.loader.exec_module(mod)
                except BaseException:
                    del sys.modules[name]
                    raise
            self._module = mod
        return self._module

    def launch(self, kernel: str) -> FastLaunch:
        """``launch(name)(grid, *args, **kwargs)``: the module's kernel ``name`` launched like ``kernel[grid](...)``,
        with less host work per call (runtime/launch.py)."""
        launcher = self._launchers.get(kernel)
        if launcher is None:
            launcher = self._launchers[kernel] = FastLaunch(getattr(self.module, kernel))
        return launcher

    def _check_device(self, t: torch.Tensor) -> None:
        _choose_mode()
        if interpreting():
            if t.device.type != "cpu":
                raise ValueError(f"cache: is on {t.device}, but Triton runs interpreted (TRITON_INTERPRET=1) in this "
                                 "process, which needs CPU tensors")
        elif t.device.type != "cuda":
            raise ValueError(f"cache: is on {t.device}; compiled Triton kernels need a CUDA device (or set "
                             "TRITON_INTERPRET=1 before importing kvgen to run on the CPU)")

    def plan_write(self, key, slot_mapping, tensors: dict, consts: dict) -> WriteLaunch:
        """A paged write's launch for keys of ``key``'s shape at ``slot_mapping`` (int64): all but the inputs and
        the cache's tensors. ``tensors``: the kernel's pointer arguments by name; ``consts``: layout and shape
        constexprs."""
        self._check_device(tensors["k_cache_ptr"])
        num_tokens = key.shape[0]
        if interpreting():
            block_t, options = 64, {}
        else:
            tiles = write_tiles(self.module.CODE_BITS, self.pow2_blocks)
            # stored bytes must not depend on the compiler contracting x * inv + c into one rounding
            block_t, options = tiles["BLOCK_T"], {"num_warps": tiles["num_warps"], "enable_fp_fusion": False}
            if tiles.get("maxnreg"):
                options["maxnreg"] = tiles["maxnreg"]
        block_t = min(block_t, _next_pow2(num_tokens))
        kwargs = dict(slot_mapping_ptr=slot_mapping, num_tokens=num_tokens, BLOCK_T=block_t,
                      NATIVE_CASTS=native_fp8(key.device), FAST_DIV=FAST_DIV and not interpreting(), **consts,
                      **options)
        # one axis: a token tile's KV heads in consecutive programs (the kernel's pid = tile * NUM_KV_HEADS + head)
        return WriteLaunch(((triton_cdiv(num_tokens, block_t) * consts["NUM_KV_HEADS"],), "reshape_and_cache_kernel",
                            kwargs),)

    def plan_write_streaming(self, key, query_start_loc, seq_lens, block_table, seq_ids, max_query_len,
                             tensors: dict, consts: dict, residual: dict) -> WriteLaunch:
        """KIVI's write launches for keys of ``key``'s shape and the batch's sequence metadata: the flush kernel
        quantizes the groups that leave the residual window, then the residual store keeps the new tokens in full
        precision (a decode step's flush stores its new token itself)."""
        self._check_device(tensors["k_cache_ptr"])
        group, ring = residual["group"], residual["ring"]
        num_seqs = seq_lens.shape[0]
        # groups one sequence can complete in this write: its new tokens span at most this many group boundaries
        max_groups = max_query_len // group + 1
        compile_options = ({} if interpreting() else
                           {"enable_fp_fusion": False, **flush_options(group, consts["HEAD_PAD"])})
        flush = dict(seq_ids_ptr=seq_ids, query_start_loc_ptr=query_start_loc, seq_lens_ptr=seq_lens,
                     block_table_ptr=block_table, stride_bt=block_table.stride(0), **consts, BLOCK_T=group,
                     RESIDUAL=residual["tokens"], RING=ring, NATIVE_CASTS=native_fp8(key.device),
                     FAST_DIV=FAST_DIV and not interpreting(), STORE_NEW=max_query_len == 1, **compile_options)
        # prefill: (sequence, KV head) on axis 0, heads fastest, the group on axis 1; a decode step: the heads on the
        # slowest axis (kivi_write.py.jinja says why)
        heads = consts["NUM_KV_HEADS"]
        grid = (num_seqs, max_groups, heads) if max_query_len == 1 else (num_seqs * heads, max_groups)
        launches = [(grid, "kivi_flush_kernel", flush)]
        if max_query_len > 1:  # (a decode step's flush kernel stores its new tokens itself: kivi_write.py.jinja)
            # the tokens that stay in full precision are among each sequence's last RING new tokens: tiles for those
            kept = min(max_query_len, ring)
            block_t = min(64 if interpreting() else 16, _next_pow2(kept))
            num_q_tiles = triton_cdiv(kept, block_t)
            store = dict(seq_ids_ptr=seq_ids, query_start_loc_ptr=query_start_loc, seq_lens_ptr=seq_lens,
                         num_q_tiles=num_q_tiles, NUM_KV_HEADS=consts["NUM_KV_HEADS"], HEAD_SIZE=consts["HEAD_SIZE"],
                         HEAD_PAD=consts["HEAD_PAD"], TOKEN_GROUP=group, RESIDUAL=residual["tokens"], RING=ring,
                         BLOCK_T=block_t)
            launches.append(((num_seqs * num_q_tiles, consts["NUM_KV_HEADS"]), "kivi_residual_kernel", store))
        return WriteLaunch(*launches)

    def bind_write(self, launch: WriteLaunch) -> tuple:
        """Each of a planned write's kernel launches with the plan's arguments bound (runtime/launch.py)."""
        return tuple(self.launch(name).bind(**kwargs) for _, name, kwargs in launch)

    def run_write(self, launch: WriteLaunch, key, value, tensors: dict, bound: tuple | None = None) -> None:
        """Launch a planned write of ``key`` / ``value`` (the planned shape) into the cache whose pointer arguments
        are ``tensors``; ``bound``: ``bind_write(launch)``, for a plan run many times."""
        strides = dict(stride_kt=key.stride(0), stride_kh=key.stride(1), stride_vt=value.stride(0),
                       stride_vh=value.stride(1))
        for i, (grid, name, kwargs) in enumerate(launch):
            if name == "kivi_residual_kernel":  # the residual store takes only the ring buffers of the cache
                own = dict(k_res_ptr=tensors["k_res_ptr"], v_res_ptr=tensors["v_res_ptr"])
            else:
                own = tensors
            if bound is not None:
                bound[i](grid, key, value, **strides, **own)
            else:
                self.launch(name)(grid, key, value, **strides, **own, **kwargs)

    def bind_attend(self, launch: AttentionLaunch) -> BoundLaunch:
        """The attention kernel's launch with a plan's arguments bound (runtime/launch.py): what ``run_attend``
        then passes per call is only the query, the output, their strides and the cache's tensors."""
        return self.launch("paged_attention_kernel").bind(**launch.kwargs)

    def plan_attend(self, query, block_table, seq_lens, query_start_loc, qk_scale, window, max_query_len,
                    tensors: dict, consts: dict, extra: dict | None = None, dot_precision: str = "auto",
                    rotated_keys: bool = False, max_seq_len: int | None = None,
                    num_splits: int | None = None) -> AttentionLaunch:
        """Everything an attention call launches except the query, the output and the cache's tensors: what
        ``run_attend`` needs for any query of ``query``'s shape and dtype over caches of ``tensors``' geometry."""
        self._check_device(tensors["k_cache_ptr"])
        num_tokens, num_q_heads, _ = query.shape
        group = num_q_heads // consts["NUM_KV_HEADS"]
        head_pad, wide, scale_words = consts["HEAD_PAD"], wide_rows(consts), scale_rows_in_words(consts, self.scale_rows)
        block_m = self.query_rows(query.dtype, dot_precision, rotated_keys, group, max_query_len, consts, query.device)
        block_q = max(1, block_m // group)
        modes = self._cached_dot_modes(query.dtype, dot_precision, rotated_keys, head_pad, query.device)
        if dot_precision == "quantized" and 3 not in (modes["DOT_K"], modes["DOT_V"]):
            raise ValueError(f"dot_precision: 'quantized' has no side to quantize at head size {query.shape[2]}: "
                             "int8 keys need a head of at least 32 elements, and the values are not int8")
        dots = self._call_dots(query.dtype, dot_precision, rotated_keys, head_pad, block_m, query.device)
        # "fast" launches with the tiles measured for auto's kernel of the same format and shape (dropping a term
        # changes no load; the table's classes by terms would move KIVI and the rotated formats to another class)
        tile_dots = dots if dot_precision != "fast" else self._call_dots(query.dtype, "auto", rotated_keys,
                                                                         head_pad, block_m, query.device)
        tiles = attention_tiles(self.module.CODE_BITS, tile_dots, self.block_scaled, block_m, head_pad, wide,
                                self.pow2_blocks, scale_words, self.position_scales, self.float_codes)
        if tile_dots.get("BLOCK_DOTS") and not dots.get("BLOCK_DOTS"):  # fast's ratios where auto takes block dots
            tiles.update(fast_ratio_tiles(self.module.CODE_BITS, self.module.BLOCK_DOTS, head_pad))
        block_n = tiles.pop("BLOCK_N")
        group_n = getattr(self.module, "BLOCK_N_GROUP", None)
        if group_n:  # KIVI keys: whole token groups per step (both powers of two)
            block_n = max(block_n, group_n)
        programs_per_sm = tiles.pop("programs_per_sm")
        prefetch_blocks = int(tiles.pop("prefetch_blocks", False))
        live_fold = tiles.pop("live_fold", True)
        convert_first = int(convert_values_first(self.module.CODE_BITS, dots, block_m, head_pad,
                                                 wide_rows(consts, "V"), tiles.pop("convert_first", None)))
        value_split = tiles.pop("value_split", False)
        if VALUE_SPLIT_OVERRIDE is not None:
            value_split = VALUE_SPLIT_OVERRIDE
        value_split = 2 if value_split is True else int(value_split)  # the number of dots (True: two)
        if value_split not in (0, 2, 4):
            raise ValueError(f"value_split: {value_split} dots; the value dot splits in 2 or 4 (0: one dot)")
        if not (getattr(self.module, "VALUE_SPLIT", "") and block_m <= DECODE_ROWS):
            value_split = 0
        num_q_tiles = triton_cdiv(max_query_len, block_q)
        row_fold = getattr(self.module, "ROW_FOLD", "")  # the kernel's kind of FOLD_ROWS ("": none)
        if row_fold == "live":  # one dot per side: the dots on every row, the paged steps' state on FOLD_ROWS
            dots = dict(dots, FOLD_ROWS=live_fold_rows(block_m, group, min(block_q, max_query_len), live_fold))
        elif row_fold:  # "key" (KIVI's key fold) or "blocks" (q8_0, q4_0): the steps' dots stack on FOLD_ROWS
            key_fold = row_fold == "key"
            dots = dict(dots, FOLD_ROWS=fold_rows(
                dots, block_m, group, min(block_q, max_query_len),
                block_n // self.module.BLOCK_N_GROUP if key_fold else 0,
                head_pad // self.scale_rows.get("V", (head_pad, 0))[0],
                0 if key_fold else head_pad // self.scale_rows.get("K", (head_pad, 0))[0]))
        num_seqs = seq_lens.shape[0]
        # an upper bound of the KV length without reading seq_lens back: what the block table can address
        max_kv = block_table.shape[1] * consts["BLOCK_SIZE"] if max_seq_len is None else max_seq_len
        programs = num_seqs * num_q_tiles * consts["NUM_KV_HEADS"]
        ruled = num_splits is None
        if ruled:
            num_splits = self._splits(programs, max_kv, num_tokens, num_q_heads, head_pad, query.device,
                                      programs_per_sm)
        # 32-bit byte offsets (fewer instructions) unless a cache tensor is too large for them
        offsets_64 = max(tensors[f].numel() for f in ("k_cache_ptr", "v_cache_ptr", "k_meta_ptr", "v_meta_ptr")) >= 2**31
        static = dict(
            block_table_ptr=block_table, seq_lens_ptr=seq_lens, query_start_loc_ptr=query_start_loc,
            qk_scale=qk_scale * LOG2E, window=window, num_q_tiles=num_q_tiles, stride_bt=block_table.stride(0),
            GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n, OFFSETS_64=offsets_64,
            PREFETCH_BLOCKS=prefetch_blocks, V_CONVERT_FIRST=convert_first, V_SPLIT=value_split,
            MASK_FREE_STEPS=int(block_m > MASK_FREE_ROWS and max_query_len > 1), **dots, **consts, **(extra or {}),
            **tiles,
        )
        if (ruled and WAVE_SPLITS and block_m <= DECODE_ROWS and not window and not interpreting() and query.is_cuda
                and programs * num_splits >= self._sm_count(query.device)):
            # decode whose grid may fill a wave (a program per SM at least; no sliding window, whose splits would be
            # mostly empty): splits whose waves of resident programs end sooner (runtime/occupancy.py). The kernel
            # read is the rule's split count (launched unless the count changes; NUM_SPLITS changes only the end)
            resident = self.resident_programs(query, tensors, static, max_kv, num_splits, block_n)
            if resident is not None:
                num_splits = wave_splits(programs, num_splits, triton_cdiv(max(max_kv, 1), block_n),
                                         resident * self._sm_count(query.device),
                                         self._most_splits(max_kv, num_tokens, num_q_heads, head_pad))
        return self._attention_launch(query, max_kv, num_splits, block_n, programs, static)

    def query_rows(self, query_dtype: torch.dtype, dot_precision: str, rotated_keys: bool, group: int,
                   max_query_len: int, consts: dict, device=None) -> int:
        """BLOCK_M of an attention call (query_rows): PREFILL_ROWS at most, or RULED_PREFILL_ROWS where the tile
        rule of a program of that many rows names them (rows_ruled; "fast" takes auto's rules, as for its tiles)."""
        head_pad = consts["HEAD_PAD"]
        block_m = query_rows(group, max_query_len, head_pad)
        more_rows = query_rows(group, max_query_len, head_pad, RULED_PREFILL_ROWS)
        if more_rows > block_m:
            dots = self._call_dots(query_dtype, "auto" if dot_precision == "fast" else dot_precision, rotated_keys,
                                   head_pad, more_rows, device)
            if rows_ruled(self.module.CODE_BITS, dots, self.block_scaled, more_rows, head_pad, wide_rows(consts),
                          self.pow2_blocks, scale_rows_in_words(consts, self.scale_rows), self.position_scales,
                          self.float_codes):
                return more_rows
        return block_m

    def resident_programs(self, query, tensors: dict, static: dict, max_kv: int, num_splits: int,
                          block_n: int) -> int | None:
        """Programs per SM of the attention kernel a plan with these arguments launches for ``num_splits`` splits,
        from its compiled binary (compiled here if need be, not launched); None where there is no binary (the
        interpreter, a stand-in kernel such as benchmarks/sass_count.py installs, a compile hook). The split scratch
        and the output enter only as pointers of their dtype: one-element stand-ins."""
        num_q_heads, head_size = query.shape[1], query.shape[2]
        scratch = torch.empty(1, dtype=torch.float32, device=query.device) if num_splits > 1 else query
        binary = self.launch("paged_attention_kernel").compiled(
            (1, 1, num_splits), query, query, scratch, scratch, stride_qt=query.stride(0), stride_qh=query.stride(1),
            stride_ot=num_q_heads * head_size, stride_oh=head_size, **tensors,
            **self._split_kwargs(static, max_kv, num_splits, block_n))
        if binary is None:
            return None
        return resident_programs(binary.n_regs, binary.metadata.num_warps, binary.metadata.shared)

    @staticmethod
    def _split_kwargs(static: dict, max_kv: int, num_splits: int, block_n: int) -> dict:
        """The kernel arguments of a plan for ``num_splits`` splits: ``static`` with each split's chunk of KV
        positions (whole steps; the last split takes the rest)."""
        chunk = triton_cdiv(triton_cdiv(max(max_kv, 1), num_splits), block_n) * block_n
        return dict(static, chunk=chunk, NUM_SPLITS=num_splits)

    @staticmethod
    def _attention_launch(query, max_kv: int, num_splits: int, block_n: int, programs: int,
                          static: dict) -> AttentionLaunch:
        """A planned call's launch for ``num_splits`` splits: the grid, the chunk, the split scratch and the
        reduction's constexprs around the ``static`` arguments of plan_attend."""
        num_tokens, num_q_heads, _ = query.shape
        part = ml = reduce = None
        if num_splits > 1:  # one scratch per plan: the calls of a plan run one after another on the stream
            part = torch.empty((num_tokens, num_q_heads, num_splits, static["HEAD_PAD"]), dtype=torch.float32,
                               device=query.device)
            ml = torch.empty((num_tokens, num_q_heads, num_splits, 2), dtype=torch.float32, device=query.device)
            # query heads per reduction program: one compiled; interpreted, every head of a token (programs run
            # one after another there, each at a fixed cost: 2400 of them took 60 s of a KIVI test's 72)
            heads = _next_pow2(num_q_heads) if interpreting() else 1
            reduce = dict(NUM_SPLITS=num_splits, SPLITS_PAD=_next_pow2(num_splits), HEAD_SIZE=static["HEAD_SIZE"],
                          HEAD_PAD=static["HEAD_PAD"], HEADS=heads)
        return AttentionLaunch(grid=(programs // static["NUM_KV_HEADS"], static["NUM_KV_HEADS"], num_splits),
                               kwargs=KernelSet._split_kwargs(static, max_kv, num_splits, block_n), part=part,
                               ml=ml, reduce=reduce)

    def _call_dots(self, query_dtype: torch.dtype, dot_precision: str, rotated_keys: bool, head_pad: int,
                   block_m: int, device) -> dict:
        """The dot constexprs of one attention call: dot_modes, then the decode-only choices (BLOCK_DOTS,
        RATIO_PAIRS, KEY_FOLD) for a program of block_m query rows. Not cached: experiments flip the module's
        knobs (KEY_FOLD_HEADS, FAST_BLOCK_DOT_BITS) between plans in one process."""
        dots = self._cached_dot_modes(query_dtype, dot_precision, rotated_keys, head_pad, device)
        if not tensor_core_rows_ok(block_m, head_pad):
            dots = self._cached_dot_modes(query_dtype, "ieee", rotated_keys, head_pad, device)
        block_dots = getattr(self.module, "BLOCK_DOTS", {})
        if any(block_dots.values()):
            # decode (one query row per KV head and query head group): block-scaled sides in two terms take one
            # tensor-core dot per block on their codes alone (one term) instead; prefill, and exact fp32 dots, keep
            # the block ratios (render.BLOCK_DOT_MIN)
            sides = [s.upper() for s, on in block_dots.items() if on and dots[f"DOT_{s.upper()}"] in (1, 2)
                     and (dot_precision != "fast" or self.module.CODE_BITS[s] <= FAST_BLOCK_DOT_BITS)]
            on = block_m <= DECODE_ROWS and bool(sides)
            dots = dict(dots, BLOCK_DOTS=on, **({f"{s}_TERMS": 1 for s in sides} if on else {}))
        if any(getattr(self.module, "RATIO_PAIRS", {}).values()):
            # e8m0 ratios in two fp16 factors pay in decode only (H200: mxfp8's chunked prefill took 9% longer with
            # them); prefill multiplies the codes by the ratios in fp32. Both give the same operand
            dots = dict(dots, RATIO_PAIRS=block_m <= DECODE_ROWS)
        if getattr(self.module, "KEY_FOLD", False):
            # keys scaled per channel and token group (KIVI): in decode, with a query of one dot term, the scales
            # multiply the query (one row block per group) and the codes enter the dot alone
            dots = dict(dots, KEY_FOLD=(block_m <= DECODE_ROWS and dots["DOT_K"] == 1 and dots["Q_TERMS"] == 1
                                        and head_pad in KEY_FOLD_HEADS))
        return dots

    def run_attend(self, launch: AttentionLaunch, query, out, tensors: dict, bound: BoundLaunch | None = None) -> None:
        """Launch a planned attention call on ``query`` (the planned shape and dtype) into ``out``, over the cache
        whose pointer arguments are ``tensors``; ``bound``: ``bind_attend(launch)``, for a plan run many times."""
        part = out if launch.part is None else launch.part  # not read without splits
        ml = out if launch.ml is None else launch.ml
        if bound is not None:
            bound(launch.grid, query, out, part, ml, stride_qt=query.stride(0), stride_qh=query.stride(1),
                  stride_ot=out.stride(0), stride_oh=out.stride(1), **tensors)
        else:
            self.launch("paged_attention_kernel")(
                launch.grid, query, out, part, ml, stride_qt=query.stride(0), stride_qh=query.stride(1),
                stride_ot=out.stride(0), stride_oh=out.stride(1), **tensors, **launch.kwargs,
            )
        if launch.reduce is not None:
            self.launch("reduce_splits_kernel")(
                (query.shape[0], triton_cdiv(query.shape[1], launch.reduce["HEADS"])), part, ml, out, out.stride(0),
                out.stride(1), query.shape[1],
                **launch.reduce,
            )

    def _cached_dot_modes(self, *key) -> dict:
        """dot_modes(*key), computed once per key."""
        dots = self._dot_modes.get(key)
        if dots is None:
            dots = self._dot_modes[key] = self.dot_modes(*key)
        return dots

    def dot_modes(self, query_dtype: torch.dtype, dot_precision: str, rotated_keys: bool, head_pad: int = 128,
                  device: torch.device | None = None) -> dict:
        """The attention kernel's dot constexprs: tensor-core dots wherever their products stay exact.

        Each operand must be a sum of at most two values of the dot type: the cache side's operand (the generated
        DOT_OPERANDS), the query (bf16 8 significant bits, fp16 11, fp32 or rotated in fp32 about 22 kept) and the
        probabilities (rounded to what the query dtype's tolerance allows: 8, 11 or 22 bits). Otherwise, under
        ``dot_precision="ieee"``, and for bf16 dots in the interpreter (which cannot compute them), exact fp32 dots.
        KIVI formats also get the residual ring's steps (DOT_R, QR_TERMS, PR_TERMS): the ring's values are one term
        of their dtype (the generated RESIDUAL_DOT), the query and the probabilities as for the paged sides.
        ``dot_precision="fast"``: the same dots in one term each (an operand that needs two, such as q8_0's codes
        times their fp16 block ratios or a rotated query, is rounded once to the dot type).
        """
        if dot_precision == "quantized":
            return self._quantized_dot_modes(query_dtype, rotated_keys, head_pad, device)
        fast = dot_precision == "fast"  # one term per operand: each value rounded once to the dot type
        q_bits = 22 if rotated_keys or query_dtype == torch.float32 else (8 if query_dtype == torch.bfloat16 else 11)
        p_bits = {torch.float32: 22, torch.float16: 11}.get(query_dtype, 8)
        modes = {"NATIVE_CASTS": native_fp8(device)}
        for side, (x, bits) in (("K", ("Q", q_bits)), ("V", ("P", p_bits))):
            dtype, terms, min_head_pad = self.module.DOT_OPERANDS[side.lower()]
            x_terms = 1 if fast else -(-bits // {"fp16": 11, "bf16": 8}.get(dtype, 1))
            exact = (dot_precision == "ieee" or not dtype or x_terms > 2 or head_pad < min_head_pad
                     or (dtype == "bf16" and interpreting()))
            modes.update({f"DOT_{side}": 0 if exact else {"fp16": 1, "bf16": 2}[dtype],
                          f"{x}_TERMS": 1 if exact else x_terms, f"{side}_TERMS": 1 if exact or fast else terms})
        if hasattr(self.module, "RESIDUAL_DOT"):
            # KIVI's residual ring: real values of its dtype, one term; the query and the probabilities as above
            dtype = self.module.RESIDUAL_DOT
            per_term = {"fp16": 11, "bf16": 8}.get(dtype, 1)
            q_terms, p_terms = (1, 1) if fast else (-(-q_bits // per_term), -(-p_bits // per_term))
            exact = (dot_precision == "ieee" or not dtype or max(q_terms, p_terms) > 2
                     or (dtype == "bf16" and interpreting()))
            modes.update(DOT_R=0 if exact else {"fp16": 1, "bf16": 2}[dtype], QR_TERMS=1 if exact else q_terms,
                         PR_TERMS=1 if exact else p_terms)
        return modes

    def _quantized_dot_modes(self, query_dtype: torch.dtype, rotated_keys: bool, head_pad: int,
                             device: torch.device | None) -> dict:
        """dot_precision="quantized": DOT 3 (int8 dots) on the sides whose codes are int8 (QUANTIZED_DOT), the exact
        choice of "auto" on the other. Their dots reduce over the head (keys) and over the positions of a step
        (values): at least 32 of them, what one int8 tensor-core step takes."""
        modes = self.dot_modes(query_dtype, "auto", rotated_keys, head_pad, device)
        for side, x in (("k", "Q"), ("v", "P")):
            # keys reduce over the head; values over a step's positions, at least 32 on a GPU
            if self.module.QUANTIZED_DOT[side] and (side == "v" or head_pad >= 32):
                modes.update({f"DOT_{side.upper()}": 3, f"{x}_TERMS": 1,
                              f"{side.upper()}_TERMS": 1})
        return modes

    _SMS: dict = {}

    def _sm_count(self, device: torch.device) -> int:
        """The device's SM count, read once per device."""
        sms = self._SMS.get(device.index)
        if sms is None:
            sms = self._SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
        return sms

    @staticmethod
    def _scratch_splits(num_tokens: int, num_q_heads: int, head_pad: int) -> int:
        """The most splits whose fp32 partial results fit in 64 MiB."""
        return max(1, (64 << 20) // (num_tokens * num_q_heads * head_pad * 4))

    @classmethod
    def _most_splits(cls, max_kv: int, num_tokens: int, num_q_heads: int, head_pad: int) -> int:
        """The most splits of the programs-per-SM target: MIN_SPLIT positions each, partial results of 64 MiB."""
        return max(1, min(max_kv // MIN_SPLIT, cls._scratch_splits(num_tokens, num_q_heads, head_pad)))

    def _splits(self, programs: int, max_kv: int, num_tokens: int, num_q_heads: int, head_pad: int,
                device: torch.device, programs_per_sm: int = 4) -> int:
        """KV splits per program so that the grid fills the GPU (flash decoding; the rule is above MIN_SPLIT),
        partial results at most 64 MiB. 1 in the interpreter. (plan_attend then fills the last wave in decode.)"""
        if interpreting():
            return 1
        sms = self._sm_count(device)
        splits = min(triton_cdiv(programs_per_sm * sms, programs), max(1, max_kv // MIN_SPLIT))
        few = min(FEW_PROGRAMS_PER_SM * sms // programs, max(1, max_kv // MIN_FEW_SPLIT))  # 0 for many sequences
        splits = max(splits, few)
        return max(1, min(splits, self._scratch_splits(num_tokens, num_q_heads, head_pad)))


# Triton 3.6 on Hopper miscompiles some warpgroup (wgmma) dots whose head dimension is 32 or less: the kernel reads
# shared memory out of range (compute-sanitizer: "Out-of-range shared or local address" at the score dot), an illegal
# access or wrong scores on the H200 (found by tests/test_random_specs.py on 2026-11-30; uint2 / uint4 keys with
# block scales at head size 32 in chunked prefill; triton-lang/triton#11366 reports the same class of fault). Dots
# take wgmma only from 64 query rows per program, so such heads take at most 32 rows (mma.sync); where a GQA group
# alone fills 64 rows, their dots go exact in fp32 without tensor cores.
SMALL_HEAD_PAD = 32
SMALL_HEAD_ROWS = 32
# Query rows per program at most, compiled, for larger heads: a prefill program reads and dequantizes each KV tile
# once for its rows, so more rows share that work. PREFILL_ROWS by default; RULED_PREFILL_ROWS where the tile rule of
# a program of that many rows names them itself (rows_ruled). H200, twenty-seventh session (benchmarks/RESULTS.md,
# `python benchmarks/tune_tiles.py FORMATS --configs 128/8/2 128/8/2p 64/8/2 --prefill-rows 128 --shapes
# 4x8192q2048 --cuda-graphs` against the 64-row rules): 128 rows on 8 warps took fp8 3871 -> 3521 us, mxfp8 5684 ->
# 4419, q8_0 11378 -> 8171 (128 positions per step), int4 per token-head 9619 -> 7219, q4_0 9179 -> 7969, kivi_2bit
# 15094 -> 13436 (64 per step); bf16 (3960 -> 4086 at best), int8 separate (4630 -> 6322), mxfp4 (4905 -> 5097) and
# nvfp4 (4368 -> 4303, level) keep 64 rows at head size 128, as did the 8-bit formats with scales per token-head
# (static counts of the twenty-sixth session: they spilled at 128 rows; with the thirty-second session's spread
# scale loads none did in the thirty-third's counts, `python benchmarks/sass_count.py --prefill FORMATS` on 128/8/2,
# and its rule takes them there, the Hadamard format aside). The twenty-eighth
# session's rules of 128 rows at head sizes 64 / 256 (ATTENTION_TILES' comment) take bf16, nvfp4 and mxfp4 at 256
# too, the twenty-ninth's int8 separate at 256. Experiments set both.
PREFILL_ROWS = 64
RULED_PREFILL_ROWS = 128


def query_rows(group: int, max_query_len: int, head_pad: int, max_rows: int | None = None) -> int:
    """BLOCK_M, the (query token, query head) rows one attention program holds: all ``group`` query heads of a KV
    head times as many query tokens as fit in ``max_rows`` rows (by default PREFILL_ROWS; 128 in the interpreter; 32
    for heads of SMALL_HEAD_PAD or fewer elements on a GPU), a power of two of at least 16."""
    if interpreting():
        max_rows = 128
    elif head_pad <= SMALL_HEAD_PAD:
        max_rows = SMALL_HEAD_ROWS
    elif max_rows is None:
        max_rows = PREFILL_ROWS
    return max(16, _next_pow2(group * min(max_query_len, max(1, max_rows // group))))


def tensor_core_rows_ok(block_m: int, head_pad: int) -> bool:
    """Whether tensor-core dots are safe for ``block_m`` rows at this head (see SMALL_HEAD_PAD)."""
    return interpreting() or head_pad > SMALL_HEAD_PAD or block_m <= SMALL_HEAD_ROWS


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
