"""FastAFD's predictor on made-up profiles: the three factors multiply, DBO overlaps attention with
the FFN only while the attention is the longer, and m micro-batches re-read the experts m times."""
from __future__ import annotations

import dataclasses

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
