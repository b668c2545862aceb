"""A Hugging Face transformers Cache backed by a kvgen format: generate() with a quantized paged KV cache.

    from kvgen.hf_cache import KvgenCache
    cache = KvgenCache("int8_per_token_head", model.config, max_tokens=4096)
    out = model.generate(**inputs, cache=cache, max_new_tokens=32)  # past_key_values= in older transformers

Every layer keeps its keys and values in a kvgen paged cache: new tokens are written by the format's generated
reshape-and-cache kernel through a slot mapping (each batch row owns its blocks), on the model's GPU when the kernels
are compiled, else interpreted on the CPU. The model's own attention then
runs on the dequantized cache: the bytes the kernel stored, decoded by the spec's NumPy reference
(``kvgen.reference``), so what the model sees is exactly what the cache holds. (kvgen's paged-attention kernel is not
plugged into transformers' attention here; that is the engine's job. Decoding on the host is slow and meant for
accuracy runs and tests, not for speed.) Formats with a residual window (KIVI) work too: each batch row is a
sequence with its own residual row, written by the streaming kernels; since tokens leaving the window change from
bf16 to quantized values, the layer re-reads every position after each write. The Cache operations generation
uses keep the kvgen cache in step: ``reset`` (a fresh cache for the next batch), ``crop`` (KIVI: only inside its
full-precision window, since quantized groups cannot be undone), and ``reorder_cache`` / ``batch_select_indices`` /
``batch_repeat_interleave`` (beam search, batch pruning), which copy each row's blocks and residual row.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional, Union

import numpy as np
import torch
try:
    from transformers.cache_utils import Cache, DynamicLayer
except ImportError as exc:  # an optional dependency: say which, and how to get it
    raise ImportError("kvgen.hf_cache needs Hugging Face transformers (>= 5.0): pip install 'kvgen[hf]' "
                      "(or pip install 'transformers>=5.0')") from exc

from . import reference as R
from .runtime.format import Format
from .runtime.kernels import interpreting
from .runtime.loader import load


class KvgenLayer(DynamicLayer):
    """One layer: writes go to the kvgen cache; ``keys``/``values`` hold the dequantized cache for attention."""

    def __init__(self, fmt: Format, block_size: int, max_tokens: int, k_scale=None, v_scale=None):
        super().__init__()
        self.fmt, self.block_size, self.max_tokens = fmt, block_size, max_tokens
        self.k_scale, self.v_scale = k_scale, v_scale
        self.cache = None
        self.length = 0

    # -- transformers' Cache operations: the kvgen cache follows every one (rows own their blocks and, for KIVI, the
    # residual row of their index), or refuses it in words
    def reset(self) -> None:
        """Forget every row: the next update allocates a fresh cache for its batch."""
        super().reset()
        self.cache, self.length = None, 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest tokens (a negative count, as transformers' own layers take it). A KIVI cache crops only
        inside its full-precision window: tokens that left it for quantized groups cannot come back."""
        if tokens_to_remove > 0 or tokens_to_remove == 0 or self.cache is None:
            super().crop(tokens_to_remove)  # refuses a positive count; nothing else to do
            return
        new_length = max(self.length - abs(tokens_to_remove), 0)
        if self.fmt.spec.streaming:  # checked before anything is cut: a refused crop leaves the layer as it was
            res = self.fmt.layout.RESIDUAL
            q = lambda n: R.quantized_length(n, res["group"], res["tokens"])  # noqa: E731
            if q(new_length) != q(self.length):
                most = self.length - q(self.length) - res["tokens"]
                raise ValueError(f"crop: {self.fmt.name} quantized positions {q(new_length)}..{q(self.length) - 1} "
                                 f"when they left its {res['tokens']}-token window, so a crop to {new_length} tokens "
                                 f"cannot be undone there; it can remove the newest {most} or fewer (or reset() and "
                                 "prefill again)")
        super().crop(tokens_to_remove)
        self.length = new_length

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row r takes row ``beam_idx[r]``'s tokens (pages and residual window copied)."""
        super().reorder_cache(beam_idx)
        self._gather_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        rows = torch.arange(self._rows())[indices.cpu()] if self.cache is not None else None  # before keys shrink
        super().batch_select_indices(indices)
        self._gather_rows(rows)

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = torch.arange(self._rows()).repeat_interleave(repeats) if self.cache is not None else None
        super().batch_repeat_interleave(repeats)
        self._gather_rows(rows)

    def _rows(self) -> int:
        """Batch rows the cache holds now (its keys' batch), or its capacity before any token."""
        if self.keys is not None and self.keys.numel():
            return self.keys.shape[0]
        return self.cache.num_blocks // self.blocks_per_row

    def _gather_rows(self, src) -> None:
        """Make row r of the kvgen cache a copy of row ``src[r]`` (its blocks; KIVI: its residual row), in a larger
        cache where there are more rows than it holds."""
        if self.cache is None or src is None:
            return
        src = torch.as_tensor(src, dtype=torch.long).reshape(-1).cpu()
        n, bpr, old = src.numel(), self.blocks_per_row, self.cache
        capacity = old.num_blocks // bpr
        new = old if n <= capacity else self.fmt.allocate(
            n * bpr, self.block_size, old.num_kv_heads, old.head_size, device=self.device,
            **({"max_seqs": n} if self.fmt.spec.streaming else {}),
            **{k: old.tensors[k] for k in ("k_scale", "v_scale") if k in old.tensors})
        blocks = (src[:, None] * bpr + torch.arange(bpr)[None, :]).reshape(-1).to(self.device)
        for name, t in old.tensors.items():
            if name in ("k_scale", "v_scale"):
                continue  # per layer: the same for every row
            index = src.to(self.device) if "residual" in name else blocks
            gathered = t[index].clone()  # a copy first: rows may move onto one another
            new.tensors[name][:gathered.shape[0]].copy_(gathered)
        self.cache = new

    def _allocate(self, batch: int, heads: int, head_size: int, device) -> None:
        blocks_per_row = math.ceil(self.max_tokens / self.block_size)
        kwargs = {"max_seqs": batch} if self.fmt.spec.streaming else {}
        for side, arg, val in (("key", "k_scale", self.k_scale), ("value", "v_scale", self.v_scale)):
            if self.fmt.static_scale_kind(side) is not None:
                kwargs[arg] = 1.0 if val is None else val
        # the kernels run where the model runs when they are compiled (a GPU), else interpreted on the CPU
        self.device = torch.device(device) if torch.device(device).type == "cuda" and not interpreting() else \
            torch.device("cpu")
        self.cache = self.fmt.allocate(batch * blocks_per_row, self.block_size, heads, head_size, device=self.device,
                                       **kwargs)
        self.blocks_per_row = blocks_per_row

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, heads, new, head_size = key_states.shape
        if self.cache is None:
            self._allocate(batch, heads, head_size, key_states.device)
        if self.length + new > self.max_tokens:
            raise ValueError(f"max_tokens: the cache holds {self.max_tokens} tokens per row; {self.length + new} "
                             "are needed")
        pos = torch.arange(self.length, self.length + new)
        rows = torch.arange(batch)
        # row r owns blocks [r * blocks_per_row, (r + 1) * blocks_per_row): slot of (r, p)
        slots = ((rows[:, None] * self.blocks_per_row + pos[None, :] // self.block_size) * self.block_size
                 + pos[None, :] % self.block_size).reshape(-1)
        k = key_states.detach().to(self.device).transpose(1, 2).reshape(batch * new, heads, head_size).contiguous()
        v = value_states.detach().to(self.device).transpose(1, 2).reshape(batch * new, heads, head_size).contiguous()
        if k.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            k, v = k.float(), v.float()
        dtype, device = key_states.dtype, key_states.device
        if self.fmt.spec.streaming:
            self._write_streaming(k, v, slots, batch, new)
            k_all, v_all = self._read_streaming(batch, heads, head_size)
            self.keys = k_all.to(device=device, dtype=dtype)
            self.values = v_all.to(device=device, dtype=dtype)
            return self.keys, self.values
        self.fmt.write(self.cache, k, v, slots.to(self.device))
        k_deq, v_deq = self._decode(slots, batch, new, heads, head_size)
        k_deq = k_deq.to(device=device, dtype=dtype)
        v_deq = v_deq.to(device=device, dtype=dtype)
        self.keys = torch.cat([self.keys, k_deq], dim=-2)
        self.values = torch.cat([self.values, v_deq], dim=-2)
        self.length += new
        return self.keys, self.values

    def _table(self, batch: int, device="cpu") -> torch.Tensor:
        return (torch.arange(batch, dtype=torch.int32, device=device)[:, None] * self.blocks_per_row
                + torch.arange(self.blocks_per_row, dtype=torch.int32, device=device)[None, :])

    def _write_streaming(self, k, v, slots, batch: int, new: int) -> None:
        """KIVI: every batch row is a sequence (residual row = its index) appending ``new`` tokens."""
        dev = self.device
        self.fmt.write(self.cache, k, v, slots.to(dev), seq_ids=torch.arange(batch, dtype=torch.int32, device=dev),
                       query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev) * new,
                       seq_lens=torch.full((batch,), self.length + new, dtype=torch.int32, device=dev),
                       block_table=self._table(batch, dev), max_query_len=new)
        self.length += new

    def _read_streaming(self, batch: int, heads: int, head_size: int):
        """Every position of every row as stored (pages and residual window), decoded by the reference."""
        arrays = {name: t.view(torch.uint8).cpu().numpy() for name, t in self.cache.tensors.items()}  # as bytes
        table = self._table(batch).numpy()
        ks, vs = [], []
        for r in range(batch):
            k, v = R.kivi_read(self.fmt.spec, arrays, r, self.length, table[r], self.block_size, heads, head_size)
            ks.append(torch.from_numpy(k).transpose(0, 1))
            vs.append(torch.from_numpy(v).transpose(0, 1))
        return torch.stack(ks), torch.stack(vs)

    def _decode(self, slots, batch, new, heads, head_size):
        """The dequantized values of the slots just written, decoded from the stored bytes by the reference."""
        spec = self.fmt.spec
        blocks = sorted({int(s) // self.block_size for s in slots})
        cache_bytes = {name: t.view(torch.uint8).reshape(t.shape[0], -1)[blocks].cpu().numpy()
                       for name, t in self.cache.tensors.items() if name.endswith("_cache")}
        scales = {}
        for n in ("k_scale", "v_scale"):
            t = self.cache.tensors.get(n)
            scales[n] = None if t is None else (float(t) if t.numel() == 1 else t.cpu().numpy())
        k_all, v_all = R.read(spec, cache_bytes, scales["k_scale"], scales["v_scale"], head_size=head_size,
                              block_size=self.block_size, num_kv_heads=heads)
        index = {b: i for i, b in enumerate(blocks)}
        s = slots.numpy()
        bi = np.array([index[int(x) // self.block_size] for x in s])
        off = s % self.block_size
        k = torch.from_numpy(k_all[bi, off]).reshape(batch, new, heads, head_size).transpose(1, 2)
        v = torch.from_numpy(v_all[bi, off]).reshape(batch, new, heads, head_size).transpose(1, 2)
        return k, v


class KvgenCache(Cache):
    """A transformers Cache whose layers store K/V in a kvgen format (``skip_layers`` keep plain model-dtype
    DynamicLayers). ``scales``: per-layer static scales, e.g. from :func:`kvgen.scales.load_scales`."""

    def __init__(self, fmt: Union[str, Format], config, *, max_tokens: int = 4096, block_size: Optional[int] = None,
                 skip_layers=(), scales: Optional[dict] = None):
        fmt = load(fmt) if not isinstance(fmt, Format) else fmt
        group = fmt.layout.RESIDUAL["group"] if fmt.spec.streaming else 1
        if block_size is None:
            block_size = group * -(-16 // group)  # 16, or the smallest multiple of KIVI's token group above it
        elif block_size % group:
            raise ValueError(f"block_size: {fmt.name} quantizes keys in groups of {group} tokens; the block size must "
                             f"be a multiple of {group}, got {block_size}")
        text = getattr(config, "get_text_config", lambda: config)()
        num_layers = text.num_hidden_layers
        scales = scales or {}
        skip = set(skip_layers)
        layers = []
        for i in range(num_layers):
            if i in skip:
                layers.append(DynamicLayer())
            else:
                k, v = scales.get(i, (None, None))
                layers.append(KvgenLayer(fmt, block_size, max_tokens, k, v))
        if any(fmt.static_scale_kind(s) is not None for s in ("key", "value")):
            missing = [i for i in range(num_layers) if i not in skip and i not in scales]
            if missing:
                warnings.warn(f"kvgen: no K/V scales for {len(missing)} layer(s); using 1.0 there", stacklevel=2)
        super().__init__(layers=layers)
        self.format = fmt
