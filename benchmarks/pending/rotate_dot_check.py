"""Which head sizes' back-rotation by tensor-core dots goes wrong on a GPU (thirty-third session: int4 per
token-head's dequantize-first attention failed at head size 16 on the H100 with the dots). For each rotated format
and head size, a fixed batch through Format.attend(dequantize_first=True) checked by the conformance run, with the
dots at every head (ROT_DOT_MIN_PAD = 0) and with the runtime's rule; prints a markdown table.

    python benchmarks/pending/rotate_dot_check.py [FORMATS]
"""
import sys

import torch

import kvgen
from kvgen.conformance import Case, HEAD_SIZES, run_case
from kvgen.runtime import dequantize as D

formats = sys.argv[1:] or ["int4_per_token_head", "int8_per_token_head_hadamard_k"]
rule = D.ROT_DOT_MIN_PAD
print("| format | head size | dots everywhere | rule (dots above %d) |" % rule)
print("|---|---|---|---|")
for name in formats:
    fmt = kvgen.load(name)
    for head_size in tuple(HEAD_SIZES) + (128, 256):
        row = []
        for min_pad in (0, rule):
            D.ROT_DOT_MIN_PAD = min_pad
            fails = []
            for seed, (seq_lens, q_lens) in enumerate((([1], [1]), ([37, 5], [37, 5]), ([45], [3]))):
                case = Case(head_size=head_size, block_size=16, num_kv_heads=2, group=2, seq_lens=seq_lens,
                            q_lens=q_lens, dtype=(torch.bfloat16, torch.float16)[seed % 2], window=None, holes=0,
                            seed=seed, k_scale=1.0, v_scale=1.0, magnitude=1.0)
                bad = {p: m for p, m in run_case(fmt, case, "cuda", dequantize_first=True).items() if m}
                if bad:
                    fails.append(f"case {seed}: {bad}")
            row.append("ok" if not fails else "; ".join(fails)[:160])
        print(f"| {name} | {head_size} | {row[0]} | {row[1]} |", flush=True)
D.ROT_DOT_MIN_PAD = rule
