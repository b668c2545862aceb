"""Decode attention and reshape-and-cache speed of every shipped format on one GPU, against its copy bandwidth.

    python benchmarks/bench.py                      # every shipped format, the shapes of issue 5
    python benchmarks/bench.py --formats bf16 int8_per_token_head --out results

For each format: decode attention at 64 x 8192, 4 x 65536 and 256 x 1024 (32 query heads, 8 KV heads, head size
128, block size 16; KIVI formats need block 32), at 64 x 8192 also with head size 64 and with block size 64,
chunked prefill (a chunk of 2048 new tokens on each of 4 sequences of 8192, 8192 query tokens in all; the
quantized formats also through `dequantize_first`, planned, its ratio to bf16's own prefill), and
reshape-and-cache of 32768 and 256 tokens. Reported: median time
(triton.testing.do_bench), bytes moved (pages read, scales included; or input read + pages written), effective
bandwidth, its fraction of the device-to-device copy bandwidth measured in the same run, and the ratio to the bf16
format. A dense bf16 torch scaled_dot_product_attention is the reference line. Writes RESULTS.md-style markdown,
JSON, and a PNG of decode time against context length per format.

    python benchmarks/bench.py --cuda-graphs        # kvgen's calls timed as CUDA-graph replays

times each attention and write call captured in a CUDA graph, as engines run decode: what is left is the GPU's time
without the host's per-call launch work (attention at these shapes took the same time both ways on the H200, third
session of 2026-11-30; writes as graph replays: benchmarks/RESULTS.md, sixth session).

Every shipped format with the sweep takes a little over 10 minutes on the H200 (sixth session: cut at 575 s in
the last format's sweep), past the device tool's limit per command: split the formats over two runs. The results
files are rewritten after each format, so a run cut short keeps what it finished; each row and sweep is also
printed as it is measured. `--replot A/results.json B/results.json --out DIR` merges such runs into one table
and chart.

The chart's sweep (4 sequences) always times CUDA-graph replays: at short contexts an eager call's host work (80-95
us on the H200) outlasts the kernel, and do_bench would time the host (seventh session of 2026-11-30: bf16 and fp8
at 4096 tokens differed 2x between runs of one kernel).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import re
import sys
import warnings
from pathlib import Path

import torch


import kvgen  # noqa: E402
from kvgen.runtime.dequantize import DENSE_FORMATS  # noqa: E402
from kvgen.runtime.kernels import DOT_PRECISIONS  # noqa: E402

DECODE_SHAPES = [(64, 8192), (4, 65536), (256, 1024)]
# (label, sequences, context, head size, block size or None for the format's default)
EXTRA_DECODE = [("64x8192 hs64", 64, 8192, 64, None), ("64x8192 bs64", 64, 8192, 128, 64)]
PREFILL = (4, 8192, 2048)  # sequences, context, new tokens per sequence
DEQUANTIZE_FIRST = ", dequantize-first"  # the shape label's suffix of a prefill run through dequantize_first
SWEEP = [1024, 4096, 16384, 65536]  # context lengths of the chart (4 sequences)
HQ, HKV, D = 32, 8, 128
DOT = "auto"  # --dot-precision
GRAPHS = False  # --cuda-graphs


def capture(fn, debug: bool = False) -> "torch.cuda.CUDAGraph":
    """``fn`` captured in a CUDA graph after warm-up calls on a side stream (which compile); ``debug``: with the
    graph's debug mode on (its ``debug_dump`` then writes the nodes as DOT)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    if debug:
        graph.enable_debug_mode()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graphed(fn):
    """``fn`` captured in a CUDA graph (capture): its replay is what an engine that captures decode in graphs pays
    per step, without the host-side launch cost."""
    return capture(fn).replay


