"""Import a generated package's Triton kernels and launch them: grids and tile sizes, nothing per-format."""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import torch

try:
    from ..codegen.errors import KvgenError
except ImportError:
    from codegen.errors import KvgenError

LOG2E = 1.4426950408889634


def interpreting() -> bool:
    """Whether Triton kernels run under the CPU interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def _choose_mode() -> None:
    """Without a GPU, kernels can only run interpreted: say so before the first @triton.jit is decorated.

    Triton decides at import time (its own library functions are decorated then), so this must happen before
    ``import triton``; a process that imported triton first on a machine without a GPU gets a clear error.
    """
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        if "triton" in sys.modules:
            raise KvgenError("there is no GPU, so kvgen's kernels must run in Triton's CPU interpreter, but triton "
                             "was imported before kvgen could select it: set TRITON_INTERPRET=1 in the environment "
                             "(or import kvgen's kernels before triton)")
        os.environ["TRITON_INTERPRET"] = "1"


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


class KernelSet:
    """The kernels module of one generated package, imported on first use."""

    def __init__(self, package: types.ModuleType):
        self.package = package
        self._module = None

    @property
    def module(self) -> types.ModuleType:
        if self._module is None:
            _choose_mode()
            name = f"{self.package.__name__}.kernels"
            mod = sys.modules.get(name)
            if mod is None:
                path = os.path.join(os.path.dirname(self.package.__file__), "kernels.py")
                spec = importlib.util.spec_from_file_location(name, path)
                mod = importlib.util.module_from_spec(spec)
                sys.modules[name] = mod
                try:
                    spec.loader.exec_module(mod)
                except BaseException:
                    del sys.modules[name]
                    raise
            self._module = mod
        return self._module

    def _check_device(self, t: torch.Tensor) -> None:
        _choose_mode()
        if interpreting():
            if t.device.type != "cpu":
                raise ValueError(f"cache: is on {t.device}, but Triton runs interpreted (TRITON_INTERPRET=1) in this "
                                 "process, which needs CPU tensors")
        elif t.device.type != "cuda":
            raise ValueError(f"cache: is on {t.device}; compiled Triton kernels need a CUDA device (or set "
                             "TRITON_INTERPRET=1 before importing kvgen to run on the CPU)")

    def write(self, key, value, slot_mapping, tensors: dict, consts: dict) -> None:
        """``tensors``: the kernel's pointer arguments by name; ``consts``: layout and shape constexprs."""
        self._check_device(tensors["k_cache_ptr"])
        num_tokens = key.shape[0]
        block_t = 64 if interpreting() else 16
        block_t = min(block_t, _next_pow2(num_tokens))
        grid = (triton_cdiv(num_tokens, block_t), consts["NUM_KV_HEADS"])
        self.module.reshape_and_cache_kernel[grid](
            key, value, slot_mapping_ptr=slot_mapping, num_tokens=num_tokens,
            stride_kt=key.stride(0), stride_kh=key.stride(1), stride_vt=value.stride(0), stride_vh=value.stride(1),
            BLOCK_T=block_t, **tensors, **consts,
            # stored bytes must not depend on the compiler contracting x * inv + c into one rounding
            **({} if interpreting() else {"enable_fp_fusion": False}),
        )

    def write_streaming(self, key, value, query_start_loc, seq_lens, block_table, seq_ids, max_query_len,
                        tensors: dict, consts: dict, residual: dict) -> None:
        """KIVI: quantize the groups that leave the residual window, then store the new residual tokens."""
        self._check_device(tensors["k_cache_ptr"])
        group, ring = residual["group"], residual["ring"]
        num_seqs = seq_lens.shape[0]
        # groups one sequence can complete in this write: its new tokens span at most this many group boundaries
        max_groups = max_query_len // group + 1
        strides = dict(stride_kt=key.stride(0), stride_kh=key.stride(1), stride_vt=value.stride(0),
                       stride_vh=value.stride(1))
        fusion = {} if interpreting() else {"enable_fp_fusion": False}
        self.module.kivi_flush_kernel[(num_seqs, max_groups, consts["NUM_KV_HEADS"])](
            key, value, **tensors, seq_ids_ptr=seq_ids, query_start_loc_ptr=query_start_loc, seq_lens_ptr=seq_lens,
            block_table_ptr=block_table, stride_bt=block_table.stride(0), **strides, **consts,
            BLOCK_T=group, RESIDUAL=residual["tokens"], RING=ring, **fusion,
        )
        block_t = min(64 if interpreting() else 16, _next_pow2(max_query_len))
        num_q_tiles = triton_cdiv(max_query_len, block_t)
        self.module.kivi_residual_kernel[(num_seqs * num_q_tiles, consts["NUM_KV_HEADS"])](
            key, value, tensors["k_res_ptr"], tensors["v_res_ptr"], seq_ids, query_start_loc, seq_lens,
            **strides, num_q_tiles=num_q_tiles, NUM_KV_HEADS=consts["NUM_KV_HEADS"], HEAD_SIZE=consts["HEAD_SIZE"],
            HEAD_PAD=consts["HEAD_PAD"], TOKEN_GROUP=group, RESIDUAL=residual["tokens"], RING=ring, BLOCK_T=block_t,
        )

    def attend(self, query, out, block_table, seq_lens, query_start_loc, qk_scale, window, max_query_len,
               tensors: dict, consts: dict, extra: dict | None = None, dot_bf16: bool = False) -> None:
        self._check_device(tensors["k_cache_ptr"])
        num_q_heads = query.shape[1]
        group = num_q_heads // consts["NUM_KV_HEADS"]
        max_rows = 128 if interpreting() else 64
        block_m = max(16, _next_pow2(group * min(max_query_len, max(1, max_rows // group))))
        block_q = max(1, block_m // group)
        block_n = 128 if interpreting() else 64
        num_q_tiles = triton_cdiv(max_query_len, block_q)
        grid = (seq_lens.shape[0] * num_q_tiles, consts["NUM_KV_HEADS"])
        self.module.paged_attention_kernel[grid](
            query, out, block_table_ptr=block_table, seq_lens_ptr=seq_lens, query_start_loc_ptr=query_start_loc,
            qk_scale=qk_scale * LOG2E, window=window, num_q_tiles=num_q_tiles,
            stride_qt=query.stride(0), stride_qh=query.stride(1), stride_ot=out.stride(0), stride_oh=out.stride(1),
            stride_bt=block_table.stride(0), GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
            DOT_BF16=dot_bf16,  # bf16 tensor-core dots (opt-in), else exact fp32 dots
            **tensors, **consts, **(extra or {}),
        )


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
