"""The simulator's stated modelling assumptions (issue 17): expert-load skew and its pricing by the
most loaded receiver, DSA's attention modes and TP replication, the baselines' collective, the
Default's token balance, the raw-mean workload fit, the SLO metrics, and speed."""
from __future__ import annotations

import time

import numpy as np
import pytest

from moeflow.experiment.serve import apply_overrides, load_experiment, parse_experiment
from moeflow.experiment.system import SimOptions, system_from_dict
from moeflow.measure.workload import WorkloadRequest
from moeflow.sim.attention_cost import AttentionOptions, attention_parts, batch_ratio, core_flops
from moeflow.sim.cost import AnalyticCost
from moeflow.sim.expert_load import ExpertLoads, dirichlet_alpha, place, popularity
from moeflow.sim.hardware import hardware_preset
from moeflow.sim.model_spec import model_preset
from moeflow.sim.run import build_cost, run_point, run_system
from moeflow.sim.shape import AttnShape

LIMITS = {"num_kv_blocks": 4096, "kv_block_size": 256, "max_num_seqs": 1024}
DS = model_preset("deepseek-v3.2")
ASCEND = hardware_preset("ascend-910c-die")


def test_dsa_flops_per_pair_in_each_mode():
    assert DS.attn_pair_flops == 278_528  # absorbed MQA: 2·128·(2·512 + 64)
    assert DS.attn_pair_flops_mha == 81_920  # masked MHA: 2·128·(128 + 64 + 128)
    short = AttnShape.of([(0, 1000, True)] * 3, DS.index_topk)  # every context within top-k
    mixed = AttnShape.of([(0, 1000, True), (0, 5000, True)], DS.index_topk)
    one_short = AttnShape.of([(0, 1000, True)], DS.index_topk).num_pairs
    assert core_flops(DS, short, "mqa") == 278_528 * short.num_sparse_pairs
    assert core_flops(DS, short, "mha_short_batch") == core_flops(DS, short, "mha_short_seqs") == 81_920 * short.num_pairs
    assert core_flops(DS, mixed, "mha_short_batch") == 278_528 * mixed.num_sparse_pairs  # one long seq: all MQA
    assert core_flops(DS, mixed, "mha_short_seqs") == (81_920 * one_short
                                                       + 278_528 * (mixed.num_sparse_pairs - one_short))
    assert mixed.num_short_pairs == one_short and mixed.max_context == 5000
    assert mixed.num_long_queries == 5000 - DS.index_topk
    with pytest.raises(ValueError, match="dsa_attention"):
        AttentionOptions("mha")


def test_tp_replicates_the_indexer_and_the_down_projections():
    shape = AttnShape.of([(0, 8192, True)], DS.index_topk)
    rep = attention_parts(AnalyticCost(DS, ASCEND, AttentionOptions(tp_replicates=True)), shape, 4, False)
    split = attention_parts(AnalyticCost(DS, ASCEND, AttentionOptions(tp_replicates=False)), shape, 4, False)
    one = attention_parts(AnalyticCost(DS, ASCEND), shape, 1, False)
    assert rep["indexer"] == pytest.approx(one["indexer"])  # every TP rank scores every pair
    assert split["indexer"] - ASCEND.launch_s == pytest.approx((one["indexer"] - ASCEND.launch_s) / 4)
    assert rep["projections"] > split["projections"] and rep["core"] == split["core"]
    assert DS.tp_replicated_params == 7168 * 1536 + 7168 * 576 + 1536 * 64 * 128 + 7168 * 128 + 7168 * 64
    # the indexer's vector work (head sum, top-k) runs pipelined with its int8 GEMM: the longer counts
    slow_vector = AnalyticCost(DS, ASCEND.with_overrides(vector_flops=1e12))
    assert attention_parts(slow_vector, shape, 1, False)["indexer"] > one["indexer"]
    # Fig. 5's comparison (1 x 32k vs 32 x 1k), core attention in MQA form: the paper measured 4.2x
    assert 3.5 < batch_ratio(AnalyticCost(DS, ASCEND), 1, ("core",)) < 4.5


def test_experts_s_many_is_experts_s():
    cost = AnalyticCost(DS, ASCEND)
    n = np.array([[0, 1, 17, 500], [2048, 4096, 65536, 3]])
    assert cost.experts_s_many(n, 16).tolist() == [[cost.experts_s(int(x), 16) for x in row] for row in n]


@pytest.mark.parametrize("a2a_bw", [None, 0.0])
def test_all_to_all_s_many_is_all_to_all_s(a2a_bw):
    """Both the collective's own bandwidth and (none given) the links'."""
    hw = ASCEND if a2a_bw is None else ASCEND.with_overrides(a2a_bw_Bps=a2a_bw)
    cost = AnalyticCost(DS, hw)
    nbytes = np.array([[0.0, 1.0, 3.5e6], [7.25e8, 1e9 / 3, 2.0 ** 40]])
    assert cost.all_to_all_s_many(nbytes).tolist() == [[cost.all_to_all_s(float(x)) for x in row] for row in nbytes]


