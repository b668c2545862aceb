"""`kvgen plan`: how many tokens and sequences fit in a GPU's KV-cache budget, per format (see kvgen.planner).

Register with ``main.add_command(plan)`` in cli.py.
"""

from __future__ import annotations

import json
import sys

import click
from rich.markup import escape
from rich.table import Table

from .codegen.errors import KvgenError
from .consoles import console, err_console


class _PlanCommand(click.Command):
    """kvgen's errors as one line on stderr (exit 1, 2 for an option's value), also when the command runs outside
    kvgen's group; the group's --debug still shows the traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KvgenError as exc:
            root = ctx.find_root()
            if root.params.get("debug") or (root.obj or {}).get("debug"):
                raise
            err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
            sys.exit(exc.exit_code)


def _kinds(p) -> str:
    return " + ".join(f"{k['num_layers']}x {k['format']} {k['page_bytes']:,}" for k in p.layer_kinds)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@click.command("plan", cls=_PlanCommand)
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="A Hugging Face config.json (text_config is used for multimodal configs).")
@click.option("--format", "formats", multiple=True, required=True,
              help="KV-cache format (shipped name, generated directory or spec .yaml); repeat to compare.")
@click.option("--gpu-memory", required=True,
              help="KV-cache budget per GPU (what is left after weights and activations): 80GiB, 141GB, 8e10.")
@click.option("--skip-layers", "skip_layers", multiple=True, metavar="LAYERS...",
              help="Layers kept in the model dtype (bf16/fp16): 'sliding_window' and/or layer indices, "
                   "e.g. --skip-layers sliding_window 0 1 (or 0,1).")
@click.option("--block-size", default=16, show_default=True, type=click.IntRange(min=1), help="Tokens per block.")
@click.option("--tp", default=1, show_default=True, type=click.IntRange(min=1), help="Tensor-parallel degree.")
@click.option("--context", default=32768, show_default=True, type=click.IntRange(min=1),
              help="Tokens per sequence for the concurrency column.")
@click.option("--json", "as_json", is_flag=True, help="Print the plans as JSON instead of a table.")
@click.option("--png", type=click.Path(dir_okay=False), default=None,
              help="Also draw max concurrent sequences against context, one line per format, to this PNG file.")
@click.argument("more_skip", nargs=-1, metavar="")
def plan(config_path, formats, gpu_memory, skip_layers, block_size, tp, context, as_json, png, more_skip):
    """Plan KV-cache capacity: bytes per token, page bytes, blocks, max tokens and sequences, gain over bf16.

    Reads a Hugging Face config (layers, KV heads, head size, sliding-window layers; GQA and MQA). Figures are per
    GPU: with --tp each rank holds its share of the KV heads (1, replicated, when tp >= KV heads). Layers kept in
    the model dtype and layers in the format are padded to one page size, as vLLM does.

    \b
    Example:
      kvgen plan --config llama-3.1-8b.json --format fp8_e4m3 --gpu-memory 80GiB
      kvgen plan --config gemma-3-12b-it.json --format int4_per_token_head --gpu-memory 40GiB \\
          --skip-layers sliding_window --context 8192
      kvgen plan --config qwen2.5-7b.json --format fp8_e4m3 --format nvfp4 --format kivi_2bit \\
          --block-size 32 --gpu-memory 141GB --tp 2 --png capacity.png
      kvgen plan --config llama-3.1-8b.json --format nvfp4 --gpu-memory 80GiB --json
    """
    from .planner import PlanOptionError, draw_capacity_png, make_plan, parse_size, read_config

    if more_skip and not skip_layers:
        raise PlanOptionError(f"unexpected argument {more_skip[0]!r} (layer lists follow --skip-layers)")
    skip = list(skip_layers) + list(more_skip)
    budget = parse_size(gpu_memory, "--gpu-memory")
    shape = read_config(config_path)
    plans = [make_plan(shape, f, budget, block_size=block_size, tp=tp, context=context, skip_layers=skip)
             for f in dict.fromkeys(formats)]
    if png:
        draw_capacity_png(plans, png)
    if as_json:
        out = dict(model=dict(name=shape.name, num_layers=shape.num_layers,
                              num_attention_heads=shape.num_attention_heads, num_kv_heads=shape.num_kv_heads,
                              head_size=shape.head_size, attention=shape.attention,
                              sliding_layers=list(shape.sliding_layers), sliding_window=shape.sliding_window,
                              dtype=shape.dtype),
                   budget_bytes=budget, block_size=block_size, tp=tp, context=context,
                   plans=[p.to_dict() for p in plans], png=png)
        click.echo(json.dumps(out, indent=2))
        return
    p0 = plans[0]
    sliding = (f", {len(shape.sliding_layers)} sliding-window layers (window {shape.sliding_window})"
               if shape.sliding_layers else "")
    console.print(f"[bold]{escape(shape.name)}[/]: {shape.num_layers} layers, {shape.num_attention_heads} heads, "
                  f"{shape.num_kv_heads} KV heads ({shape.attention}), head size {shape.head_size}{sliding}; "
                  f"{shape.dtype}", highlight=False)
    console.print(f"per GPU: {_gib(budget)} ({budget:,} B), tp {tp} -> {p0.kv_heads_per_rank} KV head(s) per rank"
                  + (" (replicated)" if tp > shape.num_kv_heads else "")
                  + f", block size {block_size}"
                  + (f"; {len(p0.skip_layers)} layer(s) kept in {shape.dtype}" if p0.skip_layers else ""),
                  highlight=False)
    t = Table(title=f"KV-cache capacity per GPU at context {context:,}")
    t.add_column("format", no_wrap=True)
    t.add_column("layers x page B", overflow="fold")
    t.add_column("padded page B", justify="right")
    t.add_column("padding", justify="right")
    t.add_column("B/token (all layers)", justify="right")
    t.add_column("blocks", justify="right")
    t.add_column("max tokens", justify="right")
    t.add_column(f"seqs @ {context:,}", justify="right")
    t.add_column("vs bf16", justify="right")
    for p in plans:
        pad = f"{p.padding_bytes_per_block:,} B/block ({p.padding_fraction:.0%})" if p.padding_bytes_per_block else "-"
        bpt = f"{p.bytes_per_token:,}" if isinstance(p.bytes_per_token, int) else f"{p.bytes_per_token:,.2f}"
        seqs = f"{p.max_seqs:,}" + ("*" if p.residual_bytes_per_seq else "")
        t.add_row(p.format, _kinds(p), f"{p.page_bytes:,}", pad, bpt, f"{p.num_blocks:,}", f"{p.max_tokens:,}",
                  seqs, f"{p.gain_vs_bf16:.2f}x" if p.gain_vs_bf16 is not None else "-")
    console.print(t)
    for p in plans:
        if p.residual_bytes_per_seq:
            console.print(f"* {p.format}: each sequence also keeps a {p.residual_bytes_per_seq:,} B full-precision "
                          f"residual window: the blocks column is what fits beside the sequences column's windows "
                          f"(allocate those blocks with max_seqs = that many sequences)", highlight=False)
        for note in p.notes:
            if "residual" not in note:
                console.print(f"[yellow]note:[/] {escape(p.format)}: {escape(note)}", highlight=False)
    if png:
        console.print(f"capacity chart written to {escape(png)}", highlight=False)
