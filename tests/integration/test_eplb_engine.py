"""Redundant experts (``num_redundant_experts``) in every mode that spreads experts, against the
colocated reference: real worker processes; a replicated expert's tokens go to one copy each."""
from __future__ import annotations

import random
import time

import pytest

from moeflow import LLM, SamplingParams
from moeflow.comm import list_segments

from parity import PARAMS, PROMPTS, assert_same, colocated_outputs


@pytest.fixture(scope="module")
def reference(checkpoints):
    return colocated_outputs(checkpoints, ("qwen3", "deepseek_v3"))


@pytest.mark.parametrize("name,layout", [
    ("qwen3", dict(mode="dep", dp=3, num_redundant_experts=2)),  # 10 slots over 3 ranks: 3/3/4
    ("qwen3", dict(mode="asap", attn_dp=2, moe_workers=2, num_redundant_experts=3, min_batch_tokens=8,
                   max_batch_tokens=128)),
    pytest.param("deepseek_v3", dict(mode="afd", attn_workers=2, ffn_workers=2, topology="all", num_redundant_experts=2),
                 marks=pytest.mark.slow),  # make test-slow: the live case below takes afd's attention-side path
    ("qwen3", dict(mode="afd", attn_workers=1, ffn_workers=3, topology="all", router="ffn", num_redundant_experts=4)),
])
def test_redundant_experts_match_colocated(checkpoints, reference, name, layout):
    with LLM(checkpoints(name).path, dtype="float32", **layout) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
    assert_same(outs, reference[name])


def test_bad_redundancy_is_refused_naming_the_numbers(checkpoints):
    path = checkpoints("qwen3").path
    with pytest.raises(ValueError, match="num_redundant_experts must be an int >= 0, got -2"):
        LLM(path, mode="dep", dp=2, num_redundant_experts=-2)
    with pytest.raises(ValueError, match="num_redundant_experts=1 needs topology 'all'"):
        LLM(path, mode="afd", attn_workers=2, ffn_workers=2, num_redundant_experts=1)
    with pytest.raises(ValueError, match=r"num_redundant_experts \(9\) is more than the model's 8 experts"):
        LLM(path, mode="dep", dp=2, num_redundant_experts=9)


def test_the_engine_counts_every_routed_token(checkpoints):
    """Each MoE layer routes every token a step feeds (prompts, then one per decode step), K pairs each."""
    path = checkpoints("qwen3").path
    with LLM(path, dtype="float32", mode="asap", attn_dp=2, attn_tp=2, moe_workers=2, num_redundant_experts=2) as llm:
        llm.generate(PROMPTS, PARAMS)
        x = llm.engine.expert_load
        load = llm.engine.load()
        cfg = llm.engine.model_config
    fed = sum(len(p) for p in PROMPTS) + (PARAMS.max_tokens - 1) * len(PROMPTS)
    assert x.total.sum(axis=1).tolist() == [fed * cfg.num_experts_per_tok] * cfg.num_moe_layers
    assert load.eplb_physical_experts == cfg.num_experts + 2
    assert [layer for layer, _ in load.eplb_balancedness] == [l for l in range(cfg.num_layers) if cfg.sparse_layers[l]]
    assert all(0 < b <= 1 for _, b in load.eplb_balancedness)


LIVE = dict(enable_eplb=True, eplb_config={"step_interval": 2, "window_size": 4})


@pytest.mark.parametrize("layout", [
    dict(mode="dep", dp=2, num_redundant_experts=2),
    dict(mode="asap", attn_dp=2, moe_workers=2, num_redundant_experts=3, min_batch_tokens=8, max_batch_tokens=128),
    dict(mode="afd", attn_workers=2, ffn_workers=2, topology="all", num_redundant_experts=2),
    pytest.param(dict(mode="afd", attn_workers=1, ffn_workers=3, topology="all", router="ffn", num_redundant_experts=2),
                 marks=pytest.mark.slow),  # the daemons' own replica choice: make test runs it with redundancy above
])
def test_outputs_stay_equal_across_live_rebalances(checkpoints, reference, layout):
    """Rebalances every 2 work items while the same prompts run again and again: every round equals
    colocated, several placements were switched to and retired, and nothing is left in /dev/shm."""
    with LLM(checkpoints("qwen3").path, dtype="float32", **LIVE, **layout) as llm:
        for _ in range(3):
            assert_same(llm.generate(PROMPTS, PARAMS), reference["qwen3"])
        history, deployment_id = llm.engine.eplb.history, llm.engine.deployment_id
    assert sum(r.retired_s is not None for r in history) >= 3
    assert all(r.balancedness_after > r.balancedness_before for r in history)
    assert list_segments(deployment_id) == []


