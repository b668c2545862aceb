#!/usr/bin/env bash
# The next GPU session's runs (benchmarks/pending/README.md, "The next GPU session"), one step per device call so
# that a machine taken back mid-session loses one step only. From the repository root on the lent H200, after
# `source benchmarks/device_env.sh`; outputs go to $OUT (the device tool's folder), each step's also to stdout.
#
#   bash benchmarks/pending/next_session.sh tests      # the GPU test list on this tree (~250 s)
#   bash benchmarks/pending/next_session.sh hs256rest  # head size 256: what the twenty-eighth session left untimed (~300 s)
#   bash benchmarks/pending/next_session.sh rowspread  # row-spread.patch: its A/B (~450 s)
#   bash benchmarks/pending/next_session.sh rowspreadtests  # the per-token formats' GPU tests on it (~250 s)
#   bash benchmarks/pending/next_session.sh kiviacc    # kivi-min-acc.patch: A/B and KIVI's GPU tests (~400 s)
#   bash benchmarks/pending/next_session.sh rows128    # 128-row prefill: head sizes 64 / 256, 3 stages (ran: s28 run 2)
#   bash benchmarks/pending/next_session.sh hs256more  # head size 256, the formats not swept there (ran: s28 run 3)
#   bash benchmarks/pending/next_session.sh cells      # profiles: the inline-scale cells converted first / 3 stages
#   bash benchmarks/pending/next_session.sh hs64prof   # profiles at head size 64 (int8 / fp8 per token-head, bf16)
#   bash benchmarks/pending/next_session.sh writes     # the pooled-state write graphs, KIVI's flush profile
#   bash benchmarks/pending/next_session.sh rules28    # the twenty-eighth session's rules: tests, times (ran: run 4)
#   bash benchmarks/pending/next_session.sh rules28b   # its KIVI follow-up (ran: run 5)
#   bash benchmarks/pending/next_session.sh bench1     # bench.py, every format, first half (~200 s)
#   bash benchmarks/pending/next_session.sh bench2     # bench.py, second half (~370 s)
#
# Steps in priority order; each prints how long it took.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
step=${1:?"a step: tests, hs256rest, rowspread, rowspreadtests, kiviacc, rows128, hs256more, cells, hs64prof, writes, rules28, rules28b, bench1 or bench2"}
start=$(date +%s)
# a pending patch's kernels: this checkout copied to /tmp/var with the patch applied, the named formats built from
# it into /tmp/variant (for benchmarks/variant_ab.py) and copied over /tmp/var's generated/ (for its tests)
# (variant PATCH MARKER FORMAT...: MARKER, a name the patched kernels hold, checks the build is the patch's)
variant() {
  local patch=$1 marker=$2; shift 2
  rm -rf /tmp/var /tmp/varroot /tmp/variant && cp -r . /tmp/var || return 1
  (cd /tmp/var && { git apply "benchmarks/pending/$patch.patch" || patch -p1 < "benchmarks/pending/$patch.patch"; }) \
    && mkdir -p /tmp/varroot && ln -sfn /tmp/var /tmp/varroot/kvgen || return 1
  local specs=""
  for f in "$@"; do specs="$specs'/tmp/var/specs/$f.yaml', "; done
  PYTHONPATH=/tmp/site:/tmp/varroot python3 -c "from kvgen.codegen.build import build_paths; \
    build_paths([$specs], '/tmp/variant')" || return 1
  for f in "$@"; do
    grep -q "$marker" "/tmp/variant/$f/kernels.py" || { echo "variant: $f was built without $patch" >&2; return 1; }
    rm -rf "/tmp/var/generated/$f" && cp -r "/tmp/variant/$f" /tmp/var/generated/
  done
}
ROW_SPREAD_FORMATS="int8_per_token_head fp8_per_token_head int8_per_token_head_separate int8_asym_per_token_head
  int8_per_token_head_hadamard_k int4_per_token_head mixed_k8_v4"
