"""The `kvgen` command line: build, validate, list, show and demo."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from .codegen.errors import KvgenError, StaleError

console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)

DEFAULT_OUT = Path(__file__).resolve().parent / "generated"


class _Group(click.Group):
    """Turn kvgen's own errors into one line on stderr (exit 1); --debug shows the traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KvgenError as exc:
            if ctx.params.get("debug") or (ctx.obj or {}).get("debug"):
                raise
            err_console.print(f"[bold red]error:[/] {exc}", highlight=False, markup=True)
            sys.exit(1)


@click.group(cls=_Group)
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.version_option(package_name="kvgen")
@click.pass_context
def main(ctx, debug):
    """kvgen: a declarative compiler for quantized KV-cache formats.

    \b
    Example:
      kvgen build specs/                 # (re)generate the shipped formats into generated/
      kvgen show int8_per_token_head     # bytes per token and page of one format
      kvgen demo                         # write a paged cache and run attention on it
    """
    ctx.obj = {"debug": debug}


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Output directory (default: the package's generated/).")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 and show the differences if any file is stale.")
def build(paths, out_dir, check):
    """Render spec files (or every *.yaml in the directories given) into generated packages.

    \b
    Example:
      kvgen build specs/
      kvgen build my_format.yaml -o build/formats
      kvgen build specs/ --check        # CI: fail when generated/ is stale
    """
    from .codegen.build import build_paths

    out = Path(out_dir) if out_dir else DEFAULT_OUT
    results = build_paths(paths, out, check=check)
    stale = [r for r in results if r.changed]
    for r in results:
        if r.name == "__init__":
            continue
        state = ("stale" if check else "written") if r.changed else "up to date"
        console.print(f"  {r.name:<28} {state:<11} {r.out_dir}", highlight=False)
    if check and stale:
        for r in stale:
            for name, diff in r.diffs.items():
                err_console.print(diff.rstrip() or f"{r.out_dir / name}: differs", highlight=False, markup=False)
        raise StaleError(f"{len(stale)} generated package(s) are stale: run `kvgen build {' '.join(paths)}"
                         + (f" -o {out_dir}" if out_dir else "") + "`")
    console.print(f"{len(results) - len(stale) if check else len(results)} format(s) "
                  + ("up to date" if check else "built"), highlight=False)


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path())
def validate(files):
    """Check spec files against the schema (and against what this kvgen can build).

    \b
    Example:
      kvgen validate specs/int8_per_token_head.yaml my_format.yaml
    """
    from .codegen.build import find_specs
    from .codegen.errors import SpecError
    from .codegen.loader import load_spec

    failed = 0
    for path in find_specs(files):
        try:
            spec = load_spec(path)
            console.print(f"[green]ok[/]   {path}: {spec.name} (hash {spec.spec_hash()})", highlight=False)
        except SpecError as exc:
            failed += 1
            err_console.print(f"[red]FAIL[/] {exc}", highlight=False)
    if failed:
        sys.exit(1)


def _formats_table(names, block_size, num_kv_heads, head_size) -> Table:
    from .runtime.loader import load

    t = Table(title=f"Page sizes at block size {block_size}, {num_kv_heads} KV heads, head size {head_size}")
    for col in ("format", "K B/tok/head", "V B/tok/head", "cell B", "page B", "vs bf16", "scales"):
        t.add_column(col, justify="left" if col in ("format", "scales") else "right")
    base = None
    rows = []
    for name in names:
        d = load(name).describe(block_size, num_kv_heads, head_size)
        rows.append(d)
        if name == "bf16":
            base = d["page_bytes"]
    base = base or 2 * 2 * head_size * block_size * num_kv_heads  # bf16 K + V
    for d in rows:
        scales = "; ".join(f"{s[0].upper()}: {v}" for s, v in d["scales"].items())
        t.add_row(d["name"], str(d["key_bytes"]), str(d["value_bytes"]), str(d["bytes_per_token_head"]),
                  f"{d['page_bytes']:,}", f"{d['page_bytes'] / base:.3f}", scales)
    return t


@main.command("list")
@click.option("--block-size", default=16, show_default=True)
@click.option("--num-kv-heads", default=8, show_default=True)
@click.option("--head-size", default=128, show_default=True)
def list_formats(block_size, num_kv_heads, head_size):
    """List the shipped formats with their page sizes.

    \b
    Example:
      kvgen list --head-size 64
    """
    from .runtime.loader import shipped_names

    console.print(_formats_table(shipped_names(), block_size, num_kv_heads, head_size))


@main.command()
@click.argument("name")
@click.option("--block-size", default=16, show_default=True)
@click.option("--num-kv-heads", default=8, show_default=True)
@click.option("--head-size", default=128, show_default=True)
def show(name, block_size, num_kv_heads, head_size):
    """Show one format: bytes per token and head, page bytes, cell layout, where each scale lives.

    NAME is a shipped format, a generated directory or a spec .yaml file.

    \b
    Example:
      kvgen show int8_per_token_head --block-size 16 --num-kv-heads 8 --head-size 128
      kvgen show my_format.yaml
    """
    from .runtime.loader import load

    fmt = load(name)
    d = fmt.describe(block_size, num_kv_heads, head_size)
    console.print(f"[bold]{d['name']}[/]  {fmt.spec.description}", highlight=False)
    if fmt.spec.origin:
        console.print(f"origin: {fmt.spec.origin}", highlight=False)
    console.print(f"heads: {num_kv_heads} KV, head size {head_size}, block size {block_size}; storage "
                  f"{', '.join(d['tensors'])} [{d['storage_dtype']}] of shape [num_blocks, {block_size}, "
                  f"{num_kv_heads}, cell]", highlight=False)
    console.print(f"bytes per token and KV head: K {d['key_bytes']}, V {d['value_bytes']}, padding "
                  f"{d['padding_bytes']}, total {d['bytes_per_token_head']}", highlight=False)
    console.print(f"bytes per page (one layer): {d['page_bytes']:,}", highlight=False)
    for side, where in d["scales"].items():
        console.print(f"{side} scale: {where}", highlight=False)
    t = Table(title=f"cell layout (one slot, one KV head; head size {head_size})")
    for col in ("tensor", "offset", "bytes", "field", "holds"):
        t.add_column(col, justify="right" if col in ("offset", "bytes") else "left")
    for f in d["fields"]:
        t.add_row(f["tensor"], str(f["offset"]), str(f["bytes"]), f["field"], f["what"])
    console.print(t)


@main.command()
@click.option("--format", "format_name", default="int8_per_token_head", show_default=True,
              help="Format to demonstrate (name, generated directory or spec .yaml).")
@click.option("--seqs", default=3, show_default=True, help="Sequences in the batch.")
@click.option("--context", default=40, show_default=True, help="KV tokens per sequence (sequences vary around it).")
def demo(format_name, seqs, context):
    """Load a generated format, write random K/V through a slot mapping, run paged attention, print page sizes.

    \b
    Example:
      kvgen demo --format fp8_e4m3
    """
    from .demo import run_demo

    run_demo(console, format_name, seqs, context)
    from .runtime.loader import shipped_names

    console.print(_formats_table(shipped_names(), 16, 8, 128))


if __name__ == "__main__":
    main()
