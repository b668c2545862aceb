#!/usr/bin/env bash
# The next GPU session's runs (benchmarks/pending/README.md, "The next GPU session"), one step per device call so
# that a machine taken back mid-session loses one step only. From the repository root on the lent H200, after
# `source benchmarks/device_env.sh`; outputs go to $OUT (the device tool's folder), each step's also to stdout.
#
#   bash benchmarks/pending/next_session.sh verify     # the s32 / s33 merges timed on the H200 (~400 s?)
#   bash benchmarks/pending/next_session.sh tests      # the GPU test list on this tree, first part (~300 s?)
#   bash benchmarks/pending/next_session.sh tests2     # its second part: random specs, KIVI, long conformance (~300 s?)
#   bash benchmarks/pending/next_session.sh bench1     # bench.py, every format, first half (~350 s?)
#   bash benchmarks/pending/next_session.sh bench2     # bench.py, second half (s56, H200: 350 s)
#   bash benchmarks/pending/next_session.sh bench3     # bench.py, the five separate-scale formats of s55 (s56, H200: 178 s)
#   bash benchmarks/pending/next_session.sh crossover  # dequantize-first against fused near auto's counts: H200, hs 64 / 256, groups 1 / 8 (~550 s?)
#   bash benchmarks/pending/next_session.sh crossover2 # head sizes 64 / 256 near the counts, nvfp4's (~400 s?)
#   bash benchmarks/pending/next_session.sh writes     # the pooled-state write graphs (H200: s43's H100 had no slowdown), KIVI's flush profile
#   bash benchmarks/pending/next_session.sh writeprof  # the writes under 70% profiled and timed on the H200 (~300 s?)
#   bash benchmarks/pending/next_session.sh kivitiles  # KIVI's decode tiles after the code orders (4 programs per SM at 128 registers; 128 positions a step) (~200 s?)
#   bash benchmarks/pending/next_session.sh int4more   # write-int4-more.patch: int4 per token-head's finite tiles round in one add and one clamp; 8 tokens per program (s57, H200: 176 s)
#   bash benchmarks/pending/next_session.sh writeab    # write-fast-div.patch timed against main (~60 s; s36 H100; stale since: rebase first)
#   bash benchmarks/pending/next_session.sh rcpfault   # recip_fast's fault in nvfp4's write, for a Triton upgrade (ran s42, H100: ~15 s)
# Ran and removed (benchmarks/results_2026-12-04_h200_s28.md, _s29.md): rows128, hs256more, rules28, rules28b (s28);
# hs256rest, kiviacc (merged) and the first rowspread (s29); tests, dequant, maskfree, rowspread, rowspread128 and
# rowspreadtests (s32, benchmarks/results_2026-12-05_h200_s32.md); verify and tests ran on an H100 (s33,
# benchmarks/results_2026-12-05_h100_s33.md) and stay for the H200; s34 (H100 again,
# benchmarks/results_2026-12-05_h100_s34.md) ran verify, tests, crossover and steprel (rejected, removed); s35
# (H100, benchmarks/results_2026-12-05_h100_s35.md) ran writediv (write-fast-div.patch: 1-2%, wrong at head 256 with
# its branch; removed) and tests; s36 (H100, benchmarks/results_2026-12-06_h100_s36.md) ran dequantall
# (dequant-decode.patch merged; the dequant / dequanttime / dequantall steps removed), writeprof and writeab
# (write-slot-unsigned.patch merged); s37 (H100, benchmarks/results_2026-12-06_h100_s37.md) ran crossover (the
# counts lowered for e8m0 blocks, scaled by head size), bench1, bench2 and tests; they stay for the H200; s38 (H100,
# benchmarks/results_2026-12-06_h100_s38.md) ran loadearly (write-load-early.patch merged), floatenc
# (float-encode.patch slower: removed) and crossover2's shapes (the counts rescaled by head size, nvfp4's lowered; the
# step stays for the H200); s39 (H100, benchmarks/results_2026-12-06_h100_s39.md) ran writeprefetch
# (write-prefetch.patch slower everywhere: removed), tests (635 passed), crossfast ("fast" got its own dequantize-first
# counts; removed) and kivicrash (KIVI's kernel only, at head size 256; the step removed, kivi_block32_crash.sh
# kept as the reproducer for a Triton upgrade); s40 (H100, benchmarks/results_2026-12-06_h100_s40.md) ran kiviheads
# (merged for prefill flushes only), int4div (merged) and its own e2m1 envelope encode (merged); s41 (an H200 for
# four calls, then an H100; benchmarks/results_2026-12-06_h200_s41.md) ran scaled on both (nvfp4-scaled-div.patch
# merged once its reciprocal came from div_rn; the step removed, benchmarks/pending/recip_fast_fault.py kept as the
# reproducer), bench1 / bench2 and tests (645 passed) on the H200; s43 (H100, benchmarks/results_2026-12-06_h100_s43.md)
# ran writeprof (as s42), cells (answered: the 4-byte copies throttle the memory-instruction queue when buffered a step
# deeper; the step removed) and writes (no pooled-state slowdown on the H100; the step stays for the H200); s44 (H100,
# benchmarks/results_2026-12-06_h100_s44.md) ran vshift (value-shift.patch 1.45-1.79x slower) and vcopies
# (why: the 8-byte copies alone gain 5-6%, each way of adding the first codes costs more); both steps and the
# patches removed; s45 (H100, benchmarks/results_2026-12-06_h100_s45.md) ran keypairs (a ceiling of 1.4-2.5%: not built) and hs64prof; both removed; s46 (H100,
# benchmarks/results_2026-12-06_h100_s46.md) ran tests (675 passed), decode4prof and loadrows / loadrowstests
# (write-load-rows.patch merged for the rotated formats); the three steps removed; s47 (H100,
# benchmarks/results_2026-12-06_h100_s47.md) ran kividec and loadgroups (kivi-decode.patch and
# write-load-groups.patch merged; both steps removed) and kivilayout (faster, one GPU stream case wrong: kivicases); s48 got no
# machine (every start failed); s49 (an H100 for its last minutes, benchmarks/results_2026-12-07_h100_s49.md) ran
# quantcaps (int8 separate's quantized domain at 128/4/2/128 merged as a rule; the step removed) and valuesplit
# without its tile tests; s50 got no machine (every start failed) and added drvs, kivicaps, drvstests, rowcaps2,
# rowcaps64 and occupancy from static scans (drvs / drvstests replace valuesplit and decoderowstests;
# benchmarks/RESULTS.md, "fiftieth session"); s51 (H100, benchmarks/results_2026-12-07_h100_s51.md) ran drvs,
# drvstests, kivicaps, rowcaps, rowcaps2, rowcaps64, occupancy and loadgroups8 (decode-rows.patch and
# value-split.patch merged with the rules they measured; those steps and decoderows removed); s52 (H100,
# benchmarks/results_2026-12-07_h100_s52.md) ran merged51, merged51time, tests (677 passed) and kivilayout
# (write-kivi-layout-prefill.patch merged for prefill kernels only; both KIVI layout patches and the three steps
# removed; kivicases now checks this tree); s53 (H100, benchmarks/results_2026-12-07_h100_s53.md) ran kivicodes /
# kivicodestests (kivi-code-orders.patch merged: KIVI decode 7-30% faster), packcodes (level: removed), packblocks
# (1.2-1.5x slower: removed) and int4sep (shipped as specs/int4_per_token_head_separate.yaml); those five steps and
# their patches removed (git history: the s53 merge's parent, c898c61); s54 (H100,
# benchmarks/results_2026-12-07_h100_s54.md) ran packint (packsub and intdecode together: the subnormal codes
# rejected, their patches removed, git history at 4cc24fd), nvscale, int4write and nvwrite (the three patches merged);
# those six steps and kivisub removed; s55 (H100, benchmarks/results_2026-12-07_h100_s55.md) ran tests (687 passed)
# and sepspecs (the five separate-scale specs shipped; the step removed); s56 (H200, benchmarks/results_2026-12-07_h200_s56.md)
# ran tests (772 passed, one new test failed: fixed after), bench3, bench2 and kivicases (all 12 ok; the step removed).
#
# Steps in priority order; each prints how long it took.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
step=${1:?"a step: verify, tests, bench1, bench2, bench3, crossover, crossover2, writes, writeprof, kivitiles, int4more, writeab or rcpfault"}
start=$(date +%s)
# a pending patch's kernels (the writeprof step's): this checkout copied to /tmp/var
# with the patch applied, the named formats built from it into /tmp/variant (for benchmarks/variant_ab.py) and
# copied over /tmp/var's generated/ (for its tests)
# (variant PATCH MARKER FORMAT...: MARKER, a name the patched kernels hold, checks the build is the patch's; PATCH
# may be several, joined by "+")
variant() {
  local patch=$1 marker=$2; shift 2
  rm -rf /tmp/var /tmp/varroot /tmp/variant && cp -r . /tmp/var || return 1
  local one
  for one in ${patch//+/ }; do
    (cd /tmp/var && { git apply "benchmarks/pending/$one.patch" || patch -p1 < "benchmarks/pending/$one.patch"; }) \
      || return 1
  done
  mkdir -p /tmp/varroot && ln -sfn /tmp/var /tmp/varroot/kvgen || return 1
  local specs=""
  for f in "$@"; do specs="$specs'/tmp/var/specs/$f.yaml', "; done
  PYTHONPATH=/tmp/site:/tmp/varroot python3 -c "from kvgen.codegen.build import build_paths; \
    build_paths([$specs], '/tmp/variant')" || return 1
  for f in "$@"; do
    grep -q "$marker" "/tmp/variant/$f/kernels.py" || { echo "variant: $f was built without $patch" >&2; return 1; }
    rm -rf "/tmp/var/generated/$f" && cp -r "/tmp/variant/$f" /tmp/var/generated/
  done
}
# the GPU tests named, run in /tmp/var on the variant's kernels: variant_tests NAME PYTEST_ARGS...
variant_tests() {
  local name=$1; shift
  (cd /tmp/var && PYTHONPATH=/tmp/site:/tmp/varroot timeout 240 python3 -m pytest -q -n 16 -p no:cacheprovider "$@" \
    2>&1 | tee "$out/${name}_tests.txt" | tail -3)
}
case "$step" in
  verify)
    # the thirty-second session's merges ran on an H100 in the thirty-third (benchmarks/RESULTS.md), not yet on the
    # H200: the loops' bounds test (the 128-row prefill conformance and the dequantize-first tests are in `tests`),
    # the rules' prefill and decode at 256, and the thirty-third's 128-row rule at head size 128 (int8 / fp8 per
    # token-head, int8 asym, mixed_k8_v4; H100: 0.73-0.98x their 64-row time) against their 64-row tiles
    timeout 150 python3 -m pytest -q -n 16 -p no:cacheprovider tests/test_conformance.py -k "many_whole" 2>&1 \
      | tee "$out/verify_tests.txt" | tail -3
    timeout 170 python3 benchmarks/tune_tiles.py bf16 int8_per_token_head int8_per_token_head_separate \
      int8_asym_per_token_head mixed_k8_v4 fp8_per_token_head --configs rt --shapes 4x8192q2048hs256 4x8192q2048 \
      16x8192hs256 --cuda-graphs 2>&1 | tee "$out/verify_times.txt" | grep "^|"
    timeout 120 python3 benchmarks/tune_tiles.py int8_per_token_head fp8_per_token_head int8_asym_per_token_head \
      mixed_k8_v4 --configs 128/4/2 --prefill-rows 64 --shapes 4x8192q2048 --cuda-graphs 2>&1 \
      | tee "$out/verify_rows64.txt" | grep "^|"
    # the dequantize kernels (rotation dots at heads over 32, CUDA-core sums below; per-row scale loads): their times
    # (H100, thirty-third session: 1.01-1.07x bf16)
    timeout 150 python3 benchmarks/dequantize_first.py int8_per_token_head int8_asym_per_token_head \
      int8_per_token_head_hadamard_k int4_per_token_head 2>&1 | tee "$out/verify_dequant.txt" | grep "^|"
    ;;
  crossover)
    # where dequantize-first starts to pay (runtime/dequantize.py AUTO_DENSE_RULES, from the H100 at head size 128
    # in s37): on the H200, at and around the classes' counts (32 two-term block-scaled, 128 per token-head and e8m0)
    for q in 32 128 256; do
      timeout 100 python3 benchmarks/dequantize_first.py int8_per_token_head int8_per_token_head_separate \
        int8_per_token_head_hadamard_k mxfp8 mxfp4 q4_0 q8_0 kivi_2bit --shape "4x8192q$q" 2>&1 \
        | tee -a "$out/crossover.txt" | grep "^|\|^Chunked"
    done
    # head sizes 64 and 256 at the per token-head class's count
    for hs in 64 256; do
      timeout 70 python3 benchmarks/dequantize_first.py int8_per_token_head q4_0 kivi_2bit mxfp8 \
        --shape "4x8192q128hs$hs" 2>&1 | tee -a "$out/crossover.txt" | grep "^|\|^Chunked"
    done
    # the counts scale inversely with the query heads per KV head (H100 s37: consistent at groups 1 and 8): group 1
    # at 4x the new tokens of group 4's counts, group 8 at half
    for g in "8 4x8192q512" "64 4x8192q64"; do
      set -- $g
      timeout 70 python3 benchmarks/dequantize_first.py int8_per_token_head q4_0 mxfp8 kivi_2bit --query-heads "$1" \
        --shape "$2" 2>&1 | tee -a "$out/crossover.txt" | grep "^|\|^Chunked"
    done
    ;;
  crossover2)
    # what crossover (s37, H100) left: head size (at 64 the per token-head and e8m0 fused kernels still win at 128
    # new tokens, at 256 dense-first wins there by 12-50%: do the counts scale inversely with head size? hs64 at
    # 256, hs256 at 64 / 16; mxfp8 at hs256 timed out there), then nvfp4's count (2048, measured before its
    # dequantize kernel got 2.5x faster)
    timeout 80 python3 benchmarks/dequantize_first.py int8_per_token_head mxfp8 --shape 4x8192q256hs64 2>&1 \
      | tee -a "$out/crossover2.txt" | grep "^|\|^Chunked"
    timeout 110 python3 benchmarks/dequantize_first.py int8_per_token_head mxfp8 --shape 4x8192q64hs256 2>&1 \
      | tee -a "$out/crossover2.txt" | grep "^|\|^Chunked"
    timeout 110 python3 benchmarks/dequantize_first.py q4_0 kivi_2bit --shape 4x8192q16hs256 2>&1 \
      | tee -a "$out/crossover2.txt" | grep "^|\|^Chunked"
    timeout 100 python3 benchmarks/dequantize_first.py nvfp4 --shape 4x8192q512 2>&1 \
      | tee -a "$out/crossover2.txt" | grep "^|\|^Chunked"
    timeout 100 python3 benchmarks/dequantize_first.py nvfp4 --shape 4x8192q1024 2>&1 \
      | tee -a "$out/crossover2.txt" | grep "^|\|^Chunked"
    ;;
  tests)
    # the GPU test list in two steps (s57: the whole list in one step ran past 560 s at 98%): this one, then tests2
    timeout 540 python3 -m pytest -q -n 16 -p no:cacheprovider tests/test_tiles.py tests/test_attention_plan.py \
      tests/test_launch.py tests/test_quantized_domain.py tests/test_fast_dots.py tests/test_golden.py \
      tests/test_dot_operand.py tests/test_alignment.py tests/test_scale_words.py tests/test_dequantize_first.py \
      tests/test_fast_div.py tests/test_numerics.py tests/test_write_plan.py tests/test_padding.py \
      tests/test_minifloat_encode.py tests/test_model_cache.py tests/test_conformance_check.py tests/test_hidden_values.py \
      2>&1 | tee "$out/tests.txt" | tail -15
    ;;
  tests2)
    # (30 random specs, not the GPU's default 40: each now also compiles a dequantize kernel and bf16's attention)
    KVGEN_RANDOM_SPECS=30 timeout 540 python3 -m pytest -q -n 16 -p no:cacheprovider tests/test_random_specs.py \
      tests/test_kivi.py tests/test_kivi_reference.py "tests/test_conformance.py::test_long_decode_many_tiles" \
      "tests/test_conformance.py::test_prefill_rows_128_conform" "tests/test_conformance.py::test_kivi_decode_256" \
      2>&1 | tee "$out/tests2.txt" | tail -15
    ;;
  tests3)
    # the conformance property per shipped format (30 cases each, and with 32-position tiles and splits), the long
    # contexts and whole prefill steps: the attention tolerance's per-channel scale and fast_slack's per-element
    # bound (s58) on the GPU's tensor-core dots
    timeout 540 python3 -m pytest -q -n 16 -p no:cacheprovider tests/test_conformance.py \
      -k "test_conformance or long_context or many_whole" 2>&1 | tee "$out/tests3.txt" | tail -15
    ;;
  tolerance)
    # one call for what the tolerance changes of s58 reach (a budget with room for one step): the per-format
    # conformance property (12 cases each), KIVI's streams, 15 random specs and the checker's own tests
    # (-v: each result as it comes, so a timeout still leaves which passed and failed)
    KVGEN_EXAMPLES=8 KVGEN_RANDOM_SPECS=10 timeout 270 python3 -m pytest -v --tb=short -n 16 -p no:cacheprovider \
      tests/test_conformance_check.py "tests/test_conformance.py::test_conformance" tests/test_kivi.py \
      tests/test_random_specs.py > "$out/tolerance.txt" 2>&1
    grep -c " PASSED " "$out/tolerance.txt"; grep " FAILED \|^FAILED\|passed\|failed" "$out/tolerance.txt" | tail -15
    ;;
  bench1)
    timeout 560 python3 benchmarks/bench.py --cuda-graphs --out "$out/benchA" --formats bf16 fp16 fp8_e4m3 \
      fp8_e4m3_per_head fp8_e5m2 fp8_per_token_head int8_per_token_head int8_per_token_head_separate \
      int8_asym_per_token_head int8_per_token_head_hadamard_k q8_0 int4_per_token_head \
      int4_per_token_head_separate 2>&1 \
      | tee "$out/bench1.txt" | grep "^|"
    ;;
  bench2)
    timeout 560 python3 benchmarks/bench.py --cuda-graphs --out "$out/benchB" --formats bf16 mixed_k8_v4 mxfp8 \
      mxfp4 nvfp4 nvfp4_separate q4_0 kivi_2bit kivi_4bit 2>&1 | tee "$out/bench2.txt" | grep "^|"
    ;;
  bench3)
    # the five separate-scale formats shipped in the fifty-fifth session (s56, H200: 178 s)
    timeout 560 python3 benchmarks/bench.py --cuda-graphs --out "$out/benchC" --formats bf16 \
      fp8_per_token_head_separate int8_asym_per_token_head_separate mixed_k8_v4_separate q8_0_separate \
      q4_0_separate 2>&1 | tee "$out/bench3.txt" | grep "^|"
    ;;
  writeprof)
    # the writes under 70% of copy bandwidth (H200 s27), profiled as they are: issue-bound (s13's profile: issue
    # slots 64-78% busy, not_selected the largest stall) or limited elsewhere, and on which pipe?
    timeout 200 python3 benchmarks/profile_decode.py --write --formats bf16 int4_per_token_head nvfp4 \
      int8_asym_per_token_head mxfp4 q4_0 int8_per_token_head_hadamard_k mixed_k8_v4 --out "$out/writeprof" 2>&1 \
      | tee "$out/writeprof.txt" | grep "^|"
    # and the writes of the formats that missed 70% in s41's full run, timed on this tree (nvfp4's scaled division
    # was merged after that run, on an H100's timings)
    timeout 100 python3 benchmarks/time_writes.py nvfp4 nvfp4_separate mxfp4 q4_0 int8_asym_per_token_head \
      int8_per_token_head_hadamard_k --tokens 32768 256 --rounds 2 2>&1 | tee "$out/writeprof_times.txt" | grep "^|"
    ;;
  kivitiles)
    # KIVI's decode after the code orders (s53: kivi_2bit 861, kivi_4bit 902 us at 64 x 8192 on the H100, 1.21-1.27x
    # bf16, with 0.19-0.31x its bytes: its instructions and their latency set the pace, not the bytes). Static (sm_90,
    # 64 x 8192; instructions per position / registers / programs per SM, no spills unless said): the rules' tiles
    # kivi_2bit 64/4/3/168 13.4 / 167 / 3, kivi_4bit 64/4/3/128 14.7 / 128 / 4 (0.1 spill); 64/4/2/128 13.3 / 128 /
    # 4 and 14.2 / 128 / 4 (0.1); 64/4/3/128 kivi_2bit 13.7 / 128 / 4 (0.1); 128/4/2/168 12.4 and 12.5 / 168 / 3
    timeout 300 python3 benchmarks/tune_tiles.py kivi_2bit kivi_4bit --configs rt 64/4/2/128 64/4/3/128 128/4/2/168 \
      --programs-per-sm 4 8 --shapes 64x8192 4x65536 256x1024 --cuda-graphs 2>&1 | tee "$out/kivitiles.txt" | grep "^|"
    ;;
  int4more)
    # write-int4-more.patch (fifty-fourth session, a subagent's static study after write-int4-next's merge): int4 per
    # token-head's finite tiles round their codes by one add of zp + 0.5 and one clamp (no lower clamp, no mask;
    # render.fast_encode) and divide the zero point through the codes' reciprocal. Static, path a finite tile takes
    # (tile test not counted): 268.0 -> 244.8 warp instructions per token-head, separate 254.5 -> 231.5; registers
    # 79 -> 77 / 71 -> 69; programs per SM unchanged. Main, the patch, main again (writes of 32768 and 256 tokens);
    # both trees at the rule's tiles against 8 tokens per program (static: 208.6 / 191.4 at 128 / 116 registers);
    # then the GPU tests (among them test_finite_tiles_write_the_same_bytes: rotated code boundaries)
    W="int4_per_token_head specs/int4_per_token_head_separate.yaml --tokens 32768 256 --rounds 2"
    timeout 60 python3 benchmarks/time_writes.py $W 2>&1 | tee "$out/int4more_main.txt" | grep "^|"
    variant write-int4-more "rounding of the finite tiles' codes" int4_per_token_head int4_per_token_head_separate \
      || exit 1
    (cd /tmp/var && PYTHONPATH=/tmp/site:/tmp/varroot timeout 60 python3 benchmarks/time_writes.py $W 2>&1 \
      | tee "$out/int4more_variant.txt" | grep "^|")
    timeout 60 python3 benchmarks/time_writes.py $W 2>&1 | tee "$out/int4more_main2.txt" | grep "^|"
    timeout 50 python3 benchmarks/tune_writes.py int4_per_token_head int4_per_token_head_separate --configs 4/1 8/1 \
      --tokens 32768 2>&1 | tee "$out/int4more_tiles_main.txt" | grep "^|\|^tree"
    (cd /tmp/var && PYTHONPATH=/tmp/site:/tmp/varroot timeout 50 python3 benchmarks/tune_writes.py int4_per_token_head \
      int4_per_token_head_separate --configs 4/1 8/1 --tokens 32768 2>&1 | tee "$out/int4more_tiles_variant.txt" \
      | grep "^|\|^tree")
    variant_tests int4more tests/test_numerics.py tests/test_fast_div.py tests/test_conformance.py tests/test_golden.py \
      tests/test_write_arithmetic.py tests/test_write_plan.py -k "int4 or fast_div or fast_encode"
    ;;
  writeab)
    # write-fast-div.patch against main (thirty-fifth session: 24% fewer
    # instructions for nvfp4, 1-2% faster on an H100, whose copy bandwidth of 3020 GB/s may have bound it instead),
    # timed and profiled; its nvfp4 branch miscompiles at head size 256 (s35), so this measures whether instruction
    # cuts pay on the H200, not a merge
    WD_FORMATS="nvfp4 nvfp4_separate int8_asym_per_token_head q4_0 kivi_2bit kivi_4bit"
    git apply --check benchmarks/pending/write-fast-div.patch 2>/dev/null \
      || { echo "write-fast-div.patch no longer applies to main (s47 found it stale): rebase it first" >&2; exit 1; }
    variant write-fast-div "KEEP: tl.constexpr" $WD_FORMATS || exit 1
    WD_TIMED="nvfp4 int8_asym_per_token_head q4_0"
    timeout 60 python3 benchmarks/time_writes.py $WD_TIMED --tokens 32768 --rounds 2 2>&1 \
      | tee "$out/writediv_shipped.txt" | grep "^|"
    (cd /tmp/var && PYTHONPATH=/tmp/site:/tmp/varroot timeout 60 python3 benchmarks/time_writes.py $WD_TIMED \
      --tokens 32768 --rounds 2 2>&1 | tee "$out/writediv_variant.txt" | grep "^|")
    (cd /tmp/var && PYTHONPATH=/tmp/site:/tmp/varroot timeout 80 python3 benchmarks/profile_decode.py --write \
      --formats nvfp4 int8_asym_per_token_head --out "$out/writeprof_variant" 2>&1 \
      | tee "$out/writeprof_variant.txt" | grep "^|")
    ;;
  rcpfault)
    # recip_fast's fault in nvfp4's write (s41: the PTX and SASS compiled here without a GPU read correct): the
    # reproducer, the ptxas the machine's Triton runs, and the faulty kernel's PTX / cubin from Triton's cache, to
    # diff against `python benchmarks/sass_count.py --write --input fp32 --dump DIR nvfp4` with the edit applied
    echo "TRITON_PTXAS_PATH=${TRITON_PTXAS_PATH:-unset}"; "${TRITON_PTXAS_PATH:-$(python3 -c 'import os, triton; \
      print(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas"))')}" --version | tail -2
    export TRITON_CACHE_DIR=/tmp/rcpcache && rm -rf /tmp/rcpcache
    timeout 200 python3 benchmarks/pending/recip_fast_fault.py 2>&1 | tee "$out/rcpfault.txt"
    mkdir -p "$out/rcpcache" && find /tmp/rcpcache -name "reshape_and_cache_kernel.*" \( -name "*.ptx" -o -name \
      "*.cubin" \) -exec cp --backup=numbered {} "$out/rcpcache/" \;
    ;;
  writes)
    timeout 250 python3 benchmarks/write_state.py nvfp4 kivi_2bit fp8_e4m3 --states nothing copy --graph-nodes 2>&1 \
      | tee "$out/write_graph_nodes.txt" | tail -30
    timeout 200 python3 benchmarks/profile_decode.py --write --formats kivi_2bit nvfp4 --out "$out/writes" 2>&1 \
      | tee "$out/write_profile.txt" | grep "^|"
    ;;
  *)
    echo "unknown step '$step': verify, tests, tests2, bench1, bench2, bench3, crossover, crossover2, writes, writeprof, kivitiles, int4more, writeab or rcpfault" >&2
    exit 2
    ;;
esac
echo "step $step took $(( $(date +%s) - start )) s"
