"""Argument checks of the kernel entry points: every problem is a ValueError that names the argument.

Cheap checks (shape, dtype, device, contiguity) always run. Checks that read tensor contents (slot and block-table
ranges, sequence lengths against capacity) need a device-to-host copy; they run when the tensors are on the CPU,
or everywhere when ``KVGEN_DEBUG=1`` (or ``kvgen.runtime.checks.DEBUG = True``).
"""

from __future__ import annotations

import math
import numbers
import operator
import os
from typing import Iterable, Optional

import numpy as np
import torch

DEBUG = os.environ.get("KVGEN_DEBUG", "") not in ("", "0")

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def costly_checks_on(*tensors: torch.Tensor) -> bool:
    return DEBUG or all(t.device.type == "cpu" for t in tensors)


def tensor(name: str, x, *, dtypes: Iterable[torch.dtype], ndim: int, device: torch.device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    dtypes = tuple(dtypes)
    if x.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name}: dtype {str(x.dtype).replace('torch.', '')} is not supported; expected {allowed}")
    if x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimension{'s' if ndim != 1 else ''}, got shape {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name}: is on {x.device}, but the cache is on {device}")
    return x


def device_arg(name: str, device) -> torch.device:
    """A device argument as a torch.device that this process can allocate on: a bad string, or a CUDA device that
    torch cannot see (a CPU build of torch, no GPU, an index past the last GPU), is an error naming ``name``."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{name}: {device!r} is not a device ({exc})") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: {dev} was asked for; kvgen's kernels run on 'cuda' (compiled) or 'cpu' (Triton's "
                         "interpreter)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}: {dev} was asked for, but torch sees no CUDA device here (torch "
                             f"{torch.__version__}); use 'cpu' with TRITON_INTERPRET=1")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name}: {dev} was asked for, but torch sees {torch.cuda.device_count()} CUDA "
                             "device(s)")
    return dev


def shape(name: str, x: torch.Tensor, expected: tuple, what: str) -> None:
    """``expected`` may hold None for a dimension of any size."""
    for got, want in zip(x.shape, expected):
        if want is not None and got != want:
            pretty = "[" + ", ".join("*" if w is None else str(w) for w in expected) + "]"
            raise ValueError(f"{name}: shape {list(x.shape)} does not match {what} {pretty}")


def last_dim_contiguous(name: str, x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride {x.stride(-1)}); pass .contiguous()")
    return x


def index_tensor(name: str, x, *, ndim: int, device: torch.device,
                 dtypes=(torch.int32, torch.int64), rows_strided: bool = False) -> torch.Tensor:
    """An index tensor, contiguous; with ``rows_strided`` (a block table, which kernels read through its row
    stride) only each row must be: a column slice of a wider table is taken as it is."""
    x = tensor(name, x, dtypes=dtypes, ndim=ndim, device=device)
    if rows_strided and ndim == 2 and (x.stride(1) == 1 or x.shape[1] <= 1) and x.stride(0) >= 0:
        return x
    if not x.is_contiguous():
        raise ValueError(f"{name}: must be contiguous" + (" along each row" if rows_strided else ""))
    return x


def output(out, query: torch.Tensor) -> torch.Tensor:
    """``out``: a tensor of the query's dtype, shape and device, its last dimension contiguous."""
    out = tensor("out", out, dtypes=(query.dtype,), ndim=3, device=query.device)
    shape("out", out, tuple(query.shape), "query's")
    return last_dim_contiguous("out", out)


def seq_ids_in_range(seq_ids: torch.Tensor, max_rows: int) -> None:
    """Each sequence's row in the residual buffers (reads the tensor)."""
    if seq_ids.numel() and (int(seq_ids.min()) < 0 or int(seq_ids.max()) >= max_rows):
        raise ValueError(f"seq_ids: must be in [0, {max_rows}) (max_seqs of allocate)")


def slots_in_range(slot_mapping: torch.Tensor, num_slots: int) -> None:
    if slot_mapping.numel() == 0:
        return
    lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
    if lo < -1:
        raise ValueError(f"slot_mapping: slot {lo} is invalid (slots are >= 0, or -1 to skip a token)")
    if hi >= num_slots:
        raise ValueError(f"slot_mapping: slot {hi} is out of range: the cache has {num_slots} slots "
                         "(num_blocks * block_size)")


