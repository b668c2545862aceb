#!/usr/bin/env bash
# Reproduces, on the lent H200 (after `source benchmarks/device_env.sh`), the illegal shared-memory address that
# KIVI's chunked prefill hits with tiles of 32 positions (twenty-ninth session; benchmarks/pending/README.md): each
# case runs in a process of its own (a CUDA error leaves the process's context unusable), and the first failing one
# again under compute-sanitizer, which names the kernel line.
#   bash benchmarks/pending/kivi_block32_crash.sh [FORMAT]     # kivi_2bit (default), kivi_4bit, or another format
# (pages of 32 positions for every format: KIVI's group; tune_tiles.py gives the others 16). About 20 s a case.
fmt=${1:-kivi_2bit}
case_py() {  # case_py CONFIG SHAPE: one attention call with the tiles forced; prints ok or the error
  cat <<PY
import argparse, sys; sys.path.insert(0, 'benchmarks'); import tune_tiles as T, bench, kvgen, torch
T.apply('$1'); (seqs, ctx, head, q), = bench.decode_shapes(argparse.ArgumentParser(), ['$2']).values()
fn, _ = bench.decode_case(kvgen.load('$fmt'), seqs, ctx, 32, head, q, graphs=False)
try:
    fn(); torch.cuda.synchronize(); print('ok')
except Exception as e:
    print(type(e).__name__, str(e).splitlines()[0])
PY
}
first=""
for c in "64/4/2 2x512q128" "32/4/2 4x8192" "32/4/2 1x128q128" "32/4/2 1x192q64" "32/4/2 1x512q128" \
         "32/8/2 1x512q128" "32/4/2 4x8192q2048hs256"; do
  set -- $c
  r=$(CUDA_LAUNCH_BLOCKING=1 timeout 120 python3 -c "$(case_py $1 $2)" 2>&1 | grep -v Warn | tail -1)
  r=${r:-"no output (timed out after 120 s?)"}
  echo "| $fmt | $1 | $2 | $r |"
  [ -z "$first" ] && [ "$r" != ok ] && first="$1 $2"
done
if [ -n "$first" ]; then
  set -- $first
  echo "compute-sanitizer on $first:"
  timeout 200 compute-sanitizer --tool memcheck --show-backtrace no --print-limit 2 python3 -c "$(case_py $1 $2)" \
    2>&1 | grep -v Warn | head -12
fi
