"""Render a validated spec into the source files of its generated package (strings; writing is build.py's job)."""

from __future__ import annotations

import dataclasses
import json
import pprint
import re
from pathlib import Path

import jinja2

from . import layout as layout_mod
from .codecs import SCALE_MAX, SCALE_TINY, Codec, element_codec, scale_codec
from .spec import FormatSpec, Placement, SideSpec
from .support import check_supported
from .version import KVGEN_VERSION

TEMPLATES = Path(__file__).parent / "templates"

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(TEMPLATES)),
    undefined=jinja2.StrictUndefined,  # a missing variable is a bug in kvgen, never silent
    keep_trailing_newline=True,
    autoescape=False,
)
# `{{ macro(...) | at(n) }}`: a macro's lines (written at 4 spaces) shifted right by n, surrounding blank lines dropped
_ENV.filters["at"] = lambda text, n: "\n".join((" " * n + line) if line.strip() else "" for line in str(text).strip("\n").splitlines())


@dataclasses.dataclass(frozen=True)
class SideContext:
    """Everything the templates know about one side: validated values only, never raw spec text."""

    name: str  # key / value
    p: str  # k / v
    P: str  # K / V
    bits: int
    unit: str  # Triton integer type of one (unpacked) code
    unit_bytes: int
    packed: bool  # sub-byte codes, several per byte
    per_byte: int
    msb_first: bool
    code_mask: int
    scale: str  # none / per_tensor / per_head / dynamic
    group: str  # elements per dynamic scale along the head dimension ("HEAD_PAD" = the whole head)
    ngroups: str  # scales per head vector (expression)
    asym: bool
    zp: str  # none / beside / low_bits
    zp_clear: str  # mask that clears the zero point bits of an fp32 scale
    global_scale: bool
    qmax: str  # fp32 literal: the code range a dynamic scale maps the group's range to
    scale_floor: str
    scale_max: str  # saturation of fp16 / bf16 scales ("" when the codec saturates itself)
    apply: str
    sunit: str
    sunit_bytes: int
    meta_ptr: str
    rotate: bool
    scale_rule: str
    codec_summary: str
    scale_summary: str

    def shift_expr(self, i: str) -> str:
        """Bit position of sub-byte element ``i`` inside its byte."""
        pos = f"({i} % {self.per_byte})"
        if self.msb_first:
            pos = f"({self.per_byte - 1} - {pos})"
        return f"{pos} * {self.bits}"


def _float_literal(x: float) -> str:
    return repr(float(x))


def render_codec(codec: Codec, prefix: str) -> str:
    template = _ENV.get_template(f"codecs/{codec.template}")
    return template.render(prefix=prefix, element=codec.name, bits=codec.bits, **codec.params).strip()


