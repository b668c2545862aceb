"""Spec fuzzing: random YAML documents and random mutations of the shipped specs.

The property (tests/test_fuzz_specs.py, and `python -m kvgen.fuzz --cases 10000` for long runs): every document
either builds a format that conforms to the NumPy reference, or is rejected with kvgen's own SpecError, naming
where. Nothing else may escape: no pydantic, YAML, Jinja or Triton exception, no crash, no half-written build.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .codegen.errors import SpecError
from .codegen.spec import FormatSpec

SPECS_DIR = Path(__file__).resolve().parent / "specs"


def _schema_words() -> tuple[list, list]:
    """Every property name and enum value of the spec's JSON schema: the vocabulary mutations draw from."""
    schema = FormatSpec.model_json_schema()
    keys, values = set(), set()

    def walk(node):
        if isinstance(node, dict):
            for k, v in node.get("properties", {}).items():
                keys.add(k)
                walk(v)
            for v in node.get("enum", []):
                values.add(v)
            if "const" in node:
                values.add(node["const"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    return sorted(keys), sorted(values, key=str)


KEYS, ENUM_VALUES = _schema_words()
SHIPPED = {p.stem: yaml.safe_load(p.read_text()) for p in sorted(SPECS_DIR.glob("*.yaml"))}

scalars = st.one_of(
    st.sampled_from(ENUM_VALUES), st.integers(-3, 300), st.sampled_from([0, 1, 2, 3, 4, 8, 16, 32, 64, 128]),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(), st.text(max_size=12),
    st.sampled_from(["kivi", "x" * 70, "Name", "a-b", "{{ evil }}", "__import__('os')", "\n", "\x07"]),
)
documents = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=8)), inner, max_size=5)),
    max_leaves=20,
)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    return out


@st.composite
def mutated_specs(draw) -> Any:
    """A shipped spec with 1 to 3 mutations: delete, replace with a scalar or enum value, add a key."""
    doc = copy.deepcopy(draw(st.sampled_from(list(SHIPPED.values()))))
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        op = draw(st.sampled_from(["delete", "replace", "replace", "add", "enum"]))
        if op == "delete":
            del parent[path[-1]]
        elif op == "replace":
            parent[path[-1]] = draw(scalars)
        elif op == "enum":
            parent[path[-1]] = draw(st.sampled_from(ENUM_VALUES))
        elif isinstance(parent[path[-1]], dict):
            parent[path[-1]][draw(st.sampled_from(KEYS))] = draw(scalars)
    return doc


@st.composite
def fuzz_texts(draw) -> str:
    """YAML text: a mutated shipped spec, a random document, or raw text."""
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "random", "text"]))
    if kind == "text":
        return draw(st.text(max_size=200))
    doc = draw(mutated_specs()) if kind == "mutated" else draw(documents)
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


def check_text(text: str, root: Path, conform: bool = True) -> str:
    """'rejected' (kvgen SpecError), 'built' (and conformed when asked), or raise what escaped."""
    from . import conformance
    from .runtime.loader import load

    path = root / "fuzz.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        fmt = load(path)
    except SpecError:
        return "rejected"
    if conform:
        run = conformance.run_stream if fmt.spec.streaming else conformance.run_case
        case = conformance.small_case(fmt, seed=len(text))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            failures = {p: m for p, m in run(fmt, case).items() if m}
        if failures:
            raise AssertionError(f"built but does not conform: {failures}\n--- spec ---\n{text}")
    return "built"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=10000)
    parser.add_argument("--conform-every", type=int, default=10,
                        help="run the conformance properties on every n-th spec that builds (kernels are slow on "
                             "the CPU interpreter)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    counts = {"rejected": 0, "built": 0, "conformed": 0}
    escaped: list = []
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp, Progress(
            TextColumn("fuzzing specs"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[state]}"), console=console) as progress:
        os.environ["KVGEN_CACHE_DIR"] = str(Path(tmp) / "cache")
        task = progress.add_task("fuzz", total=args.cases, state="")

        @settings(max_examples=args.cases, database=None, deadline=None, suppress_health_check=list(HealthCheck))
        @given(text=fuzz_texts())
        def one(text):
            n = sum(counts.values()) - counts["conformed"] + len(escaped)
            conform = counts["built"] % args.conform_every == 0
            try:
                outcome = check_text(text, Path(tmp), conform=conform)
                counts[outcome] += 1
                if outcome == "built" and conform:
                    counts["conformed"] += 1
            except Exception as exc:  # recorded, not raised: the run reports every escape
                escaped.append((text, f"{type(exc).__name__}: {exc}"))
            progress.update(task, completed=n + 1,
                            state=f"rejected {counts['rejected']}, built {counts['built']}, escaped {len(escaped)}")

        one()
    elapsed = time.time() - start
    console.print(f"{args.cases} cases in {elapsed:.0f} s: {counts['rejected']} rejected with a SpecError, "
                  f"{counts['built']} built ({counts['conformed']} of them checked for conformance), "
                  f"{len(escaped)} escaped")
    for text, err in escaped[:10]:
        console.print(f"[red]escaped[/]: {err}\n{text}", markup=True, highlight=False)
    return 1 if escaped else 0


if __name__ == "__main__":
    sys.exit(main())
