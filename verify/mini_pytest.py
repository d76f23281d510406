"""Run pytest-style tests where pytest is not installed (the GPU machine's python may lack it).

A stand-in ``pytest`` module with the few names the tests use (``mark.<name>``, ``mark.parametrize``,
``mark.skipif``, ``fixture``, ``skip``, ``raises``), fixtures from the
``conftest.py`` files between the current folder and each test file (by argument name; session,
module and function scope; yield fixtures torn down), plus ``tmp_path`` and ``tmp_path_factory``.
No plugins, hooks, assertion rewriting or output capture: a failure prints its traceback.

    python3 verify/mini_pytest.py [-m MARK | -m "not MARK"] [-x] [--collect-only] [--json FILE] PATH...

Exit status 0 iff nothing failed or errored (skips are fine). Standard library only.
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import itertools
import json
import os
import re
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path


# -- the stand-in pytest API -----------------------------------------------------------------

class Skipped(Exception):
    """``pytest.skip``, or a skip mark that applies."""


@dataclass(frozen=True)
class Mark:
    name: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:  # applied to a test (bare or configured)
            fn = args[0]
            fn.pytestmark = [*getattr(fn, "pytestmark", []), self]  # innermost decorator first
            return fn
        return Mark(self.name, args, kwargs)


class _Marks:
    def __getattr__(self, name: str) -> Mark:
        return Mark(name)


mark = _Marks()  # pytest.mark.<any name>


def fixture(fn=None, *, scope: str = "function", **_ignored):
    def wrap(f):
        f._mini_scope = scope
        return f
    return wrap(fn) if callable(fn) else wrap


def skip(reason: str = "") -> None:
    raise Skipped(reason)


class raises:
    def __init__(self, exc, match: str | None = None):
        self.exc, self.match, self.value = exc, match, None

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is None:
            raise AssertionError(f"DID NOT RAISE {self.exc}")
        if not issubclass(kind, self.exc):
            return False
        if self.match is not None and not re.search(self.match, str(value)):
            raise AssertionError(f"{self.match!r} does not match {str(value)!r}")
        self.value = value
        return True


def install() -> None:
    """Make ``import pytest`` (in tests and conftest files) import this module."""
    sys.modules["pytest"] = sys.modules[__name__]


# -- collection ------------------------------------------------------------------------------

@dataclass
class Item:
    id: str
    module: object
    fn: object
    params: dict
    marks: list


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)  # the first conftest answers `from conftest import ...`
    spec.loader.exec_module(mod)
    return mod


def _conftests(test_file: Path, root: Path) -> list[Path]:
    """conftest.py files from ``root`` down to the test's folder, outermost first."""
    dirs = [test_file.parent, *(d for d in test_file.parent.parents if d == root or root in d.parents)]
    return [d / "conftest.py" for d in reversed(dirs) if (d / "conftest.py").is_file()]


def _ids(values, argnames: list[str], ids) -> list[str]:
    def one(v, name, i):
        return str(v) if isinstance(v, (str, int, float, bool, type(None))) else f"{name}{i}"
    if ids is not None:
        return [str(i) for i in ids]
    if len(argnames) == 1:
        return [one(v, argnames[0], i) for i, v in enumerate(values)]
    return ["-".join(one(x, n, i) for x, n in zip(v, argnames)) for i, v in enumerate(values)]


def _expand(marks: list[Mark]) -> list[tuple[str, dict]]:
    """(id suffix, parameters) per case: the product of the parametrize marks, innermost first."""
    axes = []
    for m in marks:
        if m.name != "parametrize":
            continue
        names = [n.strip() for n in m.args[0].split(",")] if isinstance(m.args[0], str) else list(m.args[0])
        values = list(m.args[1])
        rows = [dict(zip(names, v if len(names) > 1 else (v,))) for v in values]
        axes.append(list(zip(_ids(values, names, m.kwargs.get("ids")), rows)))
    cases = []
    for combo in itertools.product(*axes):
        params = {k: v for _, p in combo for k, v in p.items()}
        cases.append(("-".join(i for i, _ in combo), params))
    return cases


def _selected(marks: list[Mark], expr: str | None) -> bool:
    negate = bool(expr) and expr.startswith("not ")
    return not expr or any(m.name == expr.removeprefix("not ").strip() for m in marks) != negate


def collect(paths: list[str], mark_expr: str | None, root: Path) -> tuple[list[Item], list, list[tuple[str, str]]]:
    """-> (items, conftest modules outermost first, (path, traceback) of files that did not import)."""
    files = []
    for p in map(Path, paths):
        files += sorted(p.rglob("test_*.py")) if p.is_dir() else [p]
    items, conftests, errors, loaded = [], [], [], {}
    for f in (f.resolve() for f in files):
        try:
            for c in _conftests(f, root):
                if c not in loaded:
                    sys.path.insert(0, str(c.parent))
                    loaded[c] = _load(c, "conftest" if not loaded else f"conftest_{len(loaded)}")
                    conftests.append(loaded[c])
            sys.path.insert(0, str(f.parent))
            mod = _load(f, f.stem)
        except Exception:  # noqa: BLE001  (a module that does not import is an error, not a crash)
            errors.append((str(f), traceback.format_exc()))
            continue
        mod_marks = getattr(mod, "pytestmark", [])
        mod_marks = list(mod_marks) if isinstance(mod_marks, (list, tuple)) else [mod_marks]
        rel = os.path.relpath(f, root)
        for name, fn in vars(mod).items():
            if not (name.startswith("test") and inspect.isfunction(fn)):  # imported ones too, as pytest does
                continue
            marks = [*getattr(fn, "pytestmark", []), *mod_marks]
            if _selected(marks, mark_expr):
                for suffix, params in _expand(marks):
                    items.append(Item(f"{rel}::{name}" + (f"[{suffix}]" if suffix else ""), mod, fn, params, marks))
    return items, conftests, errors


