"""Why a write kernel times differently by what ran before it in the process (issue 5's measurement question).

tune_writes.py and time_writes.py ran a decode case before timing writes because the same write kernel, timed in a
fresh process, came out up to 2x slower on the H200. This script times the writes of some formats at 32768 tokens
(CUDA-graph replays under triton's do_bench, as bench.py times them), each process state in a fresh process of its
own, with the allocator's pool kept as each state leaves it (bench.write_case's ``release_pool=False``):

    python benchmarks/write_state.py kivi_2bit kivi_4bit nvfp4
    python benchmarks/write_state.py nvfp4 --states copy load-copy      # some states
    python benchmarks/write_state.py fp8_e4m3 nvfp4 --attention          # decode at 64 x 8192 instead
    python benchmarks/write_state.py nvfp4 --placement                   # tensors fresh or carved from a pool
    python benchmarks/write_state.py nvfp4 --eager --states nothing copy # launched eagerly, not graph replays
    python benchmarks/write_state.py nvfp4 --graph-nodes --states nothing copy  # what each state's graph holds

States (what runs before the first write case):
  nothing     the write case first, nothing before it
  copy        bench.py's copy-bandwidth measurement (4 GiB allocated, freed to torch's caching allocator)
  copy-empty  the same, then torch.cuda.empty_cache() (the 4 GiB handed back to the driver)
  decode      copy, one 64 x 8192 decode case of the format, empty_cache (time_writes.py's state)
  load-copy   every format's write case built (its kernels compiled and loaded) and freed, then copy

Each state times every format for two do_bench rounds and back-to-back replays (no L2 flush between them), then
frees the case and times it again from a new allocation. What it found (benchmarks/RESULTS.md, twentieth and
twenty-first sessions): a write first loaded while the pool holds freed blocks runs slower as graph replays for the
rest of the process (nvfp4 198-203 against 91-95 us after the copy), whatever the tensors' placement; loaded before
the copy, it runs at 95 us, and launched eagerly (``--eager``) at 91 us in the slow state too.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

STATES = ["nothing", "copy", "copy-empty", "decode", "load-copy"]


def back_to_back_us(fn, calls: int = 200) -> float:
    """Mean us of ``calls`` replays issued back to back (no L2 flush between them, unlike do_bench)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def graph_nodes(fn) -> tuple[dict, float]:
    """Capture ``fn`` as bench.graphed does, with the graph's debug mode on: (the node kinds and kernel names its DOT
    dump lists, with their counts; the replay's do_bench us)."""
    import collections
    import re
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench

    graph = bench.capture(fn, debug=True)
    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        graph.debug_dump(f.name)
        text = Path(f.name).read_text()
    found = collections.Counter(re.findall(r"\b(KERNEL|MEMSET|MEMCPY|HOST|EVENT_RECORD|WAIT_EVENT|EMPTY|MEM_ALLOC|"
                                           r"MEM_FREE|CONDITIONAL)\b", text))
    found.update(re.findall(r"\b(reshape_and_cache\w*|kivi_\w+_kernel)\b", text))
    return dict(found), bench.bench(graph.replay) * 1e6


def run_state(state: str, formats: list[str], tokens: int, attention: bool = False, eager: bool = False,
              nodes: bool = False) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench

    import kvgen

    bench.GRAPHS = not (eager or nodes)
    if state == "load-copy":  # every format's write kernel compiled and loaded first, then the copy
        for name in formats:
            fmt = kvgen.load(name)
            fn, _ = bench.write_case(fmt, tokens, fmt.layout.RESIDUAL["group"] if fmt.spec.streaming else 16,
                                     release_pool=False)
            del fn
    if state != "nothing":
        bench.copy_bandwidth()
    if state == "copy-empty":
        torch.cuda.empty_cache()
    out = {}
    for name in formats:
        fmt = kvgen.load(name)
        block = fmt.layout.RESIDUAL["group"] if fmt.spec.streaming else 16  # KIVI: one key group per block
        if state == "decode":
            fn, _ = bench.decode_case(fmt, 64, 8192, block)
            bench.bench(fn)
            del fn
            torch.cuda.empty_cache()
        if nodes:  # the graph's contents and its replay time instead of the rows below
            fn, _ = bench.write_case(fmt, tokens, block, release_pool=False)
            out[name] = graph_nodes(fn)
            del fn
            continue
        rows = []
        for _ in range(2):  # a case, then the same case allocated again
            if attention:  # decode at 64 x 8192 instead of the write
                fn, moved = bench.decode_case(fmt, 64, 8192, block)
            else:
                fn, moved = bench.write_case(fmt, tokens, block, release_pool=False)
            rows.append([bench.bench(fn) * 1e6 for _ in range(2)] + [back_to_back_us(fn)])
            del fn
        out[name] = rows
    return out


