"""Deployments whose roles run on different hardware (FastAFD §2's heterogeneous deployment):
which roles a mode has, each role priced and budgeted on its own preset, what crosses between
presets riding the scale-out network, and what a deployment costs per hour."""
from __future__ import annotations

import dataclasses

import pytest

from moeflow.config import ConfigError
from moeflow.experiment.decode import load_decode_experiment
from moeflow.experiment.system import system_from_dict
from moeflow.layout import make_layout
from moeflow.sim.cost import AnalyticCost
from moeflow.sim.decode import simulate_decode
from moeflow.sim.hardware import PRESETS, SCALE_OUT_BW_Bps, between
from moeflow.sim.memory import GIB, plan_kv, role_budgets
from moeflow.sim.prices import DEFAULT_PRICES, cost_per_hour, parse_prices, role_devices
from moeflow.sim.run import build_cost, make_system

EXP = load_decode_experiment("configs/afd-hetero-gb200.yaml")
COST = build_cost(EXP)
GB200, H200, H100 = PRESETS["gb200"], PRESETS["h200"], PRESETS["h100"]


def _spec(**hardware):
    return system_from_dict("s", {"mode": "afd", "attn_workers": 3, "ffn_workers": 4, "topology": "all",
                                  "router": "ffn", "engine": {"memory_budget_gib": 155.9, "max_num_seqs": 1024},
                                  "hardware": hardware}, "qwen3-235b-a22b-fp8")


def test_a_mode_has_the_roles_it_splits_and_all():
    assert _spec(attention="h200").hardware_of("attention") == "h200" and _spec().hardware_of("ffn") is None
    assert _spec(all="h200", ffn="gb200").hardware_of("attention") == "h200"
    with pytest.raises(ConfigError, match="'prefill' is not a role of mode 'afd'.*attention"):
        _spec(prefill="h200")
    with pytest.raises(ConfigError, match="'ffn' is not a role of mode 'dep'.*only 'all'"):
        system_from_dict("d", {"mode": "dep", "dp": 2, "hardware": {"ffn": "h200"}})
    with pytest.raises(ConfigError, match="must map a role"):
        system_from_dict("d", {"mode": "dep", "dp": 2, "hardware": ["h200"]})


def test_each_role_is_priced_on_its_preset_and_the_link_between_is_the_scale_out_network():
    sim = make_system(_spec(attention="h200"), COST)
    assert sim.cost_of("attention").hw == H200 and sim.cost_of("ffn") is sim.cost and sim.cost.hw == GB200
    link = sim.link_cost("attention", "ffn").hw
    assert link.link_bw_Bps == SCALE_OUT_BW_Bps == 50e9 and link.mem_bw_Bps == H200.mem_bw_Bps
    assert between(GB200, GB200) is GB200
    assert make_system(_spec(), COST).link_cost("attention", "ffn") is COST  # one preset: its own links


def test_a_roles_budget_is_its_share_of_its_own_device():
    spec, budget = _spec(attention="h200"), 155.9 * GIB
    roles = role_budgets(spec, budget, lambda n: (n and PRESETS[n] or GB200).hbm_bytes)
    assert roles == {"attention": pytest.approx(budget * 141 / 186)}
    m, lay = COST.model, spec.layout
    plain = plan_kv(m, lay, budget, 8192, 1024)
    het = plan_kv(m, lay, budget, 8192, 1024, role_budgets=roles)
    per_token = m.kv_bytes_per_token_layer * m.num_layers
    assert plain.kv_tokens - het.kv_tokens == pytest.approx(budget * (1 - 141 / 186) / per_token, abs=1)
    # at 120 GiB a device, half the experts (106 GiB) fit a B200, not an H200's share (91 GiB)
    two, small = dataclasses.replace(lay, ffn_workers=2), 120 * GIB
    assert plan_kv(m, two, small, 8192, 1024).kv_tokens > 0
    with pytest.raises(ValueError, match="90.9.* too small for ffn0"):
        plan_kv(m, two, small, 8192, 1024,
                role_budgets=role_budgets(_spec(ffn="h200"), small, lambda n: (n and PRESETS[n] or GB200).hbm_bytes))


def test_heterogeneous_decode_takes_each_sides_rates():
    """Attention on the H200 (less memory, 0.6x the bandwidth) holds fewer requests and reads them slower."""
    ctx = 8192
    home = simulate_decode(EXP.systems["afd_28a4f"], COST, ctx, 4, 1, GB200.hbm_bytes)
    het = simulate_decode(EXP.systems["afd_28a4f_attention_h200"], COST, ctx, 4, 1, GB200.hbm_bytes)
    assert het["batch_per_group"] < home["batch_per_group"] and het["tpot_s"] > home["tpot_s"]
    assert het["devices_by_hardware"] == {"h200": 28, "gb200": 4}
    assert het["usd_per_hour"] == pytest.approx(28 * DEFAULT_PRICES["h200"] + 4 * DEFAULT_PRICES["gb200"])
    assert het["tokens_per_usd"] == pytest.approx(het["tok_s_per_device"] * 32 * 3600 / het["usd_per_hour"])


def test_what_a_deployment_costs():
    afd = make_layout("afd", attn_workers=6, ffn_workers=2)
    assert role_devices(afd, {"attention": "h200"}, "gb200") == {"h200": 6, "gb200": 2}
    pd = make_layout("pd", prefill={"mode": "dep", "dp": 2}, decode={"mode": "afd", "attn_workers": 3, "ffn_workers": 1},
                     prefill_instances=2)
    assert role_devices(pd, {"decode": "h100"}, "gb200") == {"gb200": 4, "h100": 4}
    assert role_devices(make_layout("dep", dp=4), {"all": "h100"}, "gb200") == {"h100": 4}
    assert cost_per_hour({"h200": 6, "gb200": 2}, {"gb200": 1.0}) == pytest.approx(6 * DEFAULT_PRICES["h200"] + 2.0)
    assert parse_prices("h200=3.5, gb200=6") == {"h200": 3.5, "gb200": 6.0}
    with pytest.raises(ConfigError, match="no price per device-hour for \\['h800'\\]: give --price h800=USD"):
        cost_per_hour({"h800": 1}, {})
    with pytest.raises(ConfigError, match="PRESET=USD"):
        parse_prices("h200")
    with pytest.raises(ConfigError, match="must be a number > 0"):
        parse_prices("h200=free")


def test_a_profiled_cost_has_no_presets_to_move_a_role_to():
    from moeflow.sim.cost import CostModel

    class Measured(AnalyticCost):  # stands for a profile: the base class's refusal
        on = CostModel.on
    with pytest.raises(ValueError, match="hardware per role needs the analytic cost"):
        make_system(_spec(attention="h200"), Measured(COST.model, GB200))
