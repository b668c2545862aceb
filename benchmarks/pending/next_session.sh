#!/usr/bin/env bash
# The next GPU session's runs (benchmarks/pending/README.md, "The next GPU session"), one step per device call so
# that a machine taken back mid-session loses one step only. From the repository root on the lent H200, after
# `source benchmarks/device_env.sh`; outputs go to $OUT (the device tool's folder), each step's also to stdout.
#
#   bash benchmarks/pending/next_session.sh tests      # the GPU test list on this tree (~250 s)
#   bash benchmarks/pending/next_session.sh layout     # the position-minor value patch against the shipped kernels
#   bash benchmarks/pending/next_session.sh fp8tiles   # fp8 / int8 separate tiles with more warps per SM
#   bash benchmarks/pending/next_session.sh hs64       # head size 64: the formats not swept there, then bench.py
#
# Steps in priority order; each prints how long it took.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
step=${1:?"a step: tests, layout, fp8tiles or hs64"}
start=$(date +%s)
case "$step" in
  tests)
    timeout 560 python3 -m pytest -q -n 16 -p no:cacheprovider tests/test_tiles.py tests/test_attention_plan.py \
      tests/test_launch.py tests/test_quantized_domain.py tests/test_fast_dots.py tests/test_golden.py \
      tests/test_random_specs.py tests/test_kivi.py tests/test_kivi_reference.py tests/test_dot_operand.py \
      tests/test_alignment.py "tests/test_conformance.py::test_long_decode_many_tiles" 2>&1 | tee "$out/tests.txt" | tail -15
    ;;
  layout)
    # values stored position-minor (hand-edited kernels: their outputs are not the formats', only their times count)
    rm -rf .ab/layout && mkdir -p .ab/layout/generated
    cp -r generated/fp8_e4m3 generated/int8_per_token_head_separate .ab/layout/generated/
    (cd .ab/layout && { git apply ../../benchmarks/pending/value-position-minor-static.patch 2>/dev/null \
      || patch -p1 < ../../benchmarks/pending/value-position-minor-static.patch; }) || exit 1
    timeout 280 python3 benchmarks/variant_ab.py .ab/layout/generated fp8_e4m3 int8_per_token_head_separate \
      --configs rt 128/4/3/168pn 128/4/3/128pn --shapes 64x8192 4x65536 2>&1 | tee "$out/layout.txt" | grep "^|"
    timeout 150 python3 benchmarks/variant_ab.py .ab/layout/generated int8_per_token_head_separate \
      --dot-precision quantized --configs rt 128/4/3/168pn --shapes 64x8192 4x65536 2>&1 \
      | tee "$out/layout_quantized.txt" | grep "^|"
    ;;
  fp8tiles)
    timeout 400 python3 benchmarks/tune_tiles.py fp8_e4m3 int8_per_token_head_separate --configs rt 64/4/3/168pc \
      64/4/4/168pc 128/8/3/128pc 128/8/2/128pc --shapes 64x8192 4x65536 256x1024 --cuda-graphs 2>&1 \
      | tee "$out/fp8tiles.txt" | grep "^|"
    ;;
  hs64)
    timeout 250 python3 benchmarks/tune_tiles.py mixed_k8_v4 int8_asym_per_token_head q4_0 q8_0 \
      int8_per_token_head_hadamard_k nvfp4_separate --configs rt 128/4/3/168p 128/4/2/128 --shapes 64x8192hs64 \
      --cuda-graphs 2>&1 | tee "$out/hs64_tiles.txt" | grep "^|"
    timeout 300 python3 benchmarks/bench.py --cuda-graphs --no-sweep --kinds decode --out "$out/bench_decode" \
      --formats bf16 fp8_e4m3 int8_per_token_head int8_per_token_head_separate fp8_per_token_head nvfp4 mxfp4 \
      int4_per_token_head mxfp8 2>&1 | grep "hs64"
    ;;
  *)
    echo "unknown step '$step': tests, layout, fp8tiles or hs64" >&2
    exit 2
    ;;
esac
echo "step $step took $(( $(date +%s) - start )) s"