# the GPU tests named, run in /tmp/var on the variant's kernels: variant_tests NAME PYTEST_ARGS...
variant_tests() {
  local name=$1; shift
  (cd /tmp/var && PYTHONPATH=/tmp/site:/tmp/varroot timeout 240 python3 -m pytest -q -n 16 -p no:cacheprovider "$@" \
    2>&1 | tee "$out/${name}_tests.txt" | tail -3)
}
case "$step" in
  tests)
    timeout 560 python3 -m pytest -q -n 16 -p no:cacheprovider tests/test_tiles.py tests/test_attention_plan.py \
      tests/test_launch.py tests/test_quantized_domain.py tests/test_fast_dots.py tests/test_golden.py \
      tests/test_random_specs.py tests/test_kivi.py tests/test_kivi_reference.py tests/test_dot_operand.py \
      tests/test_alignment.py tests/test_scale_words.py "tests/test_conformance.py::test_long_decode_many_tiles" \
      "tests/test_conformance.py::test_prefill_rows_128_conform" "tests/test_conformance.py::test_kivi_decode_256" \
      2>&1 | tee "$out/tests.txt" | tail -15
    ;;
  hs256rest)
    # left untimed at head size 256 by the twenty-eighth session: the Hadamard format and nvfp4_separate in decode
    # (rules vs the values converted first), "fast" on q4_0 / q8_0 (FAST_RATIO_TILES over the new rules, against the
    # twenty-seventh session's tiles for them: 128/4/2 at 8 programs per SM), and the inline-scale cells' 128-row prefill
    timeout 150 python3 benchmarks/tune_tiles.py int8_per_token_head_hadamard_k nvfp4_separate --configs rt 64/4/2pc \
      --shapes 16x8192hs256 4x65536hs256 --cuda-graphs 2>&1 | tee "$out/hs256rest.txt" | grep "^|"
    timeout 100 python3 benchmarks/tune_tiles.py q4_0 q8_0 --dot-precision fast --configs rt --shapes 16x8192hs256 \
      4x65536hs256 --cuda-graphs 2>&1 | tee "$out/hs256fast.txt" | grep "^|"
    timeout 60 python3 benchmarks/tune_tiles.py int8_per_token_head_separate int8_per_token_head --configs rt \
      --shapes 4x8192q2048hs256 --cuda-graphs 2>&1 | tee "$out/prefill256cells.txt" | grep "^|"
    timeout 80 python3 benchmarks/tune_tiles.py int8_per_token_head_separate int8_per_token_head --configs 128/8/2 \
      64/8/2 --prefill-rows 128 --shapes 4x8192q2048hs256 --cuda-graphs 2>&1 | tee -a "$out/prefill256cells.txt" \
      | grep "^|"
    ;;
  kiviacc)
    # benchmarks/pending/kivi-min-acc.patch: KIVI's value minima dot accumulating into the values' result (one tile of
    # partial sums live, not two; static: 13.7 -> 10.5 spills per position at head size 256 in prefill): its A/B
    # against the shipped kernels, then KIVI's GPU tests on it
    variant kivi-min-acc mma_acc kivi_2bit kivi_4bit || exit 1
    timeout 300 python3 benchmarks/variant_ab.py /tmp/variant kivi_2bit kivi_4bit --shapes 4x8192q2048 \
      4x8192q2048hs256 64x8192 2>&1 | tee "$out/kiviacc_ab.txt" | grep "^|"
    variant_tests kiviacc tests/test_kivi.py tests/test_kivi_reference.py tests/test_conformance.py \
      tests/test_fast_dots.py -k kivi
    ;;
  rowspread)
    # benchmarks/pending/row-spread.patch: per-position scales / zero points loaded as tiles of at least one element
    # per thread, where a step holds fewer positions than the program has threads (static, sm_90: 128-row prefill of
    # the per-token formats 22 -> 15 instructions per position, no spills, 40 -> 5-17 waited loads a step). Only
    # kernels with such steps change: head size 256 in decode (64 positions on 4 warps), 128-row prefill (8 warps).
    # Its loads are integer words: the A/B's max diff must be 0
    variant row-spread load_per_position $ROW_SPREAD_FORMATS || exit 1
    timeout 200 python3 benchmarks/variant_ab.py /tmp/variant $ROW_SPREAD_FORMATS --configs 128/8/2 --prefill-rows 128 \
      --shapes 4x8192q2048 --rounds 1 2>&1 | tee "$out/rowspread_prefill.txt" | grep "^|"
    timeout 250 python3 benchmarks/variant_ab.py /tmp/variant $ROW_SPREAD_FORMATS --shapes 16x8192hs256 4x8192q2048 \
      --rounds 1 2>&1 | tee "$out/rowspread_rules.txt" | grep "^|"
    ;;
  rowspreadtests)
    # the per-token formats' GPU conformance on row-spread.patch's kernels (the small-tile, long-decode at 256 and
    # forced 128-row cases reach its new path)
    variant row-spread load_per_position $ROW_SPREAD_FORMATS || exit 1
    variant_tests rowspread tests/test_tiles.py tests/test_conformance.py -k "per_token_head or mixed"
    ;;
  rows128)
    # the twenty-seventh session took 128-row prefill programs where they ran faster at head size 128 (fp8, mxfp8,
    # q8_0 on 128/8/2; int4 per token-head, q4_0, kivi_2bit on 64/8/2). Untried: 3 stages, the formats left at 64
    # rows with other tiles (nvfp4 level, mxfp4 4% slower on 128/8/2), the formats not timed (the inline-scale cells,
    # int8 asym, the Hadamard format, mixed_k8_v4: static counts spill), and head sizes 64 / 256
    timeout 260 python3 benchmarks/tune_tiles.py fp8_e4m3 mxfp8 nvfp4 mxfp4 int4_per_token_head q4_0 kivi_4bit \
      int8_per_token_head mixed_k8_v4 --configs 128/8/3 64/8/3 64/8/2p --prefill-rows 128 --shapes 4x8192q2048 \
      --cuda-graphs 2>&1 | tee "$out/rows128_hs128.txt" | grep "^|"
    fmts="bf16 fp8_e4m3 mxfp8 nvfp4 int4_per_token_head q4_0"
    timeout 100 python3 benchmarks/tune_tiles.py $fmts --configs rt --shapes 4x8192q2048hs64 4x8192q2048hs256 \
      --cuda-graphs 2>&1 | tee "$out/rows64_hs.txt" | grep "^|"
    timeout 200 python3 benchmarks/tune_tiles.py $fmts --configs 128/8/2 64/8/2 --prefill-rows 128 --shapes \
      4x8192q2048hs64 4x8192q2048hs256 --cuda-graphs 2>&1 | tee "$out/rows128_hs.txt" | grep "^|"
    ;;
  rules28)
    # the twenty-eighth session's rules (head size 256 in decode for q4_0 / q8_0 / KIVI; 128-row prefill at head sizes
    # 64 / 256): their GPU tests, then their times with the rules (rt) against the old tiles where not timed before
    timeout 200 python3 -m pytest -q -n 16 -p no:cacheprovider tests/test_tiles.py \
      "tests/test_conformance.py::test_prefill_rows_128_conform" "tests/test_conformance.py::test_long_decode_many_tiles" \
      2>&1 | tee "$out/rules28_tests.txt" | tail -4
    timeout 120 python3 benchmarks/tune_tiles.py bf16 fp8_e4m3 mxfp8 nvfp4 nvfp4_separate mxfp4 q4_0 kivi_2bit \
      --configs rt --shapes 4x8192q2048hs256 --cuda-graphs 2>&1 | tee "$out/rules28_prefill256.txt" | grep "^|"
    timeout 60 python3 benchmarks/tune_tiles.py fp8_e4m3 int4_per_token_head q4_0 kivi_4bit --configs rt \
      --shapes 4x8192q2048hs64 --cuda-graphs 2>&1 | tee "$out/rules28_prefill64.txt" | grep "^|"
    timeout 60 python3 benchmarks/tune_tiles.py mxfp4 kivi_4bit --configs 128/8/2 64/8/2 --prefill-rows 128 \
      --shapes 4x8192q2048hs256 --cuda-graphs 2>&1 | tee "$out/rules28_prefill256more.txt" | grep "^|"
    timeout 150 python3 benchmarks/tune_tiles.py q4_0 q8_0 kivi_2bit kivi_4bit --configs rt 64/4/3 --programs-per-sm 8 \
      --shapes 16x8192hs256 4x65536hs256 --cuda-graphs 2>&1 | tee "$out/rules28_decode256.txt" | grep "^|"
    ;;
  rules28b)
    # after run 4: KIVI's decode at 256 (a conformance test of its own), mxfp4 / kivi_4bit's 128-row prefill at 256
    timeout 150 python3 -m pytest -q -n 16 -p no:cacheprovider tests/test_tiles.py \
      "tests/test_conformance.py::test_prefill_rows_128_conform" "tests/test_conformance.py::test_kivi_decode_256" \
      2>&1 | tee "$out/rules28b_tests.txt" | tail -4
    timeout 100 python3 benchmarks/tune_tiles.py kivi_2bit kivi_4bit --configs rt --shapes 4x8192q2048hs256 \
      --cuda-graphs 2>&1 | tee "$out/rules28b_kivi.txt" | grep "^|"
    ;;
  bench1)
    timeout 500 python3 benchmarks/bench.py --cuda-graphs --out "$out/benchA" --formats bf16 fp16 fp8_e4m3 \
      fp8_e4m3_per_head fp8_e5m2 fp8_per_token_head int8_per_token_head int8_per_token_head_separate \
      int8_asym_per_token_head int8_per_token_head_hadamard_k 2>&1 | tee "$out/bench1.txt" | grep "^|"
    ;;
  bench2)
    timeout 550 python3 benchmarks/bench.py --cuda-graphs --out "$out/benchB" --formats bf16 mixed_k8_v4 mxfp8 \
      mxfp4 nvfp4 nvfp4_separate q8_0 q4_0 int4_per_token_head kivi_2bit kivi_4bit 2>&1 | tee "$out/bench2.txt" \
      | grep "^|"
    ;;
  hs256more)
    # the twenty-sixth and twenty-seventh sessions swept head size 256 for bf16, fp8, int8 separate, the inline-scale
    # cells, mxfp8, nvfp4, mxfp4 and int4 per token-head (converted first where it won); these are the rest (their
    # rules untouched), with and without the values converted first; then the formats that took int8 per token-head's
    # head-256 rule untimed (int8 asym, mixed_k8_v4) against their old tiles (128/4/2/168 at 8 programs per SM); then
    # the inline-scale cells converted first at 256, which lost at 64 / 128 (their 4-byte rows)
    timeout 330 python3 benchmarks/tune_tiles.py q4_0 q8_0 kivi_2bit kivi_4bit int8_per_token_head_hadamard_k \
      nvfp4_separate --configs rt 64/4/2 64/4/2pc 64/4/2/168pc 128/4/2pc --shapes 16x8192hs256 4x65536hs256 \
      --cuda-graphs 2>&1 | tee "$out/hs256more.txt" | grep "^|"
    timeout 90 python3 benchmarks/tune_tiles.py int8_asym_per_token_head mixed_k8_v4 --configs rt 128/4/2/168 \
      --programs-per-sm 8 --shapes 16x8192hs256 4x65536hs256 --cuda-graphs 2>&1 | tee "$out/hs256old.txt" | grep "^|"
    timeout 90 python3 benchmarks/tune_tiles.py int8_per_token_head fp8_per_token_head --configs rt 64/4/2c \
      64/4/2/168pc --shapes 16x8192hs256 4x65536hs256 --cuda-graphs 2>&1 | tee "$out/hs256cells.txt" | grep "^|"
    ;;
  cells)
    # vLLM's inline-scale cells: the rule's tiles, the values converted first, 3 stages with block ids ahead
    for t in rtn rtc 128/4/3/168pn; do
      echo "tiles $t" | tee -a "$out/cells.txt"
      timeout 180 python3 benchmarks/profile_decode.py --formats int8_per_token_head --tiles "$t" --out "$out/cells" \
        2>&1 | tee -a "$out/cells.txt" | grep "^| int8"
    done
    ;;
  hs64prof)
    timeout 400 python3 benchmarks/profile_decode.py --formats bf16 int8_per_token_head fp8_per_token_head mxfp8 \
      --shape 64x8192hs64 --out "$out/hs64prof" 2>&1 | tee "$out/hs64prof.txt" | grep "^|"
    ;;
  writes)
    timeout 250 python3 benchmarks/write_state.py nvfp4 kivi_2bit fp8_e4m3 --states nothing copy --graph-nodes 2>&1 \
      | tee "$out/write_graph_nodes.txt" | tail -30
    timeout 200 python3 benchmarks/profile_decode.py --write --formats kivi_2bit nvfp4 --out "$out/writes" 2>&1 \
      | tee "$out/write_profile.txt" | grep "^|"
    ;;
  *)
    echo "unknown step '$step': tests, hs256rest, rowspread, rowspreadtests, kiviacc, rows128, hs256more, cells, hs64prof, writes, rules28, rules28b, bench1 or bench2" >&2
    exit 2
    ;;
esac
echo "step $step took $(( $(date +%s) - start )) s"
