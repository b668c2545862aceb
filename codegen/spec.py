"""The KV-cache format spec: a pydantic schema for the whole format space.

A spec describes how one attention layer's keys and values are stored: the element type of each side, how it is
scaled (granularity, scale dtype, where the scale lives), an optional zero point, rotation and full-precision
residual window, and how the page is laid out. The schema covers every format of the seeds; what the code generator
does not implement yet is rejected later, by ``codegen.support``, with a "not supported yet" error.

Conventions used throughout kvgen:
  * "side" is ``key`` or ``value``; the two sides may use different formats.
  * "cell" is the bytes of one (slot, KV head) in a page; "page" (or block) is ``block_size`` slots of all KV heads.
  * A code is the stored integer of one element; ``decode(code) * scale`` is the value.
"""

from __future__ import annotations

import enum
import hashlib
import json
import keyword
import re
from typing import Annotated, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

# integer fields take YAML integers only: YAML's true / false, 32.0 or "32" are mistakes, not 1, 0 and 32
SpecInt = Annotated[int, Strict()]

# fp32's largest finite value, and the smallest value that rounds to infinity in fp32 (2**128 - 2**103, the midpoint)
FP32_MAX = 3.4028234663852886e38
# the static per-layer global scales a cache takes (runtime Format.allocate checks them): the writes' division by each
# group's scale times one (codegen.render.fast_division, "scaled") relies on the products staying well inside fp32
GLOBAL_SCALE_RANGE = (2.0 ** -32, 2.0 ** 32)
FP32_OVERFLOW = 2.0 ** 128 - 2.0 ** 103

# a YAML 1.2 float that YAML 1.1 (PyYAML) reads as text: 1e-6, +.5
YAML12_FLOAT = r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?"


class PlainNumber(str):
    """Unquoted spec text in YAML 1.2's float form (codegen.loader marks it): a number where the schema wants one,
    text where it wants text. Quoted text is a plain str."""

SPEC_VERSION = 1
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


class ElementType(str, enum.Enum):
    """The stored type of one key or value element."""

    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"
    fp8_e4m3 = "fp8_e4m3"  # OCP e4m3fn: no inf, max 448, NaN = 0x7F
    fp8_e5m2 = "fp8_e5m2"  # OCP e5m2: max finite 57344
    fp8_e4m3fnuz = "fp8_e4m3fnuz"  # AMD MI300 e4m3 (bias 8): no inf, no -0, max 240, NaN = 0x80
    fp4_e2m1 = "fp4_e2m1"  # two per byte, max 6
    int8 = "int8"
    int4 = "int4"
    int2 = "int2"
    uint8 = "uint8"  # asymmetric (with a zero point)
    uint4 = "uint4"
    uint2 = "uint2"


class ElementInfo:
    """Facts about an element type that validation, layout and the reference all need."""

    def __init__(self, bits: int, kind: str, qmax: float, qmin: float):
        self.bits = bits
        self.kind = kind  # "float" (unquantized float), "fp" (low-bit float code), "int", "uint"
        self.qmax = qmax
        self.qmin = qmin

    @property
    def is_quantized(self) -> bool:
        return self.kind != "float"


ELEMENTS: dict[ElementType, ElementInfo] = {
    ElementType.fp32: ElementInfo(32, "float", float("inf"), float("-inf")),
    ElementType.fp16: ElementInfo(16, "float", 65504.0, -65504.0),
    ElementType.bf16: ElementInfo(16, "float", 3.3895313892515355e38, -3.3895313892515355e38),
    ElementType.fp8_e4m3: ElementInfo(8, "fp", 448.0, -448.0),
    ElementType.fp8_e5m2: ElementInfo(8, "fp", 57344.0, -57344.0),
    ElementType.fp8_e4m3fnuz: ElementInfo(8, "fp", 240.0, -240.0),
    ElementType.fp4_e2m1: ElementInfo(4, "fp", 6.0, -6.0),
    ElementType.int8: ElementInfo(8, "int", 127.0, -128.0),
    ElementType.int4: ElementInfo(4, "int", 7.0, -8.0),
    ElementType.int2: ElementInfo(2, "int", 1.0, -2.0),
    ElementType.uint8: ElementInfo(8, "uint", 255.0, 0.0),
    ElementType.uint4: ElementInfo(4, "uint", 15.0, 0.0),
    ElementType.uint2: ElementInfo(2, "uint", 3.0, 0.0),
}


