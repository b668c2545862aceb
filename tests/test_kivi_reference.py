"""The NumPy reference of KIVI (docs/SEMANTICS.md, "Float zero points" and "KIVI"), against hand-computed values.

Covers: float zero points in the per-token / per-block path (bytes, alignment, round trip, error bound); Q(L); the
KIVI page and residual sizes of the shipped specs; one key group and one value group of a tiny G = 4 spec byte by
byte; the residual ring (indices, read-before-write on collisions); stream equivalence (one prefill == decode steps ==
random chunked batches of several sequences with padding rows); read error bounds; attention on the read state.

fp16 bits: 1 | 5 (bias 15) | 10, little-endian; 1.0 = 0x3C00, -1.0 = 0xBC00, 2.0 = 0x4000, -3.0 = 0xC200,
0.5 = 0x3800; the scale floor 1e-6 rounds to the subnormal 17 * 2**-24 = 0x0011.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgen import reference as R
from kvgen.codegen.loader import load_spec
from kvgen.codegen.spec import FormatSpec

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = (ROOT / "specs", Path("/work/pending_kivi"))


def kivi_spec(bits: int) -> FormatSpec:
    for folder in FOLDERS:
        path = folder / f"kivi_{bits}bit.yaml"
        if path.is_file():
            return load_spec(path, supported=False)
    pytest.skip(f"no spec file for kivi_{bits}bit")


def make_spec(key: dict[str, Any], value: Optional[dict[str, Any]] = None, **cache: Any) -> FormatSpec:
    return FormatSpec.model_validate({"name": "t", "key": key, "value": value or key, "cache": cache})


def tiny_spec(residual_dtype: str = "fp32", value_block: int = 2, apply: str = "divide") -> FormatSpec:
    """G = 4, R = 4; 2-bit keys per channel group, 2-bit values per block of ``value_block`` channels."""
    residual = {"tokens": 4, "dtype": residual_dtype}
    zp = {"storage": "beside_scale", "dtype": "fp16"}
    key = {"element": "uint2", "zero_point": zp, "residual": residual,
           "scale": {"granularity": "per_channel_group", "group_tokens": 4, "dtype": "fp16",
                     "placement": "page_end", "apply": apply}}
    value = {"element": "uint2", "zero_point": zp, "residual": residual,
             "scale": {"granularity": "per_block", "block": value_block, "dtype": "fp16", "apply": apply}}
    return make_spec(key, value, layout="interleaved", storage_dtype="uint8")


def hexes(a: np.ndarray) -> str:
    return " ".join(f"{b:02X}" for b in np.asarray(a, np.uint8).reshape(-1))


def bf16_values(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    """float32 values exactly representable in bf16 (so the residual dtype's rounding is the identity)."""
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def slots_of(row: np.ndarray, pos: np.ndarray, block_size: int) -> np.ndarray:
    return row[pos // block_size] * block_size + pos % block_size


def prefill(spec, cache, seqs: dict[int, np.ndarray], block_tables: dict[int, np.ndarray], block_size: int,
            lengths: dict[int, int], sid_list=None) -> None:
    """One write of each sequence's first ``lengths[sid]`` tokens (k, v stacked in ``seqs[sid]`` as [2, L, H, D])."""
    sid_list = list(seqs) if sid_list is None else sid_list
    for sid in sid_list:
        L = lengths[sid]
        k, v = seqs[sid][0, :L], seqs[sid][1, :L]
        R.kivi_write(spec, cache, k, v, slots_of(block_tables[sid], np.arange(L), block_size), [sid], [0, L], [L],
                     block_tables[sid][None], block_size)


def live_residual(spec, cache, sid: int, L: int, H: int, D: int) -> tuple[np.ndarray, np.ndarray]:
    """The ring entries of positions Q(L) .. L - 1 (float64 [n, H, D] each side)."""
    p = R.kivi_params(spec)
    idx = np.arange(R.kivi_q(spec, L), L) % p.ring
    k = R.residual_values(spec, cache["k_residual"], H, D)[sid, idx]
    v = R.residual_values(spec, cache["v_residual"], H, D)[sid, idx]
    return k, v


# --- float zero points (per token / per block) ----------------------------------------------------------------------


def test_float_zero_point_per_block_by_hand() -> None:
    side = {"element": "uint2", "zero_point": {"dtype": "fp16"},
            "scale": {"granularity": "per_block", "block": 4, "dtype": "fp16", "apply": "divide"}}
    spec = make_spec(side)
    # group 0 [0.5, -1, 2, 1.25]: lo -1, hi 2 (plain min / max), s = 3 / 3 = 1, m = -1; v = x + 1 = 1.5, 0, 3, 2.25
    #   -> half_even 2, 0, 3, 2. group 1 [0.1, 0.1, 0.1, 0.1]: s = floor 1e-6 -> fp16 0x0011, m = fp16(0.1) =
    #   0.0999755859375 (0x2E66) < 0.1, so v = (0.1 - m) / 1.0133e-6 = 24.1 -> clamp 3
    x = np.array([0.5, -1.0, 2.0, 1.25, 0.1, 0.1, 0.1, 0.1], np.float32).reshape(1, 1, 8)
    enc = R.encode_side(spec.key, x)
    assert hexes(enc.data) == "B2 FF"  # lsb first: 2 | 0 << 2 | 3 << 4 | 2 << 6 = 0xB2; 3, 3, 3, 3 = 0xFF
    assert hexes(enc.scale) == "00 3C 11 00"
    assert hexes(enc.zp) == "00 BC 66 2E"
    dec = R.decode_side(spec.key, enc.data, enc.scale, enc.zp)
    m1 = float(np.float16(0.1))
    s1 = 17 * 2.0**-24
    np.testing.assert_array_equal(dec.reshape(-1), [1.0, -1.0, 2.0, 1.0] + [3 * s1 + m1] * 4)
    # the range holds no 0: a one-signed group uses its whole range (uint8 zero points would clip to [0, hi])
    enc = R.encode_side(spec.key, np.array([4.0, 5.0, 6.0, 7.0] * 2, np.float32).reshape(1, 1, 8))
    assert hexes(enc.data) == "E4 E4" and hexes(enc.scale) == "00 3C 00 3C" and hexes(enc.zp) == "00 44 00 44"


def test_packing_hand_value_check() -> None:
    # the codes 2, 0, 3, 2 of the test above: bits 1:0 = 2, 3:2 = 0, 5:4 = 3, 7:6 = 2 -> 0b10110010 = 0xB2
    # (and [4, 5, 6, 7]: codes 0, 1, 2, 3 -> 0b11100100 = 0xE4)
    from kvgen.reference.codes import pack
    assert hexes(pack(np.array([2, 0, 3, 2]), 2)) == "B2"
    assert hexes(pack(np.array([3, 3, 3, 3]), 2)) == "FF"


def test_float_zero_point_saturates_and_rounds() -> None:
    side = {"element": "uint4", "zero_point": {"dtype": "fp16"},
            "scale": {"granularity": "per_token_head", "dtype": "fp32", "apply": "divide"}}
    spec = make_spec(side)
    # lo = -70000 saturates to -65504 (0xFBFF), not -inf; s = (70000 - -70000) / 15 in fp32
    x = np.array([-70000.0, 70000.0], np.float32).reshape(1, 1, 2)
    enc = R.encode_side(spec.key, x)
    assert hexes(enc.zp) == "FF FB"
    s = np.float32(np.float32(140000.0) / np.float32(15.0))
    assert enc.scale.view(np.float32)[0, 0, 0] == s
    # x = -70000: v = (-70000 + 65504) / s < 0 -> code 0; x = 70000: v = 135504 / s = 14.5 -> 14 (half even)
    codes = np.array([enc.data[0, 0, 0] & 0xF, enc.data[0, 0, 0] >> 4])
    v = ((np.float32(70000.0) + np.float32(65504.0)) / s).astype(np.float32)
    assert codes.tolist() == [0, int(np.rint(v))]


def test_float_zero_point_field_alignment_and_round_trip() -> None:
    # fp32 zero points align to 4: D = 6 uint4 -> 3 data bytes; k_scale (fp16) at 4, k_zp (fp32) at 8..11;
    # v_data 12..14, v_scale 16..17, v_zp 20..23; cell 24 (alignment 4)
    side = {"element": "uint4", "zero_point": {"dtype": "fp32"},
            "scale": {"granularity": "per_token_head", "dtype": "fp16"}}
    spec = make_spec(side)
    assert R.cell_layout(spec, 6) == {"k_data": 0, "k_scale": 4, "k_zp": 8, "v_data": 12, "v_scale": 16,
                                      "v_zp": 20, "cell_bytes": 24}
    kivi_like = make_spec({"element": "uint2", "zero_point": {"dtype": "fp16"},
                           "scale": {"granularity": "per_block", "block": 32, "dtype": "fp16"}})
    # 128 channels: 32 data bytes, 4 fp16 scales at 32, 4 fp16 mins at 40 -> 48 per side
    assert R.cell_layout(kivi_like, 128)["cell_bytes"] == 96
    rng = np.random.default_rng(0)
    for sp, d in ((spec, 6), (kivi_like, 128)):
        x = rng.standard_normal((40, 3, d)).astype(np.float32) * np.float32(3.0)
        x[:, :, 0] += np.float32(50.0)  # an offset channel
        x[0] = 0.0  # all-zero groups
        x[1] = 7.0  # constant groups
        cache = R.new_cache(sp, 10, 4, 3, d)
        R.write(sp, cache, x, -x, np.arange(40), block_size=4)
        k, v = R.read(sp, cache, head_size=d, block_size=4, num_kv_heads=3)
        k, v = k.reshape(40, 3, d), v.reshape(40, 3, d)
        assert np.all(np.abs(k - x) <= R.error_bound(sp.key, x))
        assert np.all(np.abs(v + x) <= R.error_bound(sp.value, -x))
        np.testing.assert_array_equal(k[0], 0.0)
        np.testing.assert_array_equal(k[1], 7.0)  # m = 7 exactly, s = floor, codes 0


def test_float_zero_point_reciprocal_multiply() -> None:
    side = {"element": "uint8", "zero_point": {"dtype": "fp32"},
            "scale": {"granularity": "per_token_head", "dtype": "fp32", "apply": "reciprocal_multiply"}}
    spec = make_spec(side)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 1, 16)).astype(np.float32)
    enc = R.encode_side(spec.key, x)
    lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    s = ((hi - lo) / np.float32(255)).astype(np.float32)
    v = ((x - lo).astype(np.float32) * (np.float32(1) / s).astype(np.float32)).astype(np.float32)
    np.testing.assert_array_equal(enc.data, np.clip(np.rint(v), 0, 255).astype(np.uint8))
    np.testing.assert_array_equal(enc.zp.view(np.float32), lo)


