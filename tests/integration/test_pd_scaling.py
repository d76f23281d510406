"""A pd deployment's prefill and decode instances X -> X', Y -> Y' while it serves: a joiner is
built beside the serving instances and takes prompts (prefill) or handoffs (decode) once built; the
last instances leave once what they hold is done (a prefill instance's leases read, a decode
instance's requests finished); outputs equal colocated's (fp32) before, during and after every
change; refusals say why; nothing is left in /dev/shm."""
from __future__ import annotations

import pytest

from moeflow import LLM
from moeflow.comm import list_segments
from moeflow.config import ConfigError

from parity import PARAMS, PROMPTS, assert_same, colocated_outputs

COLO = {"mode": "colocated"}
ASAP = {"mode": "asap", "attn_dp": 1, "moe_workers": 1}


def _segments(llm) -> list[str]:
    return [e.deployment_id for e in llm.engine.instances if getattr(e, "deployment_id", None)]


def test_instances_join_and_leave_on_both_sides_equal_to_colocated(checkpoints, monkeypatch):
    path = checkpoints("qwen3").path
    (want,) = colocated_outputs(checkpoints, ("qwen3",)).values()
    with LLM(path, dtype="float32", mode="pd", prefill=ASAP, decode=COLO, max_prefill_instances=2,
             max_decode_instances=2) as llm:
        eng = llm.engine
        up = llm.scale(prefill=2)
        assert (up["prefill"], up["decode"], up["in_progress"]) == (2, 1, False)
        assert up["events"][-1]["outcome"] == "done" and up["events"][-1]["seconds"] > 0, up
        out = llm.generate(PROMPTS, PARAMS)
        assert_same(out, want)
        assert len(eng.prefill) == 2 and eng.layout.prefill_instances == 2
        llm.scale(decode=2)
        assert_same(llm.generate(PROMPTS, PARAMS), want)
        placed: set[tuple[str, int]] = set()
        step = eng.step

        def step_and_see():  # where requests ran: both instances of each side took some
            placed.update(eng.where.values())
            return step()
        monkeypatch.setattr(eng, "step", step_and_see)
        assert_same(llm.generate(PROMPTS * 2, PARAMS), want * 2)
        monkeypatch.undo()
        assert {("prefill", 0), ("prefill", 1), ("decode", 0), ("decode", 1)} <= placed, placed
        # a change asked for with requests in flight: the last decode instance drains them, then leaves
        seen: list[int] = []

        def step_then_leave():
            if not seen and any(w == ("decode", 1) for w in eng.where.values()):
                seen.append(sum(w == ("decode", 1) for w in eng.where.values()))
                eng.scale(decode=1)
            return step()
        monkeypatch.setattr(eng, "step", step_then_leave)
        assert_same(llm.generate(PROMPTS * 2, PARAMS), want * 2)
        monkeypatch.undo()
        down = llm.scale(wait=True)
        assert seen and seen[0] > 0 and down["decode"] == 1 and len(eng.decode) == 1
        assert down["events"][-1]["outcome"] == "done"
        # and the prefill side the same way, with requests in flight on it
        llm.scale(prefill=1, wait=False)
        assert_same(llm.generate(PROMPTS, PARAMS), want)
        assert llm.scale(wait=True)["prefill"] == 1 and len(eng.prefill) == 1
        with pytest.raises(ConfigError, match=r"3 instances is outside \[1, 2\]"):
            llm.scale(prefill=3)
        with pytest.raises(ConfigError, match="one side at a time"):
            llm.scale(prefill=2, decode=2)
        with pytest.raises(ConfigError, match="one side at a time"):
            llm.scale(ffn=2)
        ids = _segments(llm)
    for dep_id in ids:
        assert list_segments(dep_id) == []


def test_a_fixed_pd_deployment_refuses_and_other_modes_have_no_sides(checkpoints):
    path = checkpoints("qwen3").path
    with LLM(path, dtype="float32", mode="pd", prefill=COLO, decode=COLO) as llm:
        with pytest.raises(ConfigError, match=r"2 instances is outside \[1, 1\].*max_prefill_instances"):
            llm.scale(prefill=2)
    with LLM(path, dtype="float32", mode="afd", attn_workers=1, ffn_workers=1) as llm:
        with pytest.raises(ConfigError, match="has no prefill or decode instances"):
            llm.scale(decode=2)
