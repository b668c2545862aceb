# the padding writes (thirty-ninth session) timed against the tree of the device copy's HEAD, then their GPU tests.
# (The device's copy of .git held the session's first commit as HEAD, 19205e9 there, not the session's later
# commits: the base is that commit, whatever was committed since.)
out=${OUT:-/tmp/out}
rm -rf /tmp/base /tmp/baseroot && mkdir -p /tmp/base /tmp/baseroot && git archive HEAD | tar -x -C /tmp/base \
  && ln -sfn /tmp/base /tmp/baseroot/kvgen || exit 1
F="int8_asym_per_token_head int8_per_token_head q4_0 nvfp4 mxfp8 bf16"
for r in 1 2; do
  (cd /tmp/base && PYTHONPATH=/tmp/site:/tmp/baseroot timeout 90 python3 benchmarks/time_writes.py $F --tokens 32768 256 \
    --rounds 2 2>&1 | tee -a "$out/padding_base.txt" | grep "^|")
  timeout 90 python3 benchmarks/time_writes.py $F --tokens 32768 256 --rounds 2 2>&1 | tee -a "$out/padding_new.txt" \
    | grep "^|"
done
timeout 240 python3 -m pytest -q -n 16 -p no:cacheprovider tests/test_padding.py tests/test_golden.py \
  tests/test_numerics.py tests/test_write_plan.py tests/test_alignment.py 2>&1 | tee "$out/padding_tests.txt" | tail -4