def slots_match_positions(slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                          query_start_loc: torch.Tensor, block_size: int) -> None:
    """A write placed by sequence metadata (KIVI): each row inside a sequence must carry the slot that the block
    table gives its position (``seq_len - q_len + i``); rows outside every sequence are not looked at. Run after
    :func:`attention_ranges` (the block-table entries it reads are in range)."""
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, (a, b) in enumerate(zip(qsl[:-1], qsl[1:])):
        if b <= a:
            continue
        pos = torch.arange(lens[s] - (b - a), lens[s], device=block_table.device)
        expect = block_table[s, pos // block_size].to(torch.int64) * block_size + pos % block_size
        got = slot_mapping[a:b].to(torch.int64)
        wrong = (got != expect).nonzero()
        if wrong.numel():
            i = int(wrong[0])
            raise ValueError(f"slot_mapping: row {a + i} (sequence {s}, position {int(pos[i])}) has slot "
                             f"{int(got[i])}, but block_table puts that position at slot {int(expect[i])}")


def attention_ranges(block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                     num_blocks: int, block_size: int, num_tokens: int, max_query_len: Optional[int] = None,
                     planned_longest: bool = False) -> None:
    """attend's checks of the batch tensors' contents. ``planned_longest``: ``max_query_len`` is what a plan found
    in ``query_start_loc`` at planning (the caller gave none), so a longer query now calls for a new plan."""
    qsl = query_start_loc.tolist()
    if qsl[0] != 0 or qsl[-1] > num_tokens:
        raise ValueError(f"query_start_loc: must start at 0 and end at most at the number of query tokens "
                         f"{num_tokens} (rows past its end are padding), got {qsl[0]} ... {qsl[-1]}")
    for s, (a, b) in enumerate(zip(qsl[:-1], qsl[1:])):
        if b < a:
            raise ValueError(f"query_start_loc: must not decrease (sequence {s}: {a} -> {b})")
    lens = seq_lens.tolist()
    longest = max((b - a for a, b in zip(qsl[:-1], qsl[1:])), default=0)
    if max_query_len is not None and max_query_len < longest:
        if planned_longest:
            raise ValueError(f"query_start_loc: its longest query ({longest} tokens) is longer than the plan's "
                             f"({max_query_len}, the longest at planning): plan again, or plan with max_query_len=")
        raise ValueError(f"max_query_len: {max_query_len} is below the longest query ({longest} tokens)")
    max_blocks = block_table.shape[1]
    for s, (a, b) in enumerate(zip(qsl[:-1], qsl[1:])):
        if lens[s] < 0:
            raise ValueError(f"seq_lens: sequence {s} has a negative length ({lens[s]})")
        if lens[s] < b - a:
            raise ValueError(f"seq_lens: sequence {s} has {lens[s]} KV tokens but {b - a} query tokens; "
                             "seq_lens counts the new tokens too")
        if lens[s] > max_blocks * block_size:
            raise ValueError(f"seq_lens: sequence {s} has {lens[s]} tokens, more than its block_table row holds "
                             f"({max_blocks} blocks x {block_size})")
        used = (lens[s] + block_size - 1) // block_size
        if used:
            row = block_table[s, :used]
            lo, hi = int(row.min()), int(row.max())
            if lo < 0 or hi >= num_blocks:
                raise ValueError(f"block_table: sequence {s} uses block {lo if lo < 0 else hi}, outside "
                                 f"[0, {num_blocks})")


def as_int(x) -> Optional[int]:
    """``x`` as a Python int where it is an integer (numpy's too), not a bool; else None."""
    if isinstance(x, (bool, np.bool_)) or isinstance(x, torch.Tensor):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def positive_int(name: str, x: int) -> int:
    v = as_int(x)
    if v is None or v < 1:
        raise ValueError(f"{name}: expected a positive integer, got {x!r}")
    return v


def optional_positive_int(name: str, x: Optional[int]) -> Optional[int]:
    if x is None:
        return None
    v = as_int(x)
    if v is None or v < 1:
        raise ValueError(f"{name}: expected a positive integer or None, got {x!r}")
    return v


INT32_MAX = 2**31 - 1


def optional_length(name: str, x: Optional[int]) -> Optional[int]:
    """A positive token count or None; above int32's range (where seq_lens live) it has no meaning for a kernel."""
    v = optional_positive_int(name, x)
    if v is not None and v > INT32_MAX:
        raise ValueError(f"{name}: {v} is beyond int32's range (seq_lens are int32; at most {INT32_MAX})")
    return v


def finite_float(name: str, x) -> float:
    """``x`` as a Python float where it is a finite real number (numpy's too), not a bool."""
    if isinstance(x, (bool, np.bool_, torch.Tensor)) or not isinstance(x, numbers.Real) or not math.isfinite(x):
        raise ValueError(f"{name}: expected a finite float, got {x!r}")
    return float(x)
