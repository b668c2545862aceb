"""A model's whole KV cache: one format per layer (skip layers in the model dtype), one block table for all layers.

Every layer has the same number of blocks, so one block table (and one block allocator) serves all of them: block b
is page b of every layer. Layers of different formats have pages of different sizes; ``padded_page_bytes`` is the
largest, the size an engine that carves every layer's pages from one pool gives each page (vLLM pads mixed pages
the same way), and ``padding_bytes`` what that costs per block.
"""

from __future__ import annotations

import collections.abc
import numbers
import warnings
from typing import Iterable, Optional, Union

import torch

from . import checks
from .format import Format, KVCache
from .loader import load

try:
    from ..scales import format_layers
except ImportError:
    from scales import format_layers

ScalePair = tuple  # (k_scale, v_scale): floats or per-head sequences

# the arguments only a residual-window (KIVI) layer takes: in a model mixing such layers with skip layers, the
# metadata passed for the model reaches the others without them
SEQUENCE_ONLY = {"write": ("seq_ids", "query_start_loc", "seq_lens", "block_table", "max_query_len"),
                 "attend": ("seq_ids",)}


class ModelKVCache:
    """Per-layer caches of one model sharing block ids. Build it with :func:`model_cache`."""

    def __init__(self, layer_formats: list[Format], num_blocks: int, block_size: int, num_kv_heads: int,
                 head_size: int, *, device: Union[str, torch.device] = "cpu",
                 scales: Optional[dict[int, ScalePair]] = None, max_seqs: Optional[int] = None):
        if not layer_formats:
            raise ValueError("layer_formats: a model needs at least one layer")
        self.formats = list(layer_formats)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.num_kv_heads, self.head_size = num_kv_heads, head_size
        scales = scales or {}
        if not isinstance(scales, dict):
            raise ValueError(f"scales: expected a dict of layer index -> (k_scale, v_scale), got "
                             f"{type(scales).__name__}")
        bad = [k for k in scales if checks.as_int(k) is None or not 0 <= checks.as_int(k) < len(self.formats)]
        if bad:
            raise ValueError(f"scales: keys {bad!r} are not layer indices in [0, {len(self.formats)})")
        scales = {checks.as_int(k): pair for k, pair in scales.items()}  # numpy's ints as ints
        if scales and not any(fmt.static_scale_kind(side) is not None for fmt in self.formats
                              for side in ("key", "value")):
            raise ValueError(f"scales: no layer's format takes static scales ({self.formats[0].name} computes its "
                             "scales on write); pass none")
        missing = []
        self.layers: list[KVCache] = []
        for i, fmt in enumerate(self.formats):
            static = any(fmt.static_scale_kind(side) is not None for side in ("key", "value"))
            kwargs = {}
            if static:
                if i in scales:
                    pair = scales[i]
                    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                        raise ValueError(f"scales: layer {i}'s entry must be a (k_scale, v_scale) pair, got {pair!r}")
                    kwargs["k_scale"], kwargs["v_scale"] = pair
                else:
                    missing.append(i)
            if fmt.spec.streaming:
                kwargs["max_seqs"] = max_seqs
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # one warning for the whole model, below
                try:
                    self.layers.append(fmt.allocate(num_blocks, block_size, num_kv_heads, head_size, device=device,
                                                    **kwargs))
                except ValueError as exc:
                    if str(exc).startswith(("k_scale", "v_scale")):  # the scales came from this layer's entry
                        raise ValueError(f"scales: layer {i}: {exc}") from None
                    raise
        self._streaming = any(fmt.spec.streaming for fmt in self.formats)
        if missing:
            warnings.warn(f"kvgen: no K/V scales for layers {format_layers(missing)}; using 1.0 there. Load them from the "
                          "checkpoint (kvgen.scales.load_scales) or calibrate them (kvgen calibrate).", stacklevel=3)

    def __len__(self) -> int:
        return len(self.layers)

    def page_bytes(self, layer: int) -> int:
        self._check_layer(layer)
        return self.formats[layer].page_bytes(self.block_size, self.num_kv_heads, self.head_size)

    @property
    def padded_page_bytes(self) -> int:
        """The page size that makes blocks interchangeable across layers: the largest layer page."""
        return max(self.page_bytes(i) for i in range(len(self)))

    @property
    def padding_bytes(self) -> int:
        """Bytes per block lost to padding every layer's page to ``padded_page_bytes``."""
        return sum(self.padded_page_bytes - self.page_bytes(i) for i in range(len(self)))

    def _layer_kwargs(self, fmt: Format, kwargs: dict, call: str) -> dict:
        """``kwargs`` for one layer: a layer without a residual window, in a model with such layers, does without
        their sequence arguments (a model without any keeps them, so that a stray one is still an error)."""
        if not self._streaming or fmt.spec.streaming:
            return kwargs
        return {k: v for k, v in kwargs.items() if k not in SEQUENCE_ONLY[call]}

    def _check_layer(self, layer) -> int:
        """``layer`` as a Python int (numpy's ints too), or a ValueError naming it."""
        index = checks.as_int(layer)
        if index is None or not 0 <= index < len(self.layers):
            raise ValueError(f"layer: {layer!r} is not a layer index in [0, {len(self.layers)})")
        return index

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, **kwargs) -> None:
        layer = self._check_layer(layer)
        fmt = self.formats[layer]
        fmt.write(self.layers[layer], key, value, slot_mapping, **self._layer_kwargs(fmt, kwargs, "write"))

    def plan_write(self, key: torch.Tensor, slot_mapping: torch.Tensor, **kwargs) -> "ModelWritePlan":
        """One step's write for every layer: ``Format.plan_write`` once per distinct format (``key`` stands for
        every layer's key and value), then ``plan.run(layer, key, value)`` per layer. Keyword arguments as for
        ``Format.plan_write``."""
        plans: dict[int, object] = {}
        by_format: dict[int, object] = {}
        for i, fmt in enumerate(self.formats):
            if id(fmt) not in by_format:
                by_format[id(fmt)] = fmt.plan_write(key, self.layers[i], slot_mapping,
                                                    **self._layer_kwargs(fmt, kwargs, "write"))
            plans[i] = by_format[id(fmt)]
        return ModelWritePlan(self, plans)

    def attend(self, layer: int, query: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               query_start_loc: torch.Tensor, **kwargs) -> torch.Tensor:
        layer = self._check_layer(layer)
        fmt = self.formats[layer]
        return fmt.attend(query, self.layers[layer], block_table, seq_lens, query_start_loc,
                          **self._layer_kwargs(fmt, kwargs, "attend"))

    def plan_attention(self, query: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                       query_start_loc: torch.Tensor, **kwargs) -> "ModelAttentionPlan":
        """One step's attention for every layer: ``Format.plan_attention`` once per distinct format and sliding
        window (``query`` stands for every layer's), then ``plan.run(layer, query)`` per layer. Keyword arguments as
        for ``Format.plan_attention``; ``sliding_window`` may also be one entry per layer (None for a full layer), for
        models that mix windowed and full attention."""
        windows = self._layer_windows(kwargs.pop("sliding_window", None))
        plans: dict[int, object] = {}
        by_format: dict[tuple, object] = {}
        for i, fmt in enumerate(self.formats):
            key = (id(fmt), windows[i])
            if key not in by_format:
                by_format[key] = fmt.plan_attention(query, self.layers[i], block_table, seq_lens, query_start_loc,
                                                    sliding_window=windows[i],
                                                    **self._layer_kwargs(fmt, kwargs, "attend"))
            plans[i] = by_format[key]
        return ModelAttentionPlan(self, plans)

    def _layer_windows(self, sliding_window) -> list:
        """Each layer's sliding window from one value for all (None or an int) or a sequence of one per layer."""
        if sliding_window is None or isinstance(sliding_window, numbers.Integral):  # numpy's ints too
            return [sliding_window] * len(self.layers)
        if isinstance(sliding_window, (str, bytes)) or not isinstance(sliding_window, collections.abc.Iterable):
            raise ValueError(f"sliding_window: expected a positive integer, None, or one entry per layer, got "
                             f"{sliding_window!r}")
        windows = list(sliding_window)
        if len(windows) != len(self.layers):
            raise ValueError(f"sliding_window: {len(windows)} entries for {len(self.layers)} layers (give one "
                             "window, or one per layer with None for a full-attention layer)")
        return windows


