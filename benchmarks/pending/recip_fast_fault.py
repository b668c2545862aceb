"""Reproducer of the fault that held nvfp4's scaled division back (fortieth and forty-first sessions; GPU only):
nvfp4's write with 1 / s' from ``recip_fast`` (inline ``rcp.approx.ftz.f32`` and one Newton step) instead of
``div_rn(1.0, s')`` saturates every e2m1 code on sm_90 (H100 and H200, triton 3.6.0), although the same helper on a
loaded 1-D tensor, and on the per-group tensors of q4_0's and KIVI's writes, gives the right reciprocals. For a
Triton upgrade: if the edit stops differing, recip_fast can take the per-group reciprocal again (it is cheaper).

From the repository root on a GPU (after `source benchmarks/device_env.sh`):

    python3 benchmarks/pending/recip_fast_fault.py

Each line: the edit of generated/nvfp4/kernels.py (restored afterwards) and scaled_debug.py's count of bytes
differing between the compiled write with its fast division (FAST_DIV) and without (div_rn per element). Not run
yet in this form: the forty-first session's scaled_variants.py, which it was cut from (a9b1d24), measured on an H100
0 with div_rn's reciprocal and 257400 (every code byte of 262144) with recip_fast's."""
import pathlib
import subprocess
import sys

path = pathlib.Path("generated/nvfp4/kernels.py")
base = path.read_text()
EDITS = {
    "main": [],
    "1 / s' by recip_fast": [("tl.math.div_rn(1.0, {p}_sn)", "recip_fast({p}_sn, True)")],
}
try:
    for name, edits in EDITS.items():
        text = base
        for old, new in edits:
            for p in ("k", "v"):
                assert old.format(p=p) in text, (name, old.format(p=p))
                text = text.replace(old.format(p=p), new.format(p=p))
        path.write_text(text)
        res = subprocess.run([sys.executable, "benchmarks/pending/scaled_debug.py", "1.0"], capture_output=True,
                             text=True)
        print(f"{name}: {(res.stdout.splitlines() or [res.stderr[-300:]])[0]}", flush=True)
finally:
    path.write_text(base)
