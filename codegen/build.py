"""Build generated packages from specs: atomic, deterministic, written only when changed, and checkable.

Layout of an output directory (``generated/`` for the shipped specs)::

    generated/__init__.py          the package marker (kvgen.generated)
    generated/<name>/__init__.py   identity: NAME, SPEC_HASH, KVGEN_VERSION, SPEC_JSON
    generated/<name>/layout.py     page-size calculator
    generated/<name>/kernels.py    Triton kernels

Each format directory is rendered completely into a temporary directory beside it and then renamed into place, so
a reader sees the old package or the new one, never a mix.
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Union

from .errors import BuildError, MissingSpecFile, SpecError
from .loader import load_spec
from .render import render_files
from .spec import FormatSpec

PACKAGE_INIT = '"""Generated kvgen formats: one package per spec (see each package\'s header). Do not edit."""\n'


@dataclasses.dataclass
class BuildResult:
    name: str
    spec_path: Optional[str]
    out_dir: Path
    changed: bool
    diffs: dict[str, str] = dataclasses.field(default_factory=dict)  # file -> unified diff (check mode)


def find_specs(paths: Iterable[Union[str, Path]]) -> list[Path]:
    """Spec files named directly, or every *.yaml / *.yml inside the directories named, sorted."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found += sorted(list(p.glob("*.yaml")) + list(p.glob("*.yml")))
        elif p.exists():
            found.append(p)
        else:
            raise MissingSpecFile("no such file or directory", path=str(p))
    return found


def _current_files(directory: Path) -> dict[str, str]:
    if not directory.is_dir():
        return {}
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(directory.iterdir()) if p.is_file()
            and p.suffix == ".py"}


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one step (Linux renameat2 RENAME_EXCHANGE); False where that is not available."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _write_atomic_dir(target: Path, files: dict[str, str]) -> None:
    """Make ``target`` hold exactly ``files``: rendered into a temporary directory beside it, then swapped in.

    A reader sees the old package or the new one. Two builds racing for the same target both succeed: whoever
    renames second finds the other's result and, when it is the same, keeps it.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.new.", dir=target.parent))
    try:
        for name, text in files.items():
            with open(tmp / name, "w", encoding="utf-8", newline="\n") as fh:
                fh.write(text)
        for _ in range(50):
            if _current_files(target) == files:
                return  # another build wrote the same thing
            try:
                if target.exists():
                    if _exchange(tmp, target):  # tmp now holds the old package
                        return
                    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
                    os.rename(target, old / "pkg")
                    shutil.rmtree(old, ignore_errors=True)
                os.rename(tmp, target)
                return
            except FileNotFoundError:
                continue  # the target was moved by a concurrent build: look again
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    continue  # a concurrent build put its package in place first: look again
                raise
        raise BuildError(f"{target}: could not be replaced; other builds keep changing it")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_file_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
        fh.write(text)
    os.replace(tmp, path)


def build_spec(spec: FormatSpec, out_dir: Union[str, Path], *, check: bool = False,
               spec_path: Optional[str] = None) -> BuildResult:
    """Render one spec into ``out_dir/<name>``; with ``check``, only compare and report differences."""
    out = Path(out_dir)
    target = out / spec.name
    try:
        files = render_files(spec)
    except SpecError:
        raise
    except Exception as exc:  # a template bug: never show a Jinja traceback as if the spec were wrong
        raise BuildError(f"{spec.name}: kvgen failed to render this spec ({type(exc).__name__}: {exc}); "
                         "this is a kvgen bug, please report it with the spec") from exc
    current = _current_files(target)
    result = BuildResult(spec.name, spec_path, target, changed=current != files)
    if check:
        for name in sorted(set(files) | set(current)):
            old, new = current.get(name, ""), files.get(name, "")
            if name not in current:  # a whole file's diff says no more than this
                result.diffs[name] = f"{target / name}: missing (the spec generates {len(new.splitlines())} lines)\n"
            elif name not in files:
                result.diffs[name] = f"{target / name}: on disk, but the spec generates no such file\n"
            elif old != new:
                diff = difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                            f"{target / name} (on disk)", f"{target / name} (from spec)", n=1)
                result.diffs[name] = "".join(diff)
        return result
    if result.changed:
        _write_atomic_dir(target, files)
    return result


def _foreign_init(init: Path) -> bool:
    """Whether ``init`` exists and is not a package marker kvgen wrote (any version's)."""
    return init.exists() and not init.read_text(encoding="utf-8", errors="replace").startswith(
        PACKAGE_INIT.split(":")[0])


