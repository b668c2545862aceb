"""Static instruction counts of the generated attention kernels for the H200 (sm_90), without a GPU.

    python benchmarks/sass_count.py [--quantized] [FORMAT ...]   # default: every shipped format
    python benchmarks/sass_count.py --write [FORMAT ...]         # the reshape-and-cache kernel

Compiles each format's paged_attention_kernel for sm_90 with Triton's own ptxas (the decode configuration the
runtime picks for bf16 queries: 32 query heads over 8 KV heads, head size 128, block size 16, no split), finds the
main loop in the SASS (the first backward branch spanning more than 200 instructions) and prints its instructions per KV position (per KV head), the
bytes per position, the instruction mix and local-memory traffic (register spills). A proxy for issue 5's "what
limits the kernel" when no GPU is at hand: a memory-bound kernel issues few instructions per byte.
"""

from __future__ import annotations

import collections
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

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
POINTER_TYPES = {"q_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32", "ml_ptr": "*fp32",
                 "block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "seq_ids_ptr": "*i32"}


def signature(fn, consts: dict) -> dict:
    sig = {}
    for a in fn.arg_names:
        if a in consts:
            sig[a] = "constexpr"
        elif a.endswith("_ptr"):
            sig[a] = POINTER_TYPES.get(a, "*u8" if any(w in a for w in ("cache", "meta", "res")) else "*fp32")
        else:
            sig[a] = "fp32" if a == "qk_scale" else "i32"
    return sig


def main_loop(sass: str) -> list[str]:
    """Instruction lines of the main loop: the first loop (a backward branch, to a label or an address) of more than
    200 instructions in code order (with a separate masked last tile, the unmasked whole-tile loop comes first)."""
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
    lo, hi = min(loops) if loops else (0, 1 << 62)
    return [line for i, line in enumerate(lines) if i in addr and lo <= addr[i] <= hi]


def compile_sm90(src, options: dict):
    """Compile for sm_90 with Triton's ptxas: (kernel, its SASS, cuobjdump's resource usage line)."""
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
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


def count(name: str, tile_override: dict | None = None, dot_precision: str = "auto") -> dict:
    fmt = kvgen.load(name)
    res = fmt.layout.RESIDUAL
    block = 2 * res["group"] if res else 16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(4, block, 8, 128, **({"max_seqs": 1} if res else {}))
    _, consts = fmt._kernel_args(cache)
    kset = fmt._kernels
    dots = kset.dot_modes(torch.bfloat16, dot_precision, fmt.spec.key.rotation is not None, consts["HEAD_PAD"])
    dots["NATIVE_CASTS"] = True
    if "OFFSETS_64" in kset.module.paged_attention_kernel.arg_names:
        dots["OFFSETS_64"] = False  # a cache below 2 GiB
    os.environ["TRITON_INTERPRET"] = "0"
    tiles = attention_tiles(kset.module.CODE_BITS, kset.module.DOT_OPERANDS, dots, kset.block_scaled)
    tiles.update(tile_override or {})
    tiles.pop("programs_per_sm")
    block_n = tiles.pop("BLOCK_N")
    block_n = getattr(kset.module, "BLOCK_N_FIXED", None) or block_n
    c = dict(consts, GROUP=4, BLOCK_M=16, BLOCK_Q=4, BLOCK_N=block_n, NUM_SPLITS=1, **dots)
    if res:
        c.update(TOKEN_GROUP=res["group"], RESIDUAL=res["tokens"], RING=res["ring"])
    fn = kset.module.paged_attention_kernel
    src = ASTSource(fn, signature=signature(fn, c), constexprs={(fn.arg_names.index(k),): v for k, v in c.items()})
    kernel, sass, usage = compile_sm90(src, tiles)
    loop = main_loop(sass)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    smem = kernel.metadata.shared
    warps = tiles.get("num_warps", 4)
    # programs resident per SM on sm_90: 64K registers (allocated per warp in units of 256), 228 KiB shared memory
    # (1 KiB reserved per block), at most 32 blocks
    per_warp = -(-regs * 32 // 256) * 256
    occupancy = min(65536 // (per_warp * warps), (228 * 1024) // (smem + 1024) if smem else 32, 32)
    ops = collections.Counter(opcode(line) for line in loop)
    bytes_per_position = fmt.page_bytes(block, 8, 128) / block / 8
    return dict(format=name, block_n=block_n, per_position=len(loop) / block_n, bytes=bytes_per_position,
                per_byte=len(loop) / block_n / bytes_per_position, regs=regs, smem=smem, occupancy=occupancy,
                spills=(ops["STL"] + ops["LDL"]) / block_n,
                mix=ops.most_common(8))


def count_write(name: str) -> dict:
    """The reshape-and-cache kernel as the runtime launches it on a GPU (bf16 K/V, 16 tokens per program, one KV
    head per program): it has no loop, so every instruction counts, per token of that head."""
    fmt = kvgen.load(name)
    if fmt.spec.streaming:
        raise ValueError(f"{name}: KIVI writes through its own flush and residual kernels")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = fmt.allocate(4, 16, 8, 128)
    _, consts = fmt._kernel_args(cache)
    fn = fmt._kernels.module.reshape_and_cache_kernel
    block_t = 16
    c = dict(consts, BLOCK_T=block_t)
    sig = signature(fn, c)
    sig.update(key_ptr="*bf16", value_ptr="*bf16", slot_mapping_ptr="*i64")
    src = ASTSource(fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in c.items()})
    _, sass, usage = compile_sm90(src, dict(num_warps=4, enable_fp_fusion=False))
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    ops = collections.Counter(opcode(line) for line in lines)
    moved = 2 * 128 * 2 + fmt.page_bytes(16, 8, 128) / 16 / 8  # bf16 K and V in, the cell out, per token-head
    return dict(format=name, per_token=len(lines) / block_t, bytes=moved, per_byte=len(lines) / block_t / moved,
                regs=int(re.search(r"REG:(\d+)", usage).group(1)), mix=ops.most_common(8), block_t=block_t)


def main_write(names: list) -> int:
    print("| format | instructions / token-head | bytes / token-head | instructions / byte | registers | most frequent |")
    print("|---|---|---|---|---|---|")
    for name in names:
        if kvgen.load(name).spec.streaming:
            continue
        r = count_write(name)
        mix = ", ".join(f"{op} {n / r['block_t']:.1f}" for op, n in r["mix"])
        print(f"| {name} | {r['per_token']:.1f} | {r['bytes']:.0f} | {r['per_byte']:.3f} | {r['regs']} | {mix} |",
              flush=True)
    return 0


def main() -> int:
    args = sys.argv[1:]
    if args[:1] == ["--write"]:  # the reshape-and-cache kernel instead
        return main_write(args[1:] or kvgen.shipped_names())
    precision = "auto"
    if args[:1] == ["--quantized"]:  # the quantized compute domain, for the formats that offer it
        precision, args = "quantized", args[1:]
    names = args or kvgen.shipped_names()
    if precision == "quantized":
        names = [n for n in names if any(kvgen.load(n).quantized_dot.values())]
    print("| format | instructions / position | bytes / position | instructions / byte | registers | shared KiB | "
          "programs / SM | spill ld+st / position | most frequent |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names:
        r = count(name, dot_precision=precision)
        mix = ", ".join(f"{op} {n / r['block_n']:.1f}" for op, n in r["mix"])
        print(f"| {name} | {r['per_position']:.1f} | {r['bytes']:.0f} | {r['per_byte']:.3f} | {r['regs']} | "
              f"{r['smem'] / 1024:.0f} | {r['occupancy']} | {r['spills']:.1f} | {mix} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
