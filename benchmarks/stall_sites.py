"""Where a decode kernel's warps stall: Nsight Compute's PC sampling per SASS instruction of one attention launch.

    python benchmarks/stall_sites.py --formats mixed_k8_v4 int8_per_token_head --out sites
    python benchmarks/stall_sites.py --formats int4_per_token_head --shape 64x8192hs64 --top 30

benchmarks/profile_decode.py says how long a warp waits per issued instruction and on what (short_scoreboard:
shared memory or MUFU results; long_scoreboard: global memory; mio_throttle: the memory-instruction queue full),
for the whole kernel. This script says at which instructions: it profiles the same launch (profile_decode.py's
child: bench.py's decode case, the third attention launch) with ncu's SourceCounters section, exports the source
page as SASS, and prints for each format

- the samples by stall reason (ncu's per-instruction stall_* columns summed, issued and not),
- the share at the copies' wait: the instruction after each `DEPBAR` (the barrier where a step waits for its
  asynchronous copies; a kernel bound by memory bandwidth spends its waits there),
- the samples summed by opcode (the instruction a warp was waiting to issue: for a scoreboard stall, the consumer
  of the late result, not its producer), and
- the instructions holding the most samples, each with its three largest reasons and the instruction before it.

The raw source CSV of every format is kept in --out (NAME_sass.csv) for a closer look.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_decode import find_ncu  # noqa: E402


def run_ncu(ncu: str, name: str, shape: str, out: Path, tiles: str | None) -> str | None:
    """The source page (SASS, CSV) of one launch of ``name``'s attention kernel, or None if ncu failed."""
    report = out / f"{name}.ncu-rep"
    child = [sys.executable, str(Path(__file__).resolve().parent / "profile_decode.py"), "--child", name,
             "--shape", shape] + (["--tiles", tiles] if tiles else [])
    collect = [ncu, "--clock-control", "none", "--kernel-name", "regex:paged_attention", "--launch-skip", "2",
               "--launch-count", "1", "--section", "SourceCounters", "--section", "WarpStateStats", "-f",
               "-o", str(report.with_suffix(""))] + child
    run = subprocess.run(collect, capture_output=True, text=True)
    if run.returncode != 0 or not report.exists():
        sys.stderr.write(f"{name}: ncu failed (rc {run.returncode})\n{run.stderr[-2000:]}\n{run.stdout[-2000:]}\n")
        return None
    export = subprocess.run([ncu, "-i", str(report), "--page", "source", "--print-source", "sass", "--csv"],
                            capture_output=True, text=True)
    if export.returncode != 0 or not export.stdout.strip():
        sys.stderr.write(f"{name}: ncu's export of {report} failed (kept)\n{export.stderr[-2000:]}\n")
        return None
    report.unlink()  # tens of MB; the CSV holds what this script reads
    (out / f"{name}_sass.csv").write_text(export.stdout)
    return export.stdout


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def parse(text: str) -> tuple[list[str], list[dict]]:
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "Source" in line and line.startswith('"')), None)
    if start is None:
        return [], []
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    return list(rows[0].keys()) if rows else [], rows


def opcode(source: str) -> str:
    """The opcode of a SASS line without its predicate ('@!P0 LDS.U8 R1, [R2]' -> 'LDS.U8')."""
    words = [w for w in source.split() if not w.startswith("@")]
    return words[0].rstrip(";") if words else ""


def report(name: str, text: str, top: int) -> None:
    columns, rows = parse(text)
    if not rows:
        print(f"\n## {name}: no source rows in ncu's export\n")
        return
    samples_col = next((c for c in columns if "Stall Sampling (All" in c), None) \
        or next((c for c in columns if "Sampling" in c), None)
    if samples_col is None:
        print(f"\n## {name}: no stall sampling column in ncu's export ({', '.join(columns)})\n")
        return
    # stall_<reason> counts every sample with that reason; "stall_<reason> (Not Issued)" the subset not issued
    reason_cols = [c for c in columns if c.startswith("stall_") and "Not Issued" not in c]
    total = sum(number(r[samples_col]) for r in rows) or 1.0
    print(f"\n## {name}\n\nstall samples {total:.0f}")
    reasons = collections.Counter({c[len("stall_"):]: sum(number(r[c]) for r in rows) for c in reason_cols})
    in_reasons = sum(reasons.values()) or 1.0
    if reasons:
        print("by reason: " + ", ".join(f"{k} {100 * v / in_reasons:.1f}%" for k, v in reasons.most_common(8)
                                        if v > 0))
    at_wait = sum(number(rows[i][samples_col]) for i in range(1, len(rows))
                  if opcode(rows[i - 1]["Source"]).startswith("DEPBAR"))
    print(f"at the copies' wait (the instruction after DEPBAR): {100 * at_wait / total:.1f}%")
    by_op = collections.Counter()
    for r in rows:
        by_op[opcode(r["Source"]).split(".")[0]] += number(r[samples_col])
    print("by opcode (the waiting instruction): "
          + ", ".join(f"{op} {100 * n / total:.1f}%" for op, n in by_op.most_common(12)) + "\n")
    print("| address | instruction | samples | reasons | previous instruction |")
    print("|---|---|---|---|---|")
    order = sorted(range(len(rows)), key=lambda i: -number(rows[i][samples_col]))
    for i in order[:top]:
        r = rows[i]
        largest = sorted(((number(r[c]), c[len("stall_"):]) for c in reason_cols), reverse=True)
        why = ", ".join(f"{c} {v:.0f}" for v, c in largest[:3] if v > 0)
        before = rows[i - 1]["Source"].strip() if i > 0 else ""
        address = r.get("# Address") or r.get("Address") or str(i)
        print(f"| {address} | `{r['Source'].strip()}` | {100 * number(r[samples_col]) / total:.1f}% | {why} "
              f"| `{before}` |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", required=True)
    ap.add_argument("--shape", default="64x8192", help="decode shape, profile_decode.py's notation")
    ap.add_argument("--tiles", default=None, help="attention's launch in tune_tiles.py's notation")
    ap.add_argument("--top", type=int, default=20, help="instructions listed per format")
    ap.add_argument("--out", default="stall_sites_out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ncu = find_ncu()
    print(f"ncu: {ncu}; decode {args.shape}; PC sampling of one launch per format", flush=True)
    failed = []
    for name in args.formats:
        text = run_ncu(ncu, name, args.shape, out, args.tiles)
        if text is None:
            failed.append(name)
            continue
        report(name, text, args.top)
        sys.stdout.flush()
    if failed:
        sys.stderr.write(f"stall_sites: no profile for {', '.join(failed)}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "0")
    sys.exit(main())