# --- KIVI: Q(L), sizes ----------------------------------------------------------------------------------------------


def test_quantized_length_by_hand() -> None:
    Q = lambda L: R.quantized_length(L, 32, 128)  # noqa: E731
    assert [Q(0), Q(127), Q(128), Q(159), Q(160), Q(191), Q(192), Q(223), Q(224)] == [0, 0, 0, 0, 32, 32, 64, 64, 96]
    spec = kivi_spec(2)
    assert R.kivi_q(spec, 127) == 0 and R.kivi_q(spec, 160) == 32 and R.kivi_q(spec, 191) == 32
    assert R.kivi_q(spec, 192) == 64
    # the newest R to R + G - 1 tokens stay exact
    assert all(128 <= L - Q(L) <= 159 for L in range(160, 2000))


def test_kivi_page_bytes_by_hand() -> None:
    spec = kivi_spec(2)
    lay = R.kivi_layout(spec, 128)
    # cell: K codes 128 * 2 / 8 = 32 B at 0; V codes 32 B at 32; V scales 128 / 32 = 4 fp16 = 8 B at 64; V mins
    # 4 fp16 = 8 B at 72 -> 80 B
    assert [(f.name, f.offset, f.nbytes) for f in lay.cell.fields] == [
        ("k_data", 0, 32), ("v_data", 32, 32), ("v_scale", 64, 8), ("v_zp", 72, 8)]
    assert lay.cell.cell == 80
    # key group entry: 128 fp16 scales (256 B) then 128 fp16 mins (256 B); block 32 = 1 group x 8 heads = 4096 B
    assert (lay.entry, lay.k_zp_offset) == (512, 256)
    assert lay.group_region_offset(32, 8) == 32 * 8 * 80 == 20480
    assert R.kivi_page_bytes(spec, 32, 8, 128) == 32 * 8 * 80 + 1 * 8 * (128 * 2 + 128 * 2) == 24576
    assert R.kivi_page_bytes(spec, 32, 8, 128) / (32 * 8) == 96.0  # per token and head (bf16 K + V: 512)
    # block 64: 2 groups per page
    assert R.kivi_page_bytes(spec, 64, 8, 128) == 64 * 8 * 80 + 2 * 8 * 512
    # residual ring: R + G = 160 positions x 8 heads x 128 x bf16, both sides
    assert R.kivi_residual_bytes(spec, 8, 128) == 2 * 160 * 8 * 128 * 2 == 655360
    shapes = R.kivi_residual_shapes(spec, 5, 8, 128)
    assert shapes == {"k_residual": ((5, 160, 8, 128), "bf16"), "v_residual": ((5, 160, 8, 128), "bf16")}
    cache = R.kivi_new_cache(spec, 3, 32, 8, 128, 5)
    assert {n: a.shape for n, a in cache.items()} == {
        "kv_cache": (3, 24576), "k_residual": (5, 160 * 8 * 128 * 2), "v_residual": (5, 160 * 8 * 128 * 2)}
    with pytest.raises(ValueError):
        R.kivi_page_bytes(spec, 16, 8, 128)  # block_size must be a multiple of G
    spec4 = kivi_spec(4)
    # 4-bit: K 64 B, V 64 B, V scales 8 B at 128, V mins 8 B at 136 -> 144; page 32 * 8 * 144 + 4096 = 40960
    assert R.kivi_layout(spec4, 128).cell.cell == 144
    assert R.kivi_page_bytes(spec4, 32, 8, 128) == 40960  # 160 B per token and head


