"""``moeflow plan`` over heterogeneous hardware: the --hardware and --price flags, the
heterogeneous variants beside each candidate, per-role memory, the cost of every answer, the
ranking per USD and the Pareto fronts."""
from __future__ import annotations

import pytest

from moeflow.config import ConfigError
from moeflow.plan import pareto
from moeflow.plan.candidates import Candidate, check_memory, with_hardware
from moeflow.plan.estimate import memory_gib
from moeflow.plan.hardware import HardwareChoice
from moeflow.plan.search import Slo, search
from moeflow.sim.model_spec import model_preset
from moeflow.sim.prices import DEFAULT_PRICES

MODEL = "qwen3-235b-a22b-fp8"


def test_the_hardware_flag():
    c = HardwareChoice.parse("gb200,attention=h200", "h200=3")
    assert (c.default, c.roles, c.prices) == ("gb200", (("attention", "h200"),), (("h200", 3.0),))
    assert HardwareChoice.parse("attention=h200,ffn=gb200").default == "h200"  # no bare preset: the first named
    assert HardwareChoice.parse("gb200,ffn=gb200").roles == ()  # a role on the default is no role of its own
    assert c.roles_for("afd") == {"attention": "h200"} and c.roles_for("pd") == {} and c.roles_for("dep") == {}
    for bad, why in (("gb200,gpu=h200", "'gpu' is not a role"), ("gb200,h200", "one default preset"),
                     ("attention=b300", "unknown hardware preset 'b300'"), ("cpu-here", "measured, not a constant")):
        with pytest.raises((ConfigError, ValueError), match=why):
            HardwareChoice.parse(bad)


def test_each_candidate_gets_its_heterogeneous_variant_and_each_role_its_own_memory():
    choice = HardwareChoice.parse("gb200,attention=h200")
    cands = with_hardware([Candidate("dep4", {"mode": "dep", "dp": 4}, 4, "aggregated"),
                           Candidate("afd_3a1f", {"mode": "afd", "attn_workers": 2, "ffn_workers": 2,
                                                        "topology": "all"}, 4, "aggregated")],
                          choice.roles_for)
    assert [c.name for c in cands] == ["dep4", "afd_3a1f", "afd_3a1f@attention=h200"]
    m = model_preset(MODEL)
    home, het = (check_memory(c, m, 186e9, 0.9, 2304, 8192, 256, 16, hbm_of=choice.hbm_bytes) for c in cands[1:])
    assert home.feasible and het.feasible
    assert het.kv_tokens["all"] < home.kv_tokens["all"]  # 141 GB of HBM per attention instance, not 186


def _pd_plan(price: str) -> list[dict]:
    """dep8 on H200 against pd dep4 -> dep4, homogeneous and with its decode side on GB200."""
    choice = HardwareChoice.parse("h200,decode=gb200", price)
    base = {"model": MODEL, "hardware": "h200", "slo_ttft_s": 3.0, "slo_metric": "p90", "slo_tpot_s": 0.05,
            "workload": {"kind": "fixed", "fixed_len": 2048, "output_len": 256, "num_requests": 40, "seed": 0}}
    cands = [Candidate("dep8", {"mode": "dep", "dp": 8}, 8, "aggregated"),
             Candidate("pd_dep4_dep4", {"mode": "pd", "prefill": {"mode": "dep", "dp": 4},
                                        "decode": {"mode": "dep", "dp": 4}}, 8, "pd")]
    m = model_preset(MODEL)
    cands = [check_memory(c, m, 141e9, 0.9, 2304, 8192, 256, 16, hbm_of=choice.hbm_bytes)
             for c in with_hardware(cands, choice.roles_for)]
    ranked = search(cands, base, Slo(3.0, 0.05, "p90"), None, 1, progress=None, confirm=0, top=0,
                    memory_gib=memory_gib(141e9, 0.9, 8), hbm_bytes=141e9, max_devices=8)
    by_name = {c.name: c for c in cands}
    for r in ranked:
        r["layout"] = {**by_name[r["name"]].system, **(r.get("system") or {})}
    pareto.price(ranked, choice, 256)
    return pareto.rank(ranked, "cost")


def test_a_heterogeneous_pick_wins_on_cost_once_its_hardware_is_cheap_and_loses_when_dear():
    cheap, dear = _pd_plan("gb200=0.01"), _pd_plan("gb200=1000")
    assert cheap[0]["name"] == "pd_dep4_dep4@decode=gb200"
    assert dear[-1]["name"] == "pd_dep4_dep4@decode=gb200" and dear[0]["name"] != cheap[0]["name"]
    het = cheap[0]
    lay = het["layout"]
    x, y = lay["prefill_instances"] * 4, lay["decode_instances"] * 4
    assert het["usd_per_hour"] == pytest.approx(x * DEFAULT_PRICES["h200"] + y * 0.01)
    assert het["requests_per_usd"] == pytest.approx(het["slo_rps"] * 3600 / het["usd_per_hour"])
    assert het["tps_per_device"] == pytest.approx(het["slo_rps"] * 256 / het["devices"])


def test_the_pareto_front_keeps_what_nothing_beats_on_both():
    rs = [{"name": n, "tps_per_user": u, "tps_per_device": d} for n, u, d in
          (("a", 50, 100), ("b", 40, 200), ("c", 40, 150), ("d", 60, 50), ("e", 30, 200))]
    assert [r["name"] for r in pareto.front(rs, "tps_per_device")] == ["d", "a", "b"]
