"""Golden tests: page sizes and encoded bytes of every shipped format, computed by hand.

Each format has one hand-made token (token 0) of K and V, all zero except the listed elements, and the bytes it must
produce in its cell (every byte not listed is 0: a zero input encodes to 0 in all shipped formats). The same numbers
are checked against the NumPy reference and against the generated kernels through the runtime API.

Write setup, the same for every format: 2 blocks of 16 slots, 2 KV heads, head size 32, three tokens with
slot_mapping [17, -1, 3]:
  token 0 -> slot 17 = block 1, offset 1: the hand-made token;
  token 1 -> slot -1: not written (filled with 7.0 so that a stray write shows);
  token 2 -> slot 3 = block 0, offset 3: token 0 with its two heads swapped, so its cell is the expected cell with
             heads swapped.
Every other slot must keep the bytes it had before the write.

Bit layouts used by hand: bf16 = 1 | 8 (bias 127) | 7; fp16 = 1 | 5 (bias 15) | 10; e4m3fn = 1 | 4 (bias 7) | 3,
max 448 = 0 1111 110; e5m2 = 1 | 5 (bias 15) | 2, max 57344 = 0 11110 11. Multi-byte values are little-endian.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import torch

from kvgen import reference as R
from kvgen.codegen.loader import load_spec

SPECS = Path(__file__).resolve().parent.parent / "specs"
NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE = 2, 16, 2, 32
SLOTS = [17, -1, 3]
CELL_OF_TOKEN0, CELL_OF_TOKEN2 = (1, 1), (0, 3)  # (block, offset)

Elements = dict[tuple[int, int], list[float]]  # (head, first d) -> consecutive input values of token 0
Bytes = dict[tuple[int, int], str]  # (head, first cell byte) -> hex bytes


@dataclass(frozen=True)
class Golden:
    name: str
    storage: torch.dtype  # dtype of the kv_cache tensor
    cell_128: int  # cell bytes at head size 128
    page_128: int  # page bytes at block 16, 8 KV heads, head size 128
    cell_32: int  # cell bytes at head size 32
    key: Elements
    value: Elements
    expected: Bytes
    k_scale: Optional[float] = None  # static scales (per_tensor formats)
    v_scale: Optional[float] = None


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
]
IDS = [g.name for g in GOLDEN]


# --- inputs and expected bytes --------------------------------------------------------------------------------------

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
        out.append(np.stack([t0, np.full_like(t0, 7.0), t0[::-1]]))
    return out[0], out[1]


def expected_cell(g: Golden) -> np.ndarray:
    """uint8 [H, cell bytes] of token 0's cell."""
    cell = np.zeros((NUM_KV_HEADS, g.cell_32), np.uint8)
    for (head, start), text in g.expected.items():
        data = bytes.fromhex(text)
        cell[head, start:start + len(data)] = list(data)
    return cell


def check_write(g: Golden, before: np.ndarray, after: np.ndarray) -> None:
    """The written cells hold the expected bytes; every other slot is unchanged."""
    assert after.shape == (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, g.cell_32)
    cell = expected_cell(g)
    np.testing.assert_array_equal(after[CELL_OF_TOKEN0], cell, err_msg="token 0 at slot 17")
    np.testing.assert_array_equal(after[CELL_OF_TOKEN2], cell[::-1], err_msg="token 2 at slot 3")
    untouched = np.ones((NUM_BLOCKS, BLOCK_SIZE), bool)
    untouched[CELL_OF_TOKEN0] = untouched[CELL_OF_TOKEN2] = False
    np.testing.assert_array_equal(after[untouched], before[untouched], err_msg="a slot that was not written changed")


def static_scales(g: Golden) -> dict[str, Any]:
    return {} if g.k_scale is None else {"k_scale": g.k_scale, "v_scale": g.v_scale}


# --- the reference --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("g", GOLDEN, ids=IDS)
def test_reference_page_bytes(g: Golden) -> None:
    spec = load_spec(SPECS / f"{g.name}.yaml")
    assert R.cell_layout(spec, 128)["cell_bytes"] == g.cell_128
    assert R.page_bytes(spec, 16, 8, 128) == g.page_128
    assert R.cell_layout(spec, HEAD_SIZE)["cell_bytes"] == g.cell_32
    assert R.page_bytes(spec, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE) == BLOCK_SIZE * NUM_KV_HEADS * g.cell_32


@pytest.mark.parametrize("g", GOLDEN, ids=IDS)
def test_reference_bytes(g: Golden) -> None:
    spec = load_spec(SPECS / f"{g.name}.yaml")
    key, value = inputs(g)
    cache = R.new_cache_bytes(spec, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    before = cache.copy()
    R.write(spec, cache, key, value, np.array(SLOTS), **static_scales(g))
    check_write(g, before, cache)


# --- the kernels, through the runtime -------------------------------------------------------------------------------

@pytest.mark.parametrize("g", GOLDEN, ids=IDS)
def test_kernel_page_bytes(g: Golden) -> None:
    import kvgen

    fmt = kvgen.load(g.name)
    assert fmt.page_bytes(16, 8, 128) == g.page_128
    assert fmt.page_bytes(BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE) == BLOCK_SIZE * NUM_KV_HEADS * g.cell_32
    cache = fmt.allocate(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device="cpu", **static_scales(g))
    kv = cache.tensors["kv_cache"]
    assert kv.dtype == g.storage
    assert tuple(kv.view(torch.uint8).shape) == (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, g.cell_32)


@pytest.mark.parametrize("g", GOLDEN, ids=IDS)
def test_kernel_bytes(g: Golden) -> None:
    import kvgen

    fmt = kvgen.load(g.name)
    cache = fmt.allocate(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device="cpu", **static_scales(g))
    if g.k_scale is not None:
        assert cache.tensors["k_scale"].float().reshape(-1).tolist() == [g.k_scale]
        assert cache.tensors["v_scale"].float().reshape(-1).tolist() == [g.v_scale]
    kv = cache.tensors["kv_cache"]
    before = kv.view(torch.uint8).cpu().numpy().copy()
    key, value = inputs(g)
    fmt.write(cache, torch.from_numpy(key), torch.from_numpy(value), torch.tensor(SLOTS, dtype=torch.int64))
    after = cache.tensors["kv_cache"].view(torch.uint8).cpu().numpy()
    check_write(g, before, after)
