"""Scan the shipped formats' kernels for the Triton 3.6 reduction miscompile of pending/reduce_lanes_fault.py (sm_90,
static; the CPU test suite runs it on the write kernels at head size 32, tests/test_benchmark_scripts.py).

The fault: a tt.reduce whose operand layout puts the reduced axis on lane bits that are not the low contiguous ones
(lane bases [[16, 0], [0, 4], [0, 8], [0, 16], [1, 0]], axis 0: lane bits 0 and 4) is lowered to butterfly shuffles
over the wrong lane masks (1 and 2 instead of 1 and 16), so the result is silently wrong. This script checks every
tt.reduce of the kernels as the runtime launches them, two ways:

  * PTX check (the verdict): the reduction needs a butterfly shuffle over lane mask 1 << i for every lane basis i with
    a nonzero component along the reduced axis (the operand's layout turned into a linear layout by Triton's own
    code, so #blocked, #mma, #slice and #linear operands all count). The shfl.sync.bfly instructions of the PTX are
    attributed to a reduction through their .loc line info: a shuffle belongs to the tt.reduce whose location chain
    (file:line:col, inlined call sites included) is a suffix of the shuffle's chain. BAD where a needed mask is
    missing, or where the reduction's shuffles use a mask that is neither needed nor a cross-warp stage's (masks
    below the number of warps along the axis, when the axis spans warps). NO-SHFL where masks are needed and no
    shuffle was attributed (e.g. redux.sync or lost line info; not seen so far).
  * layout rule (informational): "IRREGULAR" where the axis spans 2+ lane bits that are not contiguous in order (the
    fault's signature: bits 0 and 4), "high" where they are contiguous in order but not the lowest (e.g. bits 2, 3,
    4 of a blocked layout reducing its outer dimension, which the compiler gets right). The rule alone over-flags;
    the PTX check says whether the compiler got a flagged case right.

Kernels, each captured from the runtime's own launch (benchmarks/sass_count.py's stubbing and Triton's binder, so
constexprs, tile options and argument specialisation are the real ones), for head sizes 32, 64, 128, 256:
  * reshape_and_cache_kernel (Format.write, 4096 tokens, 8 KV heads, block 16), bf16 and fp32 inputs;
  * KIVI's kivi_flush_kernel and kivi_residual_kernel (Format.write of a 32768-token prefill of one sequence, and of a
    decode step: one new token on each of 64 sequences of 8192), bf16 and fp32 inputs;
  * paged_attention_kernel (and reduce_splits_kernel where it is launched) for decode at 64 x 8192, 32 query heads
    over 8 KV heads, bf16 queries, dot_precision "auto" (sass_count.py's shape).

    PYTHONPATH=<dir with a kvgen symlink> python benchmarks/reduce_lanes_scan.py [FORMAT ...]
        [--heads 32,64] [--kinds write,stream,decode] [--inputs bf16,fp32] [-v]

    python benchmarks/reduce_lanes_scan.py --selftest   # reduce_lanes_fault.py's kernel: BAD at C = 32

Prints one line per (format, kernel, shape) with the verdict ("= LABEL": the same compiled kernel as an earlier
shape) and, for any reduction that is flagged (or all, -v), its operand layout's lane bases along the axis, the masks
it needs and the masks found. Exit 1 where any BAD / NO-SHFL / compile error. About 5 minutes cold on 2 CPU cores
(Triton's cache makes reruns about 2).

Limits: the set of masks per reduction is compared, not which registers are paired (a shuffle over the right mask
of the wrong value goes unseen); reductions sharing one source location (the compiler rematerialising a reduce in a
second layout) are pooled and compared with the union of what they need and allow; a wrong extra mask that equals an
allowed cross-warp mask goes unseen (a missing needed mask never does). Shapes not covered: prefill / chunked
attention (q_len > 1), dot_precision "quantized" / "fast", dequantize_first's dequantize_kernel, fp16 inputs, tile
overrides (tune_tiles.py), head sizes other than 32/64/128/256, KV-head counts, block sizes and token counts other
than the ones above.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import traceback

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sass_count
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "pending"))  # reduce_lanes_fault (--selftest)

import torch  # noqa: E402
import triton  # noqa: E402
import triton._C.libtriton as libtriton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

import kvgen  # noqa: E402
import sass_count as sc  # noqa: E402  (benchmarks/sass_count.py: the launch capture)

HEADS = (32, 64, 128, 256)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# ---------------------------------------------------------------------------------------------------------------
# captures: {label: (jit function, args, kwargs)} of the launches the runtime makes
# ---------------------------------------------------------------------------------------------------------------
def capture_write(fmt, head: int, dtype) -> dict:
    got = sc.write_launches(fmt, 4096, dtype, head)
    return {n: got[n] for n in ("reshape_and_cache_kernel",) if n in got}


def capture_stream(fmt, head: int, dtype, seqs: int, tokens: int, ctx: int) -> dict:
    got = sc.stream_launches(fmt, seqs, tokens, ctx, head, dtype)
    return {n: got[n] for n in ("kivi_flush_kernel", "kivi_residual_kernel") if n in got}


def capture_decode(fmt, head: int) -> dict:
    """sass_count.runtime_source's capture (decode at 64 x 8192), every kernel Format.attend launches."""
    res = fmt.layout.RESIDUAL
    args, kw = sc.attention_call(fmt, 64, 8192, res["group"] if res else 16, 1, head)
    got = sc._captured(fmt, lambda: fmt.attend(*args, dot_precision="auto", **kw))
    return {n: got[n] for n in ("paged_attention_kernel", "reduce_splits_kernel") if n in got}


