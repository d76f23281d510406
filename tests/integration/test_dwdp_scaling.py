"""dwdp's ranks N -> N' while the deployment serves: a rank is an attention group and an expert holder
whose experts never move. One that joins copies a starting rank's residents out of its published
segment and pulls the rest as that rank does; one that leaves drains (or hands its requests over, with
the KV caches shared) and goes. Outputs equal colocated's (fp32) before, during and after every
change; nothing is left behind."""
from __future__ import annotations

import pytest

from moeflow import LLM
from moeflow.comm import list_segments
from moeflow.config import ConfigError

from parity import PARAMS, PROMPTS, assert_same, colocated_outputs, generate_while_draining


@pytest.mark.parametrize("shared", [False, True], ids=["drained", "handed-over"])
def test_dwdp_ranks_join_and_leave_equal_to_colocated(checkpoints, monkeypatch, shared):
    (want,) = colocated_outputs(checkpoints, ("qwen3",)).values()
    limits = dict(max_batch_tokens=64) if shared else dict(max_num_seqs=3)
    with LLM(checkpoints("qwen3").path, dtype="float32", mode="dwdp", dp=2, max_dp=4, share_kv_cache=shared,
             **limits) as llm:
        up = llm.scale(ep_size=4)  # two at once: copies of rank 0's residents and of rank 1's
        assert up["attention"] == 4 and up["capacity"] == 4 and up["events"][-1]["outcome"] == "done", up
        assert len(llm.engine.ranks) == len(llm.engine.scheduler.pool.groups) == 4
        assert_same(llm.generate(PROMPTS, PARAMS), want)
        llm.scale(attention=3)
        assert generate_while_draining(llm, monkeypatch, want, group=2) > 0  # rank 2 leaves holding requests
        down = llm.scale(wait=True)
        assert down["attention"] == 2 and down["events"][-1]["outcome"] == "done", down
        assert (down["events"][-1]["handed"] > 0) == shared, down
        assert sorted(w.index for w in llm.engine.deployment.workers) == [0, 1]
        # the same index joins again while requests are in flight
        llm.scale(attention=3, wait=False)
        assert_same(llm.generate(PROMPTS, PARAMS), want)
        assert llm.scale(wait=True)["attention"] == 3
        assert_same(llm.generate(PROMPTS, PARAMS), want)
        with pytest.raises(ConfigError, match="1 is fewer than 2: the 2 ranks the deployment started with hold every"):
            llm.scale(ep_size=1)
        with pytest.raises(ConfigError, match="mode dwdp has none; its ranks scale"):
            llm.scale(ffn=3)
        deployment, dep_id = llm.engine.deployment, llm.engine.deployment_id
    assert list_segments(dep_id) == []
    assert all(not w.process.is_alive() for w in deployment.workers)


def test_a_fixed_dwdp_deployment_refuses_to_scale(checkpoints):
    with LLM(checkpoints("qwen3").path, dtype="float32", mode="dwdp", dp=2) as llm:
        with pytest.raises(ConfigError, match=r"fixed while serving \(2\); start it with max_dp \(--max-dp\)"):
            llm.scale(ep_size=3)
