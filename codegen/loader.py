"""Read a spec file: YAML with every node's position kept, validated by the schema, errors mapped to lines."""

from __future__ import annotations

import difflib
import re
import typing
from pathlib import Path
from typing import Any, Union

import yaml
from pydantic import BaseModel, ValidationError

from .errors import MissingSpecFile, SpecError
from .spec import YAML12_FLOAT, FormatSpec, PlainNumber

Position = tuple[int, int]  # 1-based line and column


# a spec holds a few dozen values a few levels deep: far beyond that is a mistake (or an alias bomb), refused early
MAX_NODES = 10_000
MAX_DEPTH = 32


# PyYAML's wording for the mistakes spec authors make most, in plainer words (its own stays in brackets)
_YAML_PROBLEMS = {
    "mapping values are not allowed here": "a 'key: value' where this line cannot have one (check its indentation "
                                           "against the lines above, or quote a value that holds ': ')",
    "expected <block end>, but found '<block mapping start>'": "this line's indentation matches no key above it",
    "expected <block end>, but found '<block sequence start>'": "this list's indentation matches no key above it",
    "found character '\\t' that cannot start any token": "a tab; YAML indents with spaces only",
}


# plain decimal numbers; YAML 1.1 also reads 010 as 8, 0x10 as 16, 3_2 as 32 and 1:30 as 90, which no spec means
_NUMBER_TAGS = {
    "tag:yaml.org,2002:int": r"[-+]?(0|[1-9][0-9]*)",
    "tag:yaml.org,2002:float": r"[-+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)",
}


def _plain_yaml_problem(problem: str) -> str:
    plain = _YAML_PROBLEMS.get(problem)
    return f"{plain} ({problem})" if plain else problem


def _compose_with_positions(text: str, path: str) -> tuple[Any, dict[tuple, Position]]:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:  # PyYAML composes nested collections recursively
        raise SpecError("not valid YAML for a spec: collections nested too deeply", path=path) from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow: no mark, only a position
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        raise SpecError(f"not valid YAML: {exc.reason} (character {exc.character!r})", path=path, line=line,
                        column=column) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        plain = _plain_yaml_problem(problem)
        if context and plain == problem:  # PyYAML's context says what it was reading ("while scanning a quoted
            plain = f"{context}, {problem}"  # scalar"): without it "found unexpected end of stream" means little
        if context_mark is not None and "end of stream" in problem:
            mark = context_mark  # where the unfinished thing starts (a quote), not the end of the file
        raise SpecError(
            f"not valid YAML: {plain}",
            path=path,
            line=mark.line + 1 if mark else None,
            column=mark.column + 1 if mark else None,
        ) from None
    if node is None:
        raise SpecError("the file is empty; a spec is a YAML mapping with name, key and value", path=path, line=1)
    positions: dict[tuple, Position] = {}
    visited = [0]

    def walk(n: yaml.Node, loc: tuple) -> Any:
        positions.setdefault(loc, (n.start_mark.line + 1, n.start_mark.column + 1))
        visited[0] += 1  # aliases expand: a few lines can name billions of nodes
        if visited[0] > MAX_NODES or len(loc) > MAX_DEPTH:
            too = "nested too deeply" if len(loc) > MAX_DEPTH else f"more than {MAX_NODES} values once aliases expand"
            raise SpecError(f"not a spec: {too}", path=path, line=n.start_mark.line + 1,
                            column=n.start_mark.column + 1)
        default_tag = {yaml.MappingNode: "tag:yaml.org,2002:map", yaml.SequenceNode: "tag:yaml.org,2002:seq"}
        if type(n) in default_tag and n.tag != default_tag[type(n)]:
            raise SpecError(f"YAML tag {n.tag!r} is not supported in a spec", path=path, line=n.start_mark.line + 1,
                            column=n.start_mark.column + 1, field=".".join(map(str, loc)) or None)
        if isinstance(n, yaml.MappingNode):
            out: dict[Any, Any] = {}
            for key_node, value_node in n.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    raise SpecError("mapping keys must be plain names", path=path, line=key_node.start_mark.line + 1)
                key = key_node.value
                if key == "<<":
                    raise SpecError("YAML merge keys ('<<') are not supported; use an anchor for the whole side",
                                    path=path, line=key_node.start_mark.line + 1, column=key_node.start_mark.column + 1)
                if key in out:
                    raise SpecError(f"duplicate key {key!r}", path=path, line=key_node.start_mark.line + 1,
                                    column=key_node.start_mark.column + 1, field=".".join(map(str, loc + (key,))))
                # point a field at its key (where the user looks), its children at their own nodes
                positions[loc + (key,)] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
                out[key] = walk(value_node, loc + (key,))
            return out
        if isinstance(n, yaml.SequenceNode):
            return [walk(item, loc + (i,)) for i, item in enumerate(n.value)]
        if n.style is None and n.tag == "tag:yaml.org,2002:str" and re.fullmatch(YAML12_FLOAT, n.value):
            return PlainNumber(n.value)  # 1e-6: a number to YAML 1.2, text to PyYAML; the field decides
        if n.style is None and n.tag in _NUMBER_TAGS and not re.fullmatch(_NUMBER_TAGS[n.tag], n.value):
            value = yaml.SafeLoader("").construct_object(n, deep=True)
            raise SpecError(f"write numbers in decimal: YAML 1.1 reads {n.value!r} as {value!r}", path=path,
                            line=n.start_mark.line + 1, column=n.start_mark.column + 1,
                            field=".".join(map(str, loc)) or None)
        try:
            return yaml.SafeLoader("").construct_object(n, deep=True)
        except yaml.YAMLError as exc:  # e.g. an unknown tag (!foo) or YAML's '=' value key
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise SpecError(f"not a plain YAML value: {problem}", path=path, line=n.start_mark.line + 1,
                            column=n.start_mark.column + 1, field=".".join(map(str, loc)) or None) from None

    return walk(node, ()), positions


