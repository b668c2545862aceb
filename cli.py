"""The `kvgen` command line: build, validate, list, show and demo."""

from __future__ import annotations

import errno
import sys
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from .codegen.errors import KvgenError, OptionError, StaleError, UnknownFormat
from .consoles import console, err_console

DEFAULT_OUT = Path(__file__).resolve().parent / "generated"


def _require_kernel_mode() -> None:
    """A usage error (exit 2) where no kernel can run: TRITON_INTERPRET=0 without a CUDA device."""
    from .runtime.kernels import no_kernel_mode

    why = no_kernel_mode()
    if why:
        raise OptionError(why)


class _Group(click.Group):
    """Turn kvgen's own errors, and files it cannot read or write, into one line on stderr (exit 1; 2 for an
    option's value the command cannot take); --debug shows the traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (KvgenError, OSError) as exc:  # OSError: a file it could not read or write (--png, -o, ...)
            if ctx.params.get("debug") or (ctx.obj or {}).get("debug"):
                raise
            msg = str(exc)
            if isinstance(exc, OSError) and exc.filename is not None:
                msg = f"{exc.filename}: {exc.strerror or exc}"
            err_console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False)
            sys.exit(getattr(exc, "exit_code", 1))


@click.group(cls=_Group)
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.version_option(package_name="kvgen")
@click.pass_context
def main(ctx, debug):
    """kvgen: a declarative compiler for quantized KV-cache formats.

    \b
    Example:
      kvgen build specs/                 # in a kvgen checkout: (re)generate the shipped formats into generated/
      kvgen show int8_per_token_head     # bytes per token and page of one format
      kvgen demo                         # write a paged cache and run attention on it
      kvgen test my_format.yaml          # conformance of your own spec against the NumPy reference
    """
    ctx.obj = {"debug": debug}


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Output directory (default: the package's generated/).")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 and show the differences if any file is stale.")
def build(paths, out_dir, check):
    """Render spec files (or every *.yaml in the directories given) into generated packages.

    specs/ below is a kvgen checkout's; an installed kvgen keeps its shipped specs in the package (kvgen/specs).

    \b
    Example:
      kvgen build specs/
      kvgen build my_format.yaml -o build/formats
      kvgen build specs/ --check        # CI: fail when generated/ is stale
    """
    from .codegen.build import build_paths

    out = Path(out_dir) if out_dir else DEFAULT_OUT
    shipped = Path(__file__).resolve().parent / "specs"
    # into kvgen's own generated/: the shipped names stay the shipped specs', and only the shipped specs/ own it
    # (another directory checked against it does not make the shipped packages leftovers)
    reserved = None if out_dir else {p.stem: p for p in shipped.glob("*.yaml")}
    leftovers = bool(out_dir) or any(Path(p).resolve() == shipped for p in paths)
    results = build_paths(paths, out, check=check, reserved=reserved, leftovers=leftovers)
    stale = [r for r in results if r.changed]
    width = max((len(r.name) for r in results if r.name != "__init__"), default=0)
    for r in results:
        if r.name == "__init__":
            continue
        state = ("stale" if check else "written") if r.changed else "up to date"
        console.print(f"  {r.name:<{width}} {state:<11} {escape(str(r.out_dir))}", highlight=False)
    if check and stale:
        for r in stale:
            for name, diff in r.diffs.items():
                err_console.print(diff.rstrip() or f"{r.out_dir / name}: differs", highlight=False, markup=False)
        orphans = [r for r in stale if r.spec_path is None and r.name != "__init__"]
        packages = sum(r.name != "__init__" and r.spec_path is not None for r in stale)
        what = ([f"{packages} generated package(s) are stale"] if packages else []) + (
            [f"the package marker {out / '__init__.py'} is missing or different"]
            if any(r.name == "__init__" for r in stale) else [])
        fix = [f"run `kvgen build {' '.join(paths)}" + (f" -o {out_dir}" if out_dir else "") + "`"] if what else []
        if orphans:  # a rebuild leaves them: only removing them (or restoring their specs) does
            what.append(f"{len(orphans)} package(s) no spec builds ({', '.join(r.name for r in orphans)})")
            fix.append("remove those folders (or restore their specs)")
        raise StaleError(" and ".join(what) + ": " + ", then ".join(fix))
    console.print(f"{len(results) - len(stale) if check else len(results)} format(s) "
                  + ("up to date" if check else "built"), highlight=False)
    if not out_dir and not check:
        own = {p.stem for p in (Path(__file__).resolve().parent / "specs").glob("*.yaml")}
        extra = sorted(r.name for r in results if r.name != "__init__" and r.name not in own)
        if extra:
            console.print(f"note: {', '.join(extra)} {'is' if len(extra) == 1 else 'are'} not among kvgen's shipped "
                          f"specs and now built into this install (kvgen.load('{extra[0]}'), `kvgen list`); pass "
                          "-o DIR to keep your formats apart", highlight=False)


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path())
def validate(files):
    """Check spec files against the schema (and against what this kvgen can build).

    \b
    Example:
      kvgen validate specs/int8_per_token_head.yaml my_format.yaml
    """
    from .codegen.build import find_specs
    from .codegen.errors import BuildError, SpecError
    from .codegen.loader import load_spec

    failed = 0
    paths = find_specs(files)
    if not paths:
        raise BuildError("no spec files (*.yaml) found in " + ", ".join(files))
    for path in paths:
        try:
            spec = load_spec(path)
            console.print(f"[green]ok[/]   {escape(str(path))}: {spec.name} (hash {spec.spec_hash()})", highlight=False)
        except SpecError as exc:
            failed += 1
            err_console.print(f"[red]FAIL[/] {escape(str(exc))}", highlight=False)
    if failed:
        sys.exit(1)


def _formats_table(names, block_size, num_kv_heads, head_size) -> Table:
    from .runtime.loader import load

    t = Table(title=f"Page sizes at block size {block_size}, {num_kv_heads} KV heads, head size {head_size}")
    names = list(names)
    t.add_column("format", no_wrap=True, min_width=max(map(len, names), default=6))  # names never cut short
    # at 80 columns the numbers' headers and "(block 32)" wrap so that the scales keep a column
    t.add_column("K+V B/tok/head", justify="right", min_width=10)
    t.add_column("page B", justify="right", min_width=6)
    t.add_column("vs bf16", justify="right", min_width=5)
    t.add_column("scales", overflow="fold", min_width=12)
    base = None
    rows = []
    for name in names:
        fmt = load(name)
        block = block_size
        residual = fmt.layout.RESIDUAL
        if residual and block_size % residual["group"]:  # KIVI: blocks hold whole token groups
            block = -(-block_size // residual["group"]) * residual["group"]
        try:
            d = fmt.describe(block, num_kv_heads, head_size)
        except ValueError as exc:  # a shape this format does not take (e.g. a head size its scale block does not divide)
            rows.append({"name": name, "error": str(exc)})
            continue
        d["block"] = block
        if residual:
            d["residual_note"] = f"; residual window {fmt.residual_bytes(num_kv_heads, head_size):,} B per sequence"
        rows.append(d)
        if name == "bf16":
            base = d["page_bytes"]
    base = base or 2 * 2 * head_size * block_size * num_kv_heads  # bf16 K + V
    for d in rows:
        if "error" in d:
            t.add_row(d["name"], "-", "-", "-", f"not at this shape: {d['error']}")
            continue
        k, v = d["scales"]["key"], d["scales"]["value"]
        scales = k if k == v else f"K: {k}; V: {v}"
        kv = f"{d['key_bytes']}+{d['value_bytes']}" + (f"+{d['padding_bytes']}" if d["padding_bytes"] else "")
        page = f"{d['page_bytes']:,}" + (f" (block {d['block']})" if d["block"] != block_size else "")
        ratio = d["page_bytes"] / d["block"] / (base / block_size)  # bytes per token against bf16's
        t.add_row(d["name"], kv, page, f"{ratio:.3f}", scales + d.get("residual_note", ""))
    return t


@main.command("list")
@click.option("--block-size", default=16, show_default=True, type=click.IntRange(min=1))
@click.option("--num-kv-heads", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--head-size", default=128, show_default=True, type=click.IntRange(min=16))
def list_formats(block_size, num_kv_heads, head_size):
    """List the formats built into this install (the shipped ones, and any built here without -o) with page sizes.

    \b
    Example:
      kvgen list --head-size 64
    """
    from .runtime.loader import shipped_names

    console.print(_formats_table(shipped_names(), block_size, num_kv_heads, head_size))


@main.command()
@click.argument("name")
@click.option("--block-size", default=None, type=click.IntRange(min=1),
              help="Slots per page  [default: 16; KIVI formats: their token group]")
@click.option("--num-kv-heads", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--head-size", default=128, show_default=True, type=click.IntRange(min=16))
@click.option("--png", "png", type=click.Path(dir_okay=False), default=None,
              help="Also draw the byte map of one page (data, scales, zero points, padding) to this PNG file.")
def show(name, block_size, num_kv_heads, head_size, png):
    """Show one format: bytes per token and head, page bytes, cell layout, where each scale lives.

    NAME is a shipped format, a generated directory or a spec .yaml file.

    \b
    Example:
      kvgen show int8_per_token_head --block-size 16 --num-kv-heads 8 --head-size 128
      kvgen show my_format.yaml
      kvgen show nvfp4 --block-size 4 --num-kv-heads 2 --png nvfp4.png
    """
    from .runtime.loader import load

    if png and not Path(png).resolve().parent.is_dir():  # before the table, not after it
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(png))
    fmt = load(name)
    if block_size is None:
        block_size = fmt.layout.RESIDUAL["group"] if fmt.layout.RESIDUAL else 16
    try:
        d = fmt.describe(block_size, num_kv_heads, head_size)
    except ValueError as exc:  # a shape this format does not take
        raise OptionError(f"--block-size {block_size} / --head-size {head_size}: {fmt.name} does not take this "
                          f"shape: {exc}") from None
    console.print(f"[bold]{d['name']}[/]  {escape(fmt.spec.description)}", highlight=False)
    if fmt.spec.origin:
        console.print(f"origin: {escape(fmt.spec.origin)}", highlight=False)
    shapes = fmt.layout.tensor_shapes("num_blocks", block_size, num_kv_heads, head_size)
    storage = ", ".join(f"{t} {list(shapes[t])} {dt}" for t, dt in d["tensors"].items())
    console.print(f"heads: {num_kv_heads} KV, head size {head_size}, block size {block_size}; storage: {storage}",
                  highlight=False)
    console.print(f"bytes per token and KV head: K {d['key_bytes']}, V {d['value_bytes']}, padding "
                  f"{d['padding_bytes']}, total {d['bytes_per_token_head']}", highlight=False)
    console.print(f"bytes per page (one layer): {d['page_bytes']:,}", highlight=False)
    if d["residual_bytes_per_seq"]:
        console.print(f"full-precision residual window per sequence (one layer, K and V): "
                      f"{d['residual_bytes_per_seq']:,} B", highlight=False)
    for side, where in d["scales"].items():
        console.print(f"{side} scale: {where}", highlight=False)
    console.print(f"chunked prefill: {dequantize_first_summary(fmt, head_size)}", highlight=False)
    t = Table(title="fields of one (slot, KV head): its region (index, and byte start in the page), offset in the "
                    "region's cell; pad: the bytes after the field that a write stores as zeros")
    for col in ("tensor", "region", "region start", "offset", "bytes", "pad", "field", "holds"):
        t.add_column(col, justify="left" if col in ("tensor", "field", "holds") else "right")
    for f in d["fields"]:
        t.add_row(f["tensor"], str(f["region"]), str(f["base"] - f["offset"]), str(f["offset"]), str(f["bytes"]),
                  str(f["pad"]), f["field"], f["what"])
    console.print(t)
    if png:
        from .runtime.bytemap import draw

        draw(fmt, png, block_size, num_kv_heads, head_size)
        console.print(f"byte map written to {escape(str(png))}", highlight=False)


def dequantize_first_summary(fmt, head_size: int) -> str:
    """Where ``attend(..., dequantize_first="auto")`` takes the dense path for ``fmt`` at ``head_size``
    (runtime/dequantize.py)."""
    from .runtime.dequantize import AUTO_GROUP, AUTO_HEAD_SIZE, auto_min_new_tokens

    fewest = auto_min_new_tokens(fmt, AUTO_GROUP, head_size)
    if fewest is None:
        return 'dequantize_first="auto" runs the fused kernels (measured faster for this kind of format)'
    fast = auto_min_new_tokens(fmt, AUTO_GROUP, head_size, "fast")
    under_fast = f'; from {fast} under dot_precision="fast"' if fast != fewest else ""
    return (f'dequantize_first="auto" dequantizes first from {fewest} new tokens per sequence on average at '
            f"{AUTO_GROUP} query heads per KV head and head size {head_size} (fewer with more heads per KV head, "
            f"more for heads under {AUTO_HEAD_SIZE}, fewer over it{under_fast}), fused below")


@main.command()
@click.option("-o", "--out", "out_file", type=click.Path(dir_okay=False), default=None,
              help="Write the schema to this file instead of standard output.")
def schema(out_file):
    """Print the JSON Schema of a spec, for editors that validate and complete YAML as it is typed.

    \b
    Example:
      kvgen schema -o kvgen.schema.json
      # then, first line of a spec (YAML language server, e.g. VS Code's YAML extension):
      # yaml-language-server: $schema=./kvgen.schema.json
    """
    import json

    from .codegen.spec import FormatSpec

    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **FormatSpec.model_json_schema()}
    text = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    if out_file:
        Path(out_file).write_text(text, encoding="utf-8")
        console.print(f"schema written to {escape(out_file)}", highlight=False)
    else:
        click.echo(text, nl=False)


@main.command()
def doctor():
    """Report versions and how kernels run here (compiled on a GPU, or the CPU interpreter), then run one.

    \b
    Example:
      kvgen doctor
    """
    import os
    import platform

    import numpy
    import pydantic
    import torch

    from .codegen.version import KVGEN_VERSION
    from .runtime.kernels import _choose_mode

    _choose_mode()  # before triton is imported: it decides interpreted or compiled at import
    import triton

    from .runtime.kernels import interpreting, no_kernel_mode

    cuda = torch.cuda.is_available()
    interpreted = interpreting()
    why = no_kernel_mode()
    t = Table(title="kvgen doctor", show_header=False)
    t.add_column("what")
    t.add_column("value")
    for k, v in [("kvgen", KVGEN_VERSION), ("python", platform.python_version()), ("torch", torch.__version__),
                 ("triton", triton.__version__), ("numpy", numpy.__version__), ("pydantic", pydantic.VERSION),
                 ("CUDA device", torch.cuda.get_device_name() if cuda else "none"),
                 ("kernels run", "nowhere (TRITON_INTERPRET=0 without a CUDA device)" if why
                  else "Triton interpreter on the CPU (TRITON_INTERPRET=1)" if interpreted
                  else "compiled by Triton on the GPU")]:
        t.add_row(k, escape(str(v)))
    console.print(t)
    if why:
        raise OptionError(why)
    if interpreted and tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4):
        console.print("[yellow]warning:[/] numpy >= 2.4 breaks Triton 3.6's interpreter; install numpy<2.4")
    from .demo import run_demo

    err = run_demo(console, "int8_per_token_head", 2, 20)
    ok = err < 0.05
    console.print(("[green]ok[/]: " if ok else "[red]FAIL[/]: ") + f"a write and an attention ran ({err:.2e} error)")
    if not ok:
        sys.exit(1)


@main.command("test")
@click.argument("specs", nargs=-1, required=True)
@click.option("--examples", default=20, show_default=True, type=click.IntRange(min=1),
              help="Random cases per format.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="auto: the GPU when one is present (compiled kernels), else the CPU interpreter.")
@click.option("--dequantize-first", is_flag=True,
              help="Check attention through attend(dequantize_first=True) (the cache dequantized into a dense bf16 / "
                   "fp16 cache first) against float64 attention on the reference's values rounded the same way.")
def test_cmd(specs, examples, device, dequantize_first):
    """Run the conformance properties on your own specs (or shipped formats) and report pass/fail per property.

    Each SPEC (a .yaml file, a generated directory or a shipped name) is built, then random cases check: page bytes,
    stored bytes equal to the NumPy reference's encoding, quantization error within the spec's bound, and paged
    attention within tolerance of float64; once per format, the bytes of edge values (NaN, +-inf, signed zeros,
    values that round to zero, subnormals, huge values; residual-window formats: n/a). A failure is shrunk to a
    minimal case and printed.

    \b
    Example:
      kvgen test my_format.yaml --examples 50
      kvgen test specs/nvfp4.yaml int8_per_token_head
      kvgen test my_format.yaml --dequantize-first
    """
    import os

    import torch
    from rich.progress import Progress

    interpret = os.environ.get("TRITON_INTERPRET", "")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and interpret in ("", "0") else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise click.BadParameter(f"torch sees no CUDA device here (torch {torch.__version__}); use --device cpu",
                                 param_hint="--device")
    if device == "cuda" and interpret not in ("", "0"):
        raise click.BadParameter(f"TRITON_INTERPRET={interpret} runs the interpreter, on the CPU; unset it for cuda",
                                 param_hint="--device")
    if device == "cpu" and interpret == "0":
        raise click.BadParameter("TRITON_INTERPRET=0 asks for compiled kernels, which run on cuda; unset it for cpu",
                                 param_hint="--device")
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from .conformance import ONCE_PER_FORMAT, PROPERTIES, check
    from .runtime.loader import load

    how = ", attention dequantized first" if dequantize_first else ""
    t = Table(title=f"conformance on {device} ({examples} random cases per format{how})")
    t.add_column("format")
    for p in PROPERTIES:
        t.add_column(p)
    failed = 0
    details = []
    formats, given_as = [], {}
    for spec in specs:  # every SPEC loads (or names its problem) before any case runs
        fmt = load(spec)
        if fmt.name in given_as and given_as[fmt.name] == spec:
            raise OptionError(f"SPEC: {spec} is given twice")
        if fmt.name in given_as:
            raise OptionError(f"SPEC: {spec} and {given_as[fmt.name]} both define format '{fmt.name}': test them "
                              "one at a time (or rename one)")
        given_as[fmt.name] = spec
        formats.append(fmt)
    with Progress(console=console, transient=True) as progress:
        for fmt in formats:
            task = progress.add_task(f"{fmt.name}", total=examples)
            try:
                report = check(fmt, examples, device, on_example=lambda n: progress.update(task, completed=n),
                               dequantize_first=dequantize_first)
            except Exception as exc:  # not a property's verdict: a case that could not run at all
                if isinstance(exc, KvgenError):
                    raise
                first = (str(exc).strip().splitlines() or [""])[0][:300]
                raise KvgenError(f"{fmt.name}: a conformance case could not run: {type(exc).__name__}: {first} "
                                 "(kvgen --debug test ... shows the traceback)") from exc
            progress.remove_task(task)
            cells = ["[dim]n/a[/]" if p in report.not_checked else "[red]FAIL[/]" if report.failures[p]
                     else "[green]pass[/]" for p in PROPERTIES]
            t.add_row(fmt.name, *cells)
            if not report.passed:
                failed += 1
                details.append((fmt.name, report))
    console.print(t)
    for name, report in details:
        if any(msg for p, msg in report.failures.items() if p not in ONCE_PER_FORMAT):
            console.print(f"[bold]{name}[/]: minimal failing case {escape(str(report.failing_case))}", highlight=False)
        else:
            console.print(f"[bold]{name}[/]:", highlight=False)
        for p, msg in report.failures.items():
            if msg:
                console.print(f"  {p}: {escape(str(msg))}", highlight=False)
    if failed:
        sys.exit(1)


@main.command()
@click.option("--format", "format_name", default="int8_per_token_head", show_default=True,
              help="Format to demonstrate (name, generated directory or spec .yaml).")
@click.option("--seqs", default=3, show_default=True, type=click.IntRange(min=1), help="Sequences in the batch.")
@click.option("--context", default=40, show_default=True, type=click.IntRange(min=1),
              help="KV tokens per sequence (sequences vary around it).")
def demo(format_name, seqs, context):
    """Load a generated format, write random K/V through a slot mapping, run paged attention, print page sizes.

    \b
    Example:
      kvgen demo --format fp8_e4m3
    """
    from .demo import run_demo

    _require_kernel_mode()
    try:
        run_demo(console, format_name, seqs, context)
    except UnknownFormat as exc:
        raise OptionError(f"--format: {exc}") from None
    from .runtime.loader import shipped_names

    names = shipped_names()
    if format_name not in names:  # a spec file or a directory of the user's: its row first
        names = [format_name] + names
    console.print(_formats_table(names, 16, 8, 128))


from .plan_cli import plan  # noqa: E402  (commands that live in their own modules)
from .scales_cli import calibrate, import_scheme  # noqa: E402
from .eval_cli import eval_cmd  # noqa: E402

main.add_command(plan)
main.add_command(import_scheme)
main.add_command(calibrate)
main.add_command(eval_cmd)

if __name__ == "__main__":
    main()
