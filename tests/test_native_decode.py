"""The compiled-only decode paths against the portable ones, bit for bit, for every code of every shipped format.

A side's ``decode_dot(code, NATIVE)`` turns stored codes into the tensor-core operand. With ``NATIVE`` (compiled
for sm_89 or newer) it may use what only compiled code has: hardware fp8 conversions, or inline PTX that converts
four int8 codes per register with byte permutes and packed subtracts; ``decode_dot_bytes(byte)`` (2- and 4-bit
codes) decodes all codes of four bytes per register the same way. The interpreter has neither, so the conformance
suite on the CPU never runs those paths; the GPU test runs them (``TRITON_INTERPRET=0``) against the portable path,
over every code, in a tile shaped like the attention kernel's; the model test runs the PTX text on any machine.
"""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

import kvgen

on_gpu = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "0" or not torch.cuda.is_available(),
                            reason="compiled-only decode paths: run with TRITON_INTERPRET=0 on a GPU")

ROWS, COLS = 64, 128  # a KV tile: positions x head

# a streaming (KIVI-like) format whose flush encodes fp8: e4m3 key scales per channel group, e5m2 values
STREAMING_FP8 = """
kvgen_spec: 1
name: streaming_fp8
cache: {layout: interleaved}
key:
  element: uint4
  zero_point: {storage: beside_scale, dtype: fp16}
  scale: {granularity: per_channel_group, group_tokens: 16, dtype: fp8_e4m3, placement: page_end}
  residual: {tokens: 32, dtype: bf16}
value:
  element: fp8_e5m2
  scale: {granularity: per_block, block: 32, dtype: fp8_e4m3, placement: inline}
  residual: {tokens: 32, dtype: bf16}
"""

# no shipped format packs msb_first or stores signed 2-bit codes: this spec does both, on both sides
SIGNED_MSB_FIRST = """
kvgen_spec: 1
name: signed_msb_first
cache: {layout: interleaved}
key:
  element: int2
  packing: msb_first
  scale: {granularity: per_token_head, dtype: fp32, placement: inline}
value:
  element: int4
  packing: msb_first
  scale: {granularity: per_block, block: 16, dtype: fp16, placement: page_end}
"""

# the two 8-bit integer roundings the shipped formats do not pair with: int8 rounded half to even (hardware cvt.rni),
# uint8 half away from zero (cvt.rzi of v + 0.5)
INT8_ROUNDINGS = """
kvgen_spec: 1
name: int8_roundings
cache: {layout: interleaved}
key:
  element: int8
  rounding: half_even
  scale: {granularity: per_token_head, dtype: fp32, placement: inline}
value:
  element: uint8
  rounding: half_away_from_zero
  zero_point: {storage: beside_scale}
  scale: {granularity: per_token_head, dtype: fp32, placement: separate}
"""


@pytest.fixture(scope="module")
def extra_formats(tmp_path_factory):
    root = tmp_path_factory.mktemp("native_decode")
    paths = {}
    for name, text in (("signed_msb_first", SIGNED_MSB_FIRST), ("streaming_fp8", STREAMING_FP8),
                       ("int8_roundings", INT8_ROUNDINGS)):
        paths[name] = root / f"{name}.yaml"
        paths[name].write_text(text)
    before = os.environ.get("KVGEN_CACHE_DIR")
    os.environ["KVGEN_CACHE_DIR"] = str(root / "cache")
    try:
        return {name: kvgen.load(path) for name, path in paths.items()}
    finally:
        if before is None:
            del os.environ["KVGEN_CACHE_DIR"]
        else:
            os.environ["KVGEN_CACHE_DIR"] = before


def load(name: str, extra: dict):
    return extra[name] if name in extra else kvgen.load(name)


@triton.jit
def _decode_both(codes_ptr, native_ptr, portable_ptr, decode: tl.constexpr, ROWS: tl.constexpr,
                 COLS: tl.constexpr):
    i = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    code = tl.load(codes_ptr + i)
    tl.store(native_ptr + i, decode(code, True).to(tl.float32))
    tl.store(portable_ptr + i, decode(code, False).to(tl.float32))