def test_general_path_refuses_kivi() -> None:
    with pytest.raises(NotImplementedError, match="reference:"):
        R.layout(kivi_spec(2), 128)
    with pytest.raises(ValueError):
        R.kivi_params(make_spec({"element": "bf16"}))


# --- KIVI: one key group and one value group by hand ---------------------------------------------------------------


def test_tiny_key_and_value_groups_by_hand() -> None:
    spec = tiny_spec()  # G = 4, R = 4, residual fp32, D = 4, H = 1, block 4; value groups of 2 channels
    lay = R.kivi_layout(spec, 4)
    # cell: k_data 1 B at 0, v_data 1 B at 1, v_scale 2 x fp16 at 2, v_zp 2 x fp16 at 6 -> 10; entry 8 + 8 = 16
    assert [(f.name, f.offset, f.nbytes) for f in lay.cell.fields] == [
        ("k_data", 0, 1), ("v_data", 1, 1), ("v_scale", 2, 4), ("v_zp", 6, 4)]
    assert (lay.cell.cell, lay.entry, R.kivi_page_bytes(spec, 4, 1, 4)) == (10, 16, 4 * 10 + 16)
    # keys [token, channel] of tokens 0..3 (group 0):
    #   channel 0 [0.5, -1, 2, 1.25]: lo -1, hi 2, s 1 (3C00), m -1 (BC00); v = 1.5, 0, 3, 2.25 -> 2, 0, 3, 2
    #   channel 1 [0, 0, 0, 0]:       s = floor 1e-6 -> 0x0011, m 0 (0000); codes 0
    #   channel 2 [1, 2, 3, 4]:       s 1 (3C00), m 1 (3C00); codes 0, 1, 2, 3
    #   channel 3 [-3, -3, -3, 3]:    s 2 (4000), m -3 (C200); codes 0, 0, 0, 3
    keys = np.array([[0.5, 0.0, 1.0, -3.0], [-1.0, 0.0, 2.0, -3.0], [2.0, 0.0, 3.0, -3.0], [1.25, 0.0, 4.0, 3.0]],
                    np.float32)
    # value of token 0 [0.5, -1, 2, 2]: block [0.5, -1]: s = 1.5 / 3 = 0.5 (3800), m -1 (BC00), codes 3, 0;
    #   block [2, 2]: s floor (0011), m 2 (4000), codes 0, 0
    values = np.zeros((8, 4), np.float32)
    values[0] = [0.5, -1.0, 2.0, 2.0]
    values[1:] = np.arange(28, dtype=np.float32).reshape(7, 4) / 4
    k = np.zeros((8, 4), np.float32)
    k[:4] = keys
    k[4:] = np.arange(16, dtype=np.float32).reshape(4, 4) - 8
    cache = R.kivi_new_cache(spec, 2, 4, 1, 4, 1)
    bt = np.array([[1, 0]])  # position 0..3 in block 1, 4..7 in block 0
    R.kivi_write(spec, cache, k[:, None], values[:, None], slots_of(bt[0], np.arange(8), 4), [0], [0, 8], [8], bt, 4)
    page = cache["kv_cache"][1]
    # per token: key codes packed lsb first: t0 [2,0,0,0] = 02, t1 [0,0,1,0] = 10, t2 [3,0,2,0] = 23, t3 [2,0,3,3] = F2
    assert [hexes(page[t * 10:t * 10 + 1]) for t in range(4)] == ["02", "10", "23", "F2"]
    assert hexes(page[0:10]) == "02 03 00 38 11 00 00 BC 00 40"
    assert hexes(page[40:56]) == "00 3C 11 00 00 3C 00 40 00 BC 00 00 00 3C 00 C2"
    # Q(8) = 4: positions 4..7 stay exact in the ring (indices 4..7 of 8); block 0 is untouched
    assert not cache["kv_cache"][0].any()
    res = R.residual_values(spec, cache["k_residual"], 1, 4)[0, :, 0]
    np.testing.assert_array_equal(res[4:], k[4:])
    assert not res[:4].any()  # positions 0..3 were quantized at once: never in the ring
    K, V = R.kivi_read(spec, cache, 0, 8, bt[0], 4, 1, 4)
    np.testing.assert_array_equal(K[:4, 0], [[1.0, 0.0, 1.0, -3.0], [-1.0, 0.0, 2.0, -3.0], [2.0, 0.0, 3.0, -3.0],
                                             [1.0, 0.0, 4.0, 3.0]])
    np.testing.assert_array_equal(V[0, 0], [0.5, -1.0, 2.0, 2.0])
    np.testing.assert_array_equal(K[4:, 0], k[4:])
    np.testing.assert_array_equal(V[4:, 0], values[4:])