def test_live_rebalancing_is_refused_where_it_cannot_run(checkpoints):
    path = checkpoints("qwen3").path
    with pytest.raises(ValueError, match="mode dwdp has no placement to rebalance"):
        LLM(path, mode="dwdp", dp=2, enable_eplb=True)
    with pytest.raises(ValueError, match="transport 'dist' has none"):
        LLM(path, mode="dep", dp=2, transport="dist", enable_eplb=True)
    with pytest.raises(ValueError, match="eplb_config.step_interval must be a positive int"):
        LLM(path, mode="dep", dp=2, enable_eplb=True, eplb_config={"step_interval": 0})
    with pytest.raises(ValueError, match=r"unknown keys \['windw_size'\]"):
        LLM(path, mode="dep", dp=2, enable_eplb=True, eplb_config={"windw_size": 3})


def test_rebalances_under_poisson_load_answer_every_request(checkpoints):
    """Poisson arrivals (40 rps, ragged prompts) into asap with rebalances every 3 work items: every
    request finishes without error, placements switch and retire while items are in flight, and
    every KV block and shared-memory segment comes back."""
    rng = random.Random(1)
    with LLM(checkpoints("qwen3").path, dtype="float32", mode="asap", attn_dp=2, moe_workers=2,
             num_redundant_experts=2, min_batch_tokens=8, max_batch_tokens=128, enable_eplb=True,
             eplb_config={"step_interval": 3, "window_size": 8}) as llm:
        engine, t, due = llm.engine, time.monotonic(), []
        for _ in range(40):
            t += rng.expovariate(40.0)
            prompt = [rng.randrange(3, 250) for _ in range(rng.choice((1, 5, 20, 60)))]
            due.append((t, llm.make_request(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))))
        finished, n = [], len(due)
        while len(finished) < n:
            while due and due[0][0] <= time.monotonic():
                engine.add_request(due.pop(0)[1])
            finished += engine.step().finished
        assert all(r.error is None and len(r.output_token_ids) == 8 for r in finished)
        pools = engine.scheduler.pool.groups
        assert all(g.allocator.num_free == g.allocator.num_blocks for g in pools)
        history, deployment_id = engine.eplb.history, engine.deployment_id
    assert sum(r.retired_s is not None for r in history) >= 2
    assert list_segments(deployment_id) == []


def test_an_idle_deployment_switches_once_its_moves_are_done(checkpoints, reference):
    """A rebalance begun as the last request ends switches while the server only checks its workers
    (dep: the ranks' reports are read between requests), and the next requests equal colocated."""
    with LLM(checkpoints("qwen3").path, dtype="float32", mode="dep", dp=2, num_redundant_experts=2, router_skew=1.0,
             enable_eplb=True, eplb_config={"step_interval": 1000, "window_size": 16}) as llm:
        llm.generate(PROMPTS, PARAMS)
        eplb = llm.engine.eplb
        eplb.since = eplb.config.step_interval  # due now: the next turn of its state machine begins one
        eplb.take([])
        assert eplb.phase == "moving"
        deadline = time.monotonic() + 10
        while eplb.phase == "moving" and time.monotonic() < deadline:
            llm.engine.check_workers()  # what an idle server's loop does
            time.sleep(0.01)
        assert eplb.phase != "moving" and eplb.history[-1].switched_s is not None
        lag = eplb.history[-1].switched_s - eplb.history[-1].started_s
        print(f"idle switch {lag:.3f} s after the move began (copies {eplb.history[-1].move_s:.3f} s)")
        outs = llm.generate(PROMPTS, PARAMS)
    with LLM(checkpoints("qwen3").path, dtype="float32", router_skew=1.0) as ref:
        assert_same(outs, ref.generate(PROMPTS, PARAMS))


def test_the_benchmarks_router_skew_is_applied_wherever_tokens_are_routed(checkpoints):
    """``router_skew`` tilts every router alike: colocated and afd whose daemons route agree, and the
    recorded load is more skewed than the model's own."""
    path = checkpoints("qwen3").path
    with LLM(path, dtype="float32", router_skew=1.5) as llm:
        refs = llm.generate(PROMPTS, PARAMS)
    with LLM(path, dtype="float32", mode="afd", attn_workers=1, ffn_workers=2, topology="all", router="ffn",
             router_skew=1.5) as llm:
        assert_same(llm.generate(PROMPTS, PARAMS), refs)
        skewed = llm.engine.expert_load.total
    plain = colocated_counts(path)
    assert _cv(skewed) > _cv(plain) + 0.2


def _cv(counts) -> float:
    share = counts / counts.sum(axis=1, keepdims=True)
    return float((share.std(axis=1) / share.mean(axis=1)).mean())


def colocated_counts(path):
    from moeflow.bench.router_load import measure
    return sum(measure(path, PROMPTS)[1])