# ---------------------------------------------------------------------------------------------------------------
# analysis of one compiled kernel
# ---------------------------------------------------------------------------------------------------------------
_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = libtriton.ir.context()
        libtriton.ir.load_dialects(_CTX)
        libtriton.nvidia.load_dialects(_CTX)
    return _CTX


def _loc_table(ttgir: str) -> dict:
    return dict(re.findall(r"^(#loc\d*) = loc\((.*)\)\s*$", ttgir, re.M))


def _frames(loc: str, table: dict, depth: int = 0) -> list:
    """A location as [(file basename, line, col), ...], innermost first (call sites after their callee)."""
    loc = loc.strip()
    if depth > 64:
        return []
    if loc.startswith("#loc"):
        return _frames(table.get(loc, "unknown"), table, depth + 1)
    if loc.startswith("loc(") and loc.endswith(")"):
        return _frames(loc[4:-1], table, depth + 1)
    m = re.fullmatch(r"callsite\((\S+) at (\S+)\)", loc)
    if m:
        return _frames(m.group(1), table, depth + 1) + _frames(m.group(2), table, depth + 1)
    m = re.fullmatch(r'"([^"]*)":(\d+):(\d+)', loc)
    if m:
        return [(os.path.basename(m.group(1)), int(m.group(2)), int(m.group(3)))]
    m = re.fullmatch(r'"[^"]*"\((.*)\)', loc)  # a name location: "x"(#loc12)
    if m:
        return _frames(m.group(1), table, depth + 1)
    return []  # unknown, fused: no attribution


def reductions(ttgir: str) -> list:
    """Every tt.reduce: dict(axis, shape, frames, lanes, warps), lanes/warps: the operand's linear-layout bases."""
    table = _loc_table(ttgir)
    found = []
    for m in re.finditer(r'"tt\.reduce"\(([^)]*)\) <\{axis = (\d+) : i32\}>', ttgir):
        tail = re.compile(r"^\s*\}\) : \((.*?)\) -> .* loc\((#loc\d*|.*?)\)\s*$", re.M).search(ttgir, m.end())
        shape = [int(s) for s in re.match(r"tensor<([\dx]+)x[a-z]", tail.group(1)).group(1).split("x")]
        found.append(dict(axis=int(m.group(2)), shape=shape, frames=_frames(tail.group(2), table)))
    # the operands' layouts, through Triton's own conversion to linear layouts (walk order = text order)
    ctx = _context()
    builder = libtriton.gluon_ir.GluonOpBuilder(ctx)
    layouts = []

    def visit(op):
        if op.get_name() == "tt.reduce":
            layouts.append(builder.get_gluon_layout_from_tensor(op.get_operand(0)))

    with tempfile.NamedTemporaryFile("w", suffix=".ttgir") as f:
        f.write(ttgir)
        f.flush()
        module = libtriton.ir.parse_mlir_module(f.name, ctx)
        module.context = ctx
        module.walk(visit)
    assert len(layouts) == len(found), (len(layouts), len(found))
    for r, layout in zip(found, layouts):
        if not hasattr(layout, "lane_bases"):
            layout = builder.to_linear_layout(layout._to_ir(builder), r["shape"])
        r["lanes"], r["warps"] = [list(b) for b in layout.lane_bases], [list(b) for b in layout.warp_bases]
    return found


