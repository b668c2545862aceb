#!/usr/bin/env bash
# Experiment (issue 5): decode time of a few formats with variants of the generated attention code, patched in place
# on a scratch copy. Variant "nocast": 8-bit codes loaded through the uint8 base pointer without a pointer cast;
# "tc": both products as bf16 tensor-core dots with fp32 accumulation instead of exact fp32 dots.
set -u
out=${OUT:-/tmp/out}
fmts="bf16 int8_per_token_head fp8_e4m3 nvfp4"
run() { python3 benchmarks/bench.py --no-sweep --formats $fmts --out "$out/$1" 2>&1 | grep -E "^\| .* decode" ; }
echo "== original"; run original
for f in $fmts; do sed -i 's/(\([kv]\)_row\[:, None\] + d\[None, :\] \* 1).to(tl.pointer_type(tl.uint8))/(\1_row[:, None] + d[None, :])/' generated/$f/kernels.py; done
echo "== nocast"; run nocast
for f in $fmts; do sed -i 's/tl.dot(q, tl.trans(k_tile), input_precision="ieee")/tl.dot(q.to(tl.bfloat16), tl.trans(k_tile.to(tl.bfloat16)))/; s/tl.dot(p, v_tile, input_precision="ieee")/tl.dot(p.to(tl.bfloat16), v_tile.to(tl.bfloat16))/' generated/$f/kernels.py; done
echo "== nocast+tc"; run nocast_tc
