"""``bench compare`` end to end on small deployments: interleaved repeats, intervals, ratios, SLO
throughput under every metric, capacity with a time split, provenance; ``--merge`` refuses to
mix commits."""
from __future__ import annotations

import json


from moeflow.cli import main

EXPERIMENT = """
title: smoke
model: MODEL
dtype: float32
workload: {kind: uniform, isl: 380, isl_ratio: 0.3, duration_s: 1, seed: 0}
rps: [20]
slo_ttft_s: 0.5
repeats: 2
min_requests: 6
# NOTE: the probe's cap is 16 x this; an AVX-512 Xeon served 60 requests of ~300 tokens at 960 rps
# unsaturated, so the probe starts where 2 cores saturate well under the cap on any machine seen
saturation_rps: 120
profile: PROFILE
systems:
  dep2: {mode: dep, dp: 2, engine: {max_model_len: 512}}
  asap: {mode: asap, attn_dp: 1, moe_workers: 1, min_batch_tokens: 64, max_batch_wait_s: 0.005,
         engine: {max_model_len: 512}}
compare: [[asap, dep2]]
"""
PROFILE = {"num_layers": 2, "num_experts": 8, "top_k": 2, "hidden_size": 64, "dtype": "float32",
           "attention": {"fit": {"c0": 1e-4, "per_token": 1e-6, "per_pair": 1e-9, "per_seq": 0.0}},
           "head": {"fit": {"c0": 0.0, "per_token": 1e-7, "per_sampled": 1e-5}},
           "experts": {"8": [[16, 1e-4], [1024, 2e-3]]}}


def test_compare_runs_every_system_interleaved_with_intervals(checkpoints, tmp_path):
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(PROFILE))
    cfg = tmp_path / "exp.yaml"
    cfg.write_text(EXPERIMENT.replace("MODEL", checkpoints("qwen3").path).replace("PROFILE", str(prof)))
    out, md = tmp_path / "out.json", tmp_path / "out.md"
    assert main(["bench", "compare", str(cfg), "--json", str(out), "--md", str(md), "--no-progress"]) == 0
    r = json.loads(out.read_text())
    assert r["provenance"]["commit"] and r["repeats"] == 2 and r["seeds"] == [0, 1] and r["dtype"] == "float32"
    for name, s in r["systems"].items():
        (p,) = s["points"]
        assert p["repeats"] == 2 and p["completed"] >= 12 and len(p["ttft_mean_s_ci"]) == 2
        assert p["ttft_mean_s_ci"][0] <= p["ttft_mean_s"] <= p["ttft_mean_s_ci"][1]
        assert {"mean", "p50", "p90", "p99", "attainment:0.95"} == set(s["slo_rps_by_metric"])
        sat = s["saturation"]
        assert sat["tok_s"]["n"] == 2 and 0 < sat["capacity_fraction"]["mean"] and sat["saturated"] is True
        probes = s["repeats"][0]["saturation"]["saturation_probes"]
        assert probes[0]["rps"] == 120 and [p["rps"] for p in probes] == [120 * 2 ** i for i in range(len(probes))]
        assert all(abs(sum(v.values()) - 1) < 1e-6 for v in sat["time_split"].values())
    (c,) = r["comparisons"]
    assert (c["a"], c["b"]) == ("asap", "dep2") and c["per_rate"][0]["verdict"] in (
        "distinguishable", "not distinguishable")
    text = md.read_text()
    assert "Mean TTFT (s)" in text and "asap vs dep2" in text and "fraction of capacity" in text
    # merging: one commit is fine; results of another commit are refused unless asked for
    other = dict(r, provenance={**r["provenance"], "commit": "0" * 40})
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert main(["bench", "compare", "--merge", str(out), str(out), "--json", str(tmp_path / "m.json")]) == 0
    assert main(["bench", "compare", "--merge", str(out), str(tmp_path / "other.json")]) == 2
    assert main(["bench", "compare", "--merge", str(out), str(tmp_path / "other.json"), "--allow-mixed",
                 "--json", str(tmp_path / "m2.json")]) == 0
    assert json.loads((tmp_path / "m2.json").read_text())["provenance"]["commit"].startswith("mixed")


def test_a_missing_profile_fails_before_any_measurement(tmp_path):
    import pytest

    cfg = tmp_path / "exp.yaml"
    cfg.write_text(EXPERIMENT.replace("MODEL", "tiny").replace("PROFILE", str(tmp_path / "nope.json")))
    with pytest.raises(FileNotFoundError, match="moeflow profile --model tiny"):
        main(["bench", "compare", str(cfg), "--json", str(tmp_path / "out.json")])
    assert not (tmp_path / "out.json").exists()