def _locate(loc: tuple, positions: dict[tuple, Position]) -> Position | None:
    loc = tuple(loc)
    while loc:
        if loc in positions:
            return positions[loc]
        loc = loc[:-1]
    return positions.get(())


def _explain(err: dict) -> str:
    kind = err.get("type", "")
    msg = err.get("msg", "invalid")
    if kind == "extra_forbidden":
        return "unknown field (not part of the spec schema; check the spelling)"
    if kind == "missing":
        return "required field is missing"
    if kind == "enum":
        expected = err.get("ctx", {}).get("expected", "")
        return f"{err.get('input')!r} is not allowed; expected one of {expected}"
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        return f"{err.get('input')!r} is not allowed; expected {expected}"
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    elif kind.endswith(("_type", "_parsing")) and "input" in err:  # "should be a valid integer": say what it got
        msg += f", got {err['input']!r}"
    return msg


def _error_loc(err: dict, data: Any) -> tuple:
    """Where a validation error points: pydantic's location, deepened to the field a model validator's message
    opens with ("'block' must be ...") when the spec sets that field there."""
    loc = tuple(x for x in err.get("loc", ()) if not (isinstance(x, str) and x.startswith("function-")))
    m = re.match(r"'([\w.]+)'[: ]", _explain(err))
    if m and "." in m.group(1) and not loc:  # a whole-spec rule naming the field it found wrong: 'value.residual'
        loc = tuple(m.group(1).split(".")[:-1])
        m = re.match(r"([\w]+)", m.group(1).split(".")[-1])
    if m:
        node = data
        for part in loc:
            if isinstance(node, dict):
                node = node.get(part)
            elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
                node = node[part]
            else:
                node = None
        if isinstance(node, dict) and m.group(1) in node:
            loc = loc + (m.group(1),)
    return loc


