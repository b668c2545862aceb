"""`kvgen import-scheme` and `kvgen calibrate`: click commands registered by cli.py."""

from __future__ import annotations

from pathlib import Path

import click
from rich.markup import escape

from .codegen.errors import KvgenError, OptionError, UnknownFormat
from .consoles import console, err_console


@click.command("import-scheme")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("-o", "--out", "out", type=click.Path(dir_okay=False), default=None,
              help="Write the spec here (default: print it).")
@click.option("--name", default=None, help="Format name in the spec (default: derived from the scheme, "
              "e.g. ct_fp8_e4m3_per_tensor).")
def import_scheme(config, out, name):
    """Turn a compressed-tensors kv_cache_scheme (in a HF config.json) into a kvgen spec.

    \b
    Example:
      kvgen import-scheme model/config.json                  # print the spec
      kvgen import-scheme model/config.json -o my_kv.yaml --name my_kv
      kvgen build my_kv.yaml -o build/formats
    """
    from .codegen.spec import _NAME_RE
    from .scales import import_scheme as to_yaml

    if name is not None and not _NAME_RE.fullmatch(name):  # the option's fault, not the config's
        raise OptionError(f"--name: {name!r} is not a valid format name: use lower case letters, digits and '_', "
                          "starting with a letter (at most 64 characters)")
    text = to_yaml(config, name=name)
    same = _shipped_with_the_same_bytes(text)
    if same:  # on stderr: stdout stays the spec alone
        err_console.print(f"note: the scheme's bytes are those of the shipped format {same} (kvgen.load('{same}') "
                          "needs no build; a cache of one is not loaded as the other, their names differ)",
                          highlight=False)
    if out is None:
        click.echo(text, nl=False)
        return
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise KvgenError(f"{out}: cannot write: {exc.strerror}") from None
    console.print(f"wrote {escape(out)} (from {escape(config)})", highlight=False)


def _shipped_with_the_same_bytes(text: str):
    """The shipped format whose spec equals this one but for its name and prose, or None."""
    from .codegen.loader import load_spec, load_spec_text

    prose = {"name", "description", "origin"}
    mine = load_spec_text(text).model_dump(mode="json", exclude=prose)
    for path in sorted((Path(__file__).resolve().parent / "specs").glob("*.yaml")):
        spec = load_spec(path)
        if spec.model_dump(mode="json", exclude=prose) == mine:
            return spec.name
    return None


def _load_format_spec(name: str):
    p = Path(name)
    if p.suffix in (".yaml", ".yml") or p.is_file():
        from .codegen.loader import load_spec

        return load_spec(p)
    from .runtime.loader import load

    return load(name).spec


@click.command("calibrate")
@click.argument("samples", type=click.Path(dir_okay=False))
@click.option("--format", "-f", "format_name", required=True,
              help="A static-scale format: a name (fp8_e4m3, fp8_e4m3_per_head, ...) or a spec .yaml.")
@click.option("--observer", type=click.Choice(["absmax", "percentile", "mse"]), default="absmax", show_default=True,
              help="How the range is chosen: max |x|, a percentile of |x|, or the least quantization MSE.")
@click.option("--percentile", type=click.FloatRange(0, 100, min_open=True), default=99.99, show_default=True,
              help="Percentile of |x| for --observer percentile.")
@click.option("--per-head/--per-tensor", "per_head", default=None,
              help="One scale per KV head, or one per layer (default: what the format takes).")
@click.option("-o", "--out", "out", type=click.Path(dir_okay=False), required=True,
              help="Output: .safetensors (model.layers.N.self_attn.k_scale / v_scale) or .json (SGLang form).")
@click.option("--tp-size", type=click.IntRange(min=1), default=1, show_default=True,
              help=".json output: write the scales for tp ranks 0 .. N-1.")
def calibrate(samples, format_name, observer, percentile, per_head, out, tp_size):
    """Compute static K/V scales from sample activations.

    SAMPLES is a .safetensors or .npz file with one K and one V array per layer, [tokens, kv_heads, head_size],
    named layers.N.k / layers.N.v (also key/value, keys/values, k_proj/v_proj; any prefix before layers.N,
    optionally self_attn. after it).
    scale = range / qmax of the format's element (fp8_e4m3: 448, fp8_e5m2: 57344, int8: 127).

    \b
    Example:
      kvgen calibrate acts.npz --format fp8_e4m3 -o kv_scales.safetensors
      kvgen calibrate acts.safetensors -f fp8_e4m3 --observer percentile --percentile 99.9 -o kv.json
      kvgen calibrate acts.npz --format fp8_e4m3_per_head --observer mse -o kv_scales.safetensors
    """
    import numpy as np

    from .calibrate import calibrate as run, load_samples, save_scales
    from .scales import JSON_DTYPES

    if Path(out).suffix.lower() not in (".safetensors", ".json"):
        raise OptionError(f"--out: {out}: must end in .safetensors or .json")
    if tp_size != 1 and Path(out).suffix.lower() != ".json":  # it was ignored without a word
        raise OptionError(f"--tp-size: the scale JSON's ranks; a .safetensors file holds the whole model's scales "
                          f"(load_scales slices them per rank): drop --tp-size {tp_size} or write .json")
    from .calibrate import CalibrationError, check_static_sides, resolve_per_head

    try:
        spec = _load_format_spec(format_name)
        check_static_sides(spec)
    except (UnknownFormat, CalibrationError) as exc:  # a format this command cannot take: a usage error
        raise OptionError(f"--format: {exc}") from None
    try:  # before the samples are read: an option this format cannot take
        per_head = resolve_per_head(spec, per_head)
    except CalibrationError as exc:
        raise OptionError(f"--per-head: {exc}") from None
    if per_head and Path(out).suffix.lower() == ".json":
        raise OptionError(f"--out: {out}: the scale JSON holds one scale per layer; write per-head scales to "
                          ".safetensors (or pass --per-tensor)")
    data = load_samples(samples)
    try:
        scales = run(data, spec, observer=observer, per_head=per_head, percentile=percentile, progress=True)
    except CalibrationError as exc:  # about the samples' contents: name their file
        raise CalibrationError(f"{samples}: {exc}") from None
    dtype = JSON_DTYPES.get(spec.key.element.value, spec.key.element.value)
    save_scales(scales, out, dtype=dtype, tp_size=tp_size)
    ks = np.concatenate([np.ravel(k) for k, _ in scales.values()])
    vs = np.concatenate([np.ravel(v) for _, v in scales.values()])
    kind = "per-head" if np.ndim(next(iter(scales.values()))[0]) else "per-tensor"
    console.print(f"wrote {kind} scales of {len(scales)} layer(s) ({observer}) to {escape(out)}: "
                  f"k_scale {ks.min():.4g}..{ks.max():.4g}, v_scale {vs.min():.4g}..{vs.max():.4g}", highlight=False)
    if Path(out).suffix.lower() == ".json" and any(np.any(k != v) for k, v in scales.values()):
        err_console.print("note: the JSON form has one scale per layer: the larger of K and V was written",
                          highlight=False)
