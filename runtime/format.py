"""A loaded format: allocate a paged cache, write keys and values into it, run paged attention over it."""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
import types
import warnings
from typing import Optional, Union

import torch

from . import checks
from .dequantize import DequantizedLaunch, auto_dense, dense_dtype
from .kernels import DOT_PRECISIONS, KernelSet, write_pads

try:
    from ..codegen.spec import ELEMENTS, FP32_MAX, GLOBAL_SCALE_RANGE, FormatSpec, Granularity, ScaleDType
except ImportError:  # running from a source checkout with the repo root on sys.path
    from codegen.spec import ELEMENTS, FP32_MAX, GLOBAL_SCALE_RANGE, FormatSpec, Granularity, ScaleDType

STORAGE_TORCH_DTYPES = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
}

ScaleArg = Union[None, float, int, torch.Tensor, list, tuple]


# the largest head size allocate() takes (the conformance suite runs head sizes 16 to 256)
MAX_HEAD_SIZE = 1024
# the most KV splits attend takes: the splits are the launch grid's third dimension (65535 at most in CUDA)
MAX_SPLITS = 65535


@dataclasses.dataclass
class KVCache:
    """One layer's paged KV cache: raw storage tensors plus the static scales that belong to it.

    ``tensors`` maps names to torch tensors (docs/SEMANTICS.md, "page layout"): the storage, ``kv_cache`` (or
    ``k_cache``/``v_cache`` for a split layout; ``k_scale_cache``/``v_scale_cache`` for separate scales), of shape
    ``[num_blocks, block_size, num_kv_heads, cell bytes / the storage dtype's size]`` where the tensor holds one
    region, else ``[num_blocks, page]`` (page-end scales, KIVI's key groups); the static scales ``k_scale``/``v_scale`` (fp32,
    ``[1]`` per tensor or per layer for a global scale, ``[num_kv_heads]`` per head); and for a residual window
    ``k_residual``/``v_residual`` ``[max_seqs, R + G, num_kv_heads, head_size]``.
    """

    format_name: str
    spec_hash: str
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
        return sum(t.numel() * t.element_size() for n, t in self.tensors.items() if n.endswith("_cache"))