def decode_shapes(parser: argparse.ArgumentParser, shapes: list, option: str = "--shapes") -> dict:
    """Attention shapes as the tuning scripts take them: SEQSxCONTEXT, then optionally qN (N new query tokens per
    sequence, the last N of its context: a chunked prefill; else 1, decode) and hsN (head size; else D), e.g.
    64x8192, 64x8192hs64, 4x8192q2048. Each text -> (sequences, context, head size, new tokens). A shape outside
    that syntax ends the script with its text."""
    parsed = {}
    for shape in shapes:
        m = re.fullmatch(r"([1-9]\d*)x([1-9]\d*)(?:q([1-9]\d*))?(?:hs([1-9]\d*))?", shape)
        if m is None or int(m[3] or 1) > int(m[2]):
            parser.error(f"{option}: {shape!r} is not SEQSxCONTEXT[qNEW][hsHEAD] with NEW <= CONTEXT (e.g. 64x8192, "
                         "64x8192hs64, 4x8192q2048)")
        parsed[shape] = int(m[1]), int(m[2]), int(m[4] or D), int(m[3] or 1)
    return parsed


def require_gpu(parser: argparse.ArgumentParser) -> None:
    """Exit with a clear message where there is no CUDA GPU: these scripts time kernels, which the CPU interpreter
    cannot (its times say nothing about a GPU's). ``benchmarks/sass_count.py`` counts instructions without one."""
    if not torch.cuda.is_available():
        parser.error("this script times kernels on a CUDA GPU, and torch sees none here (torch "
                     f"{torch.__version__}); `python benchmarks/sass_count.py` compiles the kernels for the H200 "
                     "and counts their instructions without a GPU")


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3  # seconds


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy of 2 GiB (read + write counted)."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src))
    return 2 * src.numel() / t


def fill_random(cache) -> None:
    """Random bytes in the pages (content does not change the time); static scales stay at their value."""
    for name, t in cache.tensors.items():
        if name.endswith("_cache") or name.endswith("_residual"):
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8,
                                                    device=t.device))