class ScaleDType(str, enum.Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"
    fp8_e4m3 = "fp8_e4m3"
    e8m0 = "e8m0"  # a biased power-of-two exponent in one byte (MX formats)


SCALE_BYTES = {
    ScaleDType.fp32: 4,
    ScaleDType.fp16: 2,
    ScaleDType.bf16: 2,
    ScaleDType.fp8_e4m3: 1,
    ScaleDType.e8m0: 1,
}


class Granularity(str, enum.Enum):
    per_tensor = "per_tensor"  # static: one scale per layer and side
    per_head = "per_head"  # static: one scale per KV head and side (checkpoint shape (num_kv_heads, 1, 1))
    per_token_head = "per_token_head"  # dynamic: computed on write for every token and KV head
    per_block = "per_block"  # dynamic: one scale per block of N elements along the head dimension
    per_channel_group = "per_channel_group"  # dynamic, KIVI keys: per channel across G tokens

    @property
    def is_static(self) -> bool:
        return self in (Granularity.per_tensor, Granularity.per_head)


class Placement(str, enum.Enum):
    inline = "inline"  # right after the side's data in each cell (vLLM per-token-head layout)
    page_end = "page_end"  # all data of the page first, then all scales (vLLM NVFP4)
    separate = "separate"  # a tensor of its own (SGLang / FlashInfer)


class Rounding(str, enum.Enum):
    half_even = "half_even"
    # vLLM's int8 rounding: add +-0.5 in fp32, then truncate toward zero
    half_away_from_zero = "half_away_from_zero"


class ApplyScale(str, enum.Enum):
    divide = "divide"  # code = encode(x / scale): vLLM per-tensor fp8
    reciprocal_multiply = "reciprocal_multiply"  # code = encode(x * (1 / scale)): vLLM per-token-head


class CacheLayout(str, enum.Enum):
    # vLLM Triton backend: one tensor [num_blocks, block_size, num_kv_heads, cell], cell = K part then V part
    interleaved = "interleaved"
    # separate key and value tensors, each [num_blocks, block_size, num_kv_heads, side cell]
    split = "split"


class StorageDType(str, enum.Enum):
    uint8 = "uint8"
    int8 = "int8"
    fp16 = "fp16"
    bf16 = "bf16"
    fp32 = "fp32"


STORAGE_BYTES = {
    StorageDType.uint8: 1,
    StorageDType.int8: 1,
    StorageDType.fp16: 2,
    StorageDType.bf16: 2,
    StorageDType.fp32: 4,
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)


class ScaleSpec(_Strict):
    """How one side is scaled."""

    granularity: Granularity = Field(description="What one scale covers.")
    dtype: ScaleDType = Field(ScaleDType.fp32, description="How a dynamic scale is stored (static scales: fp32).")
    placement: Optional[Placement] = Field(
        None, description="Where dynamic scales live; static scales belong to the cache object and have none."
    )
    align: Optional[SpecInt] = Field(
        None, description="Byte alignment of an inline scale inside the cell (default: the scale's size).", ge=1, le=64
    )
    block: Optional[SpecInt] = Field(None, description="Elements per scale along the head dimension (per_block).",
                                     ge=2, le=1024)
    group_tokens: Optional[SpecInt] = Field(None, description="Tokens per group (per_channel_group, KIVI keys).",
                                            ge=1, le=1024)
    # a number: YAML's true or a quoted "0.5" are mistakes, not 1.0 and 0.5
    min: Annotated[float, Strict()] = Field(
        1e-6, description="Floor of a dynamic scale, so an all-zero vector gets a finite scale.", gt=0)
    apply: Optional[ApplyScale] = Field(
        None, description="Divide by the scale, or multiply by its reciprocal (default: divide for static scales, "
        "reciprocal_multiply for dynamic ones, as vLLM does)."
    )
    global_scale: bool = Field(False, description="A second-level fp32 scale per layer (NVFP4).")

    @field_validator("min", mode="before")
    @classmethod
    def _min_as_yaml_12_number(cls, v):
        # YAML 1.1 (PyYAML) reads 1e-6 and +.5 as text; YAML 1.2 and every spec author mean numbers. A quoted
        # "0.5" or true stays what it is, and the strict field refuses it
        return float(v) if isinstance(v, PlainNumber) else v

    @field_validator("min")
    @classmethod
    def _min_in_fp32(cls, v: float) -> float:
        if v <= 2.0 ** -150:  # it rounds to 0 in fp32 (half of its smallest value, a tie to even), leaving an
            # all-zero vector a 0 scale
            raise ValueError(f"'min' {v!r} rounds to 0 in fp32, where scales are computed; use at least 2**-149 "
                             "(about 1.4e-45)")
        return v

    @field_validator("min")
    @classmethod
    def _min_is_a_finite_fp32(cls, v: float) -> float:
        # scales are computed in fp32 (reference and kernels): a floor that rounds to inf there has no meaning
        if v >= FP32_OVERFLOW:
            raise ValueError(f"{v!r} rounds to infinity in fp32, where scales are computed; the largest floor is "
                             f"{FP32_MAX!r}")
        return v

    @model_validator(mode="after")
    def _fill_defaults(self) -> "ScaleSpec":
        g = self.granularity
        if g.is_static:
            if self.placement is not None:
                raise ValueError(f"a static {g.value} scale belongs to the cache object: remove 'placement'")
            if self.dtype != ScaleDType.fp32:
                raise ValueError(f"a static {g.value} scale is fp32, got dtype {self.dtype.value}")
        else:
            if self.placement is None:
                object.__setattr__(self, "placement", Placement.inline)
        if g == Granularity.per_block and self.block is None:
            raise ValueError("granularity per_block needs 'block' (elements per scale, e.g. 16 or 32)")
        if g != Granularity.per_block and self.block is not None:
            raise ValueError(f"'block' only applies to granularity per_block, not {g.value}")
        if self.block is not None and self.block & (self.block - 1):
            raise ValueError(f"'block' must be a power of two (it divides the head size), got {self.block}")
        if self.global_scale and g.is_static:
            raise ValueError("'global_scale' is a second level above dynamic scales; a static scale needs none")
        if g == Granularity.per_channel_group and self.group_tokens is None:
            raise ValueError("granularity per_channel_group needs 'group_tokens' (G)")
        if self.group_tokens is not None and self.group_tokens & (self.group_tokens - 1):
            raise ValueError(f"'group_tokens' must be a power of two (the kernels quantize and read whole groups "
                             f"as one tile), got {self.group_tokens}")
        if g != Granularity.per_channel_group and self.group_tokens is not None:
            raise ValueError(f"'group_tokens' only applies to granularity per_channel_group, not {g.value}")
        if self.align is not None and self.placement != Placement.inline:
            raise ValueError("'align' only applies to inline scales")
        if self.align is not None and self.align & (self.align - 1):
            raise ValueError(f"'align' must be a power of two, got {self.align}")
        if self.align is not None and self.align < SCALE_BYTES[self.dtype]:
            raise ValueError(f"'align' {self.align} is below the size of one {self.dtype.value} scale "
                             f"({SCALE_BYTES[self.dtype]} bytes): the kernels load a scale as one word, which a GPU "
                             "reads only at a multiple of its size")
        if self.apply is None:
            object.__setattr__(
                self, "apply", ApplyScale.divide if g.is_static else ApplyScale.reciprocal_multiply
            )
        return self

    @property
    def scale_bytes(self) -> int:
        return SCALE_BYTES[self.dtype]

    @property
    def inline_align(self) -> int:
        return self.align if self.align is not None else self.scale_bytes


class ZeroPointSpec(_Strict):
    """An asymmetric zero point, stored beside its scale."""

    storage: Literal["beside_scale", "scale_low_bits"] = Field(
        "beside_scale", description="A field of its own after the scale, or the low mantissa bits of an fp32 scale."
    )
    dtype: Literal["uint8", "fp16", "fp32"] = "uint8"


class RotationSpec(_Strict):
    kind: Literal["hadamard"] = "hadamard"
    seed: SpecInt = Field(0, ge=0, le=2**63 - 1,
                          description="Seed of the fixed +-1 sign vector applied before the transform.")


class ResidualSpec(_Strict):
    tokens: SpecInt = Field(description="Full-precision tokens kept per sequence (R).", ge=1, le=65536)
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"


class SideSpec(_Strict):
    """One side (keys or values) of a format."""

    element: ElementType = Field(description="Stored element type.")
    scale: Optional[ScaleSpec] = Field(None, description="Absent for an unquantized side.")
    rounding: Optional[Rounding] = Field(
        None, description="Rounding of integer codes (floats always round half to even). Default half_even."
    )
    packing: Literal["lsb_first", "msb_first"] = Field(
        "lsb_first", description="Sub-byte elements: which bits of a byte hold the first element."
    )
    zero_point: Optional[ZeroPointSpec] = None
    rotation: Optional[RotationSpec] = None
    residual: Optional[ResidualSpec] = None
    data_align: Optional[SpecInt] = Field(
        None, description="Byte alignment of this side's codes in the cell (default: the element's size, at least 1). "
        "4 or more lets compiled kernels copy the codes with wide asynchronous loads; codes at an odd offset are read "
        "byte by byte.", ge=1, le=64
    )

    @model_validator(mode="after")
    def _check(self) -> "SideSpec":
        info = ELEMENTS[self.element]
        if info.is_quantized and self.scale is None:
            raise ValueError(f"element {self.element.value} is quantized and needs a 'scale'")
        if not info.is_quantized and self.scale is not None:
            raise ValueError(f"element {self.element.value} is stored unquantized: remove 'scale'")
        if self.rounding is not None and info.kind not in ("int", "uint"):
            raise ValueError(f"'rounding' applies to integer elements, not {self.element.value}")
        if self.rounding is None and info.kind in ("int", "uint"):
            object.__setattr__(self, "rounding", Rounding.half_even)
        if self.data_align is not None and self.data_align & (self.data_align - 1):
            raise ValueError(f"'data_align' must be a power of two, got {self.data_align}")
        if self.data_align is not None and self.data_align < max(info.bits // 8, 1):
            raise ValueError(f"'data_align' {self.data_align} is below the size of one {self.element.value} element "
                             f"({info.bits // 8} bytes)")
        if self.zero_point is not None and info.kind != "uint":
            raise ValueError(f"'zero_point' needs an unsigned integer element (uint2/4/8), not {self.element.value}")
        if info.kind == "uint" and self.zero_point is None:
            raise ValueError(f"element {self.element.value} is asymmetric and needs a 'zero_point'")
        if self.zero_point is not None:
            if self.scale is None or self.scale.granularity.is_static:
                raise ValueError("'zero_point' is computed with a dynamic scale (per_token_head or per_block)")
            if self.zero_point.storage == "scale_low_bits" and self.scale.dtype.value != "fp32":
                raise ValueError("'zero_point' storage scale_low_bits needs an fp32 scale (its low mantissa bits)")
            if self.zero_point.dtype != "uint8" and self.zero_point.storage != "beside_scale":
                raise ValueError(f"a float zero point ({self.zero_point.dtype}) is stored beside_scale")
        if self.scale is not None and self.scale.granularity == Granularity.per_channel_group:
            if self.residual is None:
                raise ValueError("per_channel_group (KIVI keys) needs a 'residual' window of full-precision tokens")
            if self.residual.tokens % self.scale.group_tokens:
                raise ValueError(f"'residual' tokens {self.residual.tokens} must be a multiple of group_tokens "
                                 f"{self.scale.group_tokens}")
            if self.scale.placement != Placement.page_end:
                raise ValueError("per_channel_group scales are stored per page (placement: page_end)")
            if self.zero_point is None or self.zero_point.dtype == "uint8":
                raise ValueError("per_channel_group (KIVI keys) is asymmetric with the group minimum as offset: it "
                                 "needs an unsigned element and zero_point with dtype fp16 or fp32")
        if self.packing != "lsb_first" and info.bits >= 8:
            raise ValueError(f"'packing' applies to sub-byte elements, not {self.element.value}")
        return self

    @property
    def info(self) -> ElementInfo:
        return ELEMENTS[self.element]

    @property
    def bits(self) -> int:
        return ELEMENTS[self.element].bits


class CacheSpec(_Strict):
    layout: CacheLayout = Field(CacheLayout.interleaved, description="How K and V share page storage.")
    storage_dtype: Optional[StorageDType] = Field(
        None, description="dtype of the raw cache tensor(s) (default: the element type when both sides store the "
        "same float type, int8 for int8 data, else uint8)."
    )


class FormatSpec(_Strict):
    """A whole KV-cache format."""

    kvgen_spec: Literal[1] = Field(1, description="Spec format version.")
    name: str = Field(description="Identifier: lower case letters, digits and '_', starting with a letter.",
                      json_schema_extra={"pattern": "^[a-z][a-z0-9_]{0,63}$"})  # for editors; _name checks it
    description: str = Field("", max_length=2000)
    origin: str = Field("", max_length=2000, description="Where the format comes from (engine, paper).")
    cache: CacheSpec = Field(default_factory=CacheSpec)
    key: SideSpec
    value: SideSpec

    @field_validator("kvgen_spec", mode="before")
    @classmethod
    def _version_is_an_integer(cls, v):
        if isinstance(v, bool) or not isinstance(v, int):  # the Literal alone took true and 1.0
            raise ValueError(f"'kvgen_spec' is the integer {SPEC_VERSION}, got {v!r}")
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME_RE.fullmatch(v):  # fullmatch: "$" alone lets a trailing newline through
            raise ValueError(
                f"{v!r} is not a valid format name: use lower case letters, digits and '_', starting with a letter "
                "(at most 64 characters)"
            )
        if keyword.iskeyword(v):
            raise ValueError(f"{v!r} is a Python keyword: kvgen.generated.{v} could not be imported; pick another name")
        return v

    @field_validator("description", "origin")
    @classmethod
    def _text(cls, v: str) -> str:
        # free text ends up in comments of generated code: no control characters (tab and newlines are folded)
        bad = sorted({f"U+{ord(c):04X}" for c in v if (ord(c) < 32 and c not in "\t\n\r") or 127 <= ord(c) < 160
                      or c in "\u2028\u2029"})
        if bad:
            raise ValueError(f"control characters are not allowed in free text: {', '.join(bad)}")
        return v

    @model_validator(mode="after")
    def _residual(self) -> "FormatSpec":
        k, v = self.key.residual, self.value.residual
        if (k is None) != (v is None) or (k is not None and k != v):
            where = "value.residual" if v is not None else "key.residual"
            raise ValueError(f"'{where}': key.residual and value.residual must be the same (one full-precision window "
                             "per sequence)")
        if k is not None and (self.key.scale is None or self.key.scale.granularity != Granularity.per_channel_group):
            raise ValueError("'key.residual': a residual window goes with KIVI keys: key.scale.granularity "
                             "per_channel_group")
        return self

    @property
    def streaming(self) -> bool:
        """Whether the format keeps a per-sequence residual window (KIVI): writes need sequence metadata."""
        return self.key.residual is not None

    @property
    def group_tokens(self) -> int:
        return self.key.scale.group_tokens if self.streaming else 1

    @model_validator(mode="after")
    def _storage(self) -> "FormatSpec":
        if self.cache.storage_dtype is None:
            object.__setattr__(self.cache, "storage_dtype", _default_storage(self.key, self.value))
        return self

    def side(self, name: str) -> SideSpec:
        """The "key" or "value" side."""
        if name == "key":
            return self.key
        if name == "value":
            return self.value
        raise ValueError(f"side: expected 'key' or 'value', got {name!r}")

    def canonical_json(self) -> str:
        """The spec with every default filled in, as sorted JSON: what the hash and generated code depend on."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def spec_hash(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]


def _default_storage(key: SideSpec, value: SideSpec) -> StorageDType:
    if key.element == value.element:
        direct = {
            ElementType.bf16: StorageDType.bf16,
            ElementType.fp16: StorageDType.fp16,
            ElementType.fp32: StorageDType.fp32,
            ElementType.int8: StorageDType.int8,
        }.get(key.element)
        if direct is not None:
            return direct
    return StorageDType.uint8


SIDES = ("key", "value")

