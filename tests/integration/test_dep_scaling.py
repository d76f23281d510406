"""dep's ranks N -> N' while the deployment serves: a rank is an attention group and an expert holder
at once. One that joins reads its experts from its peers, then takes part in the barrier from the
global step after the switch with a group of its own; one that leaves drains first (its requests
finish there, in the barrier), then its experts move and it goes. Outputs equal colocated's (fp32)
before, during and after every change; nothing is left behind."""
from __future__ import annotations

import pytest

from moeflow import LLM
from moeflow.comm import list_segments
from moeflow.config import ConfigError

from parity import PARAMS, PROMPTS, assert_same, colocated_outputs, generate_while_draining


def test_dep_ranks_join_and_leave_equal_to_colocated(checkpoints, monkeypatch):
    (want,) = colocated_outputs(checkpoints, ("qwen3",)).values()
    with LLM(checkpoints("qwen3").path, dtype="float32", mode="dep", dp=2, max_dp=3, max_batch_tokens=64,
             max_num_seqs=8) as llm:
        assert_same(llm.generate(PROMPTS, PARAMS), want)
        up = llm.scale(ep_size=3)
        assert up["dep"] == 3 and not up["in_progress"] and up["events"][-1]["outcome"] == "done", up
        assert len(llm.engine.ranks) == len(llm.engine.scheduler.pool.groups) == 3
        assert_same(llm.generate(PROMPTS, PARAMS), want)
        assert generate_while_draining(llm, monkeypatch, want, group=2) > 0  # rank 2 leaves holding requests
        down = llm.scale(wait=True)
        assert down["dep"] == 2 and down["events"][-1]["outcome"] == "done", down
        assert sorted(w.index for w in llm.engine.deployment.workers) == [0, 1]
        # the same index joins again while requests are in flight: a new rank, new buffers
        llm.scale(attention=3, wait=False)
        assert_same(llm.generate(PROMPTS, PARAMS), want)
        assert llm.scale(wait=True)["dep"] == 3
        assert_same(llm.generate(PROMPTS, PARAMS), want)
        with pytest.raises(ConfigError, match=r"1 dep workers of 4 slots hold 4 experts, fewer than the model's 8"):
            llm.scale(ep_size=1)
        with pytest.raises(ConfigError, match="a leaving rank's requests finish there"):
            llm.scale(attention=2, drain=False)
        deployment, dep_id = llm.engine.deployment, llm.engine.deployment_id
    assert list_segments(dep_id) == []
    assert all(not w.process.is_alive() for w in deployment.workers)
