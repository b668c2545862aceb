"""A loaded format: allocate a paged cache, write keys and values into it, run paged attention over it."""

from __future__ import annotations

import dataclasses
import math
import types
import warnings
from typing import Optional, Union

import torch

from . import checks
from .kernels import KernelSet

try:
    from ..codegen.spec import FormatSpec, Granularity
except ImportError:  # running from a source checkout with the repo root on sys.path
    from codegen.spec import FormatSpec, Granularity

STORAGE_TORCH_DTYPES = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
}

ScaleArg = Union[None, float, int, torch.Tensor, list, tuple]


@dataclasses.dataclass
class KVCache:
    """One layer's paged KV cache: raw storage tensors plus the static scales that belong to it.

    ``tensors`` maps names to torch tensors: ``kv_cache`` (or ``k_cache``/``v_cache``) of shape
    ``[num_blocks, block_size, num_kv_heads, cell]`` in the format's storage dtype, and for static-scale formats
    ``k_scale``/``v_scale`` (fp32, ``[1]`` per tensor or ``[num_kv_heads]`` per head).
    """

    format_name: str
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    tensors: dict[str, torch.Tensor]

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def nbytes(self) -> int:
        """Bytes of the paged storage (static scales excluded)."""
        return sum(t.numel() * t.element_size() for n, t in self.tensors.items() if n.endswith("cache"))