def test_key_group_metadata_goes_to_the_page_of_its_first_position() -> None:
    spec = tiny_spec()  # G = 4, R = 4; block 8 holds 2 groups: entries [2, H, 16] after 8 cells of 10 B
    H, D, bs, L = 2, 4, 8, 17  # Q(17) = 12: groups 0, 1 (page bt[0], entries 0, 1) and 2 (page bt[1], entry 0)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, L, H, D)).astype(np.float32)
    bt = np.array([[3, 1, 0]])
    cache = R.kivi_new_cache(spec, 4, bs, H, D, 1)
    R.kivi_write(spec, cache, x[0], x[1], slots_of(bt[0], np.arange(L), bs), [0], [0, L], [L], bt, bs)
    assert R.kivi_q(spec, L) == 12
    groups_at = 8 * H * 10
    for g, (page, entry) in enumerate([(3, 0), (3, 1), (1, 0)]):
        enc = R.encode_key_group(spec.key, x[0, 4 * g:4 * g + 4])
        got = cache["kv_cache"][page, groups_at + entry * H * 16:groups_at + (entry + 1) * H * 16].reshape(H, 16)
        np.testing.assert_array_equal(got[:, :8], enc.scale)
        np.testing.assert_array_equal(got[:, 8:], enc.zp)
        cells = cache["kv_cache"][page, :groups_at].reshape(bs, H, 10)
        first = (4 * g) % bs
        np.testing.assert_array_equal(cells[first:first + 4, :, 0:1], enc.data)
    assert not cache["kv_cache"][1, groups_at + H * 16:].any()  # group 3 (positions 12..15) is not quantized yet
    assert not cache["kv_cache"][0].any()


