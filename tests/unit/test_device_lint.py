"""Every tensor factory in the runtime (model/, workers/, comm/) names its device, so the code stays
right on an accelerator even where the CPU tests cannot tell (indexing with a CPU tensor works on
the CPU and on meta, not on CUDA); a host tensor says ``device="cpu"`` (and why). The views of host
memory are listed with why."""
from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "moeflow")
PACKAGES = ("model", "workers", "comm")
FACTORIES = {"zeros", "ones", "empty", "full", "arange", "tensor", "as_tensor", "randn", "rand", "randint", "eye",
             "linspace", "Generator", "frombuffer"}

# (file, enclosing function, factory) -> why it may make a host tensor without saying so
# (frombuffer has no device argument: it views host memory)
ALLOWED = {
    ("comm/arena.py", "map", "frombuffer"): "the host payload arena is the mailbox's shared memory",
    ("comm/weights.py", "_view", "frombuffer"): "dwdp's weight store is host shared memory",
    ("comm/kv_arena.py", "__init__", "frombuffer"): "the KV handoff's flag table is host shared memory",
    ("comm/kv_arena.py", "heap", "frombuffer"): "a host KV staging heap is the arena's shared memory",
    ("comm/ipc_memory.py", "allocate", "frombuffer"): "the CPU rehearsal's memory by handle is a /dev/shm file",
    ("comm/ipc_memory.py", "open", "frombuffer"): "the CPU rehearsal's memory by handle is a /dev/shm file",
}


def _calls(path: str):
    """(enclosing function, factory name, has device=) for every torch factory call in ``path``."""
    with open(path) as f:
        tree = ast.parse(f.read())
    out = []

    def visit(node, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and \
                    isinstance(child.func.value, ast.Name) and child.func.value.id == "torch" and \
                    child.func.attr in FACTORIES:
                out.append((name, child.func.attr, any(k.arg == "device" for k in child.keywords), child.lineno))
            visit(child, name)

    visit(tree, "<module>")
    return out


def test_every_tensor_factory_names_its_device():
    offenders, used = [], set()
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT)
                for func, factory, has_device, line in _calls(path):
                    if has_device:
                        continue
                    key = (rel, func, factory)
                    if key in ALLOWED:
                        used.add(key)
                    else:
                        offenders.append(f"{rel}:{line} torch.{factory} in {func}() has no device=")
    assert not offenders, "tensor factories without a device (pass one, or allow it here with why):\n" + \
        "\n".join(offenders)
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"allowed exceptions that no longer exist (remove them): {stale}"
