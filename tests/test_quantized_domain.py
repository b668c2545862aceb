"""Attention in the cache's quantized domain (``dot_precision="quantized"``) against a NumPy model of it.

The model reads the spec, not the kernels: where a side's codes are int8 (no zero point, no block scales), the query
is quantized per row to int8 for the keys (step = the row's largest / 127, after the exact power-of-two
normalisation the kernel applies; rounded like a key), and the probabilities times each position's value scale per
row for the values (the row's largest -> 127). Test sequences fit in
one attention step (at most 45 positions; steps take 128), so the probabilities are quantized over all positions a
row sees. Everything else is float64 attention on the reference-decoded cache.

Tolerance: the query dtype's conformance tolerance (at least 1e-3, for the fp32 rounding of the rescaled sums), plus
a probability code off by one for each position whose scaled probability lies within the fp32 softmax's rounding of
a code boundary (the model computes which).
The kernel must also be closer to the model than to the exact attention, so the test fails if the quantized path
was not taken.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvgen
from kvgen import reference as R
from kvgen.conformance import TOLERANCE, Case, build_batch, static_scales
from kvgen.reference.codes import code_values, element_codes

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
SPECS = Path(kvgen.__file__).resolve().parent / "specs"
EXAMPLES = int(os.environ.get("KVGEN_EXAMPLES", "30"))
QMAX = {"int8": 127.0}


def expected_domain(side) -> str:
    """What the spec allows, by the rule documented for dot_precision="quantized"."""
    sc = side.scale
    if side.zero_point is not None or (sc is not None and (sc.block or sc.group_tokens)):
        return ""
    return "int8" if side.element.value == "int8" else ""


def offered(name: str) -> dict:
    spec = kvgen.load(name).spec
    return {"key": expected_domain(spec.key), "value": expected_domain(spec.value)}


QUANTIZED = [n for n in kvgen.shipped_names() if any(offered(n).values())]


@pytest.mark.parametrize("name", kvgen.shipped_names())
def test_offered_where_the_spec_allows(name):
    assert kvgen.load(name).quantized_dot == offered(name)


def test_shipped_formats_that_offer_it():
    assert {"int8_per_token_head", "int8_per_token_head_separate", "mixed_k8_v4"} <= set(QUANTIZED)
    assert not {"bf16", "fp8_e4m3", "q8_0", "nvfp4", "int8_asym_per_token_head", "kivi_2bit"} & set(QUANTIZED)


def test_format_without_it_is_refused():
    fmt = kvgen.load("bf16")
    cache = fmt.allocate(2, 16, 1, 32)
    q = torch.zeros(1, 1, 32)
    with pytest.raises(ValueError, match=r"dot_precision: 'quantized' needs int8 codes.*bf16"):
        fmt.attend(q, cache, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                   torch.tensor([0, 1], dtype=torch.int32), dot_precision="quantized")


def pow2_floor(x: np.ndarray) -> np.ndarray:
    """The largest power of two <= x for positive normal float32 x; 1 for 0."""
    m, e = np.frexp(x.astype(np.float64))
    return np.where(x > 0, np.ldexp(1.0, e - 1), 1.0)


def quantize_query(q32: np.ndarray, side, kind: str) -> np.ndarray:
    """[rows, D] float32 -> the dequantized query the kernel dots with (float64)."""
    norm = pow2_floor(np.abs(q32).max(axis=1))
    qn = (q32 / norm[:, None]).astype(np.float32)  # exact: a power of two
    top = np.abs(qn).max(axis=1)
    step = np.where(top > 0, (top / np.float32(QMAX[kind])).astype(np.float32), np.float32(1.0))
    x = (qn / step[:, None]).astype(np.float32)
    codes = code_values(side.element, element_codes(side.element, x, side.rounding))
    return codes * step[:, None].astype(np.float64) * norm[:, None]


def model(fmt, case: Case, query: np.ndarray, k_deq, v_deq, v_tok, block_table, qsl, sm_scale):
    """Attention with the quantized-domain rounding of the query and probabilities, float64 elsewhere; and per
    (token, query head) the output error a probability code off by one could explain, summed over the positions
    whose scaled probability lies so close to a rounding boundary that the kernel's fp32 softmax may round it the
    other way (0 elsewhere: those codes must match)."""
    spec = fmt.spec
    dom = offered(fmt.name)
    head_pad = 1 << max(0, (case.head_size - 1).bit_length())
    quant_k = bool(dom["key"]) and head_pad >= 32  # the key dot reduces over the head: at least 32 elements
    out = np.zeros(query.shape)
    slack = np.zeros(query.shape[:2])
    bs = case.block_size
    for s, seq_len in enumerate(case.seq_lens):
        start, stop = int(qsl[s]), int(qsl[s + 1])
        j = np.arange(seq_len)
        blk, off = block_table[s, j // bs], j % bs
        mask = R.attention_mask(seq_len, stop - start, case.window)
        for hq in range(query.shape[1]):
            h = hq // case.group
            keys, vals, vt = k_deq[blk, off, h], v_deq[blk, off, h], v_tok[blk, off, h]
            q = query[start:stop, hq].astype(np.float32)
            qd = quantize_query(q, spec.key, dom["key"]) if quant_k else q.astype(np.float64)
            scores = np.where(mask, sm_scale * qd @ keys.T, -np.inf)
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            l = p.sum(axis=1, keepdims=True)
            if not dom["value"]:
                out[start:stop, hq] = p @ vals / l
                continue
            pw = p * vt[None, :]
            top = pw.max(axis=1, keepdims=True).astype(np.float32)
            top = np.where(top >= np.float32(1.1754944e-38), top, np.float32(1.0))  # the kernel's guard
            x = ((pw.astype(np.float32) * (np.float32(1.0) / top)).astype(np.float32) * np.float32(127.0))
            pq = code_values(spec.value.element, element_codes(spec.value.element, x, spec.value.rounding))
            codes_v = vals / vt[:, None]
            out[start:stop, hq] = (pq * top / 127.0) @ codes_v / l
            # fp32 scores are off by about |score| * 2**-22, which moves p and x by that much relative
            spread = np.abs(np.where(mask, scores, 0.0)).max(axis=1, keepdims=True)
            near = np.abs(x - (np.floor(x) + 0.5)) <= x * (spread * 2.0**-20 + 2.0**-18) + 1e-6
            slack[start:stop, hq] = (near * (top / 127.0)) @ np.abs(codes_v).max(axis=1) / l[:, 0]
    return out, slack


def per_token_value_scales(fmt, case, value32, slots, num_blocks, scales) -> np.ndarray:
    """[num_blocks, block, H] the factor each position's value codes are multiplied by per token (1 for a static or
    absent scale: that one is applied after the dot)."""
    out = np.ones((num_blocks, case.block_size, case.num_kv_heads))
    side = fmt.spec.value
    if side.scale is None or side.scale.granularity.is_static:
        return out
    written = slots >= 0
    enc = R.encode_side(side, value32[written], None)
    out[slots[written] // case.block_size, slots[written] % case.block_size] = enc.s_eff[..., 0]
    return out


@st.composite
def small_cases(draw) -> Case:
    num_seqs = draw(st.integers(1, 3))
    seq_lens = draw(st.lists(st.integers(1, 45), min_size=num_seqs, max_size=num_seqs))
    mode = draw(st.sampled_from(["decode", "prefill", "chunked"]))
    q_lens = [1] * num_seqs if mode == "decode" else (
        list(seq_lens) if mode == "prefill" else [draw(st.integers(1, n)) for n in seq_lens])
    return Case(head_size=draw(st.sampled_from([16, 32, 48, 64])), block_size=draw(st.sampled_from([1, 4, 16])),
                num_kv_heads=draw(st.integers(1, 2)), group=draw(st.sampled_from([1, 2, 4])), seq_lens=seq_lens,
                q_lens=q_lens, dtype=draw(st.sampled_from(list(TOLERANCE))),
                window=draw(st.one_of(st.none(), st.integers(1, 20))), holes=draw(st.integers(0, 3)),
                seed=draw(st.integers(0, 2**31 - 1)), k_scale=draw(st.sampled_from([1.0, 0.037])),
                v_scale=draw(st.sampled_from([1.0, 7.25])), magnitude=draw(st.sampled_from([1.0, 30.0])), splits=1)


def run(fmt, case: Case):
    rng = np.random.default_rng(case.seed)
    num_blocks, block_table, slots, key, value = build_batch(case, rng)
    scales = static_scales(fmt, case)
    cache = fmt.allocate(num_blocks, case.block_size, case.num_kv_heads, case.head_size, device=DEVICE, **scales)
    key_t, value_t = torch.from_numpy(key).to(case.dtype), torch.from_numpy(value).to(case.dtype)
    fmt.write(cache, key_t.to(DEVICE), value_t.to(DEVICE), torch.from_numpy(slots).to(DEVICE))
    key32, value32 = key_t.float().numpy(), value_t.float().numpy()
    stored = R.new_cache(fmt.spec, num_blocks, case.block_size, case.num_kv_heads, case.head_size)
    R.write(fmt.spec, stored, key32, value32, slots, k_scale=scales["k_scale"], v_scale=scales["v_scale"])
    k_deq, v_deq = R.read(fmt.spec, stored, scales["k_scale"], scales["v_scale"], head_size=case.head_size,
                          block_size=case.block_size, num_kv_heads=case.num_kv_heads)
    v_tok = per_token_value_scales(fmt, case, value32, slots, num_blocks, scales)
    qsl = np.concatenate([[0], np.cumsum(case.q_lens)]).astype(np.int32)
    query = torch.from_numpy(rng.standard_normal((int(qsl[-1]), case.num_kv_heads * case.group,
                                                  case.head_size)).astype(np.float32)).to(case.dtype)
    sm_scale = 1.0 / math.sqrt(case.head_size)
    args = (query.to(DEVICE), cache, torch.from_numpy(block_table).to(DEVICE),
            torch.tensor(case.seq_lens, dtype=torch.int32, device=DEVICE), torch.from_numpy(qsl).to(DEVICE))
    got = fmt.attend(*args, sm_scale=sm_scale, sliding_window=case.window, dot_precision="quantized")
    got = got.cpu().double().numpy()
    q64 = query.double().numpy()
    want, slack = model(fmt, case, q64, k_deq, v_deq, v_tok, block_table, qsl, sm_scale)
    exact = R.paged_attention(q64, k_deq, v_deq, block_table, np.array(case.seq_lens), qsl, sm_scale, case.window)
    return got, want, slack, exact, v_deq


def check(name: str, case: Case) -> None:
    head_pad = 1 << max(0, (case.head_size - 1).bit_length())
    if not offered(name)["value"] and head_pad < 32:  # int8 keys need 32 elements per dot: nothing to quantize
        with pytest.raises(ValueError, match=r"dot_precision: 'quantized' has no side to quantize at head size"):
            run(kvgen.load(name), case)
        return
    got, want, slack, exact, v_deq = run(kvgen.load(name), case)
    atol, rtol = (max(t, 1e-3) for t in TOLERANCE[case.dtype])
    vmax = max(float(np.abs(v_deq).max()), 1e-30)
    limit = atol * vmax + rtol * np.abs(want) + slack[..., None]
    err = np.abs(got - want)
    assert np.all(err <= limit), f"error {err.max():.3g}, worst ratio to tolerance {(err / limit).max():.2f}"
    # the quantized path was taken: the kernel is nearer the model than the exact attention wherever they part
    apart = np.abs(want - exact) > 4 * limit
    if apart.any():
        assert np.abs(got - want)[apart].max() < np.abs(got - exact)[apart].max()


MODEL_FORMATS = [n for n in QUANTIZED if kvgen.load(n).spec.key.rotation is None]


@pytest.mark.parametrize("name", MODEL_FORMATS)
def test_quantized_domain_matches_model(name):
    @settings(max_examples=max(EXAMPLES // 3, 4), deadline=None)
    @given(case=small_cases())
    def prop(case):
        check(name, case)

    prop()


@pytest.mark.parametrize("name", MODEL_FORMATS)
@pytest.mark.parametrize("magnitude", [1.0, 30.0])
def test_quantized_domain_fixed_cases(name, magnitude):
    """Decode and prefill with GQA and a shuffled table at two data scales, every run (hypothesis draws vary)."""
    check(name, Case(head_size=64, block_size=16, num_kv_heads=2, group=2, seq_lens=[40, 17], q_lens=[1, 17],
                     dtype=torch.float32, window=None, holes=1, seed=3, k_scale=1.0, v_scale=1.0,
                     magnitude=magnitude))


def test_rotated_keys_in_the_quantized_domain():
    """Hadamard-rotated keys: the query is rotated in fp32 before it is quantized, so its codes may differ from a
    float64 model's by one at rounding boundaries; the output must stay as close to the exact attention as the
    int8 query step allows (here: within 2% relative L2 on normal data) and differ from the exact path."""
    fmt = kvgen.load("int8_per_token_head_hadamard_k")
    case = Case(head_size=64, block_size=16, num_kv_heads=2, group=2, seq_lens=[40, 17], q_lens=[1, 17],
                dtype=torch.float32, window=None, holes=1, seed=3, k_scale=1.0, v_scale=1.0, magnitude=1.0)
    got, _, _, exact, _ = run(fmt, case)
    rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert 1e-5 < rel < 2e-2, rel


def test_tiny_value_scales(tmp_path):
    """A spec whose scale floor lets value scales reach 1e-37: the row's largest weight times its value scale is then
    far below 1 / 127's reach in fp32 (127 / top would overflow); the quantized output must stay as accurate
    relative to the exact one as at ordinary magnitudes."""
    text = (SPECS / "int8_per_token_head.yaml").read_text()
    spec = tmp_path / "int8_tiny_floor.yaml"
    assert text.count("min: 1.0e-6") == 1  # one side definition, the value side an alias of it
    spec.write_text(text.replace("name: int8_per_token_head", "name: int8_tiny_floor").replace(
        "min: 1.0e-6", "min: 1.0e-37"))
    fmt = kvgen.load(str(spec))
    assert fmt.spec.value.scale.min == 1e-37 and fmt.quantized_dot["value"] == "int8"
    rng = np.random.default_rng(0)
    errs = []
    for magnitude in (1.0, 1e-35):
        cache = fmt.allocate(4, 16, 1, 64, device=DEVICE)
        k = torch.from_numpy(rng.standard_normal((8, 1, 64)).astype(np.float32)).to(DEVICE)
        v = torch.from_numpy(rng.standard_normal((8, 1, 64)).astype(np.float32) * magnitude).to(DEVICE)
        fmt.write(cache, k, v, torch.arange(8, device=DEVICE))
        q = torch.from_numpy(rng.standard_normal((1, 1, 64)).astype(np.float32)).to(DEVICE) * 3
        args = (q, cache, torch.tensor([[0, 1, 2, 3]], dtype=torch.int32, device=DEVICE),
                torch.tensor([8], dtype=torch.int32, device=DEVICE),
                torch.tensor([0, 1], dtype=torch.int32, device=DEVICE))
        exact = fmt.attend(*args, dot_precision="ieee").double()
        quant = fmt.attend(*args, dot_precision="quantized").double()
        assert torch.isfinite(quant).all()
        errs.append(float((quant - exact).norm() / exact.norm()))
    assert errs[1] < 3 * errs[0] + 1e-6, errs