class Format:
    """A generated KV-cache format, loaded. Obtain one with ``kvgen.load(name_or_path)``."""

    def __init__(self, spec: FormatSpec, package: types.ModuleType, layout: types.ModuleType, source: str):
        self.spec = spec
        self.name = spec.name
        self.package = package
        self.layout = layout
        self.source = source  # where it was loaded from
        self._kernels = KernelSet(package)

    def __repr__(self) -> str:
        return f"<kvgen format {self.name} from {self.source}>"

    # -- layout -----------------------------------------------------------------------------------------------
    def page_bytes(self, block_size: int, num_kv_heads: int, head_size: int) -> int:
        """Bytes one block of one layer takes (all cache tensors; static scales are per layer, not per page)."""
        return self.layout.page_bytes(block_size, num_kv_heads, head_size)

    def cell_layout(self, head_size: int) -> dict:
        return self.layout.cell_layout(head_size)

    def _static(self, side: str) -> Optional[Granularity]:
        sc = self.spec.side(side).scale
        return sc.granularity if sc is not None and sc.granularity.is_static else None

    # -- allocation -------------------------------------------------------------------------------------------
    def allocate(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, *,
                 device: Union[str, torch.device] = "cpu", k_scale: ScaleArg = None,
                 v_scale: ScaleArg = None) -> KVCache:
        """A zeroed paged cache; static scales (a float, or one per KV head for per-head formats) belong to it.

        A static-scale format given no scale uses 1.0 and warns once; a dynamic format refuses static scales.
        """
        for name, val in (("num_blocks", num_blocks), ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                          ("head_size", head_size)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name}: expected a positive integer, got {val!r}")
        if head_size < 16:
            raise ValueError(f"head_size: {head_size} is below the kernels' minimum of 16")
        try:
            shapes = self.layout.tensor_shapes(num_blocks, block_size, num_kv_heads, head_size)
        except ValueError as exc:
            raise ValueError(f"head_size: {exc}") from None
        device = torch.device(device)
        dtype = STORAGE_TORCH_DTYPES[self.layout.STORAGE_DTYPE]
        tensors = {name: torch.zeros(shape, dtype=dtype, device=device) for name, shape in shapes.items()}
        missing = []
        for side, arg, key in (("key", k_scale, "k_scale"), ("value", v_scale, "v_scale")):
            gran = self._static(side)
            if gran is None:
                if arg is not None:
                    raise ValueError(f"{key}: format {self.name} computes its {side} scales on write; "
                                     "a static scale does not apply")
                continue
            if arg is None:
                missing.append(key)
                arg = 1.0
            tensors[key] = self._scale_tensor(key, arg, gran, num_kv_heads, device)
        if missing:
            warnings.warn(f"kvgen format {self.name}: no {' / '.join(missing)} given; using 1.0. Load the scales "
                          "from the checkpoint, or pass k_scale= / v_scale= to allocate().", stacklevel=2)
        return KVCache(self.name, num_blocks, block_size, num_kv_heads, head_size, tensors)

    @staticmethod
    def _scale_tensor(name: str, arg: ScaleArg, gran: Granularity, num_kv_heads: int,
                      device: torch.device) -> torch.Tensor:
        t = torch.as_tensor(arg, dtype=torch.float32).flatten().to(device)
        want = 1 if gran == Granularity.per_tensor else num_kv_heads
        if t.numel() == 1 and want > 1:
            t = t.expand(want).clone()
        if t.numel() != want:
            what = "one value" if want == 1 else f"one value per KV head ({num_kv_heads})"
            raise ValueError(f"{name}: expected {what}, got {t.numel()} values")
        if not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
            raise ValueError(f"{name}: scales must be finite and positive, got {t.tolist()}")
        return t.contiguous()

    # -- kernels ----------------------------------------------------------------------------------------------
    def _check_cache(self, cache: KVCache) -> None:
        if not isinstance(cache, KVCache):
            raise ValueError(f"cache: expected a KVCache from {self.name}.allocate(), got {type(cache).__name__}")
        if cache.format_name != self.name:
            raise ValueError(f"cache: it was allocated by format {cache.format_name}, not {self.name}")

    def _layout_args(self, cache: KVCache) -> dict:
        cl = self.layout.cell_layout(cache.head_size)
        off, cells = cl["offsets"], cl["cell_bytes"]
        k_tensor = "kv_cache" if "kv_cache" in cells else "k_cache"
        v_tensor = "kv_cache" if "kv_cache" in cells else "v_cache"
        return dict(
            K_CELL=cells[k_tensor], K_DATA=off["k_data"], K_SCALE=off.get("k_scale", -1),
            V_CELL=cells[v_tensor], V_DATA=off["v_data"], V_SCALE=off.get("v_scale", -1),
        ), cache.tensors[k_tensor].view(torch.uint8), cache.tensors[v_tensor].view(torch.uint8)

    def _scales(self, cache: KVCache):
        dummy = None
        out = []
        for key in ("k_scale", "v_scale"):
            t = cache.tensors.get(key)
            if t is None:
                if dummy is None:
                    dummy = torch.ones(1, dtype=torch.float32, device=cache.device)
                t = dummy
            out.append(t)
        return out

    def write(self, cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantize ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` into ``cache`` at ``slot_mapping``.

        Slot ``s`` is block ``s // block_size``, offset ``s % block_size``; ``-1`` skips that token.
        """
        self._check_cache(cache)
        dev = cache.device
        key = checks.tensor("key", key, dtypes=checks.INPUT_DTYPES, ndim=3, device=dev)
        value = checks.tensor("value", value, dtypes=checks.INPUT_DTYPES, ndim=3, device=dev)
        expected = (None, cache.num_kv_heads, cache.head_size)
        checks.shape("key", key, expected, "[num_tokens, num_kv_heads, head_size] of the cache")
        checks.shape("value", value, (key.shape[0],) + expected[1:], "key's")
        checks.last_dim_contiguous("key", key)
        checks.last_dim_contiguous("value", value)
        slot_mapping = checks.index_tensor("slot_mapping", slot_mapping, ndim=1, device=dev)
        if slot_mapping.shape[0] != key.shape[0]:
            raise ValueError(f"slot_mapping: has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
        if checks.costly_checks_on(slot_mapping):
            checks.slots_in_range(slot_mapping, cache.num_slots)
        if key.shape[0] == 0:
            return
        layout_args, k_bytes, v_bytes = self._layout_args(cache)
        k_scale, v_scale = self._scales(cache)
        self._kernels.write(key, value, k_bytes, v_bytes, k_scale, v_scale, slot_mapping.to(torch.int64),
                            cache.num_kv_heads, cache.head_size, layout_args)

    def attend(self, query: torch.Tensor, cache: KVCache, block_table: torch.Tensor, seq_lens: torch.Tensor,
               query_start_loc: torch.Tensor, *, sm_scale: Optional[float] = None,
               sliding_window: Optional[int] = None, max_query_len: Optional[int] = None,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Causal paged attention of variable-length queries over the cache; returns ``[num_tokens, num_q_heads,
        head_size]`` in the query's dtype.

        ``query`` ``[num_tokens, num_q_heads, head_size]`` (num_q_heads a multiple of the cache's KV heads);
        ``block_table`` int32 ``[num_seqs, max_blocks]``; ``seq_lens`` int32 ``[num_seqs]`` (KV tokens including
        the new ones); ``query_start_loc`` int32 ``[num_seqs + 1]``. Query i of a sequence sits at position
        ``seq_len - q_len + i``; ``sliding_window=W`` keeps the W newest positions up to it. ``sm_scale`` defaults
        to ``1 / sqrt(head_size)``. ``max_query_len`` (optional) saves a device-to-host read.
        """
        self._check_cache(cache)
        dev = cache.device
        query = checks.tensor("query", query, dtypes=checks.INPUT_DTYPES, ndim=3, device=dev)
        checks.last_dim_contiguous("query", query)
        num_tokens, num_q_heads, head_size = query.shape
        if head_size != cache.head_size:
            raise ValueError(f"query: head size {head_size} does not match the cache's {cache.head_size}")
        if num_q_heads % cache.num_kv_heads:
            raise ValueError(f"query: {num_q_heads} query heads is not a multiple of the cache's "
                             f"{cache.num_kv_heads} KV heads")
        block_table = checks.index_tensor("block_table", block_table, ndim=2, device=dev, dtypes=(torch.int32,))
        seq_lens = checks.index_tensor("seq_lens", seq_lens, ndim=1, device=dev, dtypes=(torch.int32,))
        query_start_loc = checks.index_tensor("query_start_loc", query_start_loc, ndim=1, device=dev,
                                              dtypes=(torch.int32,))
        num_seqs = seq_lens.shape[0]
        if block_table.shape[0] != num_seqs:
            raise ValueError(f"block_table: has {block_table.shape[0]} rows for {num_seqs} sequences (seq_lens)")
        if query_start_loc.shape[0] != num_seqs + 1:
            raise ValueError(f"query_start_loc: needs num_seqs + 1 = {num_seqs + 1} entries, got "
                             f"{query_start_loc.shape[0]}")
        sliding_window = checks.optional_positive_int("sliding_window", sliding_window)
        max_query_len = checks.optional_positive_int("max_query_len", max_query_len)
        if sm_scale is None:
            sm_scale = 1.0 / math.sqrt(head_size)
        if not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale):
            raise ValueError(f"sm_scale: expected a finite float, got {sm_scale!r}")
        if checks.costly_checks_on(block_table, seq_lens, query_start_loc):
            checks.attention_ranges(block_table, seq_lens, query_start_loc, cache.num_blocks, cache.block_size,
                                    num_tokens)
        if out is None:
            out = torch.empty_like(query)
        else:
            out = checks.tensor("out", out, dtypes=(query.dtype,), ndim=3, device=dev)
            checks.shape("out", out, tuple(query.shape), "query's")
            checks.last_dim_contiguous("out", out)
        if num_tokens == 0 or num_seqs == 0:
            return out
        if max_query_len is None:
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
        layout_args, k_bytes, v_bytes = self._layout_args(cache)
        k_scale, v_scale = self._scales(cache)
        self._kernels.attend(query, out, k_bytes, v_bytes, k_scale, v_scale, block_table, seq_lens,
                             query_start_loc, float(sm_scale), sliding_window or 0, max_query_len,
                             cache.num_kv_heads, cache.block_size, layout_args)
        return out

    # -- description ------------------------------------------------------------------------------------------
    def describe(self, block_size: int = 16, num_kv_heads: int = 8, head_size: int = 128) -> dict:
        """Bytes per token and head, page bytes and where each scale lives: what `kvgen show` prints."""
        cl = self.layout.cell_layout(head_size)
        fields = []
        for name, tensor, size, align, what in self.layout.FIELDS:
            fields.append(dict(field=name, tensor=tensor, offset=cl["offsets"][name], bytes=size(head_size),
                               what=what))
        k = sum(f["bytes"] for f in fields if f["field"].startswith("k_"))
        v = sum(f["bytes"] for f in fields if f["field"].startswith("v_"))
        total = sum(cl["cell_bytes"].values())
        scales = {}
        for side in ("key", "value"):
            sc = self.spec.side(side).scale
            if sc is None:
                scales[side] = "none (unquantized)"
            elif sc.granularity.is_static:
                per = "per layer" if sc.granularity == Granularity.per_tensor else "per KV head"
                scales[side] = f"static fp32 {per}, in the cache object ({side[0]}_scale)"
            else:
                scales[side] = f"dynamic {sc.dtype.value} {sc.granularity.value}, {sc.placement.value} in the cell"
        return dict(name=self.name, block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                    key_bytes=k, value_bytes=v, padding_bytes=total - k - v, bytes_per_token_head=total,
                    page_bytes=self.page_bytes(block_size, num_kv_heads, head_size),
                    storage_dtype=self.layout.STORAGE_DTYPE, tensors=list(self.layout.TENSORS),
                    fields=fields, scales=scales)