def test_skew_model_statistics():
    e, cv = 256, 0.8
    pop = popularity(e, 400, cv, seed=1)
    assert np.allclose(pop.sum(axis=1), 1)
    measured = (pop.std(axis=1) / pop.mean(axis=1)).mean()
    assert measured == pytest.approx(cv, rel=0.05)
    assert (e - 1) / (e * dirichlet_alpha(e, cv) + 1) == pytest.approx(cv ** 2)
    contiguous, eplb = place(pop, 32, "contiguous"), place(pop, 32, "eplb")
    assert np.allclose(contiguous.sum(axis=1), 1) and np.allclose(eplb.sum(axis=1), 1)
    assert (eplb.max(axis=1) < contiguous.max(axis=1)).all()  # one redundant expert per device helps
    loads = ExpertLoads(e, 58, 16, cv, seed=3)
    draw = loads.draw(8 * 4096)
    assert draw.shape == (58, 16) and (draw.sum(axis=1) == 8 * 4096).all()
    assert loads.mean_imbalance == pytest.approx(float((draw.max(axis=1) / draw.mean(axis=1)).mean()))
    assert loads.mean_imbalance > 1.1 and ExpertLoads(e, 58, 16, 0.0).share_imbalance == 1.0
    # the same seed, the same popularity and draws
    assert (ExpertLoads(e, 58, 16, cv, seed=3).draw(8 * 4096) == draw).all()
    with pytest.raises(ValueError, match="no draw"):
        ExpertLoads(e, 58, 16, 0.0).draw(10)
    with pytest.raises(ValueError, match="too large"):
        dirichlet_alpha(16, 4.0)


def _cm384(**sim):
    cfg = load_experiment("configs/asap-cm384.yaml", tuple(f"sim.{k}={v}" for k, v in sim.items()))
    return cfg, build_cost(cfg)