# --- KIVI: the residual ring ----------------------------------------------------------------------------------------


def test_residual_ring_indices_and_collisions() -> None:
    spec = tiny_spec()  # G = 4, R = 4: ring of 8; residual fp32, so the ring holds the inputs exactly
    H, D, bs = 1, 4, 4
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 40, H, D)).astype(np.float32)
    bt = rng.permutation(10)[None]
    steps = R.kivi_new_cache(spec, 10, bs, H, D, 2)
    for L in range(1, 41):  # decode steps
        R.kivi_write(spec, steps, x[0, L - 1:L], x[1, L - 1:L], slots_of(bt[0], np.array([L - 1]), bs), [1],
                     [0, 1], [L], bt, bs)
        q = R.quantized_length(L, 4, 4)
        assert L - q in range(4, 8) or L < 4
        ring = R.residual_values(spec, steps["k_residual"], H, D)[1]
        for p in range(q, L):  # live positions at p mod 8
            np.testing.assert_array_equal(ring[p % 8], x[0, p])
        assert not steps["k_residual"][0].any()  # other rows untouched
    # a chunk 8 -> 16 flushes 4..11 (4..7 from the ring, 8..11 from the input) and stores 12..15 at ring indices
    # 4..7, over the entries it flushed: they must be read first
    chunk = R.kivi_new_cache(spec, 10, bs, H, D, 2)
    for lo, hi in ((0, 8), (8, 16)):
        R.kivi_write(spec, chunk, x[0, lo:hi], x[1, lo:hi], slots_of(bt[0], np.arange(lo, hi), bs), [1],
                     [0, hi - lo], [hi], bt, bs)
    once = R.kivi_new_cache(spec, 10, bs, H, D, 2)
    R.kivi_write(spec, once, x[0, :16], x[1, :16], slots_of(bt[0], np.arange(16), bs), [1], [0, 16], [16], bt, bs)
    np.testing.assert_array_equal(chunk["kv_cache"], once["kv_cache"])
    for a, b in zip(live_residual(spec, chunk, 1, 16, H, D), live_residual(spec, once, 1, 16, H, D)):
        np.testing.assert_array_equal(a, b)


