#!/usr/bin/env bash
# The next GPU session's runs (benchmarks/pending/README.md, "The next GPU session"), one step per device call so
# that a machine taken back mid-session loses one step only. From the repository root on the lent H200, after
# `source benchmarks/device_env.sh`; outputs go to $OUT (the device tool's folder), each step's also to stdout.
#
#   bash benchmarks/pending/next_session.sh tests      # the GPU test list on this tree (~250 s)
#   bash benchmarks/pending/next_session.sh hs256c     # head size 256 with the values converted first (~400 s)
#   bash benchmarks/pending/next_session.sh prefill128 # chunked prefill at 128 query rows per program (~450 s)
#   bash benchmarks/pending/next_session.sh bench1     # bench.py, every format, first half (~200 s)
#   bash benchmarks/pending/next_session.sh bench2     # bench.py, second half (~300 s)
#   bash benchmarks/pending/next_session.sh hs256more  # head size 256 for the formats not swept there yet (~450 s)
#   bash benchmarks/pending/next_session.sh cells      # profiles: the inline-scale cells converted first / 3 stages
#   bash benchmarks/pending/next_session.sh hs64prof   # profiles at head size 64 (int8 / fp8 per token-head, bf16)
#   bash benchmarks/pending/next_session.sh writes     # the pooled-state write graphs, KIVI's flush profile
#
# Steps in priority order; each prints how long it took.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
step=${1:?"a step: tests, hs256c, prefill128, bench1, bench2, hs256more, cells, hs64prof or writes"}
start=$(date +%s)
case "$step" in
  tests)
    timeout 560 python3 -m pytest -q -n 16 -p no:cacheprovider tests/test_tiles.py tests/test_attention_plan.py \
      tests/test_launch.py tests/test_quantized_domain.py tests/test_fast_dots.py tests/test_golden.py \
      tests/test_random_specs.py tests/test_kivi.py tests/test_kivi_reference.py tests/test_dot_operand.py \
      tests/test_alignment.py tests/test_scale_words.py "tests/test_conformance.py::test_long_decode_many_tiles" \
      2>&1 | tee "$out/tests.txt" | tail -15
    ;;
  hs256c)
    # head size 256 with the values converted first (CONVERT_FIRST_MAX_HEAD keeps it to 128; static counts of the
    # twenty-sixth session: at 64 positions per step the staging buffer leaves 2-3 programs per SM, fp8 17.4 -> 12.3
    # instructions per position without spills, mxfp8 32.9 -> 26.2 with no plain code loads). A faster "c" config
    # becomes its rule with convert_first=True (runtime.kernels.ATTENTION_TILES)
    timeout 550 python3 benchmarks/tune_tiles.py bf16 fp8_e4m3 int8_per_token_head_separate mxfp8 nvfp4 mxfp4 \
      int4_per_token_head --configs rt 64/4/2pc 64/4/2/168pc 128/4/2pc 64/4/2/255pc --shapes 16x8192hs256 \
      4x65536hs256 --cuda-graphs 2>&1 | tee "$out/hs256c.txt" | grep "^|"
    ;;
  prefill128)
    # kvgen.runtime.kernels.PREFILL_ROWS = 128 on 8 warps (static: each KV tile dequantized once for twice the rows;
    # mxfp8 29% and nvfp4 22% fewer warp instructions per position and row): its GPU conformance first, then times
    # against the rules' 64-row programs
    timeout 200 python3 -m pytest -q -n 16 -p no:cacheprovider "tests/test_conformance.py::test_prefill_rows_128_conform" \
      > "$out/prefill128_tests.txt" 2>&1
    rc=$?
    tail -3 "$out/prefill128_tests.txt"
    [ "$rc" -eq 0 ] || { echo "128-row prefill: GPU tests failed (rc $rc); no timing" >&2; exit 1; }
    fmts="bf16 fp8_e4m3 int8_per_token_head_separate mxfp8 nvfp4 mxfp4 int4_per_token_head q4_0 q8_0 kivi_2bit"
    timeout 120 python3 benchmarks/tune_tiles.py $fmts --configs rt --shapes 4x8192q2048 --cuda-graphs 2>&1 \
      | tee "$out/prefill64.txt" | grep "^|"
    timeout 300 python3 benchmarks/tune_tiles.py $fmts --configs 128/8/2 128/8/2p 64/8/2 --prefill-rows 128 \
      --shapes 4x8192q2048 --cuda-graphs 2>&1 | tee "$out/prefill128.txt" | grep "^|"
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
    # the twenty-sixth session swept head size 256 for bf16, the 8-bit per-tensor / per-token / mxfp8 formats and
    # the 4-bit block / per-token-head ones at 16 x 8192; these are the rest (their rules untouched), then the formats
    # that took another's new rule untimed (int8 asym, mixed_k8_v4: int8 per token-head's) against their old tiles
    # (128/4/2/168 at 8 programs per SM), then the 4-bit ones at 4 x 65536
    timeout 330 python3 benchmarks/tune_tiles.py bf16 q4_0 q8_0 kivi_2bit kivi_4bit int8_per_token_head_hadamard_k \
      nvfp4_separate --configs rt 64/4/2 128/4/2p 64/4/2/255p --shapes 16x8192hs256 4x65536hs256 --cuda-graphs \
      2>&1 | tee "$out/hs256more.txt" | grep "^|"
    timeout 90 python3 benchmarks/tune_tiles.py int8_asym_per_token_head mixed_k8_v4 --configs rt 128/4/2/168 \
      --programs-per-sm 8 --shapes 16x8192hs256 4x65536hs256 --cuda-graphs 2>&1 | tee "$out/hs256old.txt" | grep "^|"
    timeout 60 python3 benchmarks/tune_tiles.py nvfp4 mxfp4 int4_per_token_head --configs rt --shapes 4x65536hs256 \
      --cuda-graphs 2>&1 | tee "$out/hs256_4bit.txt" | grep "^|"
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
    echo "unknown step '$step': tests, hs256c, prefill128, bench1, bench2, hs256more, cells, hs64prof or writes" >&2
    exit 2
    ;;
esac
echo "step $step took $(( $(date +%s) - start )) s"
