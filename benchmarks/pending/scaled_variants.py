"""nvfp4-scaled-div.patch's fast path, edited one step at a time in /tmp/var's generated kernels (after
next_session.sh's `variant`), each edit checked with scaled_debug.py: which step makes every code saturate on the GPU.
Run from /tmp/var with PYTHONPATH=/tmp/site:/tmp/varroot."""
import pathlib
import subprocess
import sys

path = pathlib.Path("generated/nvfp4/kernels.py")
base = path.read_text()
EDITS = {
    "as patched": [],
    "div_rn reciprocal": [("recip_fast({p}_sn, True)", "tl.math.div_rn(1.0, {p}_sn)")],
    "int32 power of two": [("(0x7F000000 - ({p}_eff_g.to(tl.uint32, bitcast=True) & 0x7F800000)).to(tl.float32, "
                            "bitcast=True)", "((254 - (({p}_eff_g.to(tl.int32, bitcast=True) >> 23) & 255)) << 23)"
                            ".to(tl.float32, bitcast=True)")],
    "own sign": [("{p}_encode_signed({p}_v, x_{side})", "{p}_encode({p}_v)")],
    "div_rn quotient, signed encode": [("{p}_codes = {p}_encode_signed(",
                                        "{p}_v = tl.math.div_rn(x_{side}, {p}_eff)\n    {p}_codes = {p}_encode_signed(")],
    "no power of two (pw = 1)": [("{p}_sn = {p}_eff_g * {p}_pw", "{p}_pw = {p}_pw * 0.0 + 1.0\n        {p}_sn = {p}_eff_g")],
}
for name, edits in EDITS.items():
    text = base
    for old, new in edits:
        for p, side in (("k", "key"), ("v", "value")):
            o, n = old.format(p=p, side=side), new.format(p=p, side=side)
            assert o in text, (name, o)
            text = text.replace(o, n)
    path.write_text(text)
    res = subprocess.run([sys.executable, "benchmarks/pending/scaled_debug.py", "1.0"], capture_output=True, text=True)
    print(f"{name}: {(res.stdout.splitlines() or [res.stderr[-300:]])[0]}", flush=True)
path.write_text(base)
