"""The package's import graph: at most two circles, and no import runs up the layers that
docs/structure.md ("Import rules") lists. Read with ``ast``, so no module is imported.

An edge is any ``import`` statement in a module — at module level, inside a function, under
``if TYPE_CHECKING:`` alike: a lazy or type-only import still ties the two files together.
``from P import name`` is an edge to ``P.name`` when that is a module, else to ``P`` (as
import-linter counts); a relative import is resolved against the importing module's package.
"""
from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "moeflow")
MAX_CIRCLES = 2


def _modules() -> dict[str, tuple[str, bool]]:
    """module name -> (file, is a package's ``__init__``)."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            parts = os.path.relpath(os.path.join(folder, name[:-3]), ROOT).split(os.sep)
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (os.path.join(folder, name), is_package)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()

    def known(name: str) -> str | None:  # the module a dotted name lives in (an attribute's: its module)
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, (path, is_package) in modules.items():
        package = module if is_package else module.rpartition(".")[0]
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            edges[module] |= {t for t in map(known, targets) if t is not None and t != module}
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def _layers() -> list[list[str]]:
    """docs/structure.md's layers, low to high: the numbered list after "Layers, low to high"."""
    with open(os.path.join(ROOT, "docs", "structure.md")) as f:
        text = f.read()
    after = text.split("Layers, low to high", 1)[1]
    layers = []
    for line in after.splitlines()[1:]:
        if not re.match(r"^\d+\. ", line):
            if layers:
                break
            continue
        layers.append(re.findall(r"`([\w.]+)`", line.split(":", 1)[0]))
    return layers


def _layer_of(module: str) -> str:
    """``moeflow.engine.pd`` -> ``engine``; the package's own ``__init__`` -> ``moeflow``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_the_graph_reader_counts_every_kind_of_import():
    edges = _graph()
    assert "moeflow.model.kv_cache" in edges["moeflow.model.layers"]  # under TYPE_CHECKING
    assert "moeflow.engine.args" in edges["moeflow.cli"]  # at module level
    assert "moeflow.bench.demo" in edges["moeflow.cli"]  # inside a function, `from moeflow.bench import demo`
    assert "moeflow.comm.segment" in edges["moeflow.workers.launch"]  # `from moeflow.comm.segment import X`
    assert "moeflow" not in edges["moeflow.workers.launch"]  # `from moeflow import lifecycle`: the module only
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_at_most_two_import_circles():
    circles = _circles(_graph())
    assert len(circles) <= MAX_CIRCLES, (
        f"{len(circles)} import circles (at most {MAX_CIRCLES}):\n" + "\n".join(" <-> ".join(c) for c in circles))


def test_every_import_runs_down_or_sideways_the_layers():
    """No edge runs up docs/structure.md's layers (a circle's included: it could not close without
    one), and every top-level module or package of moeflow has its layer there."""
    layers = _layers()
    rank = {name: i for i, layer in enumerate(layers) for name in layer}
    edges = _graph()
    unplaced = sorted({_layer_of(m) for m in edges} - set(rank))
    assert not unplaced, f"docs/structure.md's layers lack {unplaced}"
    upward = sorted(f"{a} -> {b}" for a, bs in edges.items() for b in bs if rank[_layer_of(a)] < rank[_layer_of(b)])
    assert not upward, "imports that run up the layers of docs/structure.md:\n" + "\n".join(upward)
