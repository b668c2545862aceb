"""Static instruction counts of the generated attention kernels for the H200 (sm_90), without a GPU.

    python benchmarks/sass_count.py [--quantized | --fast] [FORMAT ...]   # default: every shipped format
    python benchmarks/sass_count.py --write [FORMAT ...]         # reshape-and-cache, as Format.write launches it
    python benchmarks/sass_count.py --tiles 64/4/3/128 [FORMAT ...]  # another tile choice (tune_tiles.py's syntax)
    python benchmarks/sass_count.py --write-streaming [FORMAT ...]   # KIVI's flush and residual-store kernels
    python benchmarks/sass_count.py --write --no-fast-div [FORMAT ...]   # (or --write-streaming) with FAST_DIV off
    python benchmarks/sass_count.py --write --input fp32 --dump DIR [FORMAT ...]   # fp32 (fp16) inputs; PTX + SASS
    python benchmarks/sass_count.py --prefill [FORMAT ...]       # bench.py's chunked prefill (4 x 2048 new on 8192)
    python benchmarks/sass_count.py --prefill --head-size 48 SPEC   # another head size (default 128)
    python benchmarks/sass_count.py --tiles 128/8/2 --prefill --prefill-rows 128 [FORMAT ...]   # 128 query rows
    python benchmarks/sass_count.py --dequantize [FORMAT ...]    # dequantize_first's dequantize_kernel (prefill)
    python benchmarks/sass_count.py --dequantize --dequant-tiles 64/4 [FORMAT ...]   # its positions / warps
    python benchmarks/sass_count.py --arch 80 --write [FORMAT ...]   # any mode above for another GPU (sm_80: A100,
                                                                     # whose fp8 conversions are not native)

Compiles each format's paged_attention_kernel for sm_90 with Triton's own ptxas exactly as the runtime would launch
it on an H200 for decode at 64 x 8192 (32 query heads over 8 KV heads, head size 128, block size 16, bf16 queries):
the call is captured from ``Format.attend`` and bound by Triton's binder, so the tile options, the split and the
argument specialisation (aligned pointers, integers divisible by 16) are the real ones. Before 2026-11-30 (third
session) the kernels were compiled without that specialisation, which hid the asynchronous copies of the compiled
kernels and overstated their instructions. Finds the main loop in the SASS (the first backward branch spanning
more than 200 instructions) and prints its instructions per KV position (per KV head), the bytes per position, the
instruction mix, local-memory traffic (register spills) and the loop's global loads by opcode (LDGSTS: the
software pipeline's asynchronous copies; LDG: plain loads each step waits for, e.g. rows narrower than the 4 bytes
an asynchronous copy takes). A proxy for issue 5's "what limits the kernel" when no GPU is at hand: a memory-bound
kernel issues few instructions per byte, and waits on no plain load but its block ids.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import warnings

os.environ["TRITON_INTERPRET"] = "0"  # compile, never run: no GPU needed

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kvgen  # noqa: E402
from kvgen.runtime.kernels import attention_tiles  # noqa: E402
from kvgen.runtime.occupancy import resident_programs  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
ARCH = 90  # the compute capability compiled for (--arch): 90 is the H100 / H200
def main_loop(sass: str, index: int = 0) -> list[str]:
    """Instruction lines of the main loop: the ``index``-th loop (a backward branch, to a label or an address) of
    more than 200 instructions in code order (with a separate masked last tile, the unmasked whole-tile loop comes
    first; prefill programs, MASK_FREE_STEPS, run the window's edge, then the steps every row sees whole, then the
    causal diagonal: the second is where a long prefix spends its time)."""
    lines = sass.splitlines()
    addr, label_at, pending = {}, {}, None
    for i, line in enumerate(lines):
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            pending = m.group(1)
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/", line)
        if m:
            addr[i] = int(m.group(1), 16)
            if pending:
                label_at[pending], pending = addr[i], None
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+(?:`?\(?(\.L_x_\d+)|0x([0-9a-f]+))", line)
        if not m or i not in addr:
            continue
        target = label_at.get(m.group(1), 1 << 62) if m.group(1) else int(m.group(2), 16)
        if target < addr[i] and (addr[i] - target) // 16 > 200:
            loops.append((target, addr[i]))
    loops.sort()
    if index and index >= len(loops):
        raise ValueError(f"main_loop: loop {index} asked, the kernel has {len(loops)} of more than 200 instructions")
    lo, hi = loops[index] if loops else (0, 1 << 62)
    return [line for i, line in enumerate(lines) if i in addr and lo <= addr[i] <= hi]


def compile_sm90(src, options: dict):
    """Compile for sm_90 (or --arch's) with Triton's ptxas: (kernel, its SASS, cuobjdump's resource usage line)."""
    kernel = triton.compile(src, target=GPUTarget("cuda", ARCH, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    return kernel, sass, usage


def opcode(line: str) -> str:
    words = line.split("*/", 1)[1].split()
    word = words[1] if words[0].startswith("@") else words[0]
    return word.split(".")[0]


H200_SMS = 132


@contextlib.contextmanager
def stubbed_launches(fmt):
    """Within it, the format's calls take the compiled (GPU) path on CPU tensors with every kernel launch replaced by
    a no-op that records it: yields {kernel name: (args, kwargs) of its first launch}. Restores everything after."""
    from kvgen.runtime import checks, kernels

    captured: dict = {}
    kset = fmt._kernels
    names = [n for n in ("paged_attention_kernel", "reduce_splits_kernel", "reshape_and_cache_kernel",
                         "kivi_flush_kernel", "kivi_residual_kernel", "dequantize_kernel") if hasattr(kset.module, n)]

    class Capture:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                captured.setdefault(self.name, (args, kwargs))
            return launch

    saved = (kernels.interpreting, kernels.native_fp8, checks.costly_checks_on, kset._check_device,
             {n: getattr(kset.module, n) for n in names}, dict(kset._SMS), dict(kset._dot_modes),
             dict(kset._launchers))
    try:
        kernels.interpreting = lambda: False
        kernels.native_fp8 = lambda device: ARCH >= 89  # as runtime.kernels.native_fp8 on such a GPU
        checks.costly_checks_on = lambda *tensors: False  # as on a GPU: no device-to-host range checks
        kset._check_device = lambda t: None
        kset._SMS[None] = H200_SMS
        kset._dot_modes.clear()
        kset._launchers.clear()  # launchers hold the kernels they were made for
        for n in names:
            setattr(kset.module, n, Capture(n))
        yield captured
    finally:
        kernels.interpreting, kernels.native_fp8, checks.costly_checks_on, kset._check_device = saved[:4]
        for n, k in saved[4].items():
            setattr(kset.module, n, k)
        kset._SMS.clear(), kset._SMS.update(saved[5]), kset._dot_modes.clear(), kset._dot_modes.update(saved[6])
        kset._launchers.clear(), kset._launchers.update(saved[7])


def _captured(fmt, call) -> dict:
    """The launches ``call()`` makes of the format's kernels, as a GPU run would make them."""
    with stubbed_launches(fmt) as captured:
        call()
    return captured


def _bound_source(fn, args, kwargs):
    """(ASTSource, compile options) of one captured launch, bound and specialised by Triton's own binder."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import create_function_from_signature

    backend = CUDABackend(GPUTarget("cuda", ARCH, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    _, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    launch = {k: v for k, v in kwargs.items() if k not in fn.arg_names}
    return ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs), launch


def attention_call(fmt, seqs: int, ctx: int, block: int, q_len: int, head_size: int = 128) -> tuple:
    """``Format.attend``'s arguments (positional, keyword) for a step of ``q_len`` new bf16 tokens on each of
    ``seqs`` sequences of ``ctx`` tokens (32 query heads over 8 KV heads), on CPU tensors."""
    res = fmt.layout.RESIDUAL
    blocks_per_seq = -(-ctx // block)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(seqs * blocks_per_seq, block, 8, head_size, **({"max_seqs": seqs} if res else {}))
    q = torch.zeros(seqs * q_len, 32, head_size, dtype=torch.bfloat16)
    table = torch.arange(seqs * blocks_per_seq, dtype=torch.int32).reshape(seqs, blocks_per_seq)
    extra = {"seq_ids": torch.arange(seqs, dtype=torch.int32)} if res else {}
    return ((q, cache, table, torch.full((seqs,), ctx, dtype=torch.int32),
             torch.arange(seqs + 1, dtype=torch.int32) * q_len), dict(max_query_len=q_len, **extra))


def runtime_source(fmt, seqs: int, ctx: int, block: int, dot_precision: str, q_len: int = 1, head_size: int = 128):
    """The attention kernel exactly as the runtime would launch it on an H200 for a step of ``q_len`` new tokens
    (1: decode) on each of ``seqs`` sequences of ``ctx`` tokens with bf16 queries: the launch is captured from
    ``Format.attend`` (CPU tensors, the kernel call stubbed) and bound by Triton's own binder, so the constexprs, the
    tile options and the argument specialisation (16-byte aligned pointers, integers divisible by 16 or equal to 1)
    match a real launch. Returns (ASTSource, compile options, BLOCK_N, the loop main_loop takes: 1 where the
    whole steps every row sees run apart, MASK_FREE_STEPS, else 0)."""
    args, kw = attention_call(fmt, seqs, ctx, block, q_len, head_size)
    launches = _captured(fmt, lambda: fmt.attend(*args, dot_precision=dot_precision, **kw))
    args, kwargs = launches["paged_attention_kernel"]
    src, launch = _bound_source(fmt._kernels.module.paged_attention_kernel, args, kwargs)
    return src, launch, kwargs["BLOCK_N"], int(bool(kwargs.get("MASK_FREE_STEPS")))


def count(name: str, dot_precision: str = "auto", seqs: int = 64, ctx: int = 8192, q_len: int = 1,
          head_size: int = 128) -> dict:
    fmt = kvgen.load(name)
    res = fmt.layout.RESIDUAL
    block = res["group"] if res else 16
    os.environ["TRITON_INTERPRET"] = "0"
    src, tiles, block_n, loop_index = runtime_source(fmt, seqs, ctx, block, dot_precision, q_len, head_size)
    kernel, sass, usage = compile_sm90(src, tiles)
    loop = main_loop(sass, loop_index)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    smem = kernel.metadata.shared
    warps = tiles.get("num_warps", 4)
    occupancy = resident_programs(regs, warps, smem)  # programs per SM on sm_90, as the runtime counts them
    ops = collections.Counter(opcode(line) for line in loop)
    # the loop's global loads by full opcode: LDGSTS are asynchronous copies into shared memory (the software
    # pipeline's), LDG plain loads that the step waits for (one LDG.E: the step's block ids)
    loads = collections.Counter(m[1] for m in (re.search(r"\b(LDGSTS[.\w]*|LDG[.\w]*)", line) for line in loop) if m)
    bytes_per_position = fmt.page_bytes(block, 8, head_size) / block / 8
    return dict(format=name, block_n=block_n, per_position=len(loop) / block_n, bytes=bytes_per_position,
                per_byte=len(loop) / block_n / bytes_per_position, regs=regs, smem=smem, occupancy=occupancy,
                spills=(ops["STL"] + ops["LDL"]) / block_n,
                mix=ops.most_common(8), loads=dict(sorted(loads.items())))


def write_launches(fmt, tokens: int = 4096, dtype: torch.dtype = torch.bfloat16, head: int = 128) -> dict:
    """The launches of ``fmt.write`` of ``tokens`` tokens of ``dtype`` (8 KV heads, block size 16, slots in order),
    captured, not run: {kernel name: (args, kwargs)}."""
    blocks = -(-tokens // 16) + 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(blocks, 16, 8, head)
    key = torch.zeros(tokens, 8, head, dtype=dtype)
    slots = torch.arange(tokens, dtype=torch.int64)
    return _captured(fmt, lambda: fmt.write(cache, key, key.clone(), slots))


def stream_launches(fmt, seqs: int, tokens: int, ctx: int, head: int = 128,
                    dtype: torch.dtype = torch.bfloat16) -> dict:
    """The launches of a streaming (KIVI) format's write, captured, not run: ``tokens`` new tokens on each of
    ``seqs`` sequences that end at ``ctx`` tokens (tokens == ctx: a prefill; tokens == 1: a decode step), 8 KV
    heads, the group as block size."""
    block = fmt.layout.RESIDUAL["group"]
    per_seq = -(-ctx // block)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(seqs * per_seq, block, 8, head, max_seqs=seqs)
    key = torch.zeros(seqs * tokens, 8, head, dtype=dtype)
    table = torch.arange(seqs * per_seq, dtype=torch.int32).reshape(seqs, per_seq)
    qsl = torch.arange(seqs + 1, dtype=torch.int32) * tokens
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    slots = (torch.arange(seqs, dtype=torch.int64)[:, None] * per_seq * block
             + torch.arange(ctx - tokens, ctx, dtype=torch.int64)[None, :]).reshape(-1)
    return _captured(fmt, lambda: fmt.write(
        cache, key, key.clone(), slots, seq_ids=torch.arange(seqs, dtype=torch.int32), query_start_loc=qsl,
        seq_lens=lens, block_table=table, max_query_len=tokens))


def count_write(name: str, tokens: int = 4096, dtype: torch.dtype = torch.bfloat16, dump: str | None = None) -> dict:
    """The reshape-and-cache kernel exactly as the runtime would launch it on a GPU for ``tokens`` tokens of
    ``dtype`` (captured from ``Format.write`` like the attention kernel; the input type changes the kernel's layouts):
    it has no loop, so every instruction counts, per token of the program's KV head. ``dump``: a folder that gets the
    kernel's PTX and SASS as NAME.ptx / NAME.sass."""
    fmt = kvgen.load(name)
    if fmt.spec.streaming:
        raise ValueError(f"{name}: KIVI writes through its own flush and residual kernels")
    os.environ["TRITON_INTERPRET"] = "0"
    args, kwargs = write_launches(fmt, tokens, dtype)["reshape_and_cache_kernel"]
    src, launch = _bound_source(fmt._kernels.module.reshape_and_cache_kernel, args, kwargs)
    block_t = kwargs["BLOCK_T"]
    kernel, sass, usage = compile_sm90(src, launch)
    if dump:
        os.makedirs(dump, exist_ok=True)
        for ext, text in (("ptx", kernel.asm["ptx"]), ("sass", sass)):
            with open(os.path.join(dump, f"{name}.{ext}"), "w") as f:
                f.write(text)
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    ops = collections.Counter(opcode(line) for line in lines)
    moved = 2 * 128 * dtype.itemsize + fmt.page_bytes(16, 8, 128) / 16 / 8  # K and V in, the cell out, per token-head
    # every warp runs the listed instructions once: warp instructions per token-head (before the seventh session
    # this printed instructions per thread at 4 warps and 16 tokens per program: a quarter of this measure)
    warp_instructions = len(lines) * launch.get("num_warps", 4)
    regs, warps = int(re.search(r"REG:(\d+)", usage).group(1)), launch.get("num_warps", 4)
    return dict(format=name, per_token=warp_instructions / block_t, bytes=moved,
                per_byte=warp_instructions / block_t / moved, regs=regs, mix=ops.most_common(8), block_t=block_t,
                warps=warps, programs=resident_programs(regs, warps, kernel.metadata.shared))


def count_dequantize(name: str, seqs: int = 4, ctx: int = 8192, q_len: int = 2048) -> dict:
    """dequantize_first's dequantize_kernel exactly as ``Format.attend(..., dequantize_first=True)`` launches it on
    a GPU for bench.py's chunked prefill (``q_len`` new bf16 tokens on each of ``seqs`` sequences of ``ctx``; 8 KV
    heads, head size 128): it has no loop, so every instruction counts, per (position, KV head) of a program."""
    fmt = kvgen.load(name)
    res = fmt.layout.RESIDUAL
    block = res["group"] if res else 16
    os.environ["TRITON_INTERPRET"] = "0"
    args, kw = attention_call(fmt, seqs, ctx, block, q_len)
    with stubbed_launches(kvgen.load("bf16")), stubbed_launches(fmt) as captured:
        fmt.attend(*args, max_seq_len=ctx, dequantize_first=True, **kw)
    args, kwargs = captured["dequantize_kernel"]
    src, launch = _bound_source(fmt._kernels.module.dequantize_kernel, args, kwargs)
    _, sass, usage = compile_sm90(src, launch)
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    ops = collections.Counter(opcode(line) for line in lines)
    warps = launch.get("num_warps", 4)
    moved = fmt.page_bytes(block, 8, 128) / block / 8 + 2 * 128 * 2  # the cell in, bf16 K and V out
    per_position = len(lines) * warps / kwargs["BLOCK_N"]
    return dict(format=name, per_position=per_position, bytes=moved, per_byte=per_position / moved,
                regs=int(re.search(r"REG:(\d+)", usage).group(1)), spills=ops["STL"] + ops["LDL"],
                mix=[(op, n * warps / kwargs["BLOCK_N"]) for op, n in ops.most_common(8)])


def main_dequantize(names: list) -> int:
    print("| format | warp instructions / position-head | bytes / position-head | per byte | registers | spill ld+st "
          "| most frequent |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        r = count_dequantize(name)
        mix = ", ".join(f"{op} {n:.1f}" for op, n in r["mix"])
        print(f"| {name} | {r['per_position']:.1f} | {r['bytes']:.0f} | {r['per_byte']:.3f} | {r['regs']} | "
              f"{r['spills']} | {mix} |", flush=True)
    return 0


def count_write_streaming(name: str, seqs: int = 1, tokens: int = 32768) -> list:
    """KIVI's two write kernels (kivi_flush_kernel, kivi_residual_kernel) exactly as ``Format.write`` launches them
    on a GPU for a prefill of ``seqs`` sequences of ``tokens`` bf16 tokens (8 KV heads, head size 128, the group as
    block size): no loops, so every instruction counts. Per kernel: instructions per program (one thread's listed
    SASS), warps, registers, the tokens one program covers and the most frequent opcodes (per program)."""
    fmt = kvgen.load(name)
    res = fmt.layout.RESIDUAL
    if not res:
        raise ValueError(f"{name}: not a streaming (residual-window) format")
    os.environ["TRITON_INTERPRET"] = "0"
    launches = stream_launches(fmt, seqs, tokens, tokens)
    out = []
    for kname in ("kivi_flush_kernel", "kivi_residual_kernel"):
        args, kwargs = launches[kname]
        src, launch = _bound_source(getattr(fmt._kernels.module, kname), args, kwargs)
        _, sass, usage = compile_sm90(src, launch)
        lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
        ops = collections.Counter(opcode(line) for line in lines)
        out.append(dict(format=name, kernel=kname, per_program=len(lines), warps=launch.get("num_warps", 4),
                        tokens=kwargs["BLOCK_T"], regs=int(re.search(r"REG:(\d+)", usage).group(1)),
                        mix=ops.most_common(8)))
    return out


def main_write_streaming(names: list) -> int:
    print("| format | kernel | instructions / program | warps | tokens / program | registers | most frequent |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        if not kvgen.load(name).spec.streaming:
            continue
        for r in count_write_streaming(name):
            mix = ", ".join(f"{op} {n}" for op, n in r["mix"])
            print(f"| {name} | {r['kernel']} | {r['per_program']} | {r['warps']} | {r['tokens']} | {r['regs']} | "
                  f"{mix} |", flush=True)
    return 0


def main_write(names: list, dtype: torch.dtype = torch.bfloat16, dump: str | None = None) -> int:
    # programs / SM: what sm_90 holds of the launch's programs at once (registers, warps, shared memory; at most 32
    # blocks), and the tokens whose loads they can have in flight
    print("| format | warp instructions / token-head | bytes / token-head | per byte | registers | programs / SM "
          "(tokens x KV heads) | most frequent |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        if kvgen.load(name).spec.streaming:
            continue
        r = count_write(name, dtype=dtype, dump=dump)
        mix = ", ".join(f"{op} {n * r['warps'] / r['block_t']:.1f}" for op, n in r["mix"])
        print(f"| {name} | {r['per_token']:.1f} | {r['bytes']:.0f} | {r['per_byte']:.3f} | {r['regs']} | "
              f"{r['programs']} ({r['programs'] * r['block_t']}) | {mix} |", flush=True)
    return 0


def main() -> int:
    global ARCH
    args = sys.argv[1:]
    if args[:1] == ["--arch"] and len(args) > 1:
        if not args[1].isdigit() or int(args[1]) < 80:
            print(f"sass_count.py: --arch: a compute capability of 80 or more as digits (80, 89, 90), got {args[1]!r}",
                  file=sys.stderr)
            return 2
        ARCH, args = int(args[1]), args[2:]
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if args[1:2] == ["--no-fast-div"] and args[0] in ("--write", "--write-streaming"):
        from kvgen.runtime import kernels  # as if runtime.kernels.FAST_DIV were off (div_rn per element)

        kernels.FAST_DIV, args = False, args[:1] + args[2:]
    if args[:1] == ["--write-streaming"]:  # KIVI's flush and residual-store kernels
        return main_write_streaming(args[1:] or kvgen.shipped_names())
    if args[:1] == ["--write"]:  # the reshape-and-cache kernel instead
        args, dtype, dump = args[1:], torch.bfloat16, None
        while args[:1] in (["--input"], ["--dump"]) and len(args) > 1:
            if args[0] == "--input":
                dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
                if args[1] not in dtypes:
                    print(f"sass_count.py: --input: one of {', '.join(dtypes)}, got {args[1]!r}", file=sys.stderr)
                    return 2
                dtype = dtypes[args[1]]
            else:
                dump = args[1]
            args = args[2:]
        return main_write(args or kvgen.shipped_names(), dtype, dump)
    if args[:1] == ["--dequantize"]:  # dequantize_first's dequantize kernel
        args = args[1:]
        if args[:1] == ["--dequant-tiles"]:  # BLOCK_N/num_warps of every dequantize program, as dequantize_first.py
            from dequantize_first import set_dequant_tiles

            try:
                set_dequant_tiles(args[1] if len(args) > 1 else "")
            except ValueError as exc:
                print(f"sass_count.py: --dequant-tiles: {exc}", file=sys.stderr)
                return 2
            args = args[2:]
        return main_dequantize(args or kvgen.shipped_names())
    precision = "auto"
    if args[:1] == ["--tiles"]:  # BLOCK_N/num_warps/num_stages[/maxnreg][p][c|n] for every kernel, as tune_tiles.py
        from tune_tiles import apply

        apply(args[1])
        args = args[2:]
    if args[:1] == ["--quantized"]:  # the quantized compute domain, for the formats that offer it
        precision, args = "quantized", args[1:]
    elif args[:1] == ["--fast"]:  # dot_precision="fast": one 16-bit term per operand
        precision, args = "fast", args[1:]
    shape = dict(seqs=64, ctx=8192, q_len=1)
    if args[:1] == ["--prefill"]:  # bench.py's chunked prefill: 2048 new tokens on each of 4 sequences of 8192
        shape, args = dict(seqs=4, ctx=8192, q_len=2048), args[1:]
    if args[:1] == ["--head-size"]:
        shape["head_size"], args = int(args[1]), args[2:]
    if args[:1] == ["--prefill-rows"]:  # query rows per prefill program, for every format (by default the rules')
        from tune_tiles import force_prefill_rows

        force_prefill_rows(int(args[1]))
        args = args[2:]
    names = args or kvgen.shipped_names()
    if precision == "quantized":
        names = [n for n in names if any(kvgen.load(n).quantized_dot.values())]
    print("| format | instructions / position | bytes / position | instructions / byte | registers | shared KiB | "
          "programs / SM | spill ld+st / position | most frequent | global loads a step (LDGSTS async, LDG waited) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        r = count(name, dot_precision=precision, **shape)
        mix = ", ".join(f"{op} {n / r['block_n']:.1f}" for op, n in r["mix"])
        loads = ", ".join(f"{op} {n}" for op, n in r["loads"].items() if op != "LDGDEPBAR")
        print(f"| {name} | {r['per_position']:.1f} | {r['bytes']:.0f} | {r['per_byte']:.3f} | {r['regs']} | "
              f"{r['smem'] / 1024:.0f} | {r['occupancy']} | {r['spills']:.1f} | {mix} | {loads} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
