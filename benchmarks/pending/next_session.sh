#!/usr/bin/env bash
# The next GPU session's runs (benchmarks/pending/README.md, "The next GPU session"), one step per device call so
# that a machine taken back mid-session loses one step only. From the repository root on the lent H200, after
# `source benchmarks/device_env.sh`; outputs go to $OUT (the device tool's folder), each step's also to stdout.
#
#   bash benchmarks/pending/next_session.sh tests      # the GPU test list on this tree (~250 s)
#   bash benchmarks/pending/next_session.sh scalewords # scale-words.patch: its GPU tests, then its A/B at head size 64
#   bash benchmarks/pending/next_session.sh cells      # profiles: the inline-scale cells converted first / 3 stages
#   bash benchmarks/pending/next_session.sh hs64prof   # profiles at head size 64 (mxfp8, int8 per token-head, bf16)
#   bash benchmarks/pending/next_session.sh writes     # the pooled-state write graphs, KIVI's flush profile
#   bash benchmarks/pending/next_session.sh hs256      # head size 256 (never swept): tiles without spills
#   bash benchmarks/pending/next_session.sh prefill    # chunked prefill's tiles (never swept per format)
#
# Steps in priority order; each prints how long it took.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
step=${1:?"a step: tests, scalewords, cells, hs64prof, writes, hs256 or prefill"}
start=$(date +%s)
case "$step" in
  tests)
    timeout 560 python3 -m pytest -q -n 16 -p no:cacheprovider tests/test_tiles.py tests/test_attention_plan.py \
      tests/test_launch.py tests/test_quantized_domain.py tests/test_fast_dots.py tests/test_golden.py \
      tests/test_random_specs.py tests/test_kivi.py tests/test_kivi_reference.py tests/test_dot_operand.py \
      tests/test_alignment.py "tests/test_conformance.py::test_long_decode_many_tiles" 2>&1 | tee "$out/tests.txt" | tail -15
    ;;
  scalewords)
    # block scale rows under 4 bytes read as aligned words (mxfp8 / mxfp4 at head size 64): a copy of this tree with
    # the patch, its GPU tests there, then its kernels against the shipped ones
    rm -rf .ab/sw && mkdir -p .ab/sw && tar --exclude=./.ab --exclude=./.git -cf - . | tar -x -C .ab/sw
    # (from the root: `git apply` inside a repository's subfolder skips paths outside it without a word)
    git apply --directory=.ab/sw benchmarks/pending/scale-words.patch \
      || patch -d .ab/sw -p1 -s < benchmarks/pending/scale-words.patch || exit 1
    grep -q "_sword = " .ab/sw/generated/mxfp8/kernels.py || { echo "scale-words.patch did not apply" >&2; exit 1; }
    mkdir -p /tmp/kvroot_sw && ln -sfn "$PWD/.ab/sw" /tmp/kvroot_sw/kvgen
    (cd .ab/sw && PYTHONPATH=/tmp/site:/tmp/kvroot_sw timeout 300 python3 -m pytest -q -n 16 -p no:cacheprovider \
      tests/test_scale_words.py tests/test_golden.py tests/test_conformance.py tests/test_random_specs.py \
      -k "mxfp or nvfp4 or q8_0 or q4_0 or narrow or random" > "$out/scalewords_tests.txt" 2>&1)
    rc=$?
    tail -4 "$out/scalewords_tests.txt"
    [ "$rc" -eq 0 ] || { echo "scale-words.patch: GPU tests failed (rc $rc); no A/B" >&2; exit 1; }
    timeout 250 python3 benchmarks/variant_ab.py .ab/sw/generated mxfp8 mxfp4 --configs rt 128/4/3/168p \
      --shapes 64x8192hs64 4x65536hs64 2>&1 | tee "$out/scalewords_ab.txt" | grep "^|"
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
    timeout 400 python3 benchmarks/profile_decode.py --formats bf16 mxfp8 int8_per_token_head fp8_e4m3 \
      --shape 64x8192hs64 --out "$out/hs64prof" 2>&1 | tee "$out/hs64prof.txt" | grep "^|"
    ;;
  writes)
    timeout 250 python3 benchmarks/write_state.py nvfp4 kivi_2bit fp8_e4m3 --states nothing copy --graph-nodes 2>&1 \
      | tee "$out/write_graph_nodes.txt" | tail -30
    timeout 200 python3 benchmarks/profile_decode.py --write --formats kivi_2bit nvfp4 --out "$out/writes" 2>&1 \
      | tee "$out/write_profile.txt" | grep "^|"
    ;;
  hs256)
    # head size 256 takes the head-128 rules untimed; statically fp8 / int8 spill under the 168-register cap there
    # and mxfp8 spills at 255 registers with one operand loaded plainly (pending/README.md)
    timeout 500 python3 benchmarks/tune_tiles.py bf16 fp8_e4m3 int8_per_token_head_separate int8_per_token_head \
      mxfp8 nvfp4 mxfp4 int4_per_token_head --configs rt 64/4/3p 64/4/2p 128/8/2p 64/8/2p --shapes 16x8192hs256 \
      --cuda-graphs 2>&1 | tee "$out/hs256_tiles.txt" | grep "^|"
    ;;
  prefill)
    # bench.py's chunked prefill (4 x 2048 new on 8192) with other tiles: the formats slower than bf16 there
    timeout 550 python3 benchmarks/tune_tiles.py bf16 int8_per_token_head_separate nvfp4 fp8_per_token_head \
      int8_per_token_head mxfp8 mxfp4 --configs rt 64/4/3 128/4/3 64/4/2 128/4/2 --shapes 4x8192q2048 \
      --cuda-graphs 2>&1 | tee "$out/prefill_tiles.txt" | grep "^|"
    ;;
  *)
    echo "unknown step '$step': tests, scalewords, cells, hs64prof, writes, hs256 or prefill" >&2
    exit 2
    ;;
esac
echo "step $step took $(( $(date +%s) - start )) s"