def placement(name: str, tokens: int) -> None:
    """Which allocation moves the time: the write case's tensors (cache, inputs) from fresh CUDA segments, or
    carved from a freed block that torch's caching allocator holds, of 1 or 2 GiB, written by a copy or not."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import math
    import warnings

    import bench

    import kvgen

    fmt = kvgen.load(name)
    num_blocks = math.ceil(tokens / 16) + 1
    print("| tensors from | do_bench us | back-to-back replays us | cache ptr % 2 MiB | key ptr % 2 MiB |")
    print("|---|---|---|---|---|")
    for source in ["fresh", "1 GiB block", "2 GiB block", "2 GiB block after a copy into it",
                   "fresh after copy_bandwidth"]:
        torch.cuda.empty_cache()  # no free block left: the next allocations get segments of their own
        if source == "fresh after copy_bandwidth":
            bench.copy_bandwidth()
            torch.cuda.empty_cache()
        elif source != "fresh":
            block = torch.empty((2 if "2 GiB" in source else 1) << 30, dtype=torch.uint8, device="cuda")
            if "copy" in source:
                block.copy_(torch.empty_like(block))
            del block
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cache = fmt.allocate(num_blocks, 16, bench.HKV, bench.D, device="cuda")
        torch.manual_seed(0)
        key = torch.randn(tokens, bench.HKV, bench.D, dtype=torch.bfloat16, device="cuda")
        value = torch.randn_like(key)
        slots = torch.randperm(num_blocks * 16, device="cuda")[:tokens].to(torch.int64)
        fn = bench.graphed(lambda: fmt.write(cache, key, value, slots))
        t = bench.bench(fn) * 1e6
        b2b = back_to_back_us(fn)
        ptr = next(iter(cache.tensors.values())).data_ptr()
        print(f"| {source} | {t:.1f} | {b2b:.1f} | {ptr % (2 << 20)} | {key.data_ptr() % (2 << 20)} |", flush=True)
        del fn, cache, key, value, slots


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("formats", nargs="+")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--states", nargs="+", default=STATES, choices=STATES)
    ap.add_argument("--state", help=argparse.SUPPRESS)  # the child process's one state
    ap.add_argument("--attention", action="store_true",
                    help="time decode at 64 x 8192 in each state instead of the writes (the decode state excepted)")
    ap.add_argument("--eager", action="store_true",
                    help="launch the cases eagerly (host launches under do_bench) instead of as CUDA-graph replays")
    ap.add_argument("--graph-nodes", action="store_true",
                    help="per state, what the captured write graph holds (node kinds, kernels) and its replay time")
    ap.add_argument("--placement", action="store_true",
                    help="for the first format: the write case's tensors fresh or carved from pooled blocks")
    args = ap.parse_args()
    if args.placement:
        import kvgen

        if kvgen.load(args.formats[0]).spec.streaming:
            ap.error(f"--placement: {args.formats[0]} is a streaming format (KIVI), whose writes need a sequence "
                     "batch; give a paged format")
        placement(args.formats[0], args.tokens)
        return
    if args.state:
        print(json.dumps(run_state(args.state, args.formats, args.tokens, args.attention, args.eager,
                                   args.graph_nodes)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench

    bench.require_gpu(ap)
    what = "decode at 64 x 8192" if args.attention else f"writes of {args.tokens} tokens"
    how = "eager launches" if args.eager else "CUDA-graph replays"
    print(f"{what}, us (do_bench medians of {how}): two rounds and back-to-back calls, then the case allocated "
          "again")
    print("| state | " + " | ".join(args.formats) + " |")
    print("|---|" + "---|" * len(args.formats))
    for state in args.states:
        res = subprocess.run([sys.executable, __file__, *args.formats, "--tokens", str(args.tokens),
                              "--state", state] + (["--attention"] if args.attention else [])
                             + (["--eager"] if args.eager else []) + (["--graph-nodes"] if args.graph_nodes else []),
                             capture_output=True, text=True)
        if res.returncode:
            print(f"| {state} | failed: {res.stderr.strip().splitlines()[-1]} |")
            continue
        data = json.loads(res.stdout.strip().splitlines()[-1])
        if args.graph_nodes:
            cells = [f"{data[n][1]:.1f} us: " + ", ".join(f"{k} {v}" for k, v in sorted(data[n][0].items()))
                     for n in args.formats]
            print(f"| {state} | " + " | ".join(cells) + " |", flush=True)
            continue
        cells = [" / ".join(f"{t:.1f}" for t in data[n][0]) + " ; " + " / ".join(f"{t:.1f}" for t in data[n][1])
                 for n in args.formats]
        print(f"| {state} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
