"""asap's MoE workers E -> E' while the deployment serves, the way afd's FFN daemons scale
(``test_afd_scaling.py``): a joiner reads its experts from its peers and every attention worker (each
TP member too) routes to it from its next work item; a leaver goes after the items routed before the
switch; outputs equal colocated's (fp32) before, between and after every change, in flight too;
nothing is left behind."""
from __future__ import annotations

import pytest

from moeflow import LLM
from moeflow.comm import list_segments
from moeflow.config import ConfigError

from parity import PARAMS, PROMPTS, assert_same, colocated_outputs, generate_while_draining


@pytest.mark.parametrize("attn_dp,attn_tp", [(2, 1), (1, 2)])
def test_moe_workers_join_and_leave_equal_to_colocated(checkpoints, attn_dp, attn_tp):
    (want,) = colocated_outputs(checkpoints, ("qwen3",)).values()
    with LLM(checkpoints("qwen3").path, dtype="float32", mode="asap", attn_dp=attn_dp, attn_tp=attn_tp,
             moe_workers=2, max_moe_workers=3) as llm:
        assert_same(llm.generate(PROMPTS, PARAMS), want)
        up = llm.scale(moe=3)
        assert up["moe"] == 3 and not up["in_progress"] and up["events"][-1]["outcome"] == "done", up
        assert sorted(w.index for w in llm.engine.deployment.workers if w.role == "moe") == [0, 1, 2]
        assert_same(llm.generate(PROMPTS, PARAMS), want)
        llm.scale(ep_size=2, wait=False)  # SGLang's name; requests in flight while it changes
        assert_same(llm.generate(PROMPTS, PARAMS), want)
        down = llm.scale(wait=True)
        assert down["moe"] == 2 and down["events"][-1]["outcome"] == "done", down
        assert sorted(w.index for w in llm.engine.deployment.workers if w.role == "moe") == [0, 1]
        assert llm.engine.load().members == (("attention", attn_dp), ("moe", 2))  # groups, not processes
        with pytest.raises(ConfigError, match="mode asap has no ffn workers; its expert holders are moe"):
            llm.scale(ffn=3)
        with pytest.raises(ConfigError, match="moe=3 and ep_size=2 disagree"):
            llm.scale(moe=3, ep_size=2)
        dep_id = llm.engine.deployment_id
    assert list_segments(dep_id) == []


def test_a_joiner_that_would_not_fit_in_shared_memory_is_refused(checkpoints, monkeypatch):
    import moeflow.comm.space as space

    with LLM(checkpoints("qwen3").path, dtype="float32", mode="asap", attn_dp=1, max_attn_dp=2, moe_workers=1,
             max_moe_workers=2) as llm:
        monkeypatch.setattr(space, "free_bytes", lambda directory: 1 << 20)
        for kind in ("moe", "attention"):
            with pytest.raises(ConfigError, match=rf"scale {kind} 1 -> 2 needs \d+ bytes .*free space there"):
                llm.scale(**{kind: 2})
        monkeypatch.undo()
        assert llm.scale(moe=2)["moe"] == 2 and llm.scale(attention=2)["attention"] == 2


def test_a_fixed_asap_deployment_refuses_to_scale(checkpoints):
    with LLM(checkpoints("qwen3").path, dtype="float32", mode="asap", moe_workers=1) as llm:
        with pytest.raises(ConfigError, match="moe workers are fixed; start it with max_moe_workers"):
            llm.scale(moe=2)
    with pytest.raises(ConfigError, match=r"max_moe_workers must be >= moe_workers \(2\), got 1"):
        LLM(checkpoints("qwen3").path, dtype="float32", mode="asap", moe_workers=2, max_moe_workers=1)


@pytest.mark.parametrize("shared,tp", [(False, 1), (True, 1), (True, 2)], ids=["drained", "handed-over", "tp2"])
def test_attention_groups_join_and_leave_equal_to_colocated(checkpoints, monkeypatch, shared, tp):
    """D 1 -> 2 -> 1 -> 2, the leaver holding requests (they finish there, or with the KV caches
    shared are handed to group 0, their KV copied), then the expert side grows under the new groups:
    every output equal to colocated's. With T 2 a joining group meets in a world of its own."""
    (want,) = colocated_outputs(checkpoints, ("qwen3",)).values()
    # both groups hold some of the 6 prompts: 3 a group at most (drained), or 64 tokens a batch (handed
    # over: then group 0 has room for group 1's)
    limits = dict(max_batch_tokens=64, min_batch_tokens=1) if shared else dict(max_num_seqs=3)
    with LLM(checkpoints("qwen3").path, dtype="float32", mode="asap", attn_dp=1, max_attn_dp=2, moe_workers=2,
             max_moe_workers=3, share_kv_cache=shared, attn_tp=tp, **limits) as llm:
        up = llm.scale(attention=2)
        assert up["attention"] == 2 and up["events"][-1]["outcome"] == "done", up
        assert_same(llm.generate(PROMPTS, PARAMS), want)
        assert {w.index for w in llm.engine.deployment.workers if w.role == "attention"} == set(range(2 * tp))
        generate_while_draining(llm, monkeypatch, want)  # group 1 leaves with requests resident
        down = llm.scale(wait=True)
        assert down["attention"] == 1 and down["events"][-1]["outcome"] == "done", down
        assert (down["events"][-1]["handed"] > 0) == shared, down
        assert len(llm.engine.scheduler.pool.groups) == 1
        assert llm.scale(attention=2)["attention"] == 2  # the same index joins again, new buffers
        assert llm.scale(moe=3)["moe"] == 3  # a MoE worker that joins replies to the new group too
        assert_same(llm.generate(PROMPTS, PARAMS), want)
        with pytest.raises(ConfigError, match=r"3 is outside \[1, 2\] .*max_attn_dp"):
            llm.scale(attention=3)
        dep_id = llm.engine.deployment_id
    assert list_segments(dep_id) == []