def shuffles(ptx: str) -> list:
    """[(frames of the .loc in force, butterfly mask)] of every shfl.sync.bfly in the PTX."""
    out, frames = [], []
    for line in ptx.splitlines():
        if re.match(r"\s*\.loc\s", line):
            comment = line.split("//", 1)[1] if "//" in line else ""
            frames = [(f, int(a), int(b)) for f, a, b in re.findall(r"([^\s@\[\]]+):(\d+):(\d+)", comment)]
        m = re.search(r"shfl\.sync\.bfly\.b32\s+\S+,\s*\S+,\s*(\d+)", line)
        if m:
            out.append((frames, int(m.group(1))))
    return out


def rule_flag(bits: list, comps: list) -> str:
    """The layout rule: "IRREGULAR" where the axis spans 2+ lane bits that are not contiguous with increasing steps
    (the fault's bits 0 and 4), "high" where they are contiguous and in order but not from lane bit 0 (a plain
    blocked layout reducing its outer dimension; compiled right so far), else ""."""
    if len(bits) < 2:
        return ""
    if bits != list(range(bits[0], bits[0] + len(bits))) or comps != sorted(comps):
        return "IRREGULAR"
    return "high" if bits[0] else ""


def check(ttgir: str, ptx: str) -> list:
    """One dict per tt.reduce: what it needs, what the PTX has, the verdict."""
    reds, shfl = reductions(ttgir), shuffles(ptx)
    claimed = [None] * len(shfl)
    for i, r in enumerate(reds):  # the longest matching chain claims a shuffle
        n = len(r["frames"])
        for j, (frames, _) in enumerate(shfl):
            if n and frames[-n:] == r["frames"] and (claimed[j] is None or len(reds[claimed[j]]["frames"]) < n):
                claimed[j] = i
    for r in reds:
        ax = r["axis"]
        r["bits"] = [b for b, v in enumerate(r["lanes"]) if v[ax]]
        r["need"] = {1 << b for b in r["bits"]}
        warps_axis = 1 << sum(1 for v in r["warps"] if v[ax])
        r["cross"] = {1 << k for k in range(warps_axis.bit_length() - 1)}  # a cross-warp stage's masks, if any
    for i, r in enumerate(reds):
        bits, need, cross = r["bits"], r["need"], r["cross"]
        comps = [r["lanes"][b][r["axis"]] for b in bits]
        # reductions sharing a location (e.g. one the compiler rematerialised in a second layout): their shuffles
        # can't be told apart, so the group's shuffles are compared with the union of what the group needs / allows
        same = [k for k, red in enumerate(reds) if red["frames"] == r["frames"]]
        got = {mask for j, (_, mask) in enumerate(shfl) if claimed[j] in same}
        need_all = set().union(*(reds[k]["need"] for k in same))
        cross_all = set().union(*(reds[k]["cross"] for k in same))
        if not r["frames"]:
            verdict = "NO-LOC"
        elif need and not got:
            verdict = "NO-SHFL"
        elif not need_all <= got or got - need_all - cross_all:
            verdict = "BAD"
        else:
            verdict = "ok"
        r.update(bits=bits, comps=comps, need=sorted(need), got=sorted(got), cross=sorted(cross),
                 shared=len(same) > 1, rule=rule_flag(bits, comps), verdict=verdict)
    return reds


def compile_sm90(fn, args, kwargs):
    src, launch = sc._bound_source(fn, args, kwargs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=launch)


