"""The engine interface stays narrow: at most twelve calls, a server's role forwards none by hand,
and nothing outside ``scheduler/`` reaches into another engine's request pool."""
from __future__ import annotations

import ast
import inspect
import pathlib
import re

from moeflow.engine.base import Engine
from moeflow.engine.decode_server import DecodeServer
from moeflow.engine.prefill_server import PrefillServer
from moeflow.engine.server_side import ServerSide

ROOT = pathlib.Path(__file__).resolve().parents[2] / "moeflow"


def test_the_engine_interface_has_at_most_twelve_calls():
    calls = sorted(n for n, v in vars(Engine).items() if not n.startswith("_") and callable(v))
    assert len(calls) <= 12, calls


def test_a_role_forwards_nothing_by_hand():
    """No method of a role is only a call of the inner engine's method of the same name."""
    by_hand = []
    for cls in (ServerSide, PrefillServer, DecodeServer):
        tree = ast.parse(inspect.getsource(cls))
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            if len(body) != 1 or not isinstance(body[0], (ast.Return, ast.Expr)) or body[0].value is None:
                continue
            v = body[0].value
            if isinstance(v, ast.Call):
                v = v.func
            if isinstance(v, ast.Attribute) and v.attr == fn.name and ast.unparse(v.value) == "self.inner":
                by_hand.append(f"{cls.__name__}.{fn.name}")
    assert not by_hand


def test_only_the_scheduler_touches_another_engines_pool():
    """An engine reads its own pool (``self.scheduler.pool``); another's is reached through its
    ``handoff_port`` (``scheduler/handoff/port.py``); ``admit_tokens`` is the pool's own."""
    reach = re.compile(r"(?<!self)(?<!moeflow)\.(scheduler|sched)\.pool\b|\._admit_tokens\b|\bpool\.leases\b")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in ROOT.rglob("*.py") if "scheduler" not in p.parts
             for i, line in enumerate(p.read_text().splitlines(), 1) if reach.search(line)]
    assert not found