class Format:
    """A generated KV-cache format, loaded. Obtain one with ``kvgen.load(name_or_path)``."""

    def __init__(self, spec: FormatSpec, package: types.ModuleType, layout: types.ModuleType, source: str):
        self.spec = spec
        self.name = spec.name
        self.package = package
        self.layout = layout
        self.source = source  # where it was loaded from
        blocks = [side.scale for side in (spec.key, spec.value) if side.scale is not None and side.scale.block]
        scale_rows = {p: (side.scale.block, side.scale.scale_bytes) for p, side in (("K", spec.key), ("V", spec.value))
                      if side.scale is not None and side.scale.block}
        dynamic = any(side.scale is not None and not side.scale.granularity.is_static for side in (spec.key, spec.value))
        self._kernels = KernelSet(package, block_scaled=bool(blocks),
                                  pow2_blocks=any(sc.dtype == ScaleDType.e8m0 for sc in blocks), scale_rows=scale_rows,
                                  position_scales=dynamic,
                                  float_codes=any(ELEMENTS[side.element].kind == "fp" for side in (spec.key, spec.value)))
        self._consts: dict = {}
        # the write kernel's constexprs: the shared ones and its padding's (write_pads), by (block size, heads, head
        # size)
        self._write_consts: dict = {}
        self._tensor_of: dict = {}
        self.spec_hash = spec.spec_hash()  # computed once: write() and attend() compare it on every call
        self._shapes: dict = {}
        # (side, tensor name, per head?) of each static scale: the cache check looks at them on every call
        self._static_scales = tuple((side, f"{side[0]}_scale", self.static_scale_kind(side) == Granularity.per_head)
                                    for side in ("key", "value") if self.static_scale_kind(side) is not None)

    def __repr__(self) -> str:
        return f"<kvgen format {self.name} from {self.source}>"

    # -- layout -----------------------------------------------------------------------------------------------
    def residual_bytes(self, num_kv_heads: int, head_size: int) -> int:
        """Bytes of one sequence's full-precision residual window (K and V, one layer); 0 for most formats."""
        num_kv_heads = checks.positive_int("num_kv_heads", num_kv_heads)
        head_size = checks.positive_int("head_size", head_size)
        return self.layout.residual_bytes(num_kv_heads, head_size)

    def page_bytes(self, block_size: int, num_kv_heads: int, head_size: int) -> int:
        """Bytes one block of one layer takes (all cache tensors; static scales are per layer, not per page)."""
        self._check_page_shape(block_size, num_kv_heads, head_size)
        return self.layout.page_bytes(block_size, num_kv_heads, head_size)

    def page_layout(self, block_size: int, num_kv_heads: int, head_size: int) -> dict:
        """Where every field lives, from the generated layout: ``{"fields": {name: {"tensor", "base" (its byte start
        in the page), "cell", "offset" (in the cell), "bytes", "pad" (zero bytes after it)}}, "regions": {tensor:
        [cell bytes per region]}, "page_bytes": {tensor: bytes}}``."""
        self._check_page_shape(block_size, num_kv_heads, head_size)
        return self.layout.page_layout(block_size, num_kv_heads, head_size)

    def static_scale_kind(self, side: str) -> Optional[Granularity]:
        """The granularity of a side's static scale (a global scale is one per layer), or None."""
        sc = self.spec.side(side).scale
        if sc is None:
            return None
        if sc.global_scale:
            return Granularity.per_tensor
        return sc.granularity if sc.granularity.is_static else None

    def _check_page_shape(self, block_size: int, num_kv_heads: int, head_size: int) -> None:
        """A page's shape as allocate() takes it: positive integers, a head size the kernels take, and for a
        residual-window format whole key token groups per block."""
        for name, val in (("block_size", block_size), ("num_kv_heads", num_kv_heads), ("head_size", head_size)):
            checks.positive_int(name, val)
        self._check_head_size(head_size)
        residual = self.layout.RESIDUAL
        if residual is not None and block_size % residual["group"]:
            raise ValueError(f"block_size: {block_size} is not a multiple of the key token group "
                             f"{residual['group']} of format {self.name}")

    def _check_head_size(self, head_size: int) -> None:
        if head_size < 16:
            raise ValueError(f"head_size: {head_size} is below the kernels' minimum of 16")
        if head_size > MAX_HEAD_SIZE:  # the kernels hold rows of a head in registers
            raise ValueError(f"head_size: {head_size} is above the kernels' maximum of {MAX_HEAD_SIZE} (conformance "
                             "is tested from 16 to 256)")
        for side_name in ("key", "value"):
            side = self.spec.side(side_name)
            if side.scale is not None and side.scale.block and head_size % side.scale.block:
                raise ValueError(f"head_size: {head_size} is not a multiple of the {side_name} scale block "
                                 f"{side.scale.block}")
            if (head_size * side.bits) % 8:
                raise ValueError(f"head_size: {head_size} {side.element.value} elements do not fill whole bytes")

    # -- allocation -------------------------------------------------------------------------------------------
    def allocate(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, *,
                 device: Union[str, torch.device] = "cpu", k_scale: ScaleArg = None,
                 v_scale: ScaleArg = None, max_seqs: Optional[int] = None) -> KVCache:
        """A zeroed paged cache; static scales (a float, or one per KV head for per-head formats) belong to it.

        A static-scale format given no scale uses 1.0 and warns once; a dynamic format refuses static scales.
        A global scale (NVFP4's per-layer fp32 scale, for any format with one) must lie in [2**-32, 2**32]
        (``codegen.spec.GLOBAL_SCALE_RANGE``): only there do nvfp4's compiled writes, which divide through each group's
        scale split into a power of two, give div_rn's codes. The check runs here; a scale copied into
        ``cache.tensors`` later is checked by ``write`` only where costly checks run (CPU tensors, KVGEN_DEBUG=1).
        Formats with a residual window (KIVI) also hold ``k_residual``/``v_residual`` ``[max_seqs, R + G, H, D]``:
        ``max_seqs`` is required for them (the number of sequences that can be live at once).
        """
        num_blocks = checks.positive_int("num_blocks", num_blocks)
        block_size, num_kv_heads, head_size = (checks.positive_int(n, v) for n, v in (
            ("block_size", block_size), ("num_kv_heads", num_kv_heads), ("head_size", head_size)))  # numpy's -> int
        self._check_page_shape(block_size, num_kv_heads, head_size)
        residual = self.layout.RESIDUAL
        if residual is not None:
            seqs = checks.as_int(max_seqs)
            if seqs is None or seqs < 1:
                raise ValueError(f"max_seqs: format {self.name} keeps a full-precision window per sequence; pass "
                                 f"the number of sequences live at once (a positive integer), got {max_seqs!r}")
            max_seqs = seqs
        elif max_seqs is not None:
            raise ValueError(f"max_seqs: format {self.name} has no residual window; leave max_seqs out")
        shapes = self.layout.tensor_shapes(num_blocks, block_size, num_kv_heads, head_size)
        device = checks.device_arg("device", device)
        try:
            tensors = {name: torch.zeros(shape, dtype=STORAGE_TORCH_DTYPES[self.layout.TENSORS[name]], device=device)
                       for name, shape in shapes.items()}
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            need = self.page_bytes(block_size, num_kv_heads, head_size) * num_blocks
            raise ValueError(f"num_blocks: {num_blocks} blocks of {block_size} slots x {num_kv_heads} KV heads x "
                             f"head size {head_size} take {need:,} bytes, which could not be allocated on {device} "
                             f"({str(exc).splitlines()[0][:200]})") from None
        if residual is not None:
            for name in ("k_residual", "v_residual"):
                tensors[name] = torch.zeros((max_seqs, residual["ring"], num_kv_heads, head_size),
                                            dtype=STORAGE_TORCH_DTYPES[residual["dtype"]], device=device)
        missing = []
        for side, arg, key in (("key", k_scale, "k_scale"), ("value", v_scale, "v_scale")):
            gran = self.static_scale_kind(side)
            if gran is None:
                if arg is not None:
                    raise ValueError(f"{key}: format {self.name} computes its {side} scales on write; "
                                     "a static scale does not apply")
                continue
            if arg is None:
                missing.append(key)
                arg = 1.0
            tensors[key] = self._scale_tensor(key, arg, gran, num_kv_heads, device)
        self._check_static_scales(tensors, "{}")  # their values: finite, positive, a global one in range
        if missing:
            warnings.warn(f"kvgen format {self.name}: no {' / '.join(missing)} given; using 1.0. Load the scales "
                          "from the checkpoint, or pass k_scale= / v_scale= to allocate().", stacklevel=2)
        return KVCache(self.name, self.spec_hash, num_blocks, block_size, num_kv_heads, head_size, tensors)

    def _check_static_scales(self, tensors: dict, naming: str) -> None:
        """A static scale that is not finite and positive, or a global scale outside GLOBAL_SCALE_RANGE, is an
        error naming it (``naming`` formats its key): the latter where nvfp4's compiled writes would no longer give
        div_rn's codes."""
        lo, hi = GLOBAL_SCALE_RANGE
        for side, key in (("key", "k_scale"), ("value", "v_scale")):
            sc = self.spec.side(side).scale
            g = tensors.get(key)
            if self.static_scale_kind(side) is not None and g is not None and \
                    not bool((torch.isfinite(g) & (g > 0)).all()):
                raise ValueError(f"{naming.format(key)}: scales must be finite and positive, got {g.tolist()}")
            if sc is not None and sc.global_scale and g is not None and bool(((g < lo) | (g > hi)).any()):
                raise ValueError(f"{naming.format(key)}: a global scale must lie in [2**-32, 2**32] (where the "
                                 f"compiled writes' division by it gives div_rn's codes), got {g.tolist()}")

    @staticmethod
    def _scale_tensor(name: str, arg: ScaleArg, gran: Granularity, num_kv_heads: int,
                      device: torch.device) -> torch.Tensor:
        if isinstance(arg, bool) or not (isinstance(arg, (numbers.Real, list, tuple, torch.Tensor))
                                         or hasattr(arg, "__array__")):
            raise ValueError(f"{name}: expected a float, a sequence of floats or a tensor, got {type(arg).__name__}")
        try:
            t = torch.as_tensor(arg, dtype=torch.float32).flatten().to(device)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{name}: expected a float, a sequence of floats or a tensor ({exc})") from None
        want = 1 if gran == Granularity.per_tensor else num_kv_heads
        if t.numel() == 1 and want > 1:
            t = t.expand(want).clone()
        if t.numel() != want:
            what = "one value" if want == 1 else f"one value per KV head ({num_kv_heads})"
            raise ValueError(f"{name}: expected {what}, got {t.numel()} values")
        return t.contiguous()

    # -- kernels ----------------------------------------------------------------------------------------------
    def _check_cache(self, cache: KVCache) -> None:
        if not isinstance(cache, KVCache):
            raise ValueError(f"cache: expected a KVCache from {self.name}.allocate(), got {type(cache).__name__}")
        if cache.format_name != self.name or cache.spec_hash != self.spec_hash:
            raise ValueError(f"cache: it was allocated by format {cache.format_name} (spec hash {cache.spec_hash}), "
                             f"not by {self.name} (spec hash {self.spec_hash})")
        geometry = (cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_size)
        shapes = self._shapes.get(geometry)
        if shapes is None:
            shapes = self._shapes[geometry] = self.layout.tensor_shapes(*geometry)
        for name, shape in shapes.items():
            t = cache.tensors.get(name)
            want = STORAGE_TORCH_DTYPES[self.layout.TENSORS[name]]
            if t is None or tuple(t.shape) != shape or t.dtype != want or not t.is_contiguous():
                got = "missing" if t is None else f"{tuple(t.shape)} {t.dtype}"
                raise ValueError(f"cache: tensor {name!r} is {got}, expected a contiguous {shape} {want}")
            if t.data_ptr() % 16:
                raise ValueError(f"cache: tensor {name!r} starts at an address that is not a multiple of 16 bytes; "
                                 "the kernels read its fields as aligned words (allocate() returns aligned tensors)")
        for side, name, per_head in self._static_scales:  # static scales, which an engine may load in later
            t, n = cache.tensors.get(name), cache.num_kv_heads if per_head else 1
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (n,) or t.dtype != torch.float32 or \
                    t.device != cache.device or not t.is_contiguous():
                got = "missing" if t is None else (f"{tuple(t.shape)} {t.dtype} on {t.device}"
                                                   if isinstance(t, torch.Tensor) else type(t).__name__)
                raise ValueError(f"cache: tensor {name!r} is {got}, expected a contiguous ({n},) torch.float32 on "
                                 f"{cache.device}: the {side} scale{'s per KV head' if n > 1 else ''}")
        residual = self.layout.RESIDUAL
        if residual is not None:  # [max_seqs, ring, heads, head] each, the same max_seqs
            k = cache.tensors.get("k_residual")
            rows = k.shape[0] if isinstance(k, torch.Tensor) and k.dim() == 4 else None
            shape = (rows, residual["ring"], cache.num_kv_heads, cache.head_size)
            want = STORAGE_TORCH_DTYPES[residual["dtype"]]
            for name in ("k_residual", "v_residual"):
                t = cache.tensors.get(name)
                if t is None or rows is None or tuple(t.shape) != shape or t.dtype != want or not t.is_contiguous():
                    got = "missing" if t is None else f"{tuple(t.shape)} {t.dtype}"
                    raise ValueError(f"cache: tensor {name!r} is {got}, expected a contiguous "
                                     f"[max_seqs, {residual['ring']}, {cache.num_kv_heads}, {cache.head_size}] {want} "
                                     "(the same max_seqs for K and V)")

    def _kernel_args(self, cache: KVCache) -> tuple[dict, dict]:
        """Pointer arguments and constexprs shared by both kernels, from the generated layout."""
        device = cache.device
        key = (cache.block_size, cache.num_kv_heads, cache.head_size)
        consts = self._consts.get(key)
        if consts is None:
            lay = self.layout.page_layout(cache.block_size, cache.num_kv_heads, cache.head_size)
            consts = dict(NUM_KV_HEADS=cache.num_kv_heads, HEAD_SIZE=cache.head_size,
                          HEAD_PAD=max(16, 1 << (cache.head_size - 1).bit_length()), BLOCK_SIZE=cache.block_size)
            for field in ("k_data", "k_scale", "k_zp", "v_data", "v_scale", "v_zp"):
                f = lay["fields"].get(field)
                pre = field.upper()
                consts[f"{pre}_PAGE"] = lay["page_bytes"][f["tensor"]] if f else 0
                consts[f"{pre}_BASE"] = f["base"] if f else 0
                consts[f"{pre}_CELL"] = f["cell"] if f else 0
            for side in ("key", "value"):
                consts[f"{side[0].upper()}_LOG_B"] = rotation_log_b(cache.head_size) \
                    if self.spec.side(side).rotation is not None else 0
            self._consts[key] = consts
            self._write_consts[key] = {**consts, **write_pads(lay)}
            self._tensor_of = {f: lay["fields"][f]["tensor"] for f in lay["fields"]}
        t = cache.tensors
        ptrs = {}
        for p, side in (("k", "key"), ("v", "value")):
            data = t[self._tensor_of[f"{p}_data"]].view(torch.uint8)
            ptrs[f"{p}_cache_ptr"] = data
            meta = self._tensor_of.get(f"{p}_scale")
            ptrs[f"{p}_meta_ptr"] = t[meta].view(torch.uint8) if meta else data
            scale = t.get(f"{p}_scale")
            if scale is None:
                scale = unit_scale(device)
            ptrs[f"{p}_scale_ptr"] = scale
            rot = self.spec.side(side).rotation
            ptrs[f"{p}_signs_ptr"] = rotation_signs(rot.seed, cache.head_size, device) if rot else scale
            if self.layout.RESIDUAL is not None:
                ptrs[f"{p}_res_ptr"] = t[f"{p}_residual"].view(torch.uint8)
        return ptrs, consts

    def write(self, cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, *,
              seq_ids: Optional[torch.Tensor] = None, query_start_loc: Optional[torch.Tensor] = None,
              seq_lens: Optional[torch.Tensor] = None, block_table: Optional[torch.Tensor] = None,
              max_query_len: Optional[int] = None) -> None:
        """Quantize ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` into ``cache`` at ``slot_mapping``.

        Slot ``s`` is block ``s // block_size``, offset ``s % block_size``; ``-1`` skips that token.

        Formats with a residual window (KIVI) append to sequences and need the batch's sequence metadata, as for
        attention: ``query_start_loc`` (int32 ``[num_seqs + 1]``, each sequence's new rows), ``seq_lens`` (int32,
        lengths after this write), ``block_table`` (int32 ``[num_seqs, max_blocks]``) and ``seq_ids`` (int32
        ``[num_seqs]``, each sequence's row in the residual buffers, one row per sequence). Rows outside every
        sequence are skipped. Their tokens go where the metadata puts them (position ``seq_lens - new + i``, its
        block from ``block_table``); ``slot_mapping`` must agree with them (checked where the range checks run).
        """
        launch, ptrs, _ = self._plan_write(cache, key, value, slot_mapping, seq_ids, query_start_loc, seq_lens,
                                           block_table, max_query_len)
        if launch is not None:
            self._kernels.run_write(launch, key, value, ptrs)

    def plan_write(self, key: torch.Tensor, cache: KVCache, slot_mapping: torch.Tensor, *,
                   seq_ids: Optional[torch.Tensor] = None, query_start_loc: Optional[torch.Tensor] = None,
                   seq_lens: Optional[torch.Tensor] = None, block_table: Optional[torch.Tensor] = None,
                   max_query_len: Optional[int] = None) -> WritePlan:
        """``write`` in two steps, for engines that write one batch into many layers: the batch's checks (the slot
        mapping, the sequence metadata) and its launch once per step, then ``plan.run(cache, key, value)`` per
        layer, which checks only the inputs and the cache against what was planned and launches. Arguments as for
        ``write``; ``key`` stands for every layer's key and value (the same shape, dtype and device), ``cache`` for
        every layer's cache (the same geometry).

        The plan keeps references to ``slot_mapping`` (int64) and to the sequence metadata: runs read their
        contents at launch, so they may be updated in place (their range checks run again on each run where write
        runs them: CPU tensors, or ``KVGEN_DEBUG=1``), but another number of tokens or sequences, or another longest
        query, needs a new plan.
        """
        if isinstance(slot_mapping, torch.Tensor) and slot_mapping.dtype != torch.int64:
            raise ValueError(f"slot_mapping: plan_write needs int64 slots (runs read them in place at launch; the "
                             f"{str(slot_mapping.dtype).replace('torch.', '')} tensor given would be copied once and "
                             "its updates missed): pass slot_mapping.long(), and update that tensor")
        return WritePlan(self, key, cache, *self._plan_write(cache, key, None, slot_mapping, seq_ids,
                                                            query_start_loc, seq_lens, block_table, max_query_len))

    def _plan_write(self, cache, key, value, slot_mapping, seq_ids, query_start_loc, seq_lens, block_table,
                    max_query_len) -> tuple:
        """write's checks (of ``value`` too unless None) and its launch: (KernelSet's WriteLaunch, or None where
        there is nothing to write; the cache's pointer arguments; (a function that runs the range checks of the
        slots and sequences again for a cache, the tensors they read), or None)."""
        self._check_cache(cache)
        dev = cache.device
        key = checks.tensor("key", key, dtypes=checks.INPUT_DTYPES, ndim=3, device=dev)
        if value is not None:
            value = checks.tensor("value", value, dtypes=checks.INPUT_DTYPES, ndim=3, device=dev)
        expected = (None, cache.num_kv_heads, cache.head_size)
        checks.shape("key", key, expected, "[num_tokens, num_kv_heads, head_size] of the cache")
        if value is not None:
            checks.shape("value", value, (key.shape[0],) + expected[1:], "key's")
        checks.last_dim_contiguous("key", key)
        if value is not None:
            checks.last_dim_contiguous("value", value)
        slot_mapping = checks.index_tensor("slot_mapping", slot_mapping, ndim=1, device=dev)
        if slot_mapping.shape[0] != key.shape[0]:
            raise ValueError(f"slot_mapping: has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
        if checks.costly_checks_on(slot_mapping):
            checks.slots_in_range(slot_mapping, cache.num_slots)
            self._check_static_scales(cache.tensors, "cache.tensors['{}']")  # copied in after allocate?
        streaming = self.layout.RESIDUAL is not None
        meta = dict(seq_ids=seq_ids, query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table)
        if not streaming:
            given = [k for k, v in dict(meta, max_query_len=max_query_len).items() if v is not None]
            if given:
                raise ValueError(f"{given[0]}: format {self.name} writes by slot only; sequence metadata is for "
                                 "formats with a residual window")
        if key.shape[0] == 0:
            return None, None, None
        ptrs, consts = self._kernel_args(cache)
        slots = slot_mapping.to(torch.int64)
        if not streaming:
            recheck = (lambda c: checks.slots_in_range(slots, c.num_slots), slots)
            consts = self._write_consts[(cache.block_size, cache.num_kv_heads, cache.head_size)]
            return self._kernels.plan_write(key, slots, ptrs, consts), ptrs, recheck
        max_query_len = self._check_sequences(cache, meta, key.shape[0], max_query_len)
        if meta["seq_lens"].shape[0] == 0:
            return None, None, None
        self._check_slots_follow_positions(cache, slots, meta)

        def recheck_sequences(c):  # against the longest query the launch was sized for
            checks.slots_in_range(slots, c.num_slots)
            self._check_sequences(c, meta, key.shape[0], max_query_len)
            self._check_slots_follow_positions(c, slots, meta)

        launch = self._kernels.plan_write_streaming(key, meta["query_start_loc"], meta["seq_lens"],
                                                    meta["block_table"], meta["seq_ids"], max_query_len, ptrs,
                                                    consts, self.layout.RESIDUAL)
        return launch, ptrs, (recheck_sequences, slots, *meta.values())

    @staticmethod
    def _check_slots_follow_positions(cache: KVCache, slots: torch.Tensor, meta: dict) -> None:
        """Where the range checks run: a metadata-placed write's slot_mapping agrees with its positions."""
        if checks.costly_checks_on(slots, meta["query_start_loc"], meta["seq_lens"], meta["block_table"]):
            checks.slots_match_positions(slots, meta["block_table"], meta["seq_lens"], meta["query_start_loc"],
                                         cache.block_size)

    def _check_sequences(self, cache: KVCache, meta: dict, num_tokens: int, max_query_len: Optional[int]) -> int:
        """Checks of the sequence metadata a residual-window format needs; returns the longest query."""
        dev = cache.device
        missing = [k for k, v in meta.items() if v is None]
        if missing:
            raise ValueError(f"{missing[0]}: format {self.name} keeps a residual window per sequence; write() and "
                             "attend() need seq_ids, query_start_loc, seq_lens and block_table")
        seq_ids = checks.index_tensor("seq_ids", meta["seq_ids"], ndim=1, device=dev, dtypes=(torch.int32,))
        qsl = checks.index_tensor("query_start_loc", meta["query_start_loc"], ndim=1, device=dev,
                                  dtypes=(torch.int32,))
        seq_lens = checks.index_tensor("seq_lens", meta["seq_lens"], ndim=1, device=dev, dtypes=(torch.int32,))
        bt = checks.index_tensor("block_table", meta["block_table"], ndim=2, device=dev, dtypes=(torch.int32,),
                                 rows_strided=True)
        n = seq_lens.shape[0]
        if seq_ids.shape[0] != n or qsl.shape[0] != n + 1 or bt.shape[0] != n:
            raise ValueError(f"seq_ids / query_start_loc / block_table: need {n}, {n + 1} and {n} rows for "
                             f"{n} sequences (seq_lens), got {seq_ids.shape[0]}, {qsl.shape[0]}, {bt.shape[0]}")
        if checks.costly_checks_on(seq_ids, qsl, seq_lens, bt):
            checks.seq_ids_in_range(seq_ids, cache.tensors["k_residual"].shape[0])
            first_of: dict[int, int] = {}
            starts = qsl.tolist()
            for i, r in enumerate(seq_ids.tolist()):
                if starts[i + 1] <= starts[i]:
                    continue  # appends nothing (a CUDA graph's padding sequence): its row may be anyone's
                if r in first_of:
                    raise ValueError(f"seq_ids: sequences {first_of[r]} and {i} of the batch both append to "
                                     f"residual row {r}")
                first_of[r] = i
            if n and int(qsl[-1]) > num_tokens:
                raise ValueError(f"query_start_loc: ends at {int(qsl[-1])}, past the {num_tokens} key rows")
            checks.attention_ranges(bt, seq_lens, qsl, cache.num_blocks, cache.block_size, int(qsl[-1]) if n else 0,
                                    max_query_len)
        if max_query_len is None:
            max_query_len = int((qsl[1:] - qsl[:-1]).max()) if n else 0
        return max(max_query_len, 1)

    @property
    def quantized_dot(self) -> dict:
        """Per side ("key", "value"), the type its dots run on under ``dot_precision="quantized"``: "int8", or ""
        for a side that keeps its exact dots."""
        q = self._kernels.module.QUANTIZED_DOT
        return {"key": q["k"], "value": q["v"]}

    def runs_dot_precision(self, dot_precision: str) -> str:
        """What ``attend`` would run for a precision asked of many formats at once (a benchmark, ``kvgen eval``):
        "quantized" on a format with no int8 side runs "auto" (``attend`` itself refuses it there)."""
        if dot_precision == "quantized" and not any(self.quantized_dot.values()):
            return "auto"
        return dot_precision

    def attend(self, query: torch.Tensor, cache: KVCache, block_table: torch.Tensor, seq_lens: torch.Tensor,
               query_start_loc: torch.Tensor, *, sm_scale: Optional[float] = None,
               sliding_window: Optional[int] = None, max_query_len: Optional[int] = None,
               out: Optional[torch.Tensor] = None, seq_ids: Optional[torch.Tensor] = None,
               dot_precision: str = "auto", max_seq_len: Optional[int] = None,
               num_splits: Optional[int] = None,
               dequantize_first: Union[bool, str, torch.dtype] = False) -> torch.Tensor:
        """Causal paged attention of variable-length queries over the cache; returns ``[num_tokens, num_q_heads,
        head_size]`` in the query's dtype.

        ``query`` ``[num_tokens, num_q_heads, head_size]`` (num_q_heads a multiple of the cache's KV heads);
        ``block_table`` int32 ``[num_seqs, max_blocks]``; ``seq_lens`` int32 ``[num_seqs]`` (KV tokens including
        the new ones); ``query_start_loc`` int32 ``[num_seqs + 1]``. Query i of a sequence sits at position
        ``seq_len - q_len + i``; ``sliding_window=W`` keeps the W newest positions up to it. ``sm_scale`` defaults
        to ``1 / sqrt(head_size)``. ``max_query_len`` (optional) saves a device-to-host read; it must be at least
        the longest query: the launch computes that many query rows per sequence and no more (a decode of one token
        per sequence carries only the rows it fills), checked where the range checks run (CPU tensors, or
        ``KVGEN_DEBUG=1``). Formats with a residual window (KIVI) also need ``seq_ids`` (each sequence's row in the
        residual buffers).

        ``dot_precision``: ``"auto"`` (default) uses tensor-core dots wherever the format's operands make every
        product exact (fp16 or bf16 values, scales applied to the scores and probabilities per row), else exact fp32
        dots; ``"ieee"`` always exact fp32 dots (slow on a GPU); ``"quantized"`` computes in the cache's quantized
        domain where the format offers it (``quantized_dot``: int8 codes): the query quantized per row to int8 for
        int8 dots on the key codes, the probabilities per row for int8 dots on the value codes; faster at long
        contexts on the H200, at an accuracy cost (docs/accuracy.md, benchmarks/RESULTS.md); ``"fast"`` the
        tensor-core dots of "auto" with one fp16 / bf16 term per operand, each dequantized value, the query and
        the probabilities rounded once to the dot's type, as inference engines dequantize (`kvgen eval` measured the
        same attention errors to about 0.1%; docs/accuracy.md); in decode, block-scaled codes (q8_0, q4_0, KIVI's
        values) keep auto's exact per-block dots, the faster there since 2026-12-07.
        ``max_seq_len``
        (optional) bounds the KV length for splitting long sequences across programs (default: what the block table
        can address); ``num_splits`` overrides that split (1 = none).

        ``dequantize_first=True`` (bf16 / fp16 queries): the positions the batch reads are first dequantized into a
        dense scratch cache of the query's type, and attention runs there as on a bf16 / fp16 cache, so a chunked
        prefill decodes each position once instead of once per tile of query rows. Each dequantized value is
        rounded once to that type; ``dequantize_first=torch.float16`` (or ``torch.bfloat16``) names the type
        instead (fp16 keeps 3 more bits, bf16 the range; an fp32 query then runs exact fp32 dots over a bf16
        scratch, two fp16 terms over an fp16 one). ``dot_precision`` then applies to the dense attention,
        which runs as the bf16 / fp16 format's on a query of this dtype. Here ``max_seq_len``, when given, must
        bound every sequence's length: longer sequences are cut to it (an error where the costly checks run: CPU
        tensors, KVGEN_DEBUG=1). The scratch holds
        ``num_seqs x max_seq_len`` positions (2 x 2 bytes per position, KV head and element; ``attend`` reads
        ``seq_lens``' largest entry without ``max_seq_len``, a plan takes what the block table addresses): meant
        for batches of prefill chunks, not for batches with many decode sequences. A value beyond fp16's range
        (65504) becomes infinite in an fp16 scratch. ``dequantize_first="auto"`` takes it (in the query's type)
        where it was measured faster than the fused kernels and the scratch stays bounded (formats whose scales
        are computed on write; batches averaging enough new tokens per sequence for the format's class, 32 for
        q4_0, q8_0 and KIVI, 128 per token-head, mxfp8 and mxfp4, 512 nvfp4 at 4 query heads per KV head and
        head size 128, more for smaller heads, fewer for larger ones; under "fast" dots 48 for q4_0 and 128 for
        q8_0: ``kvgen.runtime.dequantize.auto_min_new_tokens(fmt, group, head_size, dot_precision)``; bf16 / fp16
        queries, "auto" / "fast" dots),
        else runs fused. The average stands for every sequence: in a mixed batch, each decode sequence pays a
        dense copy of its whole context. The choice reads nothing from the device, but where it takes the dense
        path ``attend`` sizes the scratch by the longest sequence unless ``max_seq_len`` is given (one
        device-to-host read) and allocates it per call: engines plan.
        """
        launch, ptrs = self._plan(query, cache, block_table, seq_lens, query_start_loc, sm_scale, sliding_window,
                                  max_query_len, seq_ids, dot_precision, max_seq_len, num_splits, out,
                                  dequantize_first, planned=False)
        if out is None:
            out = torch.empty_like(query)
        if isinstance(launch, DequantizedLaunch):
            launch.run(query, out, ptrs)
        elif launch is not None:
            self._kernels.run_attend(launch, query, out, ptrs)
        return out

    def plan_attention(self, query: torch.Tensor, cache: KVCache, block_table: torch.Tensor,
                       seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *, sm_scale: Optional[float] = None,
                       sliding_window: Optional[int] = None, max_query_len: Optional[int] = None,
                       seq_ids: Optional[torch.Tensor] = None, dot_precision: str = "auto",
                       max_seq_len: Optional[int] = None, num_splits: Optional[int] = None,
                       dequantize_first: Union[bool, str, torch.dtype] = False) -> AttentionPlan:
        """``attend`` in two steps, for engines that run one batch through many layers: the batch's checks, tile,
        split and launch arguments once per step, then ``plan.run(query, cache)`` per layer, which checks only the
        query, the output and the cache against what was planned and launches. Arguments as for ``attend``;
        ``query`` and ``cache`` stand for every layer's (the same shape, dtype, device and cache geometry).

        The plan keeps references to ``block_table``, ``seq_lens``, ``query_start_loc`` (and ``seq_ids``): runs
        read their contents at launch, so they may be updated in place, but a batch of other sizes (sequences,
        query tokens, the longest query, the block table's width) needs a new plan, and so do another
        ``sm_scale``, ``sliding_window`` or ``dot_precision`` (layers with and without a window: one plan each).
        Without ``max_query_len`` the plan takes the longest query it finds, and 1 (decode) where every sequence
        has 0 new tokens (placeholders filled in place, or a warm-up batch); longer queries need it given.
        Runs of one plan share its scratch for split sequences (and ``dequantize_first``'s dense cache), allocated
        on the stream current at planning: run them on that stream, one after another (as layers run), and keep
        the plan alive while a CUDA graph that captured one of its runs may replay.
        """
        launch, ptrs = self._plan(
            query, cache, block_table, seq_lens, query_start_loc, sm_scale, sliding_window, max_query_len, seq_ids,
            dot_precision, max_seq_len, num_splits, None, dequantize_first, planned=True)
        recheck = None
        planned_longest = max_query_len is None
        if launch is not None:  # attend()'s range checks, as the batch tensors read at each run
            num_tokens, num_blocks, block_size = query.shape[0], cache.num_blocks, cache.block_size
            if planned_longest:  # what the launch was planned for (as _plan found it)
                max_query_len = max(int((query_start_loc[1:] - query_start_loc[:-1]).max()), 1)
            rows = cache.tensors["k_residual"].shape[0] if seq_ids is not None else None

            def ranges() -> None:
                checks.attention_ranges(block_table, seq_lens, query_start_loc, num_blocks, block_size, num_tokens,
                                        max_query_len, planned_longest)
                if rows is not None:
                    checks.seq_ids_in_range(seq_ids, rows)

            recheck = (ranges, block_table, seq_lens, query_start_loc) + ((seq_ids,) if rows is not None else ())
        return AttentionPlan(self, query, cache, launch, ptrs, recheck)

    def _plan(self, query, cache, block_table, seq_lens, query_start_loc, sm_scale, sliding_window, max_query_len,
              seq_ids, dot_precision, max_seq_len, num_splits, out, dequantize_first=False,
              planned=False) -> tuple:
        """attend's checks (``out`` too, when given) and its launch: (KernelSet.plan_attend's AttentionLaunch, a
        DequantizedLaunch for ``dequantize_first``, or None for an empty batch; the cache's pointer arguments)."""
        self._check_cache(cache)
        dev = cache.device
        query = checks.tensor("query", query, dtypes=checks.INPUT_DTYPES, ndim=3, device=dev)
        checks.last_dim_contiguous("query", query)
        num_tokens, num_q_heads, head_size = query.shape
        if head_size != cache.head_size:
            raise ValueError(f"query: head size {head_size} does not match the cache's {cache.head_size}")
        if num_q_heads == 0 or num_q_heads % cache.num_kv_heads:
            raise ValueError(f"query: {num_q_heads} query heads is not a positive multiple of the cache's "
                             f"{cache.num_kv_heads} KV heads")
        block_table = checks.index_tensor("block_table", block_table, ndim=2, device=dev, dtypes=(torch.int32,),
                                          rows_strided=True)
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
        if sliding_window is not None and sliding_window > checks.INT32_MAX:
            sliding_window = None  # longer than any sequence (seq_lens are int32): no window
        if dot_precision not in DOT_PRECISIONS:
            raise ValueError(f"dot_precision: expected one of {', '.join(map(repr, DOT_PRECISIONS))}, got "
                             f"{dot_precision!r}")
        if dot_precision == "quantized" and not any(self.quantized_dot.values()):
            raise ValueError(f"dot_precision: 'quantized' needs int8 codes with no zero point and no block scales on "
                             f"the key or value side; format {self.name} has neither")
        max_seq_len = checks.optional_length("max_seq_len", max_seq_len)
        if isinstance(dequantize_first, str) and dequantize_first == "auto":
            dequantize_first = auto_dense(self, query, num_seqs, block_table, cache.block_size, cache.num_kv_heads,
                                          dot_precision, max_seq_len)
        dense = dense_dtype(dequantize_first, query.dtype)
        if dense is not None:
            if dot_precision == "quantized":
                raise ValueError("dot_precision: 'quantized' computes on the cache's codes; dequantize_first runs on "
                                 "dequantized values (use 'auto', 'fast' or 'ieee')")
        num_splits = checks.optional_positive_int("num_splits", num_splits)
        if num_splits is not None and num_splits > MAX_SPLITS:
            raise ValueError(f"num_splits: {num_splits} is above {MAX_SPLITS} (a launch grid's third dimension)")
        max_query_len = checks.optional_positive_int("max_query_len", max_query_len)
        if max_query_len is not None and max_query_len > max(num_tokens, 1):
            raise ValueError(f"max_query_len: {max_query_len} is above the query's {num_tokens} tokens (no query "
                             "can be longer)")
        if sm_scale is None:
            sm_scale = 1.0 / math.sqrt(head_size)
        sm_scale = checks.finite_float("sm_scale", sm_scale)
        if abs(sm_scale) * math.log2(math.e) > FP32_MAX:
            raise ValueError(f"sm_scale: {sm_scale!r} times log2(e) overflows fp32, where the kernels scale scores")
        if checks.costly_checks_on(block_table, seq_lens, query_start_loc):
            checks.attention_ranges(block_table, seq_lens, query_start_loc, cache.num_blocks, cache.block_size,
                                    num_tokens, max_query_len)
            self._check_static_scales(cache.tensors, "cache.tensors['{}']")  # copied in after allocate?
        if out is not None:
            checks.output(out, query)
        if num_tokens == 0 or num_seqs == 0:
            return None, None
        if max_query_len is None:
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
            if planned and max_query_len == 0:
                # 0 new tokens everywhere: placeholders to fill in place, or a warm-up; a plan launches for decode
                max_query_len = 1
        ptrs, consts = self._kernel_args(cache)
        qk_scale = float(sm_scale)
        if self.spec.key.rotation is not None:
            qk_scale /= 1 << consts["K_LOG_B"]  # rotated keys and query: q'.k' = b * q.k
        extra = None
        residual = self.layout.RESIDUAL
        if residual is not None:
            if seq_ids is None:
                raise ValueError(f"seq_ids: format {self.name} keeps a residual window per sequence; attend() needs "
                                 "each sequence's row in the residual buffers")
            seq_ids = checks.index_tensor("seq_ids", seq_ids, ndim=1, device=dev, dtypes=(torch.int32,))
            if seq_ids.shape[0] != num_seqs:
                raise ValueError(f"seq_ids: has {seq_ids.shape[0]} entries for {num_seqs} sequences")
            if checks.costly_checks_on(seq_ids):
                checks.seq_ids_in_range(seq_ids, cache.tensors["k_residual"].shape[0])
            extra = dict(seq_ids_ptr=seq_ids, TOKEN_GROUP=residual["group"], RESIDUAL=residual["tokens"],
                         RING=residual["ring"])
        elif seq_ids is not None:
            raise ValueError(f"seq_ids: format {self.name} has no residual window")
        if max_query_len == 0:  # every sequence is padding (0 new tokens): no row to compute
            return None, None
        if dense is not None:
            launch = DequantizedLaunch(self, query, cache, block_table, seq_lens, query_start_loc, seq_ids,
                                       float(sm_scale), sliding_window, max_query_len, dot_precision, max_seq_len,
                                       num_splits, consts, planned, dense)
            return launch, ptrs
        launch = self._kernels.plan_attend(query, block_table, seq_lens, query_start_loc, qk_scale,
                                           sliding_window or 0, max_query_len, ptrs, consts, extra,
                                           dot_precision=dot_precision,
                                           rotated_keys=self.spec.key.rotation is not None,
                                           max_seq_len=max_seq_len, num_splits=num_splits)
        return launch, ptrs

    # -- description ------------------------------------------------------------------------------------------
    def describe(self, block_size: int = 16, num_kv_heads: int = 8, head_size: int = 128) -> dict:
        """Bytes per token and head, page bytes and where each scale lives: what `kvgen show` prints."""
        self._check_page_shape(block_size, num_kv_heads, head_size)
        lay = self.layout.page_layout(block_size, num_kv_heads, head_size)
        fields = []
        for name, tensor, region, size, align, what in self.layout.FIELDS:
            f = lay["fields"][name]
            fields.append(dict(field=name, tensor=tensor, region=region, offset=f["offset"], base=f["base"],
                               bytes=f["bytes"], pad=f["pad"], what=what))
        k = sum(f["bytes"] for f in fields if f["field"].startswith("k_"))
        v = sum(f["bytes"] for f in fields if f["field"].startswith("v_"))
        page = self.page_bytes(block_size, num_kv_heads, head_size)
        per_token = page / (block_size * num_kv_heads)  # amortized over the page (KIVI group metadata included)
        k = sum(f["bytes"] / (self._rows_per(f) or 1) for f in fields if f["field"].startswith("k_"))
        v = sum(f["bytes"] / (self._rows_per(f) or 1) for f in fields if f["field"].startswith("v_"))
        k, v = (int(k) if float(k).is_integer() else k), (int(v) if float(v).is_integer() else v)
        total = int(per_token) if float(per_token).is_integer() else per_token
        return dict(name=self.name, block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                    key_bytes=k, value_bytes=v, padding_bytes=total - k - v, bytes_per_token_head=total,
                    page_bytes=page, residual_bytes_per_seq=self.residual_bytes(num_kv_heads, head_size),
                    tensors=dict(self.layout.TENSORS), fields=fields,
                    scales={side: self.scale_summary(side) for side in ("key", "value")})

    def _rows_per(self, field: dict) -> int:
        return self.layout.ROWS_PER.get((field["tensor"], field["region"]), 1)

    def scale_summary(self, side: str) -> str:
        s = self.spec.side(side)
        sc = s.scale
        if sc is None:
            return "none"
        if sc.granularity.is_static:
            return "static fp32 " + ("per layer" if sc.granularity == Granularity.per_tensor else "per KV head")
        if sc.group_tokens:
            group = f"per channel over {sc.group_tokens} tokens"
        else:
            group = f"per {sc.block} elements" if sc.block else "per token and head"
        text = f"{sc.dtype.value} {group}, {sc.placement.value}"
        if sc.global_scale:
            text += " (x fp32 global per layer)"
        if s.zero_point is not None:
            if s.zero_point.dtype != "uint8":
                text += f", {s.zero_point.dtype} minimum"
            else:
                text += ", zero point " + ("in scale low bits" if s.zero_point.storage == "scale_low_bits" else "uint8")
        if s.residual is not None:
            text += f"; newest {s.residual.tokens}+ tokens in {s.residual.dtype}"
        return text


def rotation_log_b(head_size: int) -> int:
    """log2 of the Hadamard block: the largest power of two dividing the head size."""
    return (head_size & -head_size).bit_length() - 1


_SIGNS: dict = {}
_ROTATIONS_BACK: dict = {}
_UNIT_SCALES: dict = {}


def unit_scale(device: torch.device) -> torch.Tensor:
    """A read-only fp32 1.0 per device: the scale pointer of formats without static scales (allocating it per call
    cost a tensor and a fill kernel on the GPU for every attend and write)."""
    key = str(device)
    if key not in _UNIT_SCALES:
        _UNIT_SCALES[key] = torch.ones(1, dtype=torch.float32, device=device)
    return _UNIT_SCALES[key]


def rotation_signs(seed: int, head_size: int, device: torch.device) -> torch.Tensor:
    """The fixed +-1 vector applied before the Hadamard transform (docs/SEMANTICS.md)."""
    key = (seed, head_size, str(device))
    if key not in _SIGNS:
        import numpy as np

        bits = np.random.default_rng(seed).integers(0, 2, size=head_size)
        _SIGNS[key] = torch.from_numpy((1 - 2 * bits).astype(np.float32)).to(device)
    return _SIGNS[key]


def rotation_back(seed: int, head_size: int, head_pad: int, device: torch.device) -> torch.Tensor:
    """R, fp16 [head_pad, head_pad]: a stored rotated row x' (x' = FWHT_b(x * signs), docs/SEMANTICS.md) back to the
    input basis as x = x' @ R, i.e. R[i, j] = H_b[i mod b, j mod b] * signs[j] / b where i and j share a block of b
    = 2**rotation_log_b(head_size) elements (H_b Sylvester's Hadamard matrix, the unnormalized transform's: entries
    (-1)**popcount(i & j)), zero elsewhere and in the padding. Entries +-1 / b, a power of two: exact in fp16. The
    dequantize kernels' tensor-core path for rotated sides (codegen/templates/dequantize.py.jinja)."""
    key = (seed, head_size, head_pad, str(device))
    if key not in _ROTATIONS_BACK:
        import numpy as np

        b = 1 << rotation_log_b(head_size)
        i = np.arange(head_pad)
        both = (i[:, None] % b) & (i[None, :] % b)
        parity = np.zeros_like(both)
        for bit in range(rotation_log_b(head_size)):
            parity ^= (both >> bit) & 1
        inside = (i[:, None] // b == i[None, :] // b) & (i[:, None] < head_size) & (i[None, :] < head_size)
        signs = np.ones(head_pad)
        signs[:head_size] = rotation_signs(seed, head_size, torch.device("cpu")).numpy()
        r = np.where(inside, (1.0 - 2.0 * parity) * signs[None, :] / b, 0.0)
        _ROTATIONS_BACK[key] = torch.from_numpy(r.astype(np.float16)).to(device)
    return _ROTATIONS_BACK[key]


class _CachePointers:
    """A plan's caches and their pointer arguments: one cache per layer, each checked against the planned geometry
    the first time it is run, then remembered while it still holds the tensors it was checked with, at the same
    addresses and shapes (checked on every run)."""

    def __init__(self, fmt: Format, cache: KVCache, ptrs: Optional[dict]):
        self.format = fmt
        self.geometry = self.geometry_of(cache)
        self._caches: dict = {}  # id -> (the cache, its tensors' storage (_storage), their pointer arguments)
        if ptrs is not None:
            self._remember(cache, ptrs)

    @staticmethod
    def geometry_of(cache: KVCache) -> tuple:
        res = cache.tensors.get("k_residual")
        return (cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_size, cache.device,
                None if res is None else res.shape[0])

    @staticmethod
    def _storage(cache: KVCache) -> tuple:
        """What the remembered pointers depend on: each tensor's name, object, address and shape (a tensor given
        new storage in place, by ``set_`` or ``resize_``, is seen)."""
        return tuple((name, t, t.data_ptr(), t.shape) for name, t in cache.tensors.items())

    def _remember(self, cache: KVCache, ptrs: dict) -> None:
        self._caches[id(cache)] = (cache, self._storage(cache), ptrs)

    def __call__(self, cache: KVCache) -> dict:
        """The cache's pointer arguments; raises where the cache does not match the plan."""
        seen = self._caches.get(id(cache))
        if seen is not None and seen[0] is cache:
            storage = seen[1]
            tensors = cache.tensors
            if len(tensors) == len(storage) and all(
                    t is s[1] and name == s[0] and t.data_ptr() == s[2] and t.shape == s[3]
                    for (name, t), s in zip(tensors.items(), storage)):
                return seen[2]
        self.format._check_cache(cache)
        geometry = self.geometry_of(cache)
        if geometry != self.geometry:
            raise ValueError(f"cache: {geometry[:4]} blocks / block size / KV heads / head size on {geometry[4]} "
                             f"(residual rows {geometry[5]}), but the plan was made for {self.geometry[:4]} on "
                             f"{self.geometry[4]} (residual rows {self.geometry[5]}): plan again for this cache")
        ptrs = self.format._kernel_args(cache)[0]
        self._remember(cache, ptrs)
        return ptrs


def _check_planned(name: str, x, planned: tuple) -> None:
    """``x`` has the (shape, dtype, device) a plan was made for, and a contiguous last dimension."""
    shape, dtype, device = planned
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) != shape or x.dtype != dtype or x.device != device:
        raise ValueError(f"{name}: {list(x.shape)} {x.dtype} on {x.device}, but the plan was made for "
                         f"{list(shape)} {dtype} on {device}: plan again for this batch")
    checks.last_dim_contiguous(name, x)


class AttentionPlan:
    """A planned attention call (``Format.plan_attention``): ``run(query, cache, out=None)`` per layer."""

    def __init__(self, fmt: Format, query: torch.Tensor, cache: KVCache, launch, ptrs: Optional[dict] = None,
                 recheck: Optional[tuple] = None):
        self.format = fmt
        self._launch = launch  # None: an empty batch, nothing to launch
        self._query = (tuple(query.shape), query.dtype, query.device)
        # (check(), the tensors it reads): the block-table, length and query-range checks, re-run by each run where
        # attend() would run them (CPU tensors, or KVGEN_DEBUG): the batch tensors may have changed in place
        self._recheck = recheck
        self._pointers = _CachePointers(fmt, cache, ptrs)
        # the attention kernel's launch with the plan's arguments bound: a run specialises only its own arguments
        self._bound = None if launch is None or isinstance(launch, DequantizedLaunch) else \
            fmt._kernels.bind_attend(launch)

    def __repr__(self) -> str:
        shape, dtype, _ = self._query
        return f"AttentionPlan({self.format.name}, query {list(shape)} {dtype})"

    def run(self, query: torch.Tensor, cache: KVCache, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention of ``query`` over ``cache`` (one layer) with the planned batch; returns ``out`` (a new tensor
        of the query's shape and dtype when None)."""
        ptrs = self._pointers(cache)  # checked against the plan also for an empty batch
        _check_planned("query", query, self._query)
        out = torch.empty_like(query) if out is None else checks.output(out, query)
        if self._recheck is not None and checks.costly_checks_on(*self._recheck[1:]):
            self._recheck[0]()
        if isinstance(self._launch, DequantizedLaunch):
            self._launch.run(query, out, ptrs)
        elif self._launch is not None:
            self.format._kernels.run_attend(self._launch, query, out, ptrs, self._bound)
        return out


class WritePlan:
    """A planned write (``Format.plan_write``): ``run(cache, key, value)`` per layer."""

    def __init__(self, fmt: Format, key: torch.Tensor, cache: KVCache, launch, ptrs: Optional[dict] = None,
                 recheck: Optional[tuple] = None):
        self.format = fmt
        self._launch = launch  # None: nothing to write (no tokens, or no sequences)
        self._key = (tuple(key.shape), key.dtype, key.device)
        # (check(cache), the tensors it reads): the slot and sequence range checks, re-run by each run where
        # write() would run them (CPU tensors, or KVGEN_DEBUG): their contents may have changed in place
        self._recheck = recheck
        self._pointers = _CachePointers(fmt, cache, ptrs)
        # the write kernels' launches with the plan's arguments bound: a run specialises only its own arguments
        self._bound = None if launch is None else fmt._kernels.bind_write(launch)

    def __repr__(self) -> str:
        shape, dtype, _ = self._key
        return f"WritePlan({self.format.name}, key and value {list(shape)} {dtype})"

    def run(self, cache: KVCache, key: torch.Tensor, value: torch.Tensor) -> None:
        """Quantize ``key`` / ``value`` (the planned shape, dtype and device) into ``cache`` (one layer) at the
        planned slots."""
        ptrs = self._pointers(cache)  # checked against the plan also when there is nothing to write
        _check_planned("key", key, self._key)
        _check_planned("value", value, self._key)
        if self._recheck is not None and checks.costly_checks_on(*self._recheck[1:]):
            self._recheck[0](cache)  # write()'s range checks of the slots and sequences, as they read now
        if checks.costly_checks_on(key):  # and its check of this layer's static scales
            self.format._check_static_scales(cache.tensors, "cache.tensors['{}']")
        if self._launch is not None:
            self.format._kernels.run_write(self._launch, key, value, ptrs, self._bound)