def _foreign_package(target: Path) -> bool:
    """Whether ``target`` exists and is not a format package kvgen generated (its ``__init__.py`` header)."""
    if not target.exists() and not target.is_symlink():
        return False
    init = target / "__init__.py"
    return not (target.is_dir() and init.is_file()
                and init.read_text(encoding="utf-8", errors="replace").startswith("# Generated by kvgen "))


def ensure_package_init(out_dir: Union[str, Path], check: bool = False) -> bool:
    """The package marker of an output directory; returns True when it is (or would be) changed. An
    ``__init__.py`` that kvgen did not write is never replaced (BuildError)."""
    init = Path(out_dir) / "__init__.py"
    if init.exists() and init.read_text(encoding="utf-8") == PACKAGE_INIT:
        return False
    if _foreign_init(init):
        raise BuildError(f"{init}: exists and is not kvgen's package marker; kvgen build will not replace it: "
                         "build into a directory of its own (-o DIR)")
    if not check:
        _write_file_atomic(init, PACKAGE_INIT)
    return True


def build_paths(paths: Iterable[Union[str, Path]], out_dir: Union[str, Path], *, check: bool = False,
                on_result=None, reserved: Optional[dict[str, Path]] = None,
                leftovers: bool = True) -> list[BuildResult]:
    """Validate every spec first (nothing is written when one is bad), then build each.

    ``reserved``: format names owned by other spec files (kvgen's shipped specs, when building into its own
    ``generated/``): a spec of such a name from another file is refused rather than replacing that format.
    ``leftovers``: with ``check`` and directories given, also report packages in ``out_dir`` that no spec builds
    (for an output directory the specs own, as ``specs/`` owns ``generated/``). A directory or ``__init__.py`` in
    ``out_dir`` that kvgen did not generate is never replaced (BuildError).
    """
    paths = list(paths)
    spec_files = find_specs(paths)
    if not spec_files:
        raise BuildError("no spec files (*.yaml) found in " + ", ".join(map(str, paths)))
    specs: list[tuple[Path, FormatSpec]] = []
    bad: list[SpecError] = []
    for p in spec_files:
        try:
            specs.append((p, load_spec(p)))
        except SpecError as exc:
            bad.append(exc)
    if bad:  # the first error in full, and every other file that fails, so that one run finds them all
        first = bad[0]
        if len(bad) > 1:
            names = ", ".join(str(e.path) for e in bad[1:])
            raise type(first)(f"{first.message} (and {len(bad) - 1} other spec file(s) fail: {names}; "
                              "`kvgen validate` shows each)", path=first.path, line=first.line, column=first.column,
                              field=first.field)
        raise first
    seen: dict[str, Path] = {}
    for p, spec in specs:
        if spec.name in seen:
            raise SpecError(f"format name {spec.name!r} is also used by {seen[spec.name]}", path=str(p),
                            field="name")
        owner = (reserved or {}).get(spec.name)
        if owner is not None and Path(p).resolve() != Path(owner).resolve():
            raise SpecError(f"format name {spec.name!r} is kvgen's shipped format ({owner}); building this spec "
                            "into kvgen's own generated/ would replace it: rename the format or pass -o DIR",
                            path=str(p), field="name")
        seen[spec.name] = p
        target = Path(out_dir) / spec.name
        if _foreign_package(target):
            raise BuildError(f"{target}: exists and was not generated by kvgen; kvgen build will not replace it: "
                             "rename the format or build into another directory (-o DIR)")
    results = []
    try:
        init_changed = ensure_package_init(out_dir, check=check)
        for p, spec in specs:
            r = build_spec(spec, out_dir, check=check, spec_path=str(p))
            results.append(r)
            if on_result:
                on_result(r)
    except OSError as exc:
        raise BuildError(f"cannot write {exc.filename or out_dir}: {exc.strerror}") from None
    if init_changed and check:
        results.append(BuildResult("__init__", None, Path(out_dir), True,
                                   {"__init__.py": f"{Path(out_dir) / '__init__.py'}: package marker missing or "
                                                   "different\n"}))
    if check and leftovers and all(Path(p).is_dir() for p in paths):
        # a package left behind by a spec that was removed or renamed
        for orphan in sorted(set(_generated_packages(out_dir)) - set(seen)):
            results.append(BuildResult(orphan, None, Path(out_dir) / orphan, True,
                                       {"": f"{Path(out_dir) / orphan}: no spec builds this package; remove it\n"}))
    return results


def _generated_packages(out_dir: Union[str, Path]) -> list[str]:
    out = Path(out_dir)
    if not out.is_dir():
        return []
    return [p.name for p in out.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))
            and (p / "__init__.py").is_file()]
