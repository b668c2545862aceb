"""`kvgen eval`: accuracy of formats on synthetic attention through the NumPy reference (see kvgen.evaluate).

Register with ``main.add_command(eval_cmd)`` in cli.py.
"""

from __future__ import annotations

import errno
import json
import re
import sys
from pathlib import Path

import click
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .codegen.errors import KvgenError, OptionError
from .consoles import console, err_console
from .runtime.kernels import DOT_PRECISIONS


class _EvalCommand(click.Command):
    """kvgen's errors as one line on stderr (exit 1, 2 for an option's value), also outside kvgen's group; the
    group's --debug re-raises."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KvgenError as exc:
            root = ctx.find_root()
            if root.params.get("debug") or (root.obj or {}).get("debug"):
                raise
            msg = str(exc)
            if isinstance(exc, OptionError):  # evaluate()'s parameter names as the options the user typed
                msg = re.sub(r"\b(dot_precision|query_dtype|dequantize_first)\b",
                             lambda m: "--" + m.group(1).replace("_", "-"), msg)
            err_console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False)
            sys.exit(exc.exit_code)


def _fmt_bytes(b: float) -> str:
    return f"{b:g}"


@click.command("eval", cls=_EvalCommand)
@click.argument("specs", nargs=-1, metavar="[SPEC ...]")
@click.option("--context", "contexts", multiple=True, type=click.IntRange(min=16), metavar="N",
              help="Context length (tokens); repeat for several. Default: 1024 and 4096. Up to 65536 and beyond "
                   "works (chunked).")
@click.option("--seeds", default=3, show_default=True, type=click.IntRange(min=1), help="Random seeds per context.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON instead of a table.")
@click.option("--png", type=click.Path(dir_okay=False), default=None,
              help="Also draw attention error against bytes per token-head (log y) to this PNG file.")
@click.option("--backend", type=click.Choice(["auto", "reference", "kernels"]), default="auto", show_default=True,
              help="Where the attention output comes from: the format's generated kernels (auto: when a GPU is "
                   "present; on a CPU they run interpreted, slowly) or float64 attention on the reference decoding.")
@click.option("--dot-precision", type=click.Choice(list(DOT_PRECISIONS)), default="auto",
              show_default=True,
              help="With --backend kernels: the attention's dots. quantized: int8 dots on int8 codes with the query "
                   "and probabilities quantized per row (formats without int8 codes run auto); fast: one fp16 / "
                   "bf16 term per operand (dequantized values rounded once, as engines do). The accuracy cost is "
                   "the difference to auto.")
@click.option("--query-dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default=None,
              help="With --backend kernels: the queries' type in the kernels' call. Default: fp32, or bf16 with "
                   "--dequantize-first.")
@click.option("--dequantize-first", is_flag=True,
              help="With --backend kernels: attend(dequantize_first=...), the cache dequantized into a dense cache "
                   "of the query's 16-bit type (or --dense-dtype) first, each value rounded once to it. Compare with "
                   "the same --query-dtype without it for the cost.")
@click.option("--dense-dtype", type=click.Choice(["bf16", "fp16"]), default=None,
              help="With --dequantize-first: the dense cache's type (default: the query's).")
def eval_cmd(specs, contexts, seeds, as_json, png, backend, dot_precision, query_dtype, dequantize_first,
             dense_dtype):
    """Accuracy of KV-cache formats: attention error on synthetic K/V, through the kernels on a GPU, else the
    NumPy reference.

    SPEC is a shipped format name or a spec .yaml (default: every shipped format). Keys are N(0,1) with 4 outlier
    channels per head (x10..x20) and RoPE; values N(0,1); queries (32 heads over 8 KV heads, head size 128, 4 per
    head) mix a few keys plus noise, so attention is peaked. Per format and context, averaged over seeds: relative
    L2 error and cosine of the attention output against fp32 K/V, top-8 agreement of the attended positions, and
    the relative Frobenius error of K and V. Static scales are calibrated (absmax / qmax); KIVI formats keep their
    residual window (the newest R..R+G-1 tokens: 128..159 in bf16 for the shipped ones), as a real cache does.

    \b
    Example:
      kvgen eval                                       # all shipped formats, contexts 1024 and 4096, 3 seeds
      kvgen eval fp8_e4m3 int4_per_token_head --context 65536 --seeds 1
      kvgen eval my_format.yaml int8_per_token_head --json
      kvgen eval --png accuracy.png
      kvgen eval int8_per_token_head --backend kernels --dot-precision quantized   # cost of the int8 domain
      kvgen eval q4_0 --backend kernels --dequantize-first      # against: --backend kernels --query-dtype bf16
    """
    from .evaluate import draw_png, evaluate, resolve_backend, resolve_format
    from .runtime.loader import shipped_names

    names = list(dict.fromkeys(specs)) or list(shipped_names())
    for n in names:  # fail fast, one line, before any work
        resolve_format(n)
    if dense_dtype and not dequantize_first:
        raise click.UsageError("--dense-dtype goes with --dequantize-first")
    query_dtype = query_dtype or ("bf16" if dequantize_first else "fp32")
    if dequantize_first and dense_dtype:
        dequantize_first = dense_dtype
    if png and not Path(png).resolve().parent.is_dir():  # before the evaluation's minutes, not after
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(png))
    ctxs = list(dict.fromkeys(contexts)) or [1024, 4096]
    if resolve_backend(backend) == "kernels":
        from .runtime.kernels import no_kernel_mode

        if no_kernel_mode():
            raise OptionError(no_kernel_mode())
    total = len(names) * len(ctxs) * seeds
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err_console, transient=True, disable=as_json) as prog:
        task = prog.add_task("evaluating", total=total)

        def step(name, ctx, seed):
            prog.update(task, advance=1, description=f"{name} @ {ctx:,} seed {seed}")

        rows = evaluate(names, ctxs, seeds, progress=step, backend=backend, dot_precision=dot_precision,
                        query_dtype=query_dtype, dequantize_first=dequantize_first)
    where = "generated kernels" if resolve_backend(backend) == "kernels" else "NumPy reference"
    if as_json:
        if png:
            draw_png(rows, png, where=where)
        click.echo(json.dumps({"contexts": ctxs, "seeds": seeds, "backend": resolve_backend(backend),
                               "dot_precision": dot_precision, "query_dtype": query_dtype,
                               "dequantize_first": dequantize_first, "num_kv_heads": 8, "num_q_heads": 32,
                               "head_size": 128, "top_k": 8, "results": rows, "png": png}, indent=2))
        return
    chart_where = where
    if dot_precision != "auto":
        where += f", dot_precision={dot_precision}"
    if query_dtype != "fp32" and resolve_backend(backend) == "kernels":
        where += f", {query_dtype} queries"
    if dequantize_first:
        where += f", dequantized first{' into ' + dense_dtype if dense_dtype else ''}"
    t = Table(title=f"Attention accuracy vs fp32 K/V (synthetic, {seeds} seed(s); means; attention by the {where})")
    t.add_column("format", no_wrap=True)
    t.add_column("B/token-head", justify="right")
    t.add_column("context", justify="right")
    t.add_column("attn rel L2", justify="right")
    t.add_column("cosine", justify="right")
    t.add_column("top-8", justify="right")
    t.add_column("K rel err", justify="right")
    t.add_column("V rel err", justify="right")
    for r in rows:
        name = r["format"] + ("*" if "quantized_fraction" in r else "")
        t.add_row(name, _fmt_bytes(r["bytes_per_token_head"]), f"{r['context']:,}", f"{r['attn_rel_l2']:.2e}",
                  f"{r['cosine']:.6f}", f"{r['topk']:.3f}", f"{r['key_rel']:.2e}", f"{r['value_rel']:.2e}")
    console.print(t)
    windows = {}  # each KIVI format's window, in the rows' order
    for r in rows:
        if "residual_window" in r:
            windows.setdefault(r["format"], r["residual_window"])
    for text in dict.fromkeys(_window_text(w) for w in windows.values()):
        names = [n for n, w in windows.items() if _window_text(w) == text]
        console.print(f"* {', '.join(names)}: {text} (the format's residual window); bytes exclude that "
                      "per-sequence window", highlight=False)
    fell_back = sorted({r["format"] for r in rows if dot_precision == "quantized" and r["dot_precision"] == "auto"})
    if fell_back:
        console.print(f"dot_precision=quantized: {', '.join(fell_back)} ha{'s' if len(fell_back) == 1 else 've'} no "
                      "int8 codes and ran auto", highlight=False)
    if png:  # after the table: a chart that cannot be written loses no results
        draw_png(rows, png, where=chart_where)
        console.print(f"chart written to {escape(png)}", highlight=False)


def _window_text(window: dict) -> str:
    lo, hi = window["tokens"]
    return f"the newest {lo}..{hi} tokens stay in {window['dtype']}"