# -- running ---------------------------------------------------------------------------------

class TmpPathFactory:
    def __init__(self):
        self.base = Path(tempfile.mkdtemp(prefix="mini-pytest-"))

    def mktemp(self, name: str, numbered: bool = True) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.base)) if numbered else self.base / name


class Fixtures:
    """Fixture values by name, cached per scope; finalizers run when the scope ends."""

    def __init__(self, conftests: list):
        self.defs = {"tmp_path_factory": (lambda: TmpPathFactory(), "session"),
                     "tmp_path": (lambda tmp_path_factory: tmp_path_factory.mktemp("tmp"), "function")}
        for mod in conftests:
            self.defs.update(_fixtures_of(mod))
        self.cache = {"session": {}, "module": {}, "function": {}}
        self.finalizers = {"session": [], "module": [], "function": []}

    def value(self, name: str, module_defs: dict):
        fn, scope = module_defs.get(name) or self.defs.get(name) or (None, None)
        if fn is None:
            raise LookupError(f"fixture {name!r} not found (mini_pytest knows {sorted({**self.defs, **module_defs})})")
        scope = scope if scope in self.cache else "session"  # package/class scope: as long as the run
        if name not in self.cache[scope]:
            kwargs = {a: self.value(a, module_defs) for a in inspect.signature(fn).parameters}
            v = fn(**kwargs)
            if inspect.isgenerator(v):
                gen, v = v, next(v)
                self.finalizers[scope].append(lambda gen=gen: next(gen, None))
            self.cache[scope][name] = v
        return self.cache[scope][name]

    def end(self, scope: str) -> None:
        while self.finalizers[scope]:
            self.finalizers[scope].pop()()
        self.cache[scope].clear()


def _fixtures_of(mod) -> dict:
    return {n: (f, f._mini_scope) for n, f in vars(mod).items() if callable(f) and hasattr(f, "_mini_scope")}


def _skip_reason(marks: list[Mark]) -> str | None:
    for m in marks:
        if m.name == "skip":
            return m.kwargs.get("reason", m.args[0] if m.args else "unconditional skip")
        if m.name == "skipif" and any(bool(c) for c in m.args):
            return m.kwargs.get("reason", "skipif")
    return None


def run(items: list[Item], conftests: list, stop_first: bool) -> list[dict]:
    fixtures, results, module = Fixtures(conftests), [], None
    try:
        for item in items:
            if item.module is not module:
                fixtures.end("module")
                module, module_defs = item.module, _fixtures_of(item.module)
            t0, outcome, message = time.monotonic(), "passed", ""
            try:
                if (reason := _skip_reason(item.marks)) is not None:
                    raise Skipped(reason)
                kwargs = {a: item.params[a] if a in item.params else fixtures.value(a, module_defs)
                          for a in inspect.signature(item.fn).parameters}
                item.fn(**kwargs)
            except Skipped as e:
                outcome, message = "skipped", str(e)
            except Exception:  # noqa: BLE001
                outcome, message = "failed", traceback.format_exc()
            finally:
                fixtures.end("function")
            results.append({"id": item.id, "outcome": outcome, "seconds": round(time.monotonic() - t0, 3),
                            "message": message})
            print(f"{outcome.upper()} {item.id} ({results[-1]['seconds']:.2f} s)" +
                  (f": {message}" if outcome == "skipped" else ""), flush=True)
            if outcome == "failed":
                print(message, flush=True)
                if stop_first:
                    break
    finally:
        fixtures.end("module")
        fixtures.end("session")
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mini_pytest", description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+")
    p.add_argument("-m", dest="mark", default=None, help='run only tests with this mark ("not NAME": without it)')
    p.add_argument("-x", action="store_true", help="stop at the first failure")
    p.add_argument("--collect-only", action="store_true")
    p.add_argument("--json", default=None, metavar="FILE", help="write the counts and each test's outcome here")
    args = p.parse_args(argv)
    install()
    t0 = time.monotonic()
    items, conftests, errors = collect(args.paths, args.mark, Path.cwd().resolve())
    for path, tb in errors:
        print(f"ERROR collecting {path}\n{tb}", flush=True)
    results = [] if args.collect_only or (errors and args.x) else run(items, conftests, args.x)
    if args.collect_only:
        print("\n".join(i.id for i in items) + f"\n\n{len(items)} tests collected, {len(errors)} errors")
    counts = {k: sum(r["outcome"] == k for r in results) for k in ("passed", "failed", "skipped")}
    counts["errors"], counts["collected"] = len(errors), len(items)
    if not args.collect_only:
        print(", ".join(f"{v} {k}" for k, v in counts.items()) + f" in {time.monotonic() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**counts, "tests": results, "collection_errors": [p for p, _ in errors]}, f, indent=1)
    return 0 if not counts["failed"] and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