def test_dep_prices_each_moe_layer_by_its_most_loaded_receiver():
    cfg, cost = _cm384(expert_load_cv=1.0, compute_jitter_cv=0)  # jitter off: the closed form
    spec = cfg.systems["dep"]
    from moeflow.sim.dep import DepSystem

    n = 6000
    rec = DepSystem(spec, cost).run([WorkloadRequest(0.0, n, 1)]).records[0]
    m, tp, ep = cost.model, 4, 32
    c = cost.for_system(spec.sim)
    loads = ExpertLoads(m.num_experts, m.num_moe_layers, ep, 1.0, "contiguous", 0).draw(n * m.top_k)
    shape = AttnShape.of([(0, n, True)], m.index_topk)
    share = (ep - 1) / ep
    total = c.head_s(shape, tp) + m.num_dense_layers * c.attention_s(shape, tp, True)
    for peak in loads.max(axis=1):
        total += (c.attention_s(shape, tp, False)
                  + c.all_to_all_s(max(c.dispatch_bytes(n) / tp, peak * c.dispatch_bytes(1) / m.top_k) * share)
                  + c.experts_s(int(peak), m.num_experts // ep) + c.host_dispatch_s
                  + c.all_to_all_s(max(c.combine_bytes(n) / tp, peak * c.combine_bytes(1) / m.top_k) * share))
    assert rec.ttft_s == pytest.approx(total, rel=1e-9)
    # a lone 6k prompt's layers are bound by its rank's sends and the experts' weight reads, which
    # skew does not change; a 30k prompt's expert compute is past the inflection, where it does
    base_cfg, _ = _cm384(compute_jitter_cv=0, expert_load_cv=0)
    one = [WorkloadRequest(0.0, 30000, 1)]
    skewed = DepSystem(spec, cost).run(one).records[0].ttft_s
    assert skewed > DepSystem(base_cfg.systems["dep"], build_cost(base_cfg)).run(one).records[0].ttft_s


def test_asap_workers_take_their_own_loads():
    cfg, cost = _cm384(expert_load_cv=1.0, compute_jitter_cv=0)  # jitter off: the closed form
    from moeflow.sim.asap import AsapSystem

    n = 6000
    spec = cfg.systems["asap"]
    sim = AsapSystem(spec, cost)
    rec = sim.run([WorkloadRequest(0.0, n, 1)]).records[0]
    m, c, e, t = cost.model, cost.for_system(spec.sim), 16, 4
    loads = ExpertLoads(m.num_experts, m.num_moe_layers, e, 1.0, "contiguous", 0).draw(n * m.top_k)
    shape = AttnShape.of([(0, n, True)], m.index_topk)
    lat, in_s, out_s = sim.workers.latency, sim.in_s, sim.out_s
    now = spec.layout.scheduler.max_batch_wait_s + m.num_dense_layers * c.attention_s(shape, t, True)  # a lone batch waits
    port = 0.0
    for row in loads:  # one batch through idle FIFO ports: the slowest worker's round trip, then the group's port
        sent = now + c.attention_s(shape, t, False)
        back = max(sent + p * in_s + lat + c.experts_s(int(p), m.num_experts // e) + p * out_s + lat for p in row)
        now = port = max(back, port + row.sum() * out_s / t)
    assert rec.ttft_s == pytest.approx(now + c.head_s(shape, t), rel=1e-9)
    assert sim.loads.mean_imbalance == pytest.approx(float((loads.max(axis=1) / loads.mean(axis=1)).mean()))


def test_the_baselines_collective_is_a_system_option():
    cfg, cost = _cm384(a2a_bw_GBps=49)
    c = cost.for_system(cfg.systems["dep"].sim)
    assert c.all_to_all_s(49e9) == pytest.approx(1 + ASCEND.a2a_latency_s)
    assert cost.for_system(SimOptions()) is cost  # nothing to refine: the same cost model
    with pytest.raises(ValueError, match="a2a_bw_GBps"):
        SimOptions(a2a_bw_GBps=0)
    with pytest.raises(ValueError, match="expert_placement"):
        SimOptions(expert_placement="random")


def test_default_places_requests_for_token_balance():
    """ASAP §5.1's Default "aggregates incoming requests into batches of similar total token
    counts": least_loaded gives ranks batches closer in tokens than round robin does."""
    from moeflow.core import Request, SamplingParams
    from moeflow.scheduler import make_scheduler

    lens = [8000, 300, 300, 300, 6000, 500, 4000, 200, 200, 3000, 900, 100]
    spreads = {}
    for placement in ("least_loaded", "round_robin"):
        spec = system_from_dict("d", {"mode": "dep", "dp": 4, "max_batch_tokens": 32768, "placement": placement,
                                      "engine": LIMITS})
        e = spec.engine
        sched = make_scheduler(spec.layout, e, 1 << 20)
        for i, n in enumerate(lens):
            sched.add(Request(f"r{i}", range(n), SamplingParams(max_tokens=1, ignore_eos=True)))
        tokens = [sum(s.num_tokens for s in w.batches[0].seqs) for w in sched.schedule(0.0)]
        spreads[placement] = max(tokens) / (sum(tokens) / len(tokens))
    assert spreads["least_loaded"] < spreads["round_robin"]
    assert load_experiment("configs/asap-cm384.yaml").systems["dep"].layout.placement == "least_loaded"


def test_overrides_and_per_metric_slo_search():
    d = {"model": "qwen3-235b-a22b", "hardware": "h200", "rps": [2, 8], "slo_ttft_s": 1.0,
         "workload": {"kind": "production", "length_scale": 0.25, "duration_s": 20, "seed": 3},
         "systems": {"dep": {"mode": "dep", "dp": 4, "max_batch_tokens": 8192, "engine": LIMITS,
                             "sim": {"super_kernel": False}}}}
    over = apply_overrides(d, ("sim.expert_load_cv=0.5", "workload.seed=4", "slo_ttft_s=2"))
    cfg = parse_experiment(over)
    assert cfg.systems["dep"].sim == SimOptions(super_kernel=False, expert_load_cv=0.5)
    assert cfg.workload.seed == 4 and cfg.slo_ttft_s == 2
    assert d["systems"]["dep"]["sim"] == {"super_kernel": False}  # the parsed dict is left as it was
    from moeflow.measure.slo import SloMetric
    from moeflow.sim.cli import slo_metrics

    metrics = slo_metrics("mean,p99")
    assert metrics == (SloMetric.parse("mean"), SloMetric.parse("p99")) and len(slo_metrics("all")) == 5
    res = run_system("dep", cfg, build_cost(cfg), cfg.rps, True, slo_metrics=metrics).result
    for m in metrics:
        rps = res["slo_rps_by_metric"][m.name]["median"]
        point = next(p for p in res["points"] if p["rps"] == rps)
        assert m.score(point) <= cfg.slo_ttft_s
    assert res["slo_rps_by_metric"]["p99"]["median"] <= res["slo_rps_by_metric"]["mean"]["median"]
    assert res["points"][0].get("sim_expert_imbalance", 0) > 1
    with pytest.raises(ValueError, match="KEY=VALUE"):
        apply_overrides(d, ("sim.expert_load_cv",))
    assert parse_experiment(apply_overrides(d, ("systems.dep.placement=round_robin",))).systems[
        "dep"].layout.placement == "round_robin"
    with pytest.raises(ValueError, match="NAME among"):
        apply_overrides(d, ("systems.nope.dp=2",))


@pytest.mark.parametrize("system", ["asap", "dep", "chunked"])
def test_five_simulated_minutes_at_20_rps_take_under_10_s(system):
    cfg, cost = _cm384()
    t0 = time.process_time()
    p, res = run_point(cfg.systems[system], cost, cfg, 20.0)
    assert time.process_time() - t0 < 10.0 and p["completed"] > 5000


def test_a_profiled_all_to_all_s_many_is_all_to_all_s():
    import os

    from moeflow.sim.profiled import ProfiledCost

    path = os.path.join(os.path.dirname(__file__), "..", "fixtures", "profile_cpu_here.json")
    cost = ProfiledCost.load(model_preset("tiny"), path)
    nbytes = np.array([0.0, 1.0, 3.5e6, 7.25e8, 1e9 / 3])
    assert cost.all_to_all_s_many(nbytes).tolist() == [cost.all_to_all_s(float(x)) for x in nbytes]