@triton.jit
def _decode_bytes_both(bytes_ptr, native_ptr, portable_ptr, decode_bytes: tl.constexpr, decode: tl.constexpr,
                       BITS: tl.constexpr, MSB_FIRST: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    # native: all codes of each byte at once; portable: each code unpacked and decoded alone. Output
    # [ROWS, COLS * 8 // BITS] in element order (element i of a byte: bit position i, or the reverse for MSB_FIRST).
    i = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    byte = tl.load(bytes_ptr + i)
    OUT: tl.constexpr = COLS * 8 // BITS
    o = tl.arange(0, ROWS)[:, None] * OUT + tl.arange(0, OUT)[None, :]
    b = byte.to(tl.uint32)
    if BITS == 4:
        f0, f1 = decode_bytes(byte)
        c0 = b & 15
        c1 = (b >> 4) & 15
        if MSB_FIRST:
            native = tl.join(f1, f0)
            codes = tl.join(c1, c0)
        else:
            native = tl.join(f0, f1)
            codes = tl.join(c0, c1)
    else:
        f0, f1, f2, f3 = decode_bytes(byte)
        c0 = b & 3
        c1 = (b >> 2) & 3
        c2 = (b >> 4) & 3
        c3 = (b >> 6) & 3
        if MSB_FIRST:
            native = tl.join(tl.join(f3, f1), tl.join(f2, f0))
            codes = tl.join(tl.join(c3, c1), tl.join(c2, c0))
        else:
            native = tl.join(tl.join(f0, f2), tl.join(f1, f3))
            codes = tl.join(tl.join(c0, c2), tl.join(c1, c3))
    tl.store(native_ptr + o, tl.reshape(native, [ROWS, OUT]).to(tl.float32))
    tl.store(portable_ptr + o, decode(tl.reshape(codes, [ROWS, OUT]), False).to(tl.float32))


def sides(extra: dict):
    for name in list(kvgen.shipped_names()) + list(extra):
        fmt = load(name, extra)
        for side in ("k", "v"):
            if hasattr(fmt._kernels.module, f"{side}_decode_dot"):
                yield fmt, side


@on_gpu
def test_native_decode_matches_portable(extra_formats):
    for fmt, side in sides(extra_formats):
        check_side(fmt.name, side, fmt._kernels.module)
        if hasattr(fmt._kernels.module, f"{side}_decode_dot_bytes"):
            check_byte_decode(fmt, side)


@on_gpu
def test_native_scale_decode_matches_portable(extra_formats):
    """Scale codecs with a hardware type (fp8 e4m3 block / channel scales: native_scale_decode) decode in compiled
    attention and dequantize kernels and writes by the hardware's conversion: every code gives the portable decode's
    value (NaN codes NaN)."""
    seen = 0
    for name in list(kvgen.shipped_names()) + list(extra_formats):
        fmt = load(name, extra_formats)
        for side in ("k", "v"):
            decode = getattr(fmt._kernels.module, f"{side}_scale_decode_native", None)
            if decode is None:
                continue
            seen += 1
            codes = (torch.arange(ROWS * COLS, device="cuda") % 256).to(torch.uint8).reshape(ROWS, COLS)
            codes = codes[:, torch.randperm(COLS, device="cuda")].contiguous()
            native = torch.empty(ROWS, COLS, dtype=torch.float32, device="cuda")
            portable = torch.empty_like(native)
            _decode_both[(1,)](codes, native, portable, decode, ROWS, COLS)
            same = (native == portable) | (native.isnan() & portable.isnan())
            assert bool(same.all()), (f"{name} {side}: native scale decode differs for codes "
                                      f"{codes[~same][:8].tolist()}: {native[~same][:8].tolist()} vs "
                                      f"{portable[~same][:8].tolist()}")
    assert seen >= 4  # nvfp4 and nvfp4_separate, both sides


def check_byte_decode(fmt, side):
    name, module = fmt.name, fmt._kernels.module
    spec = fmt.spec.side("key" if side == "k" else "value")
    bits = module.CODE_BITS[side]
    cols = ROWS * COLS * bits // 8 // ROWS
    data = (torch.arange(ROWS * cols, device="cuda") % 256).to(torch.uint8).reshape(ROWS, cols)
    data = data[:, torch.randperm(cols, device="cuda")].contiguous()
    native = torch.empty(ROWS, COLS, dtype=torch.float32, device="cuda")
    portable = torch.empty_like(native)
    _decode_bytes_both[(1,)](data, native, portable, getattr(module, f"{side}_decode_dot_bytes"),
                             getattr(module, f"{side}_decode_dot"), bits, spec.packing == "msb_first", ROWS, cols)
    same = (native == portable) | (native.isnan() & portable.isnan())
    assert bool(same.all()), (f"{name} {side}: byte decode differs: {native[~same][:8].tolist()} vs "
                              f"{portable[~same][:8].tolist()}")
    unscaled = getattr(module, f"{side}_decode_dot_bytes_unscaled", None)
    if unscaled is not None:  # e2m1: the values times 2**-14 (fp16's exponent bias 15 against e2m1's 1)
        _decode_bytes_both[(1,)](data, native, portable, unscaled, getattr(module, f"{side}_decode_dot"), bits,
                                 spec.packing == "msb_first", ROWS, cols)
        assert torch.equal(native * 2.0 ** 14, portable), f"{name} {side}: unscaled byte decode differs"


def check_side(name, side, module):
    bits = module.CODE_BITS[side]
    # codes as the attention kernel holds them: loaded bytes for 8-bit codes, unpacked uint32 below a byte
    dtype = torch.uint8 if bits == 8 else torch.int32
    codes = (torch.arange(ROWS * COLS, device="cuda") % (1 << bits)).to(dtype)
    # neighbours differ from one tile to the next: codes shuffled within each row, so that every register of four
    # packed codes holds a mix
    codes = codes.reshape(ROWS, COLS)[:, torch.randperm(COLS, device="cuda")].contiguous()
    native = torch.empty(ROWS, COLS, dtype=torch.float32, device="cuda")
    portable = torch.empty_like(native)
    for helper in ("decode_dot", "decode_dot_biased"):
        if not hasattr(module, f"{side}_{helper}"):
            continue
        _decode_both[(1,)](codes, native, portable, getattr(module, f"{side}_{helper}"), ROWS, COLS)
        both_nan = native.isnan() & portable.isnan()
        same = (native == portable) | both_nan
        assert bool(same.all()), (f"{name} {side}: native {helper} differs for codes "
                                  f"{codes[~same][:8].tolist()}: {native[~same][:8].tolist()} vs "
                                  f"{portable[~same][:8].tolist()}")


# -- the hardware's fp8 encode in compiled writes -------------------------------------------------------------------
ENCODE_BLOCK = 4096  # fp32 bit patterns per program: 2**20 programs cover all 2**32


@triton.jit
def _encode_mismatches(counts_ptr, encode_native: tl.constexpr, encode: tl.constexpr, BLOCK: tl.constexpr,
                       NAN_AS_ZERO: tl.constexpr):
    # every fp32 bit pattern of this program's block, encoded both ways; the number that differ per program. With
    # NAN_AS_ZERO (integer codes, which have no NaN) NaN must give 0.0's code: what the writes store for NaN
    bits = tl.program_id(0).to(tl.uint32) * BLOCK + tl.arange(0, BLOCK).to(tl.uint32)
    v = bits.to(tl.float32, bitcast=True)
    if NAN_AS_ZERO:
        differ = encode_native(v, True) != encode(tl.where(v == v, v, 0.0))
    else:
        differ = encode_native(v, True) != encode(v)
    tl.store(counts_ptr + tl.program_id(0), tl.sum(differ.to(tl.int32), axis=0))


def encoders(extra: dict):
    """(format, prefix) of every generated codec with a hardware encode: element and scale codecs."""
    for name in list(kvgen.shipped_names()) + list(extra):
        fmt = load(name, extra)
        for prefix in ("k_", "v_", "k_scale_", "v_scale_"):
            if hasattr(fmt._kernels.module, f"{prefix}encode_native"):
                yield fmt, prefix


def test_writes_encode_through_the_hardware_where_a_codec_can(extra_formats):
    """The write kernels (reshape-and-cache, or KIVI's flush) call a codec's encode_native, with the kernel's
    NATIVE_CASTS, exactly where the codec renders one (fp8 e4m3 / e5m2 and 8-bit integer elements, e4m3 scales), so
    the GPU check below covers every compiled hardware encode of a write."""
    import re

    seen = set()
    for fmt, prefix in encoders(extra_formats):
        seen.add(fmt.name)
        source = open(fmt._kernels.module.__file__).read()
        kernel = "def kivi_flush_kernel(" if fmt.spec.streaming else "def reshape_and_cache_kernel("
        write = source[source.index(kernel):source.index("# Attention helpers")]
        calls = re.findall(rf"\b{prefix}encode(_native)?\((.*)", write)
        assert calls, (fmt.name, prefix)
        for native, rest in calls:
            assert native and rest.rstrip().endswith(", NATIVE_CASTS)"), (fmt.name, prefix, rest)
    assert {"fp8_e4m3", "fp8_e5m2", "fp8_per_token_head", "mxfp8", "nvfp4", "streaming_fp8", "int8_per_token_head",
            "int8_asym_per_token_head", "q8_0", "int8_roundings"} <= seen


@on_gpu
def test_native_encode_matches_portable_for_every_fp32(extra_formats):
    """encode_native(v, True) (the hardware's fp8 conversion, NaN fixed to the codec's code; for 8-bit integers one
    saturating conversion; for narrower ones a NaN-keeping clamp and one conversion) gives encode's byte for each of
    the 2**32 fp32 bit patterns: finite values, both zeros, subnormals, overflow, infinities and every NaN
    (integers: 0.0's code, as the writes store NaN)."""
    import re

    from kvgen.codegen.spec import ELEMENTS

    checked, conversions = set(), set()
    for fmt, prefix in encoders(extra_formats):
        module = fmt._kernels.module
        native, portable = getattr(module, f"{prefix}encode_native"), getattr(module, f"{prefix}encode")
        # the same codec appears in many formats and under several prefixes: its source decides
        key = (native.src + portable.src).replace(prefix, "")
        if key in checked:
            continue
        checked.add(key)
        counts = torch.empty(2 ** 32 // ENCODE_BLOCK, dtype=torch.int32, device="cuda")
        # compiled as the writes are (runtime/kernels.py): no contraction of multiplies and adds into FMAs
        side = {"k_": fmt.spec.key, "v_": fmt.spec.value}.get(prefix)
        integer = side is not None and ELEMENTS[side.element].kind in ("int", "uint")
        _encode_mismatches[(counts.numel(),)](counts, native, portable, ENCODE_BLOCK, integer, enable_fp_fusion=False)
        conversions |= set(re.findall(r"cvt\.r[nz]i(?:\.sat)?\.[su](?:8|32)", native.src))
        bad = torch.nonzero(counts).flatten()
        assert bad.numel() == 0, (f"{fmt.name} {prefix}encode_native differs from {prefix}encode in "
                                  f"{int(counts.sum())} fp32 patterns, first in the block starting at "
                                  f"{int(bad[0]) * ENCODE_BLOCK:#010x}")
    assert len(checked) >= 6  # e4m3, e5m2; int8 and uint8, each rounded half away from zero and to even
    # 8-bit codes saturate in the conversion; 4-bit ones (q4_0) clamp first, keeping NaN, then convert to s32
    assert conversions == {"cvt.rzi.sat.s8", "cvt.rni.sat.s8", "cvt.rzi.sat.u8", "cvt.rni.sat.u8", "cvt.rni.s32"}


# -- the inline PTX itself, modelled on the CPU -------------------------------------------------------------------
# The decoders' PTX (codegen/templates/codecs/int.py.jinja, minifloat.py.jinja) read from a generated module and
# executed by a model of the instructions they use, as the PTX ISA defines them: checks the byte selectors, shifts,
# masks and constants for every code on any machine. The GPU test above checks what the compiler does with it
# (register packing, the tile's layout).

def _prmt(a: int, b: int, sel: int) -> int:
    # default mode: selector nibble i picks result byte i from a (0-3) or b (4-7); its bit 3 would replicate the
    # picked byte's sign instead, which the decoders never want
    assert all(not (sel >> 4 * i) & 0x8 for i in range(4)), f"prmt selector {sel:#x} replicates a sign"
    pool = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    return sum(pool[(sel >> 4 * i) & 0x7] << 8 * i for i in range(4))  # default mode, no sign replication


def _f16x2(x: int):
    import numpy as np
    return np.array([x & 0xFFFF, x >> 16], dtype=np.uint16).view(np.float16)


def _bits(values) -> list:
    """fp16 bit patterns of the values: tells -0.0 from 0.0 (each value exact in fp16)."""
    import numpy as np
    return [int(np.float16(v).view(np.uint16)) for v in values]


def run_ptx(asm: str, inputs: dict) -> dict:
    import re

    import numpy as np
    regs = dict(inputs)
    val = lambda t: regs[t] if t in regs else int(t, 0)  # noqa: E731
    for ins in asm.strip("{} ").split(";"):
        ins = ins.strip()
        if not ins or ins.startswith(".reg"):
            continue
        op, args = ins.split(None, 1)
        a = [x.strip() for x in args.split(",")]
        if op == "mov.b32":
            regs[a[0]] = val(a[1])
        elif op == "and.b32":
            regs[a[0]] = val(a[1]) & val(a[2])
        elif op == "or.b32":
            regs[a[0]] = val(a[1]) | val(a[2])
        elif op == "shl.b32":
            regs[a[0]] = (val(a[1]) << val(a[2])) & 0xFFFFFFFF
        elif op == "shr.b32":
            regs[a[0]] = val(a[1]) >> val(a[2])
        elif op == "mul.f16x2":
            r = (_f16x2(val(a[1])) * _f16x2(val(a[2]))).astype(np.float16).view(np.uint16)
            regs[a[0]] = int(r[0]) | int(r[1]) << 16
        elif op == "lop3.b32":  # any function of three inputs, bit by bit: bit i of the look-up table, i = (a, b, c)
            x, y, z, lut = val(a[1]), val(a[2]), val(a[3]), val(a[4])
            regs[a[0]] = sum(((lut >> ((x >> k & 1) << 2 | (y >> k & 1) << 1 | (z >> k & 1))) & 1) << k
                             for k in range(32))
        elif op == "xor.b32":
            regs[a[0]] = val(a[1]) ^ val(a[2])
        elif op == "prmt.b32":
            regs[a[0]] = _prmt(val(a[1]), val(a[2]), val(a[3]))
        elif op == "sub.f16x2":
            r = (_f16x2(val(a[1])) - _f16x2(val(a[2]))).astype(np.float16).view(np.uint16)
            regs[a[0]] = int(r[0]) | int(r[1]) << 16
        else:
            raise AssertionError(f"the model does not know {op!r}")
    assert all(re.fullmatch(r"\$\d+|[a-z]+", k) for k in regs)
    return regs


def inline_ptx(module, side: str, helper: str = "decode_dot") -> str:
    import inspect
    import re
    src = inspect.getsource(getattr(module, f"{side}_{helper}").fn)
    parts = re.findall(r'"([^"]*)"', src.split("inline_asm_elementwise(", 1)[1].split("\"=r", 1)[0])
    return "".join(parts)


@pytest.mark.parametrize("name", ["int8_per_token_head", "int8_asym_per_token_head"])
def test_int8_ptx_model(name):
    import numpy as np
    module = kvgen.load(name)._kernels.module
    signed = kvgen.load(name).spec.key.element.value == "int8"
    asm = inline_ptx(module, "k")
    for word in range(256):  # four codes per register: every code in every byte position over the loop
        codes = [(word + i * 67) % 256 for i in range(4)]
        reg = sum(c << 8 * i for i, c in enumerate(codes))
        out = run_ptx(asm, {"$2": reg})
        got = list(_f16x2(out["$0"])) + list(_f16x2(out["$1"]))
        want = [np.int8(np.uint8(c)) if signed else c for c in codes]
        assert _bits(got) == _bits(want), (name, codes, got)


def _e2m1(code: int) -> float:
    import ml_dtypes
    import numpy as np
    return float(np.array([code], dtype=np.uint8).view(ml_dtypes.float4_e2m1fn)[0])


@triton.jit
def _decode_unscaled(codes_ptr, out_ptr, decode: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, decode(tl.load(codes_ptr + i)).to(tl.float32))


@pytest.mark.parametrize("name,side", [("nvfp4", "k"), ("nvfp4", "v"), ("mxfp4", "k"), ("mxfp4", "v")])
def test_unscaled_e2m1_decoders(name, side):
    """The decoders whose factor the block ratios carry: every e2m1 code (portable decoder, run here; inline PTX,
    modelled) is its value times 2**-14, fp16's exponent bias (15) against e2m1's (1), exactly."""
    module = kvgen.load(name)._kernels.module
    factor = 2.0 ** -14
    device = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
    codes = torch.arange(16, dtype=torch.uint8, device=device)
    out = torch.empty(16, dtype=torch.float32, device=device)
    _decode_unscaled[(1,)](codes, out, getattr(module, f"{side}_decode_dot_unscaled"), 16)
    assert _bits(out.tolist()) == _bits([_e2m1(c) * factor for c in range(16)])
    asm = inline_ptx(module, side, "decode_dot_bytes_unscaled")
    for word in range(256):  # every byte in every byte position of the register
        data = [(word + i * 67) % 256 for i in range(4)]
        out = run_ptx(asm, {"$4": sum(b << 8 * i for i, b in enumerate(data))})
        for j in range(2):
            got = list(_f16x2(out[f"${2 * j}"])) + list(_f16x2(out[f"${2 * j + 1}"]))
            assert _bits(got) == _bits([_e2m1((b >> 4 * j) & 15) * factor for b in data]), (name, data, j)


@pytest.mark.parametrize("name", kvgen.shipped_names())
def test_unscaled_decoders_come_with_the_fold(name):
    """Attention calls a side's unscaled decoders (compiled and portable) exactly where it multiplies that side's
    block ratios by the factor they leave out: a decoder without its fold, or a fold without its decoder, would scale
    the values by 2**14 or 2**-14."""
    import inspect
    source = inspect.getsource(kvgen.load(name)._kernels.module.paged_attention_kernel.fn)
    for p in ("k", "v"):
        compiled = f"{p}_decode_dot_bytes_unscaled({p}_byte)" in source
        portable = f"{p}_decode_dot_unscaled({p}_code)" in source
        folded = f"{p}_ratio = {p}_ratio * 16384.0" in source
        scaled = f"{p}_decode_dot_bytes({p}_byte)" in source or f"{p}_decode_dot({p}_code, NATIVE_CASTS)" in source
        assert compiled == portable == folded, (name, p, compiled, portable, folded)
        assert not (folded and scaled), (name, p)


@pytest.mark.parametrize("name,side,value_of", [
    ("nvfp4", "k", _e2m1), ("mxfp4", "v", _e2m1),
    ("int4_per_token_head", "k", lambda c: c),  # uint4
    ("q4_0", "k", lambda c: c - 16 if c >= 8 else c),  # int4, two's complement
    ("kivi_2bit", "k", lambda c: c),  # uint2
    ("signed_msb_first", "k", lambda c: c - 4 if c >= 2 else c),  # int2
    ("signed_msb_first", "v", lambda c: c - 16 if c >= 8 else c),  # int4
])
def test_byte_decode_ptx_model(name, side, value_of, extra_formats):
    """All codes of every byte, four bytes per register, through the byte decoder's PTX as modelled: the codes at
    bit position j of the four bytes in registers $2j and $2j+1, each lane the code's value (oracle: ml_dtypes for
    e2m1, integer arithmetic for integers)."""
    fmt = load(name, extra_formats)
    element = fmt.spec.side("key" if side == "k" else "value").element.value
    bits = {"int4": 4, "uint4": 4, "int2": 2, "uint2": 2, "fp4_e2m1": 4}[element]
    expected = {"q4_0": "int4", "kivi_2bit": "uint2", "signed_msb_first": {"k": "int2", "v": "int4"}[side]}
    if value_of is not _e2m1:
        assert element == expected.get(name, "uint4"), element  # the oracle fits the spec
    per = 8 // bits
    asm = inline_ptx(fmt._kernels.module, side, "decode_dot_bytes")
    for word in range(256):  # every byte in every byte position of the register over the loop
        data = [(word + i * 67) % 256 for i in range(4)]
        out = run_ptx(asm, {f"${2 * per}": sum(b << 8 * i for i, b in enumerate(data))})
        for j in range(per):
            got = list(_f16x2(out[f"${2 * j}"])) + list(_f16x2(out[f"${2 * j + 1}"]))
            want = [value_of((b >> bits * j) & ((1 << bits) - 1)) for b in data]
            assert _bits(got) == _bits(want), (name, data, j, got)


@pytest.mark.parametrize("name,side", [("q4_0", "k"), ("int4_per_token_head", "k"), ("kivi_2bit", "k"),
                                       ("signed_msb_first", "k"), ("signed_msb_first", "v")])
def test_integer_byte_decode_in_place(name, side, extra_formats):
    """Integer byte decoders leave each code at its bit position s in the byte (no shift): per position one mask
    (lop3 with the xor that offsets signed codes, and otherwise), two byte permutes under an fp16 high byte whose ulp
    is 2**-s, two packed subtracts; test_byte_decode_ptx_model checks the values. Every lane reads one input byte:
    the and / lop3 act bit by bit, each prmt moves whole bytes, sub.f16x2 acts per lane, so 256 byte values in each
    of the four byte positions cover all 2**32 registers."""
    fmt = load(name, extra_formats)
    element = fmt.spec.side("key" if side == "k" else "value").element.value
    bits = {"int4": 4, "uint4": 4, "int2": 2, "uint2": 2}[element]
    ops = [i.split()[0] for i in inline_ptx(fmt._kernels.module, side, "decode_dot_bytes").strip("{} ").split(";")
           if i.strip() and not i.strip().startswith((".reg", "mov"))]
    per = 8 // bits
    assert set(ops) <= {"and.b32", "lop3.b32", "prmt.b32", "sub.f16x2"}, ops
    assert len(ops) == 5 * per, ops


@pytest.mark.parametrize("side", ["k", "v"])
def test_biased_decoder(side):
    """The decoder that leaves fp16's 1024 in each byte code (for sides with a zero point per row, whose subtraction
    takes the bias too): the portable path run here over every code, the inline PTX modelled over every code in every
    byte position of its register; each gives code + 1024 exactly."""
    import numpy as np
    module = kvgen.load("int8_asym_per_token_head")._kernels.module
    device = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
    codes = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)
    out = torch.empty(256, dtype=torch.float32, device=device)
    _decode_biased_portable[(1,)](codes, out, getattr(module, f"{side}_decode_dot_biased"), 256)
    assert out.tolist() == [1024.0 + c for c in range(256)]
    asm = inline_ptx(module, side, "decode_dot_biased")
    for word in range(256):
        data = [(word + i * 67) % 256 for i in range(4)]
        out = run_ptx(asm, {"$2": sum(b << 8 * i for i, b in enumerate(data))})
        got = list(_f16x2(out["$0"])) + list(_f16x2(out["$1"]))
        assert _bits(got) == _bits([np.float16(1024 + b) for b in data]), (data, got)


@triton.jit
def _decode_biased_portable(codes_ptr, out_ptr, decode: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, decode(tl.load(codes_ptr + i), False).to(tl.float32))


@pytest.mark.parametrize("name", kvgen.shipped_names())
def test_biased_decoder_comes_with_its_subtraction(name):
    """Attention decodes a side's codes through its biased decoder exactly where the zero point's subtraction also
    takes its 1024 away; the unbiased decoder there would shift every value by -1024, a bias left in by +1024."""
    import inspect
    source = inspect.getsource(kvgen.load(name)._kernels.module.paged_attention_kernel.fn)
    for p in ("k", "v"):
        # one subtraction of zp + 1024 after each biased decode (every loop of the kernel has its own), and none else
        biased = source.count(f"{p}_decode_dot_biased({p}_code, NATIVE_CASTS)")
        taken = source.count(f" + 1024).to({p}_tile.dtype)[:, None]")
        assert biased == taken, (name, p, biased, taken)
        # the shipped sides with a byte code and its zero point per row (a new such format belongs in this list)
        assert (taken > 0) == (name in ("int8_asym_per_token_head", "int8_asym_per_token_head_separate")), (name, p)
