"""recip_fast's fault in nvfp4's write (benchmarks/RESULTS.md, forty-first and forty-second sessions), narrowed: the
per-group reciprocal 1 / s' of generated/nvfp4/kernels.py taken several ways (the file is restored afterwards). For
each: scaled_debug.py's count of bytes differing between the compiled write with its fast division and div_rn per
element, its first differing bytes, and the write of 32768 tokens timed (time_writes.py, whatever its bytes: the
time says what a working cheaper reciprocal would be worth). GPU only, from the repository root:

    python3 benchmarks/pending/recip_variants.py
"""
import pathlib
import subprocess
import sys

path = pathlib.Path("generated/nvfp4/kernels.py")
base = path.read_text()
HELPERS = '''
@triton.jit
def rcp_noftz(s):  # rcp.approx without ftz, one Newton step
    r0 = tl.inline_asm_elementwise("rcp.approx.f32 $0, $1;", "=r,r", [s], dtype=tl.float32, is_pure=True, pack=1)
    return tl.fma(r0, tl.fma(-s, r0, 1.0), r0)


@triton.jit
def rcp_fcon(s):  # recip_fast's, with f32 register constraints
    r0 = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [s], dtype=tl.float32, is_pure=True, pack=1)
    return tl.fma(r0, tl.fma(-s, r0, 1.0), r0)


@triton.jit
def rcp_rn(s):  # the correctly rounded reciprocal, one PTX instruction
    return tl.inline_asm_elementwise("rcp.rn.f32 $0, $1;", "=r,r", [s], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def rcp_raw(s):  # rcp.approx alone
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [s], dtype=tl.float32, is_pure=True,
                                     pack=1)

'''
ANCHOR = "@triton.jit\ndef div_corrected("
SITE = "tl.math.div_rn(1.0, {p}_sn)"
EDITS = {
    "main (div_rn)": None,
    "recip_fast": "recip_fast({p}_sn, True)",
    "rcp.approx.f32 + Newton": "rcp_noftz({p}_sn)",
    "recip_fast, =f constraints": "rcp_fcon({p}_sn)",
    "rcp.rn.f32": "rcp_rn({p}_sn)",
    "rcp.approx.ftz alone": "rcp_raw({p}_sn)",
    "1.0 / s' (div.full)": "(1.0 / {p}_sn)",
}
try:
    for name, new in EDITS.items():
        text = base
        if new is not None:
            assert ANCHOR in text
            text = text.replace(ANCHOR, HELPERS.lstrip("\n") + "\n" + ANCHOR, 1)
            for p in ("k", "v"):
                assert SITE.format(p=p) in text, (name, p)
                text = text.replace(SITE.format(p=p), new.format(p=p))
        path.write_text(text)
        res = subprocess.run([sys.executable, "benchmarks/pending/scaled_debug.py", "1.0"], capture_output=True,
                             text=True)
        lines = res.stdout.splitlines() or [res.stderr[-400:]]
        print(f"## {name}: {lines[0]}", *lines[1:5], sep="\n", flush=True)
        res = subprocess.run([sys.executable, "benchmarks/time_writes.py", "nvfp4", "--tokens", "32768", "256",
                              "--rounds", "2"], capture_output=True, text=True)
        print(*(ln for ln in res.stdout.splitlines() if ln.startswith("| nvfp4")), res.stderr[-300:] if
              res.returncode else "", sep="\n", flush=True)
finally:
    path.write_text(base)
