"""The accuracy ``moeflow plan`` prints beside its pick comes from the committed results: the file
it reads is what docs/results/plan/accuracy.py writes from them, and the closest cases are chosen
by the pick's modes and cost model."""
from __future__ import annotations

import importlib.util
import os

from moeflow.plan import accuracy

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _script():
    spec = importlib.util.spec_from_file_location("accuracy_script", os.path.join(ROOT, "docs/results/plan/accuracy.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_committed_accuracy_is_what_the_results_say():
    s = _script()
    with open(accuracy._PATH) as f:
        assert f.read() == s.text(s.build()), "regenerate: python docs/results/plan/accuracy.py"


def test_the_closest_cases_follow_the_picks_modes():
    pd = {"mode": "pd", "prefill": {"mode": "dwdp", "dp": 2}, "decode": {"mode": "afd"}}
    lines = accuracy.closest(pd, profiled=False)
    assert lines[0].startswith("dwdp: ") and "DWDP on GB200" in lines[0] and lines[1].startswith("afd: ")
    dep = accuracy.closest({"mode": "dep", "dp": 8}, profiled=False)
    assert len(dep) == 1 and "DeepSeek" in dep[0] and "decode" in dep[0] and "prefill" in dep[0]
    here = accuracy.closest({"mode": "dep", "dp": 4}, profiled=True)
    assert "Kendall's tau" in here[0] and "x of the predicted" in here[0] and "decide/README.md" in here[0]
