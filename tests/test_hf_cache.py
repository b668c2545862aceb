"""transformers integration: a tiny randomly initialised Llama-style model generates with a kvgen paged cache."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvgen.hf_cache import KvgenCache  # noqa: E402

CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)


def tiny_model(dtype, **over):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**CONFIG, **over})).to(dtype).eval()
    return model


KIVI_MODEL = dict(hidden_size=128)  # head size 32: KIVI's values have one scale per 32 elements


def generate(model, cache=None, new=12):
    ids = torch.tensor([[5, 17, 42, 99, 3, 7, 11, 250, 1, 64, 33]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, past_key_values=cache, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def scores(model, cache=None, new=8):
    ids = torch.tensor([[5, 17, 42, 99, 3, 7, 11, 250, 1, 64, 33]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, past_key_values=cache, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    return torch.stack(out.scores)


def test_bf16_cache_generates_exactly_what_dynamic_cache_does():
    model = tiny_model(torch.bfloat16)
    expected = generate(model)  # transformers' default DynamicCache
    got = generate(model, KvgenCache("bf16", model.config, max_tokens=64, block_size=4))
    assert got == expected
    # stronger than the tokens: every logit of every step is bit-identical (the cache holds the same bf16 values)
    assert torch.equal(scores(model, KvgenCache("bf16", model.config, max_tokens=64, block_size=4)), scores(model))
    # and a quantized cache does change them (the comparison can fail)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp8 = scores(model, KvgenCache("fp8_e4m3", model.config, max_tokens=64, block_size=4))
    assert not torch.equal(fp8, scores(model))


@pytest.mark.parametrize("name", ["int8_per_token_head", "fp8_e4m3", "nvfp4", "int4_per_token_head"])
def test_quantized_formats_generate(name):
    model = tiny_model(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = KvgenCache(name, model.config, max_tokens=64, block_size=4)
    tokens = generate(model, cache)
    assert len(tokens) == 12 and all(0 <= t < CONFIG["vocab_size"] for t in tokens)
    # the cache really holds the sequence: 11 prompt tokens + 11 generated ones fed back
    assert cache.layers[0].length == 11 + 11


def test_kivi_within_its_residual_window_is_exact():
    # 11 + 8 tokens stay in KIVI's bf16 residual window: the logits equal the default cache's, bit for bit
    model = tiny_model(torch.bfloat16, **KIVI_MODEL)
    cache = KvgenCache("kivi_2bit", model.config, max_tokens=64)
    assert torch.equal(scores(model, cache), scores(model))
    assert cache.layers[0].length == 11 + 7


def test_kivi_quantizes_what_leaves_the_window():
    from transformers import DynamicCache

    from kvgen import reference as R
    from kvgen.runtime.loader import load

    model = tiny_model(torch.bfloat16, **KIVI_MODEL)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 200), generator=torch.Generator().manual_seed(1))
    kivi, plain = KvgenCache("kivi_2bit", model.config, max_tokens=256), DynamicCache()
    with torch.no_grad():
        model(ids[:, :150], past_key_values=kivi)  # a prefill, then a second chunk that flushes groups
        model(ids[:, 150:], past_key_values=kivi)
        model(ids, past_key_values=plain)
    p = R.kivi_params(load("kivi_2bit").spec)
    q = R.quantized_length(200, p.G, p.R)
    assert 0 < q < 200
    got, want = kivi.layers[0].keys, plain.layers[0].keys  # layer 0 sees the same inputs either way
    assert got.shape == want.shape == (2, CONFIG["num_key_value_heads"], 200, 32)
    assert torch.equal(got[:, :, q:], want[:, :, q:])  # the residual window: the model's bf16 keys
    diff = (got[:, :, :q] - want[:, :, :q]).float()
    assert diff.abs().max() > 0  # quantized to 2 bits ...
    rel = diff.norm() / want[:, :, :q].float().norm()
    assert rel < 0.5, float(rel)  # ... and still close


def test_kivi_block_size_must_hold_whole_groups():
    model = tiny_model(torch.bfloat16)
    with pytest.raises(ValueError, match="block_size"):
        KvgenCache("kivi_2bit", model.config, block_size=16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen on machines without a GPU")
def test_importing_kvgen_first_selects_the_interpreter_without_a_gpu():
    # the README's recipe, in a fresh process with no TRITON_INTERPRET: kvgen, then transformers (which imports
    # triton), then a generation through a kvgen cache
    import os
    import subprocess
    import sys

    script = (
        "import kvgen\n"
        "from kvgen.hf_cache import KvgenCache\n"
        "import torch, triton\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "torch.manual_seed(0)\n"
        f"cfg = LlamaConfig(**{CONFIG!r})\n"
        "model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()\n"
        "ids = torch.tensor([[5, 17, 42, 99]])\n"
        "out = model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0,\n"
        "                     past_key_values=KvgenCache('int8_per_token_head', cfg))\n"
        "print('generated', out.shape[1])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "generated 6" in r.stdout, r.stdout


KIVI16 = (Path(__file__).resolve().parent.parent / "specs" / "kivi_2bit.yaml").read_text().replace(
    "name: kivi_2bit", "name: kivi_2bit_g16").replace("group_tokens: 32", "group_tokens: 16").replace(
    "tokens: 128", "tokens: 16")


@pytest.fixture(scope="module")
def kivi16(tmp_path_factory):
    """kivi_2bit with groups of 16 tokens and a 16-token window: 32 tokens already flush a group."""
    import kvgen

    path = tmp_path_factory.mktemp("kivi16") / "kivi_2bit_g16.yaml"
    path.write_text(KIVI16)
    return kvgen.load(path)


def _logits(model, cache, ids):
    with torch.no_grad():
        return model(ids, past_key_values=cache).logits


@pytest.mark.parametrize("name", ["bf16", "kivi16"])
def test_cache_operations_leave_what_a_fresh_cache_would_hold(name, kivi16):
    """reset, crop, reorder_cache, batch_select_indices and batch_repeat_interleave: the next step's logits equal a
    fresh cache's on the batch they describe. KIVI re-reads its pages and residual rows on every step, so it kept
    the old rows' tokens (reset, crop, reorder, select: wrong logits) and a repeated batch overflowed its slots."""
    fmt = kivi16 if name == "kivi16" else name
    model = tiny_model(torch.bfloat16, **KIVI_MODEL)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(1, 255, (2, 34), generator=g), torch.randint(1, 255, (2, 20), generator=g)
    step = torch.randint(1, 255, (2, 1), generator=g)

    def fresh(*prompts):
        cache = KvgenCache(fmt, model.config, max_tokens=64, block_size=16)
        for ids in prompts:
            out = _logits(model, cache, ids)
        return out

    cache = KvgenCache(fmt, model.config, max_tokens=64, block_size=16)
    for _ in range(2):  # rounds of 34 tokens in a 64-token cache: each reset must free the rows
        _logits(model, cache, a)
        cache.reset()
    assert torch.equal(_logits(model, cache, b), fresh(b))

    cache = KvgenCache(fmt, model.config, max_tokens=64, block_size=16)
    _logits(model, cache, a)
    cache.crop(-2)  # inside KIVI's window: Q(32) = Q(34) = 16
    assert cache.get_seq_length() == 32
    assert torch.equal(_logits(model, cache, step), fresh(a[:, :32], step))
    if name == "kivi16":
        with pytest.raises(ValueError, match="crop: .* cannot be undone there; it can remove the newest 1 or fewer"):
            cache.crop(-10)  # 33 -> 23: Q(23) = 0, the group quantized at 32 tokens cannot be unquantized
        assert cache.get_seq_length() == 33  # a refused crop cut nothing

    for op, batch in (("reorder", a.flip(0)), ("select", a[1:]), ("repeat", a.repeat_interleave(2, dim=0))):
        cache = KvgenCache(fmt, model.config, max_tokens=64, block_size=16)
        _logits(model, cache, a)
        if op == "reorder":
            cache.reorder_cache(torch.tensor([1, 0]))
        elif op == "select":
            cache.batch_select_indices(torch.tensor([1]))
        else:
            cache.batch_repeat_interleave(2)
        nxt = step[:batch.shape[0]] if op != "repeat" else step.repeat(2, 1)
        assert torch.equal(_logits(model, cache, nxt), fresh(batch, nxt)), op
