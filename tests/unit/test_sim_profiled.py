"""The profiled cost model (``sim/profiled.py``): tables interpolated, transport recovered from the
engine's own samples, decode rows priced by the decode fit, and the relative least-squares fit."""
from __future__ import annotations

import dataclasses

import pytest

from moeflow.sim.model_spec import model_preset
from moeflow.sim.profiled import ProfiledCost, fit_nonneg, interpolate
from moeflow.sim.shape import AttnShape


def test_profiled_cost_interpolates_tables_and_recovers_transport():
    assert interpolate([(10, 1.0), (20, 3.0)], 15) == 2.0
    assert interpolate([(10, 1.0), (20, 3.0)], 5) == 1.0  # the plateau below the first point
    assert interpolate([(10, 1.0), (20, 3.0)], 30) == 5.0  # linear beyond the last
    m = dataclasses.replace(model_preset("tiny"), gate_load_cv=0.0)  # no skew, no jitter: the samples have no barrier wait
    prof = {"compute_jitter_cv": 0.0, "model": "tiny", "num_layers": m.num_layers, "num_experts": m.num_experts, "top_k": m.top_k,
            "hidden_size": m.hidden_size,
            "attention": {"fit": {"c0": 1e-3, "per_token": 5e-5, "per_pair": 5e-8, "per_seq": 0.0}},
            "head": {"fit": {"c0": 0.0, "per_token": 2e-7, "per_sampled": 0.0}},
            "experts": {str(k): [[16, 0.004], [1024, 0.02], [32768, 0.7]] for k in (16, 8, 4)}}
    latency, bw = 2e-4, 1e9
    engine = {}
    for name, layout in (("asap", {"moe_workers": 1}), ("dep", {"dp": 2})):
        dummy = [{"prompt_len": 128, "ttft_s": 1.0}, {"prompt_len": 1024, "ttft_s": 9.0}]
        probe = ProfiledCost(m, {**prof, "engine": {n: {"layout": {}, "samples": dummy} for n in ("asap", "dep")}})
        local, share, moved = (16, 1.0, 1.0) if name == "asap" else (8, 0.5, 0.5)
        samples = []
        for n in (128, 1024, 4096):
            extra = m.num_layers * (2 * latency + (probe.dispatch_bytes(n) + probe.combine_bytes(n)) * moved / bw)
            samples.append({"prompt_len": n, "ttft_s": probe._stages_s(0, n, local, share) + extra})
        engine[name] = {"layout": layout, "samples": samples}
    cost = ProfiledCost(m, {**prof, "engine": engine})
    for name in ("asap", "dep"):
        assert cost.transport[name][0] == pytest.approx(latency, rel=1e-6)
        assert cost.transport[name][1] == pytest.approx(bw, rel=1e-6)
    assert cost.experts_s(512, 8) == pytest.approx(0.004 + 0.016 * (512 - 16) / (1024 - 16))
    with pytest.raises(ValueError, match="local experts"):
        cost.experts_s(512, 2)
    with pytest.raises(ValueError, match="does not match"):
        ProfiledCost(model_preset("qwen3-235b-a22b"), {**prof, "engine": engine})


def test_profiled_decode_rows_and_latency_come_from_decode_samples():
    """Decode rows are priced by the profile's decode fit, and a decode step (no bytes to speak of)
    pins the per-message latency that lone prompts cannot tell from a per-request constant."""
    m = dataclasses.replace(model_preset("tiny"), gate_load_cv=0.0)  # no skew, no jitter: the samples have no barrier wait
    prof = {"compute_jitter_cv": 0.0, "model": "tiny", "dtype": "float32", "num_layers": m.num_layers, "num_experts": m.num_experts,
            "top_k": m.top_k, "hidden_size": m.hidden_size,
            "attention": {"fit": {"c0": 1e-3, "per_token": 5e-5, "per_pair": 5e-8, "per_seq": 0.0}},
            "decode": {"fit": {"c0": 2e-4, "per_seq": 1e-4, "per_key": 3e-7}},
            "head": {"fit": {"c0": 0.0, "per_token": 2e-7, "per_sampled": 0.0}},
            "experts": {str(k): [[1, 0.001], [16, 0.004], [1024, 0.02], [32768, 0.7]] for k in (16, 8, 4)}}
    dummy = {n: {"layout": {}, "samples": [{"prompt_len": 128, "ttft_s": 1.0}, {"prompt_len": 1024, "ttft_s": 9.0}]}
             for n in ("asap", "dep")}
    probe = ProfiledCost(m, {**prof, "engine": dummy})
    assert probe.model.weight_bytes == probe.model.kv_bytes == probe.model.base_bytes == 4.0  # the profile's dtype
    decode = AttnShape.of([(2048, 1, True)] * 3)
    assert probe.attention_s(decode, 1, False) == pytest.approx(2e-4 + 3 * 1e-4 + 3 * 2049 * 3e-7)
    mixed = AttnShape.of([(2048, 1, True), (0, 512, True)])
    prompt = AttnShape.of([(0, 512, True)])
    assert probe.attention_s(mixed, 1, False) == pytest.approx(probe.attention_s(prompt, 1, False) + 1e-4 + 2049 * 3e-7)
    latency, bw, per_request = 2e-4, 1e9, 0.1
    engine = {}
    for name, layout in (("asap", {"moe_workers": 1}), ("dep", {"dp": 2})):
        local, share, moved = (16, 1.0, 1.0) if name == "asap" else (8, 0.5, 0.5)

        def extra(n: int) -> float:
            return m.num_layers * (2 * latency + (probe.dispatch_bytes(n) + probe.combine_bytes(n)) * moved / bw)
        samples = [{"prompt_len": n, "ttft_s": probe._stages_s(0, n, local, share) + extra(n) + per_request}
                   for n in (128, 1024, 4096)]
        decodes = [{"context": c, "tpot_s": probe._stages_s(c, 1, local, share) + extra(1)} for c in (512, 2048)]
        engine[name] = {"layout": layout, "samples": samples, "decode_samples": decodes}
    cost = ProfiledCost(m, {**prof, "engine": engine})
    without = ProfiledCost(m, {**prof, "engine": {n: {**e, "decode_samples": []} for n, e in engine.items()}})
    for name in ("asap", "dep"):
        assert cost.transport[name][0] == pytest.approx(latency, rel=0.02)
        assert without.transport[name][0] > 5 * latency  # the per-request constant lands on every message


def test_the_relative_fit_serves_every_decade_and_recovers_exact_data():
    """Samples of 4 ms to 4 s: plain least squares bends to the longest one's excess (as an
    8192-token prompt's attention did, pricing 32-token prompts at +93%); on relative errors every
    sample stays close. Noiseless linear data comes back exactly either way."""
    xs = [32, 128, 512, 2048, 8192]
    rows = [[1, n, n * n / 2] for n in xs]
    exact = [1e-4 + 1e-4 * n + 5e-8 * n * n / 2 for n in xs]
    for rel in (False, True):
        assert fit_nonneg(rows, exact, relative=rel) == pytest.approx([1e-4, 1e-4, 5e-8], rel=1e-6)
    bent = exact[:-1] + [exact[-1] * 1.3]  # the longest 30% above the model

    def worst(fit):
        return max(abs(sum(f * x for f, x in zip(fit, r)) / y - 1) for r, y in zip(rows, bent))
    assert worst(fit_nonneg(rows, bent, relative=True)) < worst(fit_nonneg(rows, bent))