class ModelWritePlan:
    """A step's write planned for every layer of a ModelKVCache: ``run(layer, key, value)``."""

    def __init__(self, model: ModelKVCache, plans: dict):
        self.model = model
        self._plans = plans

    def run(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        layer = self.model._check_layer(layer)
        self._plans[layer].run(self.model.layers[layer], key, value)


class ModelAttentionPlan:
    """A step's attention planned for every layer of a ModelKVCache: ``run(layer, query, out=None)``."""

    def __init__(self, model: ModelKVCache, plans: dict):
        self.model = model
        self._plans = plans

    def run(self, layer: int, query: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        layer = self.model._check_layer(layer)
        return self._plans[layer].run(query, self.model.layers[layer], out=out)


def model_cache(fmt: Union[str, Format], num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                head_size: int, *, skip_layers: Iterable[int] = (), model_dtype: str = "bf16",
                device: Union[str, torch.device] = "cpu", scales: Optional[dict[int, ScalePair]] = None,
                max_seqs: Optional[int] = None) -> ModelKVCache:
    """A model cache with ``fmt`` on every layer except ``skip_layers``, which keep the model dtype (bf16 / fp16).

    ``scales``: per-layer static scales, e.g. from :func:`kvgen.scales.load_scales`; layers without them use 1.0
    and one warning names them; a skip layer's entry is not used (its cache holds the model dtype), and a format
    that computes its scales on write takes none. With a residual-window format (KIVI), pass its sequence arguments (``seq_ids``, and
    for writes the batch metadata) to the model's calls: the skip layers do without them.
    """
    if model_dtype not in ("bf16", "fp16"):
        raise ValueError(f"model_dtype: expected 'bf16' or 'fp16', got {model_dtype!r}")
    num_layers = checks.positive_int("num_layers", num_layers)  # numpy's ints too
    fmt = load(fmt) if not isinstance(fmt, Format) else fmt
    if skip_layers is None:
        skip_layers = ()
    if isinstance(skip_layers, (str, bytes)) or not isinstance(skip_layers, collections.abc.Iterable):
        raise ValueError(f"skip_layers: expected layer indices, got {skip_layers!r}")
    skip_layers = list(skip_layers)
    bad = [i for i in skip_layers if checks.as_int(i) is None or not 0 <= checks.as_int(i) < num_layers]
    if bad:
        raise ValueError(f"skip_layers: {bad} are not layer indices in [0, {num_layers})")
    skip = {checks.as_int(i) for i in skip_layers}
    plain = load(model_dtype)
    formats = [plain if i in skip else fmt for i in range(num_layers)]
    return ModelKVCache(formats, num_blocks, block_size, num_kv_heads, head_size, device=device, scales=scales,
                        max_seqs=max_seqs)