def selftest() -> int:
    """reduce_lanes_fault.py's kernel through check(): C = 32 must be BAD, C = 64 ok."""
    import reduce_lanes_fault as fault
    from triton.compiler import ASTSource

    failed = 0
    for C, want in ((32, "BAD"), (64, "ok")):
        src = ASTSource(fault.view_min_max, signature={"x_ptr": "*fp32", "lo_ptr": "*fp32", "hi_ptr": "*fp32",
                        "T": "constexpr", "C": "constexpr", "TB": "constexpr", "CV": "constexpr"},
                        constexprs={"T": 32, "C": C, "TB": 16, "CV": 4},
                        attrs={(i,): [["tt.divisibility", 16]] for i in range(3)})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
        got = [r["verdict"] for r in check(k.asm["ttgir"], k.asm["ptx"])]
        failed += got != [want, want]
        print(f"selftest C = {C}: {got} (want {want}): {'pass' if got == [want, want] else 'FAIL'}")
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------------------------
def jobs(names, heads, kinds, inputs):
    """(format, label, thunk -> {kernel: (args, kwargs)})"""
    for name in names:
        fmt = kvgen.load(name)
        stream = bool(fmt.layout.RESIDUAL)
        for head in heads:
            for dt in inputs:
                if "write" in kinds and not stream:
                    yield fmt, f"write {dt} h{head}", lambda f=fmt, h=head, d=DTYPES[dt]: capture_write(f, h, d)
                if "stream" in kinds and stream:
                    yield fmt, f"prefill-write {dt} h{head}", \
                        lambda f=fmt, h=head, d=DTYPES[dt]: capture_stream(f, h, d, 1, 32768, 32768)
                    yield fmt, f"decode-write {dt} h{head}", \
                        lambda f=fmt, h=head, d=DTYPES[dt]: capture_stream(f, h, d, 64, 1, 8192)
            if "decode" in kinds:
                yield fmt, f"decode bf16 h{head}", lambda f=fmt, h=head: capture_decode(f, h)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("formats", nargs="*")
    ap.add_argument("--heads", default=",".join(map(str, HEADS)))
    ap.add_argument("--kinds", default="write,stream,decode")
    ap.add_argument("--inputs", default="bf16,fp32")
    ap.add_argument("-v", "--verbose", action="store_true", help="every reduction, not only the flagged ones")
    ap.add_argument("--selftest", action="store_true", help="only check that reduce_lanes_fault.py's kernel is BAD "
                    "at C = 32 and ok at C = 64")
    a = ap.parse_args()
    names = a.formats or kvgen.shipped_names()
    heads = [int(h) for h in a.heads.split(",")]
    if a.selftest:
        return selftest()
    totals = {"BAD": 0, "ok": 0, "NO-SHFL": 0, "NO-LOC": 0, "IRREGULAR": 0, "high": 0, "errors": 0}
    seen = {}
    for fmt, label, thunk in jobs(names, heads, a.kinds.split(","), a.inputs.split(",")):
        try:
            launches = thunk()
        except Exception as exc:  # a shape the format rejects
            print(f"{fmt.name:32s} {label:26s} skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
            continue
        for kname, (args, kwargs) in launches.items():
            try:
                k = compile_sm90(getattr(fmt._kernels.module, kname), args, kwargs)
                if k.hash in seen:  # same compiled kernel as an earlier shape
                    print(f"{fmt.name:32s} {label:26s} {kname:24s} = {seen[k.hash]}")
                    continue
                seen[k.hash] = label
                reds = check(k.asm["ttgir"], k.asm["ptx"])
            except Exception:
                totals["errors"] += 1
                print(f"{fmt.name:32s} {label:26s} {kname:24s} ERROR\n{traceback.format_exc()}")
                continue
            worst = [r for r in reds if r["verdict"] != "ok"]
            for r in reds:
                totals[r["verdict"]] += 1
                totals[r["rule"]] = totals.get(r["rule"], 0) + bool(r["rule"])
            rules = [r["rule"] for r in reds if r["rule"]]
            summary = (f"{len(reds)} reductions: " + ("all ok" if not worst else
                       ", ".join(sorted({r['verdict'] for r in worst}))) +
                       "".join(f"; layout rule {k} on {rules.count(k)}" for k in sorted(set(rules))))
            print(f"{fmt.name:32s} {label:26s} {kname:24s} {summary}", flush=True)
            for r in reds:
                if a.verbose or r["verdict"] != "ok" or r["rule"] == "IRREGULAR":
                    where = " <- ".join(f"{f}:{ln}" for f, ln, _ in r["frames"][:3])
                    print(f"    {r['verdict']:7s} {r['rule'] or '-':9s} axis {r['axis']} of "
                          f"{r['shape']}: lane bits {r['bits']} (steps {r['comps']}), need masks {r['need']}, PTX "
                          f"{r['got']}{' (cross-warp ' + str(r['cross']) + ')' if r['cross'] else ''}"
                          f"{' [shared loc]' if r['shared'] else ''}  lanes={r['lanes']}  @ {where}")
    print("totals (reductions; layout rule IRREGULAR / high; compile errors): "
          + ", ".join(f"{k} {v}" for k, v in totals.items() if k))
    return 1 if totals["BAD"] or totals["NO-SHFL"] or totals["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
