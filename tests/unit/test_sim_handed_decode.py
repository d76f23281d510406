"""Decode from handed-over KV (``simulate_handed_decode``, what ``moeflow plan`` estimates every
mode's decode side with) against the step systems' window (``simulate_decode``, what ``bench
decode``'s mirror measures): the same TPOT where both apply; and it runs the modes the window
cannot (asap, dwdp), whose decode a closed batch never reaches whole."""
from __future__ import annotations

import dataclasses

import pytest

from moeflow.experiment.decode import load_decode_experiment
from moeflow.layout import make_layout
from moeflow.sim.decode import simulate_decode, simulate_handed_decode
from moeflow.sim.run import build_cost

BENCH = load_decode_experiment("configs/afd-gb200.yaml")
COST = build_cost(BENCH)
HBM = COST.hw.hbm_bytes


@pytest.mark.parametrize("name", ["dep4", "afd_28a4f"])
@pytest.mark.parametrize("per_group", [1, 16])
def test_handed_over_decode_has_the_step_windows_tpot(name, per_group):
    spec = BENCH.systems[name]
    batch = per_group * spec.layout.num_groups
    window = simulate_decode(spec, COST, 8192, 4, 1, HBM, batch=batch)
    handed = simulate_handed_decode(spec, COST, 8192, 4, HBM, batch=batch)
    assert handed["batch_per_group"] == window["batch_per_group"] == per_group
    assert handed["tpot_s"] == pytest.approx(window["tpot_s"], rel=2e-3)
    assert handed["capacity_per_group"] >= window["capacity_per_group"]  # fewer tokens decoded: no fewer fit


@pytest.mark.parametrize("layout", [dict(mode="asap", attn_dp=2, moe_workers=2),
                                    dict(mode="dwdp", dp=4)])
def test_modes_without_a_step_window_decode_from_handed_over_kv(layout):
    spec = BENCH.systems["dep4"]
    spec = dataclasses.replace(spec, name=layout["mode"], layout=make_layout(**layout))
    with pytest.raises(ValueError, match="measures decode for"):
        simulate_decode(spec, COST, 8192, 4, 1, HBM)
    groups = spec.layout.num_groups
    small, large = (simulate_handed_decode(spec, COST, 8192, 4, HBM, batch=b * groups) for b in (1, 32))
    assert small["decode_tokens_per_request"] == 5 and 0 < small["tpot_s"] <= large["tpot_s"]
    assert large["tok_s_per_device"] > small["tok_s_per_device"]  # batching amortises the weights read
    with pytest.raises(ValueError, match="split evenly"):
        simulate_handed_decode(spec, COST, 8192, 4, HBM, batch=groups + 1)