def side_context(name: str, side: SideSpec) -> tuple[SideContext, list[str]]:
    """The render context of a side and the codec sources it needs."""
    p = name[0]
    codec = element_codec(side)
    sources = [render_codec(codec, f"{p}_")]
    sc = side.scale
    info = side.info
    if sc is None:
        scale = "none"
    elif sc.granularity.is_static:
        scale = sc.granularity.value
    else:
        scale = "dynamic"
    dynamic = scale == "dynamic"
    scodec = scale_codec(sc.dtype) if dynamic else None
    if scodec is not None:
        sources.append(render_codec(scodec, f"{p}_scale_"))
    asym = side.zero_point is not None
    qmax = info.qmax - info.qmin if asym else info.qmax
    zp = "none" if not asym else ("low_bits" if side.zero_point.storage == "scale_low_bits" else "beside")
    group = str(sc.block) if dynamic and sc.block else "HEAD_PAD"
    rule = ("(max - min) / " if asym else "absmax / ") + f"{qmax:g}" + (" / global" if dynamic and sc.global_scale else "")
    ctx = SideContext(
        name=name, p=p, P=p.upper(), bits=side.bits, unit=codec.unit, unit_bytes=codec.unit_bytes,
        packed=side.bits < 8, per_byte=max(8 // side.bits, 1), msb_first=side.packing == "msb_first",
        code_mask=(1 << side.bits) - 1 if side.bits < 32 else 0xFFFFFFFF,
        scale=scale, group=group, ngroups=f"HEAD_SIZE // {sc.block}" if dynamic and sc.block else "1",
        asym=asym, zp=zp, zp_clear=hex(0xFFFFFFFF ^ ((1 << side.bits) - 1)),
        global_scale=bool(dynamic and sc.global_scale), qmax=_float_literal(qmax),
        scale_floor=_float_literal(max(sc.min, SCALE_TINY[sc.dtype])) if dynamic else "0.0",
        scale_max=_float_literal(SCALE_MAX[sc.dtype]) if dynamic and sc.dtype in SCALE_MAX else "",
        apply="none" if sc is None else sc.apply.value,
        sunit=scodec.unit if scodec else "tl.uint8", sunit_bytes=scodec.unit_bytes if scodec else 1,
        meta_ptr=f"{p}_meta_ptr" if dynamic and sc.placement == Placement.separate else f"{p}_cache_ptr",
        rotate=side.rotation is not None,
        scale_rule=f"scale = max({rule}, {sc.min:g}) stored as {sc.dtype.value}" if dynamic else "",
        codec_summary=codec.summary,
        scale_summary=(f"{sc.dtype.value} per " + (f"{sc.block} elements" if sc.block else "token and head")
                       + f", {sc.placement.value}") if dynamic else "",
    )
    return ctx, sources


def header(spec: FormatSpec, part: str) -> str:
    lines = [
        f"# Generated by kvgen {KVGEN_VERSION} from spec '{spec.name}' (hash {spec.spec_hash()}): {part}.",
        "# Do not edit: change the spec and run `kvgen build`.",
    ]
    if spec.description:
        lines.append("#")
        lines += ["# " + line for line in _wrap(spec.description, 110)]
    if spec.origin:
        origin = _wrap("Origin: " + spec.origin, 110)
        lines += ["# " + origin[0]] + ["#   " + line for line in origin[1:]]
    return "\n".join(lines)


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    # spec text is validated free text; keep it on comment lines only (no line breaks can escape the comment)
    return textwrap.wrap(" ".join(text.split()), width) or [""]


def _tidy(source: str) -> str:
    source = "\n".join(line.rstrip() for line in source.splitlines())
    source = re.sub(r"\n{4,}", "\n\n\n", source)
    return source.strip() + "\n"


def render_files(spec: FormatSpec) -> dict[str, str]:
    """File name -> text of the generated package of ``spec``."""
    check_supported(spec)
    plan = layout_mod.plan(spec)
    k_ctx, k_src = side_context("key", spec.key)
    v_ctx, v_src = side_context("value", spec.value)
    files = {
        "__init__.py": _ENV.get_template("init.py.jinja").render(
            header=header(spec, "package"),
            name=spec.name,
            spec_hash=spec.spec_hash(),
            kvgen_version=KVGEN_VERSION,
            spec_json=pprint.pformat(json.loads(spec.canonical_json()), width=110, sort_dicts=True),
        ),
        "layout.py": _ENV.get_template("layout.py.jinja").render(
            header=header(spec, "page-size calculator"),
            tensors=repr(layout_mod.tensor_storage(spec)),
            fields=plan,
        ),
        "kernels.py": _ENV.get_template("kernels.py.jinja").render(
            header=header(spec, "Triton kernels"),
            k=k_ctx,
            v=v_ctx,
            codec_sources=k_src + v_src,
        ),
    }
    out = {name: _tidy(text) for name, text in files.items()}
    for name, text in out.items():
        compile(text, f"<generated {spec.name}/{name}>", "exec")  # a template bug fails here, not at import
    return out