def write_real_codes(fmt, cache, table: torch.Tensor, ctx: int) -> None:
    """Replace a decode case's random bytes (which hold NaN codes and scales) with codes the format's write computes
    from random bf16 keys and values: every sequence of ``table`` (its rows) ``ctx`` tokens long, so outputs compare
    (benchmarks/variant_ab.py). Formats with a residual window (KIVI) write each sequence as one prefill, which
    leaves its newest tokens in the window as attention expects; the others write every slot."""
    heads, head_size = cache.num_kv_heads, cache.head_size
    dev = table.device
    if not fmt.spec.streaming:
        slots = cache.num_blocks * cache.block_size
        for lo in range(0, slots, 1 << 16):
            n = min(1 << 16, slots - lo)
            kv = torch.randn(2, n, heads, head_size, dtype=torch.bfloat16, device=dev)
            fmt.write(cache, kv[0], kv[1], torch.arange(lo, lo + n, device=dev))
        return
    t = torch.arange(ctx, device=dev)
    for s in range(table.shape[0]):
        kv = torch.randn(2, ctx, heads, head_size, dtype=torch.bfloat16, device=dev)
        slots = table[s, t // cache.block_size].long() * cache.block_size + t % cache.block_size
        fmt.write(cache, kv[0], kv[1], slots, seq_ids=torch.tensor([s], dtype=torch.int32, device=dev),
                  query_start_loc=torch.tensor([0, ctx], dtype=torch.int32, device=dev),
                  seq_lens=torch.tensor([ctx], dtype=torch.int32, device=dev), block_table=table[s:s + 1])


def decode_case(fmt, num_seqs: int, ctx: int, block_size: int, head_size: int = D, q_len: int = 1,
                planned: bool = False, graphs: bool | None = None, num_splits: int | None = None,
                dequantize_first: bool = False):
    """A cache holding num_seqs sequences of ctx tokens, and the arguments of one attention step with q_len new
    tokens per sequence (1: decode). ``planned``: the step as an engine runs it per layer, ``plan.run`` of a plan
    made once (Format.plan_attention). ``graphs``: time CUDA-graph replays (None: as --cuda-graphs says).
    ``num_splits``: the KV splits per program (None: the runtime's choice). ``dequantize_first``: through a dense
    bf16 cache (Format.attend's dequantize_first, sized by max_seq_len = ctx)."""
    torch.manual_seed(0)  # the same block table and bytes in every run: runs of one shape compare
    blocks_per_seq = math.ceil(ctx / block_size)
    num_blocks = num_seqs * blocks_per_seq
    extra = {"max_seqs": num_seqs} if fmt.spec.streaming else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(num_blocks, block_size, HKV, head_size, device="cuda", **extra)
    fill_random(cache)
    table = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).reshape(num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda") * q_len
    q = torch.randn(num_seqs * q_len, HQ, head_size, dtype=torch.bfloat16, device="cuda")
    kwargs = dict(max_query_len=q_len, dot_precision=fmt.runs_dot_precision(DOT), num_splits=num_splits)
    if dequantize_first:
        kwargs.update(dequantize_first=True, max_seq_len=ctx)
    if fmt.spec.streaming:
        kwargs["seq_ids"] = torch.arange(num_seqs, dtype=torch.int32, device="cuda")
    bytes_read = num_blocks * fmt.page_bytes(block_size, HKV, head_size)
    if fmt.spec.streaming:  # the residual rows read: positions >= Q(L)
        res = fmt.layout.RESIDUAL
        quantized = max(ctx - res["tokens"], 0) // res["group"] * res["group"]
        bytes_read = (num_seqs * (quantized // block_size) * fmt.page_bytes(block_size, HKV, head_size)
                      + num_seqs * (ctx - quantized) * HKV * head_size * 2 * cache.tensors["k_residual"].element_size())
    fn = lambda: fmt.attend(q, cache, table, seq_lens, qsl, **kwargs)  # noqa: E731
    fn.inputs = (q, cache, table, seq_lens, qsl, kwargs)  # for scripts that run other kernels on the same case
    if planned:  # planned on a cache of the same geometry, run on this one: as an engine's later layers run
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            first = fmt.allocate(num_blocks, block_size, HKV, head_size, device="cuda", **extra)
        plan = fmt.plan_attention(q, first, table, seq_lens, qsl, **kwargs)
        fn = lambda: plan.run(q, cache)  # noqa: E731
        fn.plan = plan  # for scripts that read the launch the runtime chose (tune_splits.py)
    return (graphed(fn) if (GRAPHS if graphs is None else graphs) else fn), bytes_read


def write_case(fmt, num_tokens: int, block_size: int, release_pool: bool = True, planned: bool = False,
               ordered_slots: bool = False, flushing: bool = False):
    """reshape_and_cache of num_tokens tokens (KIVI: one prefill of that many tokens, or that many decode steps;
    ``flushing``: a decode step of num_tokens sequences whose new token makes each flush a group, G - 1 of its
    tokens read back from the residual ring).
    ``planned``: the write as an engine runs it per layer, ``plan.run`` of a plan made once (Format.plan_write).
    ``ordered_slots``: paged formats' tokens at slots 0, 1, 2, ... (a prefill into consecutive blocks) instead of
    the default random permutation of the cache's slots (the case every figure here was measured on).

    ``release_pool``: hand the blocks torch's caching allocator holds back to the driver first. On the H200 a write
    first loaded while the pool held freed blocks ran slower as CUDA-graph replays for the rest of the process, up
    to 2.1x (nvfp4 at 32768 tokens: 198-203 against 91-95 us after bench.py's copy measurement, back-to-back replays
    too), where the tensors' own placement made no difference; launched eagerly it ran at 91 us, and Nsight Compute
    timed the slow graph's kernel node at 88 (benchmarks/write_state.py; RESULTS.md, twentieth and twenty-first
    sessions). Released, every write is timed in the state of a clean start."""
    if release_pool:
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    if flushing and not fmt.spec.streaming:
        raise ValueError(f"{fmt.spec.name}: only streaming (KIVI) formats flush")
    flush_len = fmt.layout.RESIDUAL["tokens"] + fmt.layout.RESIDUAL["group"] if flushing else 0
    num_blocks = ((math.ceil(flush_len / block_size) + 1) * num_tokens if flushing
                  else math.ceil(num_tokens / block_size) + 1)
    extra = {"max_seqs": max(num_tokens if num_tokens <= 256 or flushing else 1, 1)} if fmt.spec.streaming else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(num_blocks, block_size, HKV, D, device="cuda", **extra)
    key = torch.randn(num_tokens, HKV, D, dtype=torch.bfloat16, device="cuda")
    value = torch.randn_like(key)
    slots = (torch.arange(num_tokens, device="cuda") if ordered_slots
             else torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens]).to(torch.int64)
    cell = fmt.page_bytes(block_size, HKV, D) / block_size
    moved = 2 * key.numel() * key.element_size() + num_tokens * cell
    meta = {} if not fmt.spec.streaming else _write_sequences(num_tokens, block_size, num_blocks, flush_len)
    if meta:  # the slots the metadata gives the new tokens (write() checks them where the range checks run)
        slots = sequence_slots(meta, block_size)
    if planned:
        plan = fmt.plan_write(key, cache, slots, **meta)
        fn = lambda: plan.run(cache, key, value)  # noqa: E731
    else:
        fn = lambda: fmt.write(cache, key, value, slots, **meta)  # noqa: E731
    return (graphed(fn) if GRAPHS else fn), moved


def _write_sequences(num_tokens: int, block_size: int, num_blocks: int, flush_len: int = 0,
                     device: str = "cuda") -> dict:
    """A streaming format's write metadata: one sequence's prefill of num_tokens, or a decode step of that many
    (flush_len > 0: every sequence at that length after the step, the residual window plus one group, so each step's
    token flushes a group)."""
    if num_tokens > 256 and not flush_len:  # one sequence's prefill
        seqs, q_len = 1, num_tokens
    else:  # a decode step of num_tokens sequences
        seqs, q_len = num_tokens, 1
    length = flush_len or q_len
    per_seq = math.ceil(length / block_size) + 1
    table = torch.arange(seqs * per_seq, dtype=torch.int32, device=device).remainder(num_blocks).reshape(seqs, per_seq)
    return dict(seq_ids=torch.arange(seqs, dtype=torch.int32, device=device),
                query_start_loc=torch.arange(seqs + 1, dtype=torch.int32, device=device) * q_len,
                seq_lens=torch.full((seqs,), length, dtype=torch.int32, device=device), block_table=table,
                max_query_len=q_len)


def sequence_slots(meta: dict, block_size: int) -> torch.Tensor:
    """The slot_mapping of a streaming write's metadata: each sequence's new rows at positions seq_len - q_len + i,
    each at its block-table slot."""
    qsl, lens, table = meta["query_start_loc"].tolist(), meta["seq_lens"].tolist(), meta["block_table"]
    pos = torch.cat([torch.arange(n - (b - a), n, device=table.device)
                     for a, b, n in zip(qsl[:-1], qsl[1:], lens)])
    seq = torch.repeat_interleave(torch.arange(len(lens), device=table.device),
                                  torch.tensor([b - a for a, b in zip(qsl[:-1], qsl[1:])], device=table.device))
    return table[seq, pos // block_size].long() * block_size + pos % block_size


def sdpa_case(num_seqs: int, ctx: int, head_size: int = D, q_len: int = 1):
    k = torch.randn(num_seqs, HKV, ctx, head_size, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    q = torch.randn(num_seqs, HQ, q_len, head_size, dtype=torch.bfloat16, device="cuda")
    # the q_len queries are the last positions: causal with an offset, as a boolean mask
    mask = None if q_len == 1 else (torch.arange(ctx, device="cuda")[None, :]
                                    <= torch.arange(ctx - q_len, ctx, device="cuda")[:, None])
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # noqa: E731
    return fn, 2 * k.numel() * k.element_size()


def plot_sweep(sweep: dict, contexts: list, meta: dict, path: Path) -> None:
    """Decode time against context length, one line per format (20 distinct colours, line styles by family)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6.5))
    colours = plt.get_cmap("tab20").colors
    for i, (name, times) in enumerate(sweep.items()):
        spec = kvgen.load(name).spec
        style = "--" if min(spec.key.bits, spec.value.bits) < 8 else "-"  # sub-byte formats dashed
        ax.plot(contexts, times, marker="o", linestyle=style, color=colours[i % len(colours)], label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens), 4 sequences, 32 q heads / 8 KV heads, head size 128")
    ax.set_ylabel("decode attention time (us)" + (", CUDA graph replays" if meta.get("sweep_graphs") else ""))
    ax.set_title(f"kvgen decode attention on {meta['gpu']} ({meta['date']})")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def merge_runs(runs: list, paths: list) -> tuple[list, dict, dict]:
    """Rows, sweep and metadata of several runs' results.json as one: rows in run order, a case (format, kind,
    shape) measured twice taken from the first run; each row keeps the bf16 ratio of its own run."""
    for field in ("gpu", "dot_precision", "cuda_graphs", "sweep_graphs"):
        if len({str(r["meta"].get(field)) for r in runs}) > 1:
            raise SystemExit(f"--replot: the runs differ in {field}; they cannot share one table")
    if len({tuple(r["sweep_ctx"]) for r in runs}) > 1:
        raise SystemExit("--replot: the runs swept different context lengths")
    rows, seen, sweep = [], set(), {}
    for run in runs:
        for r in run["rows"]:
            case = (r["format"], r["kind"], r["shape"])
            if case not in seen:
                seen.add(case)
                rows.append(r)
        for name, times in run["sweep"].items():
            sweep.setdefault(name, times)
    meta = dict(runs[0]["meta"])
    merged = "python benchmarks/bench.py --replot " + " ".join(map(str, paths))
    meta["command"] = " + ".join(r["meta"]["command"] for r in runs) + f" (merged: {merged})"
    meta["copy_gbps"] = min(r["meta"]["copy_gbps"] for r in runs)
    return rows, sweep, meta


def write_results(out: Path, rows: list, sweep: dict, meta: dict, final: bool = False, ratios: bool = True) -> None:
    """results.json and results.md (and the chart, when the run is over) under ``out``; with ``ratios``, ``vs_bf16``
    is filled in for every row whose shape bf16 has measured (else the rows keep theirs)."""
    base = {(r["kind"], r["shape"]): r["time_us"] for r in rows if r["format"] == "bf16"}
    for r in rows if ratios else ():
        b = base.get((r["kind"], r["shape"].removesuffix(DEQUANTIZE_FIRST)))
        r["vs_bf16"] = r["time_us"] / b if b else None
    (out / "results.json").write_text(json.dumps(dict(meta=meta, rows=rows, sweep=sweep, sweep_ctx=SWEEP), indent=1))
    lines = [f"Measured {meta['date']} on {meta['gpu']} (torch {meta['torch']}, triton {meta['triton']}, Python "
             f"{meta['python']}); copy bandwidth {meta['copy_gbps']:.0f} GB/s (read + write, 2 GiB). Command: "
             f"`{meta['command']}`.", "",
             "| format | kind | shape | median us | MB moved | GB/s | of copy bw | vs bf16 |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vs = f"{r['vs_bf16']:.2f}" if r["vs_bf16"] else "-"
        lines.append(f"| {r['format']} | {r['kind']} | {r['shape']} | {r['time_us']:.0f} | {r['bytes'] / 1e6:.0f} | "
                     f"{r['gbps']:.0f} | {100 * r['frac']:.0f}% | {vs} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    if final:
        if sweep:
            plot_sweep(sweep, SWEEP, meta, out / "decode_vs_context.png")
        print("\n".join(lines))


KINDS = ("decode", "prefill", "write")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="*", default=None)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent))
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                        help="measure only these cases (e.g. `--kinds prefill --no-sweep` for a quick A/B of the "
                             "chunked prefill); default: all")
    parser.add_argument("--dot-precision", choices=DOT_PRECISIONS, default="auto",
                        help="attention dots: tensor cores where products stay exact (default), exact fp32, the "
                             "quantized compute domain where the format offers it, or one 16-bit term per operand")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="time kvgen's attention and writes as CUDA graph replays (no host launch cost per call)")
    parser.add_argument("--replot", metavar="JSON", nargs="+",
                        help="only redraw the chart of an earlier run's results.json; with several, merge the runs "
                             "(each row keeps its own run's bf16 ratio; the first run's row wins where two measured "
                             "the same case) into --out")
    args = parser.parse_args()
    if args.replot:
        runs = [json.loads(Path(p).read_text()) for p in args.replot]
        if len(runs) == 1:
            run, path = runs[0], Path(args.replot[0])
            plot_sweep(run["sweep"], run["sweep_ctx"], run["meta"], path.with_suffix(".png"))
            return 0
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        rows, sweep, meta = merge_runs(runs, args.replot)
        write_results(out, rows, sweep, meta, final=True, ratios=False)
        return 0
    require_gpu(parser)
    global DOT, GRAPHS
    DOT = args.dot_precision
    GRAPHS = args.cuda_graphs
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.formats or kvgen.shipped_names()
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth: {copy_bw / 1e9:.0f} GB/s", flush=True)
    meta = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=__import__("triton").__version__, python=platform.python_version(),
                copy_gbps=copy_bw / 1e9, command="python benchmarks/bench.py " + " ".join(sys.argv[1:]),
                dot_precision=DOT, cuda_graphs=GRAPHS, sweep_graphs=True)
    rows = []
    shapes = ([("decode", f"{n}x{c}", n, c, D, None, 1) for n, c in DECODE_SHAPES]
              + [("decode", label, n, c, hs, bs, 1) for label, n, c, hs, bs in EXTRA_DECODE]
              + [("prefill", f"{PREFILL[0]}x{PREFILL[2]} new on {PREFILL[1]}", PREFILL[0], PREFILL[1], D, None,
                  PREFILL[2])])
    shapes = [shape for shape in shapes if shape[0] in args.kinds]
    for kind, label, num_seqs, ctx, hs, _, q_len in shapes:
        if "bs64" in label:
            continue  # the same dense computation as the block-16 shape
        fn, moved = sdpa_case(num_seqs, ctx, hs, q_len)
        t = bench(fn)
        rows.append(dict(format="torch SDPA (dense bf16)", kind=kind, shape=label, time_us=t * 1e6,
                         bytes=moved, gbps=moved / t / 1e9, frac=moved / t / copy_bw))
        print(rows[-1], flush=True)
        del fn
    sweep = {}
    for name in names:
        fmt = kvgen.load(name)
        bs = fmt.layout.RESIDUAL["group"] if fmt.spec.streaming else 16
        for kind, label, num_seqs, ctx, hs, block, q_len in shapes:
            # the chunked prefill also through dequantize_first (planned: the dense cache allocated once), for the
            # quantized formats; its ratio is to bf16's own (fused) prefill
            ways = [False] + ([True] if kind == "prefill" and name not in DENSE_FORMATS.values() else [])
            for first in ways:
                fn, moved = decode_case(fmt, num_seqs, ctx, block or bs, hs, q_len, planned=first,
                                        dequantize_first=first)
                t = bench(fn)
                rows.append(dict(format=name, kind=kind, shape=label + (DEQUANTIZE_FIRST if first else ""),
                                 time_us=t * 1e6, bytes=moved, gbps=moved / t / 1e9, frac=moved / t / copy_bw))
                print(rows[-1], flush=True)
                del fn
                torch.cuda.empty_cache()
        for tokens in (32768, 256) if "write" in args.kinds else ():
            fn, moved = write_case(fmt, tokens, bs)
            t = bench(fn)
            rows.append(dict(format=name, kind="write", shape=f"{tokens} tokens", time_us=t * 1e6, bytes=moved,
                             gbps=moved / t / 1e9, frac=moved / t / copy_bw))
            print(rows[-1], flush=True)
            del fn
        if not args.no_sweep:
            sweep[name] = []
            for ctx in SWEEP:
                fn, _ = decode_case(fmt, 4, ctx, bs, graphs=True)  # kernel time, not the host's (docstring)
                sweep[name].append(bench(fn) * 1e6)
                del fn
            print(f"{name} sweep (4 sequences; us):", dict(zip(SWEEP, (round(t, 1) for t in sweep[name]))),
                  flush=True)
            torch.cuda.empty_cache()
        write_results(out, rows, sweep, meta)  # a run cut short keeps the formats it finished
    write_results(out, rows, sweep, meta, final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