def test_decode_steps_quantize_the_stored_residual_values() -> None:
    # earlier tokens are quantized from the residual buffer (bf16 here), new ones from the float32 input: after
    # decode steps every quantized token passed through the ring, so the pages equal a prefill of bf16-rounded inputs
    spec = kivi_spec(2)
    H, D, bs, L = 1, 32, 32, 230
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, L, H, D)).astype(np.float32)  # not bf16-representable
    bt = np.arange(8)[None]
    steps = R.kivi_new_cache(spec, 8, bs, H, D, 1)
    for p in range(L):
        R.kivi_write(spec, steps, x[0, p:p + 1], x[1, p:p + 1], slots_of(bt[0], np.array([p]), bs), [0], [0, 1],
                     [p + 1], bt, bs)
    xb = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    once = R.kivi_new_cache(spec, 8, bs, H, D, 1)
    R.kivi_write(spec, once, xb[0], xb[1], slots_of(bt[0], np.arange(L), bs), [0], [0, L], [L], bt, bs)
    np.testing.assert_array_equal(steps["kv_cache"], once["kv_cache"])
    raw = R.kivi_new_cache(spec, 8, bs, H, D, 1)
    R.kivi_write(spec, raw, x[0], x[1], slots_of(bt[0], np.arange(L), bs), [0], [0, L], [L], bt, bs)
    assert not np.array_equal(raw["kv_cache"], once["kv_cache"])  # a prefill quantizes the float32 input itself


