"""Round three of the simulator: compute jitter at barriers, skew on by default, sequence-split attention."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moeflow.experiment.serve import load_experiment
from moeflow.experiment.system import SimOptions
from moeflow.measure.workload import WorkloadRequest
from moeflow.sim.attention_cost import AttentionOptions, attention_parts
from moeflow.sim.cost import AnalyticCost
from moeflow.sim.dep import DepSystem
from moeflow.sim.hardware import PRESETS
from moeflow.sim.jitter import Jitter
from moeflow.sim.model_spec import PRESETS as MODELS
from moeflow.sim.run import build_cost
from moeflow.sim.shape import AttnShape


def test_factors_have_mean_one_and_the_stated_cv():
    f = Jitter(0.1, 0).factors(200_000)
    assert f.mean() == pytest.approx(1.0, abs=0.002) and f.std() / f.mean() == pytest.approx(0.1, rel=0.02)
    assert (Jitter(0.0, 0).factors(3, 4) == 1).all()


def test_the_slowest_of_n_grows_with_n_and_off_is_the_plain_max():
    j = Jitter(0.1, 0)
    assert 1 < j.expected_max(2) < j.expected_max(8) < j.expected_max(32)
    times = np.array([1.0, 2.0, 0.0])
    assert (Jitter(0.0, 0).slowest(5, times) == 2.0).all()
    slow = j.slowest(10_000, times, group=4)
    assert slow.mean() > 2.0  # a rank's TP group waits for its slowest member
    assert (j.slowest(10, np.zeros(3)) == 0).all()  # no work: nobody waits


def _dep_ttft(cv: float, n_requests: int) -> float:
    cfg = load_experiment("configs/asap-cm384.yaml", (f"sim.compute_jitter_cv={cv}", "sim.expert_load_cv=0"))
    sim = DepSystem(cfg.systems["dep"], build_cost(cfg))
    recs = sim.run([WorkloadRequest(0.0, 4096, 1) for _ in range(n_requests)]).records
    return max(r.ttft_s for r in recs)


def test_the_barrier_loss_grows_with_the_busy_ranks():
    """One busy rank waits only for its own TP group and the expert devices; eight busy ranks
    wait for the slowest of all 32 dies at every layer."""
    lone = _dep_ttft(0.079, 1) / _dep_ttft(0.0, 1)
    full = _dep_ttft(0.079, 8) / _dep_ttft(0.0, 8)
    assert 1.0 < lone < full, (lone, full)


def test_the_defaults_come_from_the_hardware_and_the_model():
    assert PRESETS["ascend-910c-die"].compute_jitter_cv == pytest.approx(0.079)
    assert PRESETS["ascend-910c-die"].flops == pytest.approx(376e12)  # CM384 paper: 752 per chip, two dies
    assert MODELS["deepseek-v3.2"].gate_load_cv == pytest.approx(1.28)
    cfg = load_experiment("configs/asap-cm384.yaml")
    sim = DepSystem(cfg.systems["dep"], build_cost(cfg))
    assert sim.jitter.cv == pytest.approx(0.079) and not sim.loads.balanced
    with pytest.raises(Exception, match="compute_jitter_cv"):
        SimOptions(compute_jitter_cv=1.5)


def test_sequence_split_gathers_kv_and_has_no_all_reduce():
    m, hw = MODELS["deepseek-v3.2"], PRESETS["ascend-910c-die"]
    shape = AttnShape.of([(0, 8192, True)] * 4, m.index_topk)
    seq = attention_parts(AnalyticCost(m, hw, AttentionOptions(parallel="sequence")), shape, 4, False)
    ten = attention_parts(AnalyticCost(m, hw, AttentionOptions(parallel="tensor")), shape, 4, False)
    assert "tp_allreduce" not in seq and seq["kv_allgather"] > 0 and ten["tp_allreduce"] > 0
    # replicated down-projections and indexer: sequence splits the work the tensor split repeats
    assert seq["indexer"] < ten["indexer"] / 3 and sum(seq.values()) < sum(ten.values())
    one = attention_parts(AnalyticCost(m, hw, AttentionOptions(parallel="sequence")), shape, 1, False)
    assert sum(v for k, v in seq.items() if k != "kv_allgather") < sum(one.values()) / 3
    with pytest.raises(ValueError, match="attention_parallel"):
        AttentionOptions(parallel="heads")


def test_a_profiled_cost_refuses_a_modelled_attention_split():
    cfg = load_experiment("configs/validate-cpu-here.yaml")
    with pytest.raises(ValueError, match="attention_parallel applies to the analytic cost only"):
        build_cost(cfg).for_system(SimOptions(attention_parallel="sequence"))


def test_the_profiled_transport_leaves_the_barrier_to_the_simulator():
    """A lone request's dep step waits for the slowest expert device; that wait is the simulator's
    (jitter, skew), so the transport fitted from the same samples is smaller with it than without."""
    import json

    from moeflow.sim.model_spec import model_preset
    from moeflow.sim.profiled import ProfiledCost

    cfg = load_experiment("configs/validate-cpu-here.yaml")
    with open(cfg.target.profile) as f:
        profile = json.load(f)
    m = model_preset("tiny")
    quiet = ProfiledCost(dataclasses.replace(m, gate_load_cv=0.0), {**profile, "compute_jitter_cv": 0.0})
    noisy = ProfiledCost(m, {**profile, "compute_jitter_cv": 0.27})
    assert noisy.all_to_all_s(1e6) < quiet.all_to_all_s(1e6)


def test_the_best_colocated_baseline_is_the_fastest_dep_of_the_run():
    from types import SimpleNamespace

    from moeflow.sim.decode import against_best

    systems = {n: SimpleNamespace(layout=SimpleNamespace(mode=n[:3])) for n in ("dep4", "dep8", "afd_a")}
    results = {"dep4": {8: {"tok_s_per_device": 100.0}}, "dep8": {8: {"tok_s_per_device": 120.0}},
               "afd_a": {8: {"tok_s_per_device": 150.0}}}
    assert against_best(results, systems, [8]) == {"afd_a": [{"context": 8, "best": "dep8", "tok_s_ratio": 1.25}]}


def test_resident_experts_fill_the_budget_and_no_more():
    from moeflow.layout import layout_from_dict
    from moeflow.sim.memory import GIB, most_resident_experts, plan_kv

    m = MODELS["deepseek-r1"]
    lay = layout_from_dict({"mode": "dwdp", "dp": 4, "max_batch_tokens": 32768})
    per = most_resident_experts(m, lay, 155.9 * GIB, 32768, 1024)
    assert 64 < per < 256

    def kv(k: int) -> int:
        try:
            return plan_kv(m, dataclasses.replace(lay, experts_per_rank=k), 155.9 * GIB, 32768, 1024).kv_tokens
        except ValueError:  # the weights alone overflow the budget
            return 0
    assert kv(per) >= 32768 > kv(per + 1)


def test_a_dep_point_reports_its_step_split():
    from moeflow.sim.run import run_point

    cfg = load_experiment("configs/asap-cm384.yaml")
    p, _ = run_point(cfg.systems["dep"], build_cost(cfg), cfg, 2.0, num_requests=60)
    split = p["sim_split"]
    assert set(split) == {"attention", "ffn", "transport", "wait"} and 0.5 < sum(split.values()) <= 1 + 1e-9
    assert split["wait"] > 0  # jitter, skew and unequal batches: the ranks wait at the barriers


@pytest.mark.parametrize("overrides", [(), ("systems.asap.comm_threads=false",),
                                       ("sim.compute_jitter_cv=0", "sim.expert_load_cv=0")])
def test_asap_prices_its_moe_workers_at_once_as_the_loop_does(monkeypatch, overrides):
    """The array fast path of ``AsapSystem`` against the worker-by-worker loop: the same run."""
    from moeflow.sim.asap import AsapSystem
    from moeflow.sim.run import run_point

    cfg = load_experiment("configs/asap-cm384.yaml", overrides)
    cost = build_cost(cfg)
    fast, _ = run_point(cfg.systems["asap"], cost, cfg, 8.0, num_requests=60)
    monkeypatch.setattr(AsapSystem, "fast", False)
    slow, _ = run_point(cfg.systems["asap"], cost, cfg, 8.0, num_requests=60)
    assert fast["completed"] == slow["completed"] == 60
    assert fast == slow
