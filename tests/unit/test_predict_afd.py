"""FastAFD's predictor on made-up profiles: the three factors multiply, DBO overlaps attention with
the FFN only while the attention is the longer, and m micro-batches re-read the experts m times."""
from __future__ import annotations

import dataclasses
import os

import pytest

from moeflow.predict.afd import Baseline, experts_s, predict

# experts op: 10 ms at 16 pairs (weights), +1 ms per 16 pairs after (16 local experts)
PROFILE = {"experts": {"16": [[16, 0.010], [32, 0.011], [64, 0.013], [1024, 0.073]]}}
BASE = Baseline(tpot_s=0.2, resident=10, attention=0.5, ffn=0.4, transport=0.0, overhead=0.1)


def test_experts_interpolate_and_shrink_below_the_table():
    assert experts_s(PROFILE, 48, 16) == pytest.approx(0.012)
    assert experts_s(PROFILE, 16, 16) == pytest.approx(0.010)
    assert experts_s(PROFILE, 4, 16) < 0.010 / 2  # 4 pairs touch at most 4 of 16 experts
    with pytest.raises(ValueError, match="no experts table for 8 local experts"):
        experts_s(PROFILE, 16, 8)


def kw(**over):
    return {"m": 2, "attn_workers": 1, "ffn_workers": 1, "served": 1, "local_experts": 16, "b_afd": 20,
            "num_layers": 4, "num_moe_layers": 4, "top_k": 2, **over}


def test_the_factors_multiply_and_m1_serializes():
    p = predict(BASE, PROFILE, **kw(m=1))
    a = 20 * 0.2 * 0.5 / 10 / 4  # per layer: 20 requests x 10 ms of attention per request per step / 4 layers
    assert p.attention_per_layer_s == pytest.approx(a)
    assert p.ffn_per_layer_s == pytest.approx(experts_s(PROFILE, 40, 16))
    assert p.t_afd_s == pytest.approx(4 * (a + p.ffn_per_layer_s))  # m = 1: nothing overlaps
    assert p.speedup == pytest.approx(p.b_ratio * p.t_ratio * p.node_factor)
    assert (p.b_ratio, p.node_factor) == (2.0, 0.5)


def test_dbo_hides_the_ffn_only_while_attention_is_longer():
    p2 = predict(BASE, PROFILE, **kw(m=2))
    a, f = p2.attention_per_layer_s, p2.ffn_per_layer_s
    assert a > f and p2.overlap_holds
    assert p2.t_afd_s == pytest.approx(4 * a + f / 2)  # the pipeline runs across layers: one fill per step
    assert f == pytest.approx(2 * experts_s(PROFILE, 20, 16))  # each micro-batch reads the weights again
    cheap = dataclasses.replace(BASE, attention=0.02)  # short contexts: the experts' weights dominate
    p = predict(cheap, PROFILE, **kw())
    assert not p.overlap_holds and p.t_afd_s == pytest.approx(4 * p.ffn_per_layer_s + p.attention_per_layer_s / 2)


def test_without_overlap_scheduling_the_engine_overhead_is_paid():
    on, off = predict(BASE, PROFILE, **kw()), predict(BASE, PROFILE, **kw(overlap_scheduling=False))
    assert off.t_afd_s - on.t_afd_s == pytest.approx(0.2 * 0.1)


def test_the_profile_attention_model_pays_fixed_costs_per_micro_batch_not_per_request():
    """Linear (FastAFD) scales the baseline's attention per request; "profile" adds the decode fit's
    growth from B_base to m micro-batches of B_AFD / m. Without a fixed part in the fit, and with a
    baseline whose attention side is exactly the fit's, the two agree; a fixed part the baseline
    divides among 10 requests is paid once per micro-batch by the profile model."""
    per_row = 0.001 + 2e-7 * 1025  # per layer and sequence at context 1024
    base = dataclasses.replace(BASE, attention=4 * 10 * per_row / BASE.tpot_s)  # 4 layers x 10 requests
    flat = {**PROFILE, "decode": {"fit": {"c0": 0.0, "per_seq": 0.001, "per_key": 2e-7}}}
    lin = predict(base, flat, **kw(), attention="linear")
    prof = predict(base, flat, **kw(), attention="profile", context=1024)
    assert prof.attention_per_layer_s == pytest.approx(lin.attention_per_layer_s)
    fixed = {**PROFILE, "decode": {"fit": {"c0": 0.005, "per_seq": 0.001, "per_key": 2e-7}}}
    base_fixed = dataclasses.replace(base, attention=4 * (0.005 + 10 * per_row) / BASE.tpot_s)
    lin = predict(base_fixed, fixed, **kw(b_afd=40), attention="linear")
    prof = predict(base_fixed, fixed, **kw(b_afd=40), attention="profile", context=1024)
    assert prof.attention_per_layer_s == pytest.approx(2 * 0.005 + 40 * per_row)  # m = 2 micro-batches of 20
    assert lin.attention_per_layer_s == pytest.approx(4 * (0.005 + 10 * per_row))  # the fixed part x B ratio
    with pytest.raises(ValueError, match="no decode fit"):
        predict(base, PROFILE, **kw(), attention="profile", context=1024)


def test_afds_resident_requests_are_what_bench_decode_gave_it(tmp_path):
    """B_AFD from afd's own memory plan and KV reservation (bench decode's sizing: the reservation
    grows with the group that prefills before the window) equals what session 7's afd runs held."""
    import json

    from moeflow.cli import main

    fixtures = os.path.join(os.path.dirname(__file__), "..", "fixtures")  # trimmed copies of docs/results' files
    runs = os.path.join(fixtures, "decode_afd_session7.json")
    out = tmp_path / "pred.json"
    assert main(["predict", "afd", "--baseline", runs, "--system", "dep2", "--profile",
                 os.path.join(fixtures, "profile_decode.json"), "--context", "2048", "8192", "--measured", runs,
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["predictions"]
    assert [(r["b_afd"], r["measured"]["b_afd"]) for r in rows] == [(30, 30), (8, 8)]