def _misspelling_hint(err: dict, errors: list[dict]) -> str:
    """For an unknown field beside a missing required one of the same mapping: the likely intended name."""
    loc = tuple(err.get("loc", ()))
    if err.get("type") != "extra_forbidden" or not loc or not isinstance(loc[-1], str):
        return ""
    missing = [
        e["loc"][-1] for e in errors
        if e.get("type") == "missing" and tuple(e.get("loc", ()))[:-1] == loc[:-1] and isinstance(e["loc"][-1], str)
    ]
    close = difflib.get_close_matches(loc[-1], missing, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}, which is required?"
    close = difflib.get_close_matches(loc[-1], _known_fields(loc[:-1]), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _known_fields(loc: tuple) -> list[str]:
    """The field names the schema allows in the mapping at ``loc`` (walked through FormatSpec's nested models)."""
    model = FormatSpec
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return []
        inner = [a for a in typing.get_args(field.annotation) or (field.annotation,) if isinstance(a, type)
                 and issubclass(a, BaseModel)]
        if not inner:
            return []
        model = inner[0]
    return list(model.model_fields)


def validate_data(data: Any, path: str, positions: dict[tuple, Position] | None = None) -> FormatSpec:
    """Validate parsed spec data; the first error becomes a SpecError with the field's position."""
    positions = positions or {}
    if not isinstance(data, dict):
        raise SpecError("a spec must be a YAML mapping (name, key, value, ...)", path=path, line=1)
    try:
        return FormatSpec.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        # report the most specific error first: the deepest location; at equal depth an unknown field before a
        # missing one, since a misspelled field is both and the unknown one is where the typo is
        err = max(errors, key=lambda e: (len(e.get("loc", ())), e.get("type") == "extra_forbidden"))
        loc = _error_loc(err, data)
        hint = _misspelling_hint(err, errors)
        pos = _locate(loc, positions)
        field = ".".join(str(x) for x in loc) or None
        others = [e for e in errors if e is not err]
        if hint.endswith("which is required?"):  # the missing field the hint names is this error's other half
            meant = tuple(err["loc"][:-1]) + (hint.split("'")[1],)
            others = [e for e in others if not (e.get("type") == "missing" and tuple(e.get("loc", ())) == meant)]
        same = [".".join(map(str, _error_loc(e, data))) for e in others if _explain(e) == _explain(err)]
        if others and len(same) == len(others):  # e.g. both sides of a spec whose value is the key's YAML alias
            more = f" (the same error at {', '.join(same)})"
        elif others:  # each other error where it is, so that one run shows them all
            def where(e: dict) -> str:
                eloc = _error_loc(e, data)
                epos = _locate(eloc, positions)
                return ".".join(map(str, eloc)) + (f" (line {epos[0]})" if epos else "")

            listed = [f"{where(e)}: {_explain(e)}" for e in others[:5]]
            rest = f"; and {len(others) - 5} more" if len(others) > 5 else ""
            more = f" (also {'; '.join(listed)}{rest})"
        else:
            more = ""
        msg = re.sub(r"^'\w+\.[\w.]+': ", "", _explain(err))  # a whole-spec rule's field: the error's own now
        msg += hint
        raise SpecError(
            msg + more, path=path, line=pos[0] if pos else None, column=pos[1] if pos else None, field=field,
        ) from None


def load_spec_text(text: str, path: str = "<string>", *, supported: bool = True) -> FormatSpec:
    """Parse and validate spec text; with ``supported``, also reject what this kvgen cannot build yet."""
    data, positions = _compose_with_positions(text, path)
    spec = validate_data(data, path, positions)
    if supported:
        from .support import check_supported

        check_supported(spec, path, positions)
    return spec


def load_spec(path: Union[str, Path], *, supported: bool = True) -> FormatSpec:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MissingSpecFile("no such file", path=str(p)) from None
    except UnicodeDecodeError as exc:
        raise SpecError(f"not UTF-8 text ({exc.reason})", path=str(p)) from None
    except OSError as exc:
        raise SpecError(f"cannot read: {exc.strerror}", path=str(p)) from None
    return load_spec_text(text, str(p), supported=supported)