# --- KIVI: stream equivalence ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits, bs", [(2, 32), (4, 64)])
def test_prefill_equals_decode_steps(bits: int, bs: int) -> None:
    spec = kivi_spec(bits)
    H, D, L = 2, 64, 300
    rng = np.random.default_rng(bits)
    x = bf16_values(rng, (2, L, H, D), 2.0)
    bt = rng.permutation(12)[None]
    once = R.kivi_new_cache(spec, 12, bs, H, D, 3)
    R.kivi_write(spec, once, x[0], x[1], slots_of(bt[0], np.arange(L), bs), [2], [0, L], [L], bt, bs)
    steps = R.kivi_new_cache(spec, 12, bs, H, D, 3)
    for p in range(L):
        R.kivi_write(spec, steps, x[0, p:p + 1], x[1, p:p + 1], slots_of(bt[0], np.array([p]), bs), [2], [0, 1],
                     [p + 1], bt, bs)
    np.testing.assert_array_equal(steps["kv_cache"], once["kv_cache"])
    for a, b in zip(live_residual(spec, steps, 2, L, H, D), live_residual(spec, once, 2, L, H, D)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(R.kivi_read(spec, steps, 2, L, bt[0], bs, H, D), R.kivi_read(spec, once, 2, L, bt[0], bs, H, D)):
        np.testing.assert_array_equal(a, b)


@st.composite
def batches(draw):
    """Several sequences, each split into random chunks, advanced together in random batches with padding rows."""
    n = draw(st.integers(1, 3))
    lengths = draw(st.lists(st.integers(1, 330), min_size=n, max_size=n))
    chunks = []
    for L in lengths:
        cuts = sorted(set(draw(st.lists(st.integers(1, max(L - 1, 1)), max_size=6))) - {L})
        bounds = [0] + [c for c in cuts if c < L] + [L]
        chunks.append(list(zip(bounds[:-1], bounds[1:])))
    padding = draw(st.lists(st.integers(0, 3), min_size=12, max_size=12))
    order_seed = draw(st.integers(0, 2**16))
    return lengths, chunks, padding, order_seed


@settings(max_examples=40, deadline=None)
@given(batches())
def test_chunked_batches_equal_one_prefill(case) -> None:
    lengths, chunks, padding, seed = case
    spec = kivi_spec(2)
    H, D, bs = 2, 32, 32
    rng = np.random.default_rng(seed)
    n = len(lengths)
    per_seq = -(-max(lengths) // bs)
    blocks = rng.permutation(n * per_seq + 2)
    bts = np.stack([blocks[i * per_seq:(i + 1) * per_seq] for i in range(n)])
    sids = rng.permutation(5)[:n]  # rows of the residual buffers
    data = {int(sids[i]): bf16_values(rng, (2, lengths[i], H, D), 3.0) for i in range(n)}
    cache = R.kivi_new_cache(spec, n * per_seq + 2, bs, H, D, 5)
    # steps: each sequence's next chunk joins the batch with probability 1/2 (at least one sequence per step)
    nxt, step = [0] * n, 0
    while any(nxt[i] < len(chunks[i]) for i in range(n)):
        live = [i for i in range(n) if nxt[i] < len(chunks[i])]
        pick = [i for i in live if rng.random() < 0.5] or live[:1]
        keys, vals, slots, qsl, lens, bt_rows, ids = [], [], [], [0], [], [], []
        for i in pick:
            lo, hi = chunks[i][nxt[i]]
            nxt[i] += 1
            sid = int(sids[i])
            keys.append(data[sid][0, lo:hi])
            vals.append(data[sid][1, lo:hi])
            slots.append(slots_of(bts[i], np.arange(lo, hi), bs))
            qsl.append(qsl[-1] + hi - lo)
            lens.append(hi)
            bt_rows.append(bts[i])
            ids.append(sid)
        pad = padding[step % len(padding)]
        step += 1
        keys.append(rng.standard_normal((pad, H, D)).astype(np.float32) * 100)  # garbage rows, slot -1
        vals.append(rng.standard_normal((pad, H, D)).astype(np.float32) * 100)
        slots.append(np.full(pad, -1))
        R.kivi_write(spec, cache, np.concatenate(keys), np.concatenate(vals), np.concatenate(slots), ids, qsl, lens,
                     np.stack(bt_rows), bs)
    once = R.kivi_new_cache(spec, n * per_seq + 2, bs, H, D, 5)
    prefill(spec, once, data, {int(sids[i]): bts[i] for i in range(n)}, bs,
            {int(sids[i]): lengths[i] for i in range(n)})
    np.testing.assert_array_equal(cache["kv_cache"], once["kv_cache"])
    for i in range(n):
        sid, L = int(sids[i]), lengths[i]
        for a, b in zip(live_residual(spec, cache, sid, L, H, D), live_residual(spec, once, sid, L, H, D)):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(R.kivi_read(spec, cache, sid, L, bts[i], bs, H, D),
                        R.kivi_read(spec, once, sid, L, bts[i], bs, H, D)):
            np.testing.assert_array_equal(a, b)


def test_write_checks_its_metadata() -> None:
    spec = kivi_spec(2)
    H, D, bs = 1, 32, 32
    cache = R.kivi_new_cache(spec, 4, bs, H, D, 2)
    x = np.zeros((3, H, D), np.float32)
    bt = np.array([[2, 3]])
    with pytest.raises(ValueError, match="slot_mapping"):
        R.kivi_write(spec, cache, x, x, [0, 1, 2], [0], [0, 3], [3], bt, bs)
    with pytest.raises(ValueError, match="twice"):
        R.kivi_write(spec, cache, x, x, [64, 65, 64], [0, 0], [0, 2, 3], [2, 1], np.array([[2, 3], [2, 3]]), bs)
    with pytest.raises(ValueError, match="new tokens"):
        R.kivi_write(spec, cache, x, x, [64, 65, 66], [0], [0, 3], [2], bt, bs)
    R.kivi_write(spec, cache, x, x, [64, 65, -1], [1], [0, 2], [2], bt, bs)  # row 2 is padding
    assert not cache["k_residual"][0].any() and not cache["kv_cache"].any()


# --- KIVI: error bounds and attention -------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4])
def test_read_is_within_the_error_bound(bits: int) -> None:
    spec = kivi_spec(bits)
    H, D, bs, L = 2, 128, 32, 420
    rng = np.random.default_rng(10 + bits)
    k = rng.standard_normal((L, H, D)).astype(np.float32)
    k[:, :, [3, 77]] *= 15  # outlier channels
    k[:, :, 5] += 40  # an offset channel: m's fp16 rounding matters
    k[64:96, 0, :] = 0.0  # an all-zero group (both sides)
    k = k.astype(ml_dtypes.bfloat16).astype(np.float32)  # bf16 inputs: the ring stores them exactly
    v = bf16_values(rng, (L, H, D))
    v[100] = 1.5  # a constant token
    bt = np.arange(14)[None]
    cache = R.kivi_new_cache(spec, 14, bs, H, D, 1)
    R.kivi_write(spec, cache, k, v, slots_of(bt[0], np.arange(L), bs), [0], [0, L], [L], bt, bs)
    K, V = R.kivi_read(spec, cache, 0, L, bt[0], bs, H, D)
    bk, bv = R.kivi_error_bound(spec, k, v)
    q = R.kivi_q(spec, L)
    assert q == 288
    assert np.all(np.abs(K - k) <= bk) and np.all(np.abs(V - v) <= bv)
    np.testing.assert_array_equal(K[q:], k[q:])  # the residual window is exact (bf16 inputs)
    np.testing.assert_array_equal(V[q:], v[q:])
    np.testing.assert_array_equal(K[64:96, 0], 0.0)
    # the bound is half a step plus little: per key group, |error| <= s_q / 2 + |m - lo| + slack
    qmax = 2**bits - 1
    for g0 in range(0, q, 32):
        grp = k[g0:g0 + 32]
        lo, hi = grp.min(0), grp.max(0)
        s = np.maximum((hi - lo) / qmax, 1e-6).astype(np.float16).astype(np.float64)
        m = lo.astype(np.float16).astype(np.float64)
        err = np.abs(K[g0:g0 + 32] - grp)
        assert np.all(err <= s / 2 + np.abs(m - lo) + 2 * np.abs(hi - lo) * 2.0**-11 + 1e-6)


def test_attention_on_the_read_state() -> None:
    spec = kivi_spec(2)
    H, Hq, D, bs = 2, 4, 32, 32
    rng = np.random.default_rng(7)
    lengths = [250, 40, 193]
    q_lens = [5, 40, 1]  # chunked prefill, a whole prompt, a decode step
    n = len(lengths)
    bts = rng.permutation(n * 8).reshape(n, 8)
    data = [bf16_values(rng, (2, L, H, D)) for L in lengths]
    cache = R.kivi_new_cache(spec, n * 8, bs, H, D, n)
    for i, (L, ql) in enumerate(zip(lengths, q_lens)):  # everything before the batch's new tokens
        if L > ql:
            R.kivi_write(spec, cache, data[i][0, :L - ql], data[i][1, :L - ql],
                         slots_of(bts[i], np.arange(L - ql), bs), [i], [0, L - ql], [L - ql], bts[i][None], bs)
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    keys = np.concatenate([data[i][0, L - ql:] for i, (L, ql) in enumerate(zip(lengths, q_lens))])
    vals = np.concatenate([data[i][1, L - ql:] for i, (L, ql) in enumerate(zip(lengths, q_lens))])
    slots = np.concatenate([slots_of(bts[i], np.arange(L - ql, L), bs) for i, (L, ql) in enumerate(zip(lengths,
                                                                                                       q_lens))])
    R.kivi_write(spec, cache, keys, vals, slots, np.arange(n), qsl, lengths, bts, bs)
    qv = rng.standard_normal((int(qsl[-1]), Hq, D))
    for window in (None, 50):
        out = R.kivi_attention(spec, cache, qv, np.arange(n), qsl, lengths, bts, 0.2, window, bs)
        for i, (L, ql) in enumerate(zip(lengths, q_lens)):
            K, V = R.kivi_read(spec, cache, i, L, bts[i], bs, H, D)
            for j in range(ql):
                p = L - ql + j
                lo = 0 if window is None else max(0, p - window + 1)
                for h in range(Hq):
                    sc = 0.2 * K[lo:p + 1, h // 2] @ qv[qsl[i] + j, h]
                    w = np.exp(sc - sc.max())
                    ref = (w / w.sum()) @ V[lo:p + 1, h // 2]
                    np.testing.assert_allclose(out[qsl[i] + j, h], ref, rtol=1e-12, atol=1e-12)
    # a sequence within the residual window (L <= R) attends over its exact values
    K, V = R.kivi_read(spec, cache, 1, 40, bts[1], bs, H, D)
    np.testing.assert_array_equal(K, data[1][0])
    np.testing.assert_array_equal(V, data[1][1])
