"""Golden tests: page sizes and encoded bytes of every shipped format, computed by hand.

Each format has one hand-made token (token 0) of K and V, all zero except the listed elements, and the bytes it must
produce in its cells (every byte not listed is 0, so every listed field that is not 0 is written out in full). The
same numbers are checked against the NumPy reference and against the generated kernels through the runtime API (the
kernel tests of a format run once its kernels are built: ``name in kvgen.shipped_names()``).

Write setup, the same for every format: 2 blocks of 16 slots, 2 KV heads, head size 32, three tokens with
slot_mapping [17, -1, 3]:
  token 0 -> slot 17 = block 1, offset 1: the hand-made token;
  token 1 -> slot -1: not written (filled with 7.0 so that a stray write shows);
  token 2 -> slot 3 = block 0, offset 3: token 0 with its two heads swapped, so its cells are the expected cells with
             heads swapped (formats with per-head static scales: token 0 itself, since the scale belongs to the head).
Every other byte of every tensor must keep the value it had before the write.

Layout terms (docs/SEMANTICS.md): a tensor's page is a sequence of regions ``[block_size, H, cell]``; expected bytes
are keyed ``(head, cell byte)`` for the one region of ``kv_cache``, or ``(tensor, region, head, cell byte)``.

Bit layouts used by hand: bf16 = 1 | 8 (bias 127) | 7; fp16 = 1 | 5 (bias 15) | 10; e4m3fn = 1 | 4 (bias 7) | 3,
max 448 = 0 1111 110; e5m2 = 1 | 5 (bias 15) | 2, max 57344 = 0 11110 11; e2m1 = 1 | 2 (bias 1) | 1 with codes
0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6 (8..15 the negatives), two per byte, element 2i in the low nibble; e8m0 = the byte
E + 127 of a scale 2**E. Multi-byte values are little-endian. fp32: 1.0 = 0x3F800000, 2.0 = 0x40000000,
0.5 = 0x3F000000, 2**-5 = 0x3D000000, 2**-7 = 0x3C000000, float32(1e-6) = 0x358637BD.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import torch

import kvgen
from kvgen import reference as R
from kvgen.codegen.loader import load_spec

# the kernel tests run on the GPU, compiled, when TRITON_INTERPRET=0 (else on the CPU interpreter)
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
SPECS = Path(__file__).resolve().parent.parent / "specs"
PENDING = Path("/work/pending_specs")  # specs staged before their kernels land
NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE = 2, 16, 2, 32
SLOTS = [17, -1, 3]
CELL_OF_TOKEN0, CELL_OF_TOKEN2 = (1, 1), (0, 3)  # (block, offset)

Elements = dict[tuple[int, int], list[float]]  # (head, first d) -> consecutive input values of token 0
Bytes = dict[tuple, str]  # (head, first cell byte) or (tensor, region, head, first cell byte) -> hex bytes
Regions = tuple[tuple[int, int], ...]  # ((byte offset of the region in the page, cell bytes), ...) at head size 32

# int4_per_token_head rotates with seed 0: signs = 1 - 2 * numpy.random.default_rng(0).integers(0, 2, size=32)
# (a fact of numpy's generator, the definition in SEMANTICS.md; only signs[0] and signs[1] matter below).
S0 = (1 - 2 * np.random.default_rng(0).integers(0, 2, size=32)).astype(float)


@dataclass(frozen=True)
class Golden:
    name: str
    storage: torch.dtype  # dtype of the data tensor(s) (kv_cache, or k_cache / v_cache)
    cell_128: int  # bytes per token and KV head at head size 128: the cells of all regions and tensors, summed
    page_128: int  # page bytes at block 16, 8 KV heads, head size 128 (all tensors)
    cell_32: int  # the kv_cache cell at head size 32 (one-region formats; 0 when `tensors` is given)
    key: Elements
    value: Elements
    expected: Bytes
    k_scale: Any = None  # static scales (per_tensor / per_head formats) or global scales (global_scale formats)
    v_scale: Any = None
    tensors: Optional[dict[str, tuple[torch.dtype, Regions]]] = None  # None: kv_cache with one region (0, cell_32)
    sides_128: Optional[tuple[int, int]] = None  # key, value bytes (data + scales + zero points) at head size 128
    swap_heads: bool = True  # token 2 = token 0 with heads swapped (False: token 0 itself)

    @property
    def tensor_map(self) -> dict[str, tuple[torch.dtype, Regions]]:
        return self.tensors or {"kv_cache": (self.storage, ((0, self.cell_32),))}


GOLDEN = [
    Golden(
        "bf16", torch.bfloat16,
        cell_128=512,  # K 128 x 2 B, V 128 x 2 B
        page_128=65536,  # 16 * 8 * 512
        cell_32=128,  # K 0..63, V 64..127
        key={
            # 1.0 = 0x3F80; 1 + 3 * 2**-8 is the tie of 1 + 2**-7 (m=1, odd) and 1 + 2**-6 (m=2) -> 0x3F82
            # (truncation would give 0x3F81); 1 + 2**-8 + 2**-10 is above the tie of 1.0 and 1 + 2**-7 -> 0x3F81
            (0, 0): [1.0, 1 + 3 * 2.0**-8, 1 + 2.0**-8 + 2.0**-10],
            (1, 0): [-2.0],  # 1 10000000 0000000 = 0xC000
            (1, 31): [3.0],  # 1.5 * 2 = 0 10000000 1000000 = 0x4040, at byte 62
        },
        value={
            (0, 0): [0.5],  # 0 01111110 0000000 = 0x3F00, at byte 64
            (1, 31): [1 + 2.0**-8],  # tie of 1.0 (even) and 1 + 2**-7 -> 0x3F80, at byte 64 + 62 = 126
        },
        expected={
            (0, 0): "80 3F 82 3F 81 3F",
            (1, 0): "00 C0",
            (1, 62): "40 40",
            (0, 64): "00 3F",
            (1, 126): "80 3F",
        },
    ),
    Golden(
        "fp16", torch.float16,
        cell_128=512, page_128=65536, cell_32=128,
        key={
            # 1.0 = 0 01111 0 = 0x3C00; 1 + 3 * 2**-11 ties to m=2 -> 0x3C02; 65504 = 0 11110 1111111111 = 0x7BFF
            (0, 0): [1.0, 1 + 3 * 2.0**-11, 65504.0],
            (1, 0): [-0.5],  # 1 01110 0 = 0xB800
            (1, 31): [2.0**-24],  # smallest subnormal 0x0001, at byte 62
        },
        value={
            (0, 0): [1 + 2.0**-11],  # tie of 1.0 (even) and 1 + 2**-10 -> 0x3C00, at byte 64
            (1, 31): [-2.0],  # 1 10000 0 = 0xC000, at byte 126
        },
        expected={
            (0, 0): "00 3C 02 3C FF 7B",
            (1, 0): "00 B8",
            (1, 62): "01 00",
            (0, 64): "00 3C",
            (1, 126): "00 C0",
        },
    ),
    Golden(
        "fp8_e4m3", torch.uint8,
        cell_128=256,  # K 128 B, V 128 B
        page_128=32768,  # 16 * 8 * 256
        cell_32=64,  # K 0..31, V 32..63
        k_scale=1.0, v_scale=2.0,
        key={
            # 1.0 = 0 0111 000 = 0x38; 1.0625 ties 1.0 / 1.125 -> 1.0 = 0x38; 17 ties 16 / 18 -> 16 = 0 1011 000 =
            # 0x58; 21 ties 20 / 22 -> 20 = 0 1011 010 = 0x5A; 464 clips to 448 = 0x7E; -448 = 0xFE
            (0, 0): [1.0, 1.0625, 17.0, 21.0, 464.0, -448.0],
            # 3 * 2**-10 ties subnormals 2**-9 (m=001) / 2**-8 (m=010) -> 0x02; 2**-10 ties 0 / 2**-9 -> 0x00;
            # -1.5 = 1 0111 100 = 0xBC; 2**-9 = 0x01
            (1, 0): [3 * 2.0**-10, 2.0**-10, -1.5, 2.0**-9],
        },
        value={
            # divided by v_scale 2: 1.5 -> 0x3C; 17 -> 0x58; 500 clips to 448 -> 0x7E; -1 = 1 0111 000 = 0xB8
            (0, 0): [3.0, 34.0, 1000.0, -2.0],
            (1, 31): [0.25],  # 0.125 = 2**-3 = 0 0100 000 = 0x20, at byte 32 + 31 = 63
        },
        expected={
            (0, 0): "38 38 58 5A 7E FE",
            (1, 0): "02 00 BC 01",
            (0, 32): "3C 58 7E B8",
            (1, 63): "20",
        },
    ),
    Golden(
        "fp8_e5m2", torch.uint8,
        cell_128=256, page_128=32768, cell_32=64,
        k_scale=1.0, v_scale=4.0,
        key={
            # 1.0 = 0 01111 00 = 0x3C; 1.125 ties 1.0 / 1.25 -> 0x3C; 1.375 ties 1.25 / 1.5 -> 1.5 = 0 01111 10 =
            # 0x3E; 57344 = 0x7B; 100000 clips to 57344 = 0x7B
            (0, 0): [1.0, 1.125, 1.375, 57344.0, 100000.0],
            # -2 = 1 10000 00 = 0xC0; 2**-16 = smallest subnormal 0x01; 6 = 1.5 * 4 = 0 10001 10 = 0x46
            (1, 0): [-2.0, 2.0**-16, 6.0],
        },
        value={
            (0, 0): [4.0, -8.0, 6.0],  # / 4: 1.0 -> 0x3C; -2 -> 0xC0; 1.5 -> 0x3E
            (1, 31): [2.0**-14],  # / 4 = 2**-16 -> 0x01, at byte 63
        },
        expected={
            (0, 0): "3C 3C 3E 7B 7B",
            (1, 0): "C0 01 46",
            (0, 32): "3C C0 3E",
            (1, 63): "01",
        },
    ),
    Golden(
        "fp8_per_token_head", torch.uint8,
        cell_128=264,  # K 0..127, K scale 128..131, V 132..259, V scale 260..263
        page_128=33792,  # 16 * 8 * 264
        cell_32=72,  # K 0..31, K scale 32..35, V 36..67, V scale 68..71
        key={
            # absmax 448: scale 448 / 448 = 1.0 (00 00 80 3F); 448 -> 0x7E; 17 -> 16 = 0x58; 1.0625 -> 1.0 = 0x38;
            # -21 -> -20 = 0x80 | 0x5A = 0xDA
            (0, 0): [448.0, 17.0, 1.0625, -21.0],
            # absmax 896: scale 2.0 (00 00 00 40), 1 / 2 = 0.5: 448 -> 0x7E; 17 -> 0x58; -1.5 -> 0xBC
            (1, 0): [896.0, 34.0, -3.0],
        },
        value={
            # head 0 all zero: scale max(0 / 448, 1e-6) = float32(1e-6) = 0x358637BD -> BD 37 86 35, codes 0
            # absmax 112: scale 112 / 448 = 0.25 = 0x3E800000, 1 / 0.25 = 4: 448 -> 0x7E; 1.0 -> 0x38;
            # -2.0 = 1 1000 000 = 0xC0
            (1, 0): [112.0, 0.25, -0.5],
        },
        expected={
            (0, 0): "7E 58 38 DA",
            (0, 32): "00 00 80 3F",
            (1, 0): "7E 58 BC",
            (1, 32): "00 00 00 40",
            (0, 68): "BD 37 86 35",
            (1, 36): "7E 38 C0",
            (1, 68): "00 00 80 3E",
        },
    ),
    Golden(
        "int8_per_token_head", torch.int8,
        cell_128=264, page_128=33792, cell_32=72,
        key={
            # absmax 127: scale 1.0, 1 / scale = 1.0; half away from zero = trunc(v + copysign(0.5, v)) in fp32:
            # 127 -> 0x7F; 2.5 -> 3; -2.5 -> -3 = 0xFD; 0.5 -> 1; -0.5 -> -1 = 0xFF;
            # 0.5 - 2**-25: + 0.5 = 1 - 2**-25, the fp32 tie of 1 - 2**-24 (odd) and 1.0 (even) -> 1.0 -> 1;
            # 1.4 -> trunc(1.9) = 1
            (0, 0): [127.0, 2.5, -2.5, 0.5, -0.5, 0.5 - 2.0**-25, 1.4],
            # absmax 254: scale 254 / 127 = 2.0, 1 / 2 = 0.5: 127; 2.5 -> 3; -0.5 -> -1 = 0xFF; 1.5 -> 2
            (1, 0): [254.0, 5.0, -1.0, 3.0],
        },
        value={
            # head 0 all zero: scale float32(1e-6) -> BD 37 86 35, codes 0
            # absmax 127: scale 1.0: -127 = 0x81; 63.5 -> 64 = 0x40; 1.0 -> 1
            (1, 0): [-127.0, 63.5, 1.0],
        },
        expected={
            (0, 0): "7F 03 FD 01 FF 01 01",
            (0, 32): "00 00 80 3F",
            (1, 0): "7F 03 FF 02",
            (1, 32): "00 00 00 40",
            (0, 68): "BD 37 86 35",
            (1, 36): "81 40 01",
            (1, 68): "00 00 80 3F",
        },
    ),
    # ---- formats of the second milestone ----------------------------------------------------------------------------
    Golden(
        "fp8_e4m3_per_head", torch.uint8,
        cell_128=256,  # K 128 B | V 128 B, static scales are not in the page
        page_128=32768,  # 16 * 8 * 256
        cell_32=64,  # K 0..31, V 32..63
        sides_128=(128, 128),
        k_scale=[1.0, 2.0], v_scale=[0.5, 4.0],  # one per KV head, divide
        swap_heads=False,
        key={
            (0, 0): [1.0, 17.0, -448.0],  # / 1: 1.0 = 0x38; 17 ties 16 / 18 -> 16 = 0x58; -448 = 0xFE
            (1, 0): [2.0, 3.0, 1000.0],  # / 2: 1.0 = 0x38; 1.5 = 0 0111 100 = 0x3C; 500 clips to 448 = 0x7E
        },
        value={
            (0, 0): [0.5, -1.0],  # / 0.5: 1.0 = 0x38; -2 = 1 1000 000 = 0xC0, at byte 32
            (1, 30): [4.0, 6.0],  # / 4: 1.0 = 0x38; 1.5 = 0x3C, at bytes 32 + 30 = 62, 63
        },
        expected={
            (0, 0): "38 58 FE",
            (1, 0): "38 3C 7E",
            (0, 32): "38 C0",
            (1, 62): "38 3C",
        },
    ),
    Golden(
        "int4_per_token_head", torch.uint8,
        cell_128=136,  # K 64 B (128 nibbles) | K scale 4 (at 64) | V 64 (68..131) | V scale 4 (132..135)
        page_128=17408,  # 16 * 8 * 136
        cell_32=40,  # K 0..15, K scale 16..19, V 20..35, V scale 36..39
        sides_128=(68, 68),
        # Rotation by hand (head size 32, b = 32, seed 0): with x = signs * u, x * signs = u, and
        # u = [p, q, 0, ...] gives FWHT(u)[i] = p + (-1)^(i & 1) q: p + q at even i, p - q at odd i (exact in fp32).
        key={
            # u = [0.5, 7.5]: x' = 8 (even), -7 (odd); lo -7, hi 8: scale (8 + 7) / 15 = 1.0 = 0x3F800000;
            # zp = round_half_away(7 / 1) = 7; codes 8 + 7 = 15 (even i, low nibble), -7 + 7 = 0 (odd i, high
            # nibble): every data byte 0x0F; stored scale bits 0x3F800000 & ~0xF | 7 = 0x3F800007 -> 07 00 80 3F
            (0, 0): [0.5 * S0[0], 7.5 * S0[1]],
            # head 1 all zero: lo = hi = 0, scale floor float32(1e-6) = 0x358637BD, low 4 bits cleared -> 0x358637B0,
            # zp = round(-0 / s) = 0: B0 37 86 35; codes 0
        },
        value={
            # head 0 all zero: scale B0 37 86 35 at byte 36
            # u = [-2, 3.75]: x' = 1.75 (even), -5.75 (odd); scale 7.5 / 15 = 0.5 = 0x3F000000;
            # zp = round_half_away(5.75 / 0.5 = 11.5) = 12; even: 3.5 + 12 = 15.5 -> 16 -> clamped to 15 (the zero
            # point's rounding saturates the top code); odd: -11.5 + 12 = 0.5 -> 1: bytes 0x1F; scale bits
            # 0x3F000000 | 12 = 0x3F00000C -> 0C 00 00 3F
            (1, 0): [-2.0 * S0[0], 3.75 * S0[1]],
        },
        expected={
            (0, 0): "0F" * 16,
            (0, 16): "07 00 80 3F",
            (1, 16): "B0 37 86 35",
            (0, 36): "B0 37 86 35",
            (1, 20): "1F" * 16,
            (1, 36): "0C 00 00 3F",
        },
    ),
    Golden(
        "int8_asym_per_token_head", torch.uint8,
        # K 0..127 | K scale (align 4) 128..131 | K zp 132 | V (data_align 4) 136..263 | V scale (align 4)
        # 264..267 | V zp 268; end 269 -> the cell ends at a multiple of 4: 272
        cell_128=272,
        page_128=34816,  # 16 * 8 * 272
        # K 0..31 | K scale 32..35 | K zp 36 | V 40..71 | V scale 72..75 | V zp 76; end 77 -> 80
        cell_32=80,
        sides_128=(133, 133),  # 128 + 4 + 1
        key={
            # lo -1, hi 0.9921875 = 127 / 128: scale 1.9921875 / 255 = 1 / 128 = 2**-7 -> 00 00 00 3C;
            # zp = round(1 / 2**-7) = 128 = 0x80; codes x * 128 + 128, half to even: -1 -> 0; 127/128 -> 255;
            # 0.5 -> 192 = 0xC0; 1/256 -> 128.5 -> 128 (even); 3/256 -> 129.5 -> 130 = 0x82; every zero -> 0x80
            (0, 0): [-1.0, 0.9921875, 0.5, 1 / 256, 3 / 256],
            # head 1 all zero: scale float32(1e-6) BD 37 86 35, zp round(-0 / s) = 0, codes 0
        },
        value={
            # head 0 all zero: as key head 1, at bytes 72 and 76
            # lo -3, hi 4.96875 = 159 / 32: scale 7.96875 / 255 = 1 / 32 = 2**-5 -> 00 00 00 3D; zp 3 * 32 = 96 =
            # 0x60; codes: -3 -> 0; 4.96875 -> 255; 1.0 -> 128 = 0x80; every zero -> 0x60
            (1, 0): [-3.0, 4.96875, 1.0],
        },
        expected={
            (0, 0): "00 FF C0 80 82" + " 80" * 27,
            (0, 32): "00 00 00 3C 80",
            (1, 32): "BD 37 86 35 00",
            (0, 72): "BD 37 86 35 00",
            (1, 40): "00 FF 80" + " 60" * 29,
            (1, 72): "00 00 00 3D 60",
        },
    ),
    Golden(
        "int8_per_token_head_separate", torch.int8,
        # kv_cache cell K 128 | V 128 = 256; k_scale_cache and v_scale_cache: one fp32 each (cell 4):
        # 256 + 4 + 4 = 264 per token and head (the bytes of int8_per_token_head, scales moved out)
        cell_128=264,
        page_128=33792,  # 16 * 8 * (256 + 4 + 4)
        cell_32=0,
        sides_128=(132, 132),
        tensors={
            "kv_cache": (torch.int8, ((0, 64),)),  # K 0..31, V 32..63
            "k_scale_cache": (torch.float32, ((0, 4),)),  # fp32 scale dtype without a zero point -> fp32 storage
            "v_scale_cache": (torch.float32, ((0, 4),)),
        },
        key={
            # absmax 127: scale 1.0, 1 / s = 1: half away from zero: 127; 2.5 -> 3; -2.5 -> -3 = 0xFD;
            # 0.5 - 2**-25 -> (1 - 2**-25 ties to 1.0 in fp32) -> 1
            (0, 0): [127.0, 2.5, -2.5, 0.5 - 2.0**-25],
            # absmax 254: scale 2.0, 1 / s = 0.5: 127; 2.5 -> 3; -0.5 -> -1 = 0xFF; 1.5 -> 2
            (1, 0): [254.0, 5.0, -1.0, 3.0],
        },
        value={
            # head 0 all zero: scale float32(1e-6); absmax 127: scale 1.0: -127 = 0x81; 63.5 -> 64 = 0x40; 1 -> 1
            (1, 0): [-127.0, 63.5, 1.0],
        },
        expected={
            ("kv_cache", 0, 0, 0): "7F 03 FD 01",
            ("kv_cache", 0, 1, 0): "7F 03 FF 02",
            ("kv_cache", 0, 1, 32): "81 40 01",
            ("k_scale_cache", 0, 0, 0): "00 00 80 3F",
            ("k_scale_cache", 0, 1, 0): "00 00 00 40",
            ("v_scale_cache", 0, 0, 0): "BD 37 86 35",
            ("v_scale_cache", 0, 1, 0): "00 00 80 3F",
        },
    ),
    Golden(
        "mixed_k8_v4", torch.uint8,
        cell_128=200,  # K 128 | K scale 4 (128..131) | V 64 (132..195) | V scale 4 (196..199)
        page_128=25600,  # 16 * 8 * 200
        cell_32=56,  # K 0..31 | K scale 32..35 | V 36..51 | V scale 52..55
        sides_128=(132, 68),
        key={
            (0, 0): [127.0, -2.5],  # scale 1.0: 0x7F, -3 = 0xFD (half away from zero)
            # the dynamic scale's default `apply` (SEMANTICS: reciprocal_multiply) where it differs from divide: fp32
            # s = 170.67393 / 127 = 1.3438892 (0x3FAC0490), 1 / s times 109.52697 = 81.49999 -> 81 = 0x51 (divide:
            # exactly 81.5 -> 82); 170.67393 * (1 / s) = 127.0 -> 0x7F
            (1, 0): [170.67393, 109.52697],
        },
        value={
            # int4, qmax 7, half to even, 1 / s: absmax 7 -> scale 1.0: 7; -3.5 -> -4 (even) = 0xC; 2.5 -> 2;
            # 0.5 -> 0; -7 = 0x9; 1.5 -> 2; bytes (element 2i low nibble): 0xC7, 0x02, 0x29
            (0, 0): [7.0, -3.5, 2.5, 0.5, -7.0, 1.5],
            # absmax 14 -> scale 2.0, 1 / s = 0.5: 7; -4 = 0xC; 0.5 -> 0; 1.5 -> 2: 0xC7, 0x20
            (1, 0): [14.0, -8.0, 1.0, 3.0],
        },
        expected={
            (0, 0): "7F FD",
            (1, 0): "7F 51",
            (0, 32): "00 00 80 3F",
            (1, 32): "90 04 AC 3F",
            (0, 36): "C7 02 29",
            (0, 52): "00 00 80 3F",
            (1, 36): "C7 20",
            (1, 52): "00 00 00 40",
        },
    ),
    Golden(
        "mxfp8", torch.uint8,
        # k_cache 128 | k_scale_cache 4 e8m0 bytes (one per 32) | the same for V: 2 x (128 + 4) = 264
        cell_128=264,
        page_128=33792,  # 16 * 8 * 264
        cell_32=0,
        sides_128=(132, 132),
        tensors={
            "k_cache": (torch.uint8, ((0, 32),)),
            "k_scale_cache": (torch.uint8, ((0, 1),)),  # e8m0 -> uint8 storage; one block of 32 at head size 32
            "v_cache": (torch.uint8, ((0, 32),)),
            "v_scale_cache": (torch.uint8, ((0, 1),)),
        },
        key={
            # amax 672 = 448 * 1.5: s = 1.5, E = ceil(log2 1.5) = 1 -> byte 128 = 0x80, s = 2 (divide):
            # 336 in [256, 512) steps 32: tie of 320 (m=010) and 352 (m=011) -> 320 = 0 1111 010 = 0x7A;
            # 17 -> 16 = 0x58; -1.5 = 0xBC
            (0, 0): [672.0, 34.0, -3.0],
            # head 1 all zero: s = max(0, 1e-6, 2**-127) = 1e-6, E = ceil(-19.93) = -19 -> byte 108 = 0x6C
        },
        value={
            # amax 448: s = 1, E = 0 -> 0x7F: 448 = 0x7E; -1.0625 -> -1 = 0xB8; 2**-9 = 0x01
            (0, 0): [448.0, -1.0625, 2.0**-9],
            # amax 449: s = 449 / 448 > 1, E = 1 -> 0x80, s = 2: 224.5 in [128, 256) steps 16 -> 224 = 0 1110 110 =
            # 0x76; 0.25 = 0 0101 000 = 0x28
            (1, 0): [449.0, 0.5],
        },
        expected={
            ("k_cache", 0, 0, 0): "7A 58 BC",
            ("k_scale_cache", 0, 0, 0): "80",
            ("k_scale_cache", 0, 1, 0): "6C",
            ("v_cache", 0, 0, 0): "7E B8 01",
            ("v_cache", 0, 1, 0): "76 28",
            ("v_scale_cache", 0, 0, 0): "7F",
            ("v_scale_cache", 0, 1, 0): "80",
        },
    ),
    Golden(
        "mxfp4", torch.uint8,
        cell_128=136,  # 2 x (64 + 4)
        page_128=17408,  # 16 * 8 * 136
        cell_32=0,
        sides_128=(68, 68),
        tensors={
            "k_cache": (torch.uint8, ((0, 16),)),
            "k_scale_cache": (torch.uint8, ((0, 1),)),
            "v_cache": (torch.uint8, ((0, 16),)),
            "v_scale_cache": (torch.uint8, ((0, 1),)),
        },
        key={
            # amax 9 = 6 * 1.5: s = 1.5 -> E = 1, byte 0x80, s = 2: 4.5 -> 4 = code 6; 2.5 ties 2 (code 4) / 3
            # (code 5) -> code 4; -1.25 ties -1 (0xA) / -1.5 (0xB) -> 0xA; 0.25 ties 0 / 0.5 -> code 0; 0.5 = code 1;
            # 3.5 ties 3 (5) / 4 (6) -> code 6. Bytes: 6 | 4 << 4 = 0x46; 0xA | 0 << 4 = 0x0A; 1 | 6 << 4 = 0x61
            (0, 0): [9.0, 5.0, -2.5, 0.5, 1.0, 7.0],
            # head 1 all zero: E = ceil(log2 1e-6) = -19 -> 0x6C
        },
        value={
            # amax 6: s = 1, byte 0x7F: 6 = code 7; -6 = 0xF; 0.75 ties 0.5 / 1 -> code 2; -0.25 ties -0 (0x8) and
            # -0.5 (0x9) -> 0x8 (negative zero keeps its sign bit); 1.75 ties 1.5 / 2 -> code 4; 5 ties 4 / 6 ->
            # code 6. Bytes 7 | 0xF << 4 = 0xF7; 2 | 8 << 4 = 0x82; 4 | 6 << 4 = 0x64
            (0, 0): [6.0, -6.0, 0.75, -0.25, 1.75, 5.0],
            # amax 0.75: s = 0.125, E = -3 -> byte 124 = 0x7C: 6 = code 7; -0.1 / 0.125 = -0.8 -> -1 = 0xA: 0xA7
            (1, 0): [0.75, -0.1],
        },
        expected={
            ("k_cache", 0, 0, 0): "46 0A 61",
            ("k_scale_cache", 0, 0, 0): "80",
            ("k_scale_cache", 0, 1, 0): "6C",
            ("v_cache", 0, 0, 0): "F7 82 64",
            ("v_cache", 0, 1, 0): "A7",
            ("v_scale_cache", 0, 0, 0): "7F",
            ("v_scale_cache", 0, 1, 0): "7C",
        },
    ),
]

# NVFP4 inputs and bytes, shared by the two layouts. Global scales g: K 2.0, V 0.5. Per block of 16:
# s = amax / 6 / g, floored at max(1e-6, 2**-9), rounded to e4m3 (saturating at 448) = s_q; s_eff = s_q * g.
NVFP4_KEY = {
    # block 0: amax 24: 24 / 6 / 2 = 2 = 0x40, s_eff 4: 6 = code 7; -2.5 ties -2 (0xC) / -3 (0xD) -> 0xC;
    #   0.75 ties 0.5 / 1 -> code 2: bytes 7 | 0xC << 4 = 0xC7, 0x02
    # block 1 (d 16): amax 1: float32(1 / 6) / 2 = 0.083333336, in [2**-4, 2**-3) steps 2**-7: 10.67 steps ->
    #   11 -> 0.0859375 = 0 0011 011 = 0x1B; s_eff 0.171875: 1 / 0.171875 = 5.82 -> 6 = code 7, byte 8 = 0x07
    (0, 0): [24.0, -10.0, 3.0],
    (0, 16): [1.0],
    # head 1 all zero: both blocks s = max(0, 1e-6, 2**-9) = 2**-9 = 0x01
}
NVFP4_VALUE = {
    # head 0 block 0: amax 3: 3 / 6 / 0.5 = 1 = 0x38, s_eff 0.5: 6 = code 7; -0.5 = 0x9; 2.5 ties 2 / 3 -> code 4:
    #   bytes 0x97, 0x04; block 1 all zero -> 0x01
    (0, 0): [3.0, -0.25, 1.25],
    # head 1 block 0: amax 6000: 6000 / 6 / 0.5 = 2000 saturates to 448 = 0x7E, s_eff 224: 26.8 clips to 6 = code 7;
    #   block 1: amax 6: 6 / 6 / 0.5 = 2 = 0x40, s_eff 1: -6 = 0xF, at byte 8
    (1, 0): [6000.0],
    (1, 16): [-6.0],
}
NVFP4_BYTES = {
    "k_data": {0: "C7 02 00 00 00 00 00 00 07"},
    "k_scale": {0: "40 1B", 1: "01 01"},
    "v_data": {0: "97 04", 1: "07 00 00 00 00 00 00 00 0F"},
    "v_scale": {0: "38 01", 1: "7E 40"},
}


def _nvfp4_expected(where: dict[str, tuple[str, int]]) -> Bytes:
    return {(where[f][0], where[f][1], head, 0): text
            for f, heads in NVFP4_BYTES.items() for head, text in heads.items()}


GOLDEN += [
    Golden(
        "nvfp4", torch.uint8,
        # one tensor, four regions per page: [K data 64][K scales 8][V data 64][V scales 8] per (slot, head)
        cell_128=144,
        page_128=18432,  # 16 * 8 * (64 + 8 + 64 + 8)
        cell_32=0,
        sides_128=(72, 72),
        k_scale=2.0, v_scale=0.5,
        # head size 32, 16 slots x 2 heads: K data 32 x 16 = 512 B at 0; K scales 32 x 2 = 64 B at 512;
        # V data at 576; V scales at 1088; page 1152 -> shape [2, 1152]
        tensors={"kv_cache": (torch.uint8, ((0, 16), (512, 2), (576, 16), (1088, 2)))},
        key=NVFP4_KEY, value=NVFP4_VALUE,
        expected=_nvfp4_expected({"k_data": ("kv_cache", 0), "k_scale": ("kv_cache", 1),
                                  "v_data": ("kv_cache", 2), "v_scale": ("kv_cache", 3)}),
    ),
    Golden(
        "nvfp4_separate", torch.uint8,
        cell_128=144,  # k_cache 64 | k_scale_cache 8 (e4m3, uint8 storage) | v_cache 64 | v_scale_cache 8
        page_128=18432,
        cell_32=0,
        sides_128=(72, 72),
        k_scale=2.0, v_scale=0.5,
        tensors={
            "k_cache": (torch.uint8, ((0, 16),)),
            "k_scale_cache": (torch.uint8, ((0, 2),)),
            "v_cache": (torch.uint8, ((0, 16),)),
            "v_scale_cache": (torch.uint8, ((0, 2),)),
        },
        key=NVFP4_KEY, value=NVFP4_VALUE,
        expected=_nvfp4_expected({"k_data": ("k_cache", 0), "k_scale": ("k_scale_cache", 0),
                                  "v_data": ("v_cache", 0), "v_scale": ("v_scale_cache", 0)}),
    ),
    Golden(
        "q8_0", torch.uint8,
        cell_128=272,  # K 128 | K scales 4 x fp16 (128..135) | V 136..263 | V scales 264..271: 2 x (128 + 8)
        page_128=34816,  # 16 * 8 * 272
        cell_32=68,  # one block of 32: K 0..31 | K scale 32..33 | V 34..65 | V scale 66..67
        sides_128=(136, 136),
        key={
            # amax 127: s = 1.0 = fp16 0x3C00 -> 00 3C; half away from zero: 127, 3, -3 = 0xFD
            (0, 0): [127.0, 2.5, -2.5],
            # amax 1: float32(1 / 127) -> fp16: 1.00787 * 2**-7, mantissa 1032.06 / 1024 -> 1032: 0 01000 0000001000 =
            # 0x2008 (s_q = 1032 * 2**-17); 1 / s_q = 127.0078: 1 -> 127 = 0x7F; -0.5 -> -63.5039 -> -64 = 0xC0
            (1, 0): [1.0, -0.5],
        },
        value={
            # head 0 all zero: float32(1e-6) -> fp16 subnormal 1e-6 / 2**-24 = 16.78 -> 17 = 0x0011 -> 11 00
            # amax 254: s = 2 = 0x4000, 1 / s = 0.5: -127 = 0x81; 2.5 -> 3; 1.5 -> 2
            (1, 0): [-254.0, 5.0, 3.0],
        },
        expected={
            (0, 0): "7F 03 FD",
            (0, 32): "00 3C",
            (1, 0): "7F C0",
            (1, 32): "08 20",
            (0, 66): "11 00",
            (1, 34): "81 03 02",
            (1, 66): "00 40",
        },
    ),
    Golden(
        "q4_0", torch.uint8,
        cell_128=144,  # K 64 | K scales 8 (64..71) | V 72..135 | V scales 136..143: 2 x (64 + 8)
        page_128=18432,  # 16 * 8 * 144
        cell_32=36,  # K 0..15 | K scale 16..17 | V 18..33 | V scale 34..35
        sides_128=(72, 72),
        key={
            # amax 7: s = 1 (00 3C), divide, half to even: 7; -4 (0xC); 2; 0; -7 (0x9); 2 -> C7 02 29
            (0, 0): [7.0, -3.5, 2.5, 0.5, -7.0, 1.5],
            # amax 0.7: float32(0.7) / 7 = 0.1 -> fp16 1.6 * 2**-4, mantissa 614.4 -> 614 = 0x266: 0x2E66 = 66 2E
            # (s_q = 0.0999755859375): 0.7 / s_q = 7.0017 -> 7; -0.35 / s_q = -3.5009 -> -4 = 0xC: byte 0xC7
            (1, 0): [0.7, -0.35],
        },
        value={
            # head 0 all zero: fp16(1e-6) = 0x0011 -> 11 00
            # amax 14: s = 2 (00 40): 7; -4 = 0xC; 0.5 -> 0 (even); 1.5 -> 2: C7 20
            (1, 0): [14.0, -8.0, 1.0, 3.0],
        },
        expected={
            (0, 0): "C7 02 29",
            (0, 16): "00 3C",
            (1, 0): "C7",
            (1, 16): "66 2E",
            (0, 34): "11 00",
            (1, 18): "C7 20",
            (1, 34): "00 40",
        },
    ),
]
IDS = [g.name for g in GOLDEN]


# --- specs, inputs and expected bytes -------------------------------------------------------------------------------

def spec_of(name: str):
    """The spec from specs/, or from the staging folder until it moves there; never rejected as unsupported."""
    for folder in (SPECS, PENDING):
        path = folder / f"{name}.yaml"
        if path.is_file():
            return load_spec(path, supported=False)
    pytest.skip(f"no spec file for {name}")


def built(name: str) -> bool:
    return name in kvgen.shipped_names()


def _token0(elements: Elements) -> np.ndarray:
    x = np.zeros((NUM_KV_HEADS, HEAD_SIZE), np.float32)
    for (head, d), values in elements.items():
        x[head, d:d + len(values)] = values
    return x


def inputs(g: Golden) -> tuple[np.ndarray, np.ndarray]:
    """key, value float32 [3, H, D] for the slots [17, -1, 3]."""
    out = []
    for elements in (g.key, g.value):
        t0 = _token0(elements)
        out.append(np.stack([t0, np.full_like(t0, 7.0), t0[::-1] if g.swap_heads else t0]))
    return out[0], out[1]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def page_32(regions: Regions) -> int:
    """Page bytes of one tensor at head size 32 (no padding after the last region in these formats)."""
    offset, cell = regions[-1]
    return offset + BLOCK_SIZE * NUM_KV_HEADS * cell


def shape_32(dtype: torch.dtype, regions: Regions) -> tuple[int, ...]:
    """The tensor's shape in storage elements: one region [blocks, block_size, H, cell], several [blocks, page]."""
    if len(regions) == 1:
        return (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, regions[0][1] // _itemsize(dtype))
    return (NUM_BLOCKS, page_32(regions) // _itemsize(dtype))


def expected_cells(g: Golden) -> dict[tuple[str, int], np.ndarray]:
    """uint8 [H, cell bytes] of token 0 in every region: {(tensor, region): cells}."""
    cells = {(name, r): np.zeros((NUM_KV_HEADS, cell), np.uint8)
             for name, (_, regions) in g.tensor_map.items() for r, (_, cell) in enumerate(regions)}
    for place, text in g.expected.items():
        tensor, region, head, start = ("kv_cache", 0, *place) if len(place) == 2 else place
        data = bytes.fromhex(text)
        cells[(tensor, region)][head, start:start + len(data)] = list(data)
    return cells


def expected_after(g: Golden, before: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The bytes every tensor ([blocks, page] uint8) must hold after the write."""
    after = {name: a.copy() for name, a in before.items()}
    for (name, r), cell in expected_cells(g).items():
        offset, size = g.tensor_map[name][1][r]
        region = after[name][:, offset:offset + BLOCK_SIZE * NUM_KV_HEADS * size]
        region = region.reshape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, size)
        region[CELL_OF_TOKEN0] = cell
        region[CELL_OF_TOKEN2] = cell[::-1] if g.swap_heads else cell
    return after


def check_write(g: Golden, before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> None:
    """Every tensor holds the expected bytes: the two written slots, and every other byte unchanged."""
    assert set(after) == set(g.tensor_map)
    want = expected_after(g, before)
    for name, got in after.items():
        assert got.shape == (NUM_BLOCKS, page_32(g.tensor_map[name][1])), name
        if not np.array_equal(got, want[name]):
            diff = np.argwhere(got != want[name])
            b, i = diff[0]
            raise AssertionError(f"{name}: {len(diff)} bytes differ; first at block {b} page byte {i}: got "
                                 f"{got[b, i]:#04x}, expected {want[name][b, i]:#04x}")


def static_scales(g: Golden) -> dict[str, Any]:
    return {} if g.k_scale is None else {"k_scale": g.k_scale, "v_scale": g.v_scale}


# --- the reference --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("g", GOLDEN, ids=IDS)
def test_reference_page_bytes(g: Golden) -> None:
    spec = spec_of(g.name)
    assert R.page_bytes(spec, 16, 8, 128) == g.page_128
    per = R.bytes_per_token_head(spec, 128)
    assert per["total"] == g.cell_128
    if g.sides_128 is not None:
        assert (per["key"], per["value"]) == g.sides_128
    if g.tensors is None:
        assert R.cell_layout(spec, 128)["cell_bytes"] == g.cell_128
        assert R.cell_layout(spec, HEAD_SIZE)["cell_bytes"] == g.cell_32
    assert R.page_bytes(spec, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE) == \
        sum(page_32(regions) for _, regions in g.tensor_map.values())
    shapes = R.tensor_shapes(spec, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    dtype_names = {torch.uint8: "uint8", torch.int8: "int8", torch.float16: "fp16", torch.bfloat16: "bf16",
                   torch.float32: "fp32"}
    assert shapes == {name: (shape_32(dtype, regions), dtype_names[dtype])
                      for name, (dtype, regions) in g.tensor_map.items()}


@pytest.mark.parametrize("g", GOLDEN, ids=IDS)
def test_reference_bytes(g: Golden) -> None:
    spec = spec_of(g.name)
    key, value = inputs(g)
    cache = R.new_cache(spec, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    before = {name: a.copy() for name, a in cache.items()}
    R.write(spec, cache, key, value, np.array(SLOTS), **static_scales(g))
    check_write(g, before, cache)


# --- the kernels, through the runtime -------------------------------------------------------------------------------

def _needs_kernels(g: Golden):
    return pytest.param(g, id=g.name, marks=pytest.mark.skipif(not built(g.name), reason="kernels not built yet"))


@pytest.mark.parametrize("g", [_needs_kernels(g) for g in GOLDEN])
def test_kernel_page_bytes(g: Golden) -> None:
    fmt = kvgen.load(g.name)
    assert fmt.page_bytes(16, 8, 128) == g.page_128
    assert fmt.page_bytes(BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE) == \
        sum(page_32(regions) for _, regions in g.tensor_map.values())
    cache = fmt.allocate(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device="cpu", **static_scales(g))
    assert set(cache.tensors) - {"k_scale", "v_scale"} == set(g.tensor_map)  # no storage the golden does not name
    for name, (dtype, regions) in g.tensor_map.items():
        t = cache.tensors[name]
        assert t.dtype == dtype, name
        assert tuple(t.shape) == shape_32(dtype, regions), name


@pytest.mark.parametrize("g", [_needs_kernels(g) for g in GOLDEN])
def test_kernel_bytes(g: Golden) -> None:
    fmt = kvgen.load(g.name)
    cache = fmt.allocate(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device=DEVICE, **static_scales(g))
    if g.k_scale is not None:
        assert cache.tensors["k_scale"].float().cpu().reshape(-1).tolist() == np.ravel(g.k_scale).tolist()
        assert cache.tensors["v_scale"].float().cpu().reshape(-1).tolist() == np.ravel(g.v_scale).tolist()

    # every storage tensor the cache holds (not only those the golden names, so a stray one shows), but the static
    # scales, which are the format's inputs
    def pages() -> dict[str, np.ndarray]:
        return {name: t.view(torch.uint8).reshape(NUM_BLOCKS, -1).cpu().numpy().copy()
                for name, t in cache.tensors.items() if name not in ("k_scale", "v_scale")}

    before = pages()
    key, value = inputs(g)
    fmt.write(cache, torch.from_numpy(key).to(DEVICE), torch.from_numpy(value).to(DEVICE),
              torch.tensor(SLOTS, dtype=torch.int64, device=DEVICE))
    check_write(g, before, pages())
