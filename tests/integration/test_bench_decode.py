"""``moeflow bench decode`` of dep and afd on one budget, then ``moeflow predict afd`` from the dep
run and a quick stage profile: the result files, intervals, step splits and factors."""
from __future__ import annotations

import json

import yaml

from moeflow.cli import main


def test_decode_bench_then_predict(checkpoints, tmp_path):
    path = checkpoints("qwen3").path
    engine = {"memory_budget_gib": 0.03, "max_num_seqs": 4}
    cfg = {"model": path, "dtype": "float32", "contexts": [24], "steps": 2, "warmup_steps": 1, "repeats": 2,
           "systems": {"dep2": {"mode": "dep", "dp": 2, "max_batch_tokens": 64, "engine": engine},
                       "afd": {"mode": "afd", "max_batch_tokens": 64, "engine": engine}},
           "compare": [["afd", "dep2"]]}
    (tmp_path / "decode.yaml").write_text(yaml.safe_dump(cfg))
    out, md = tmp_path / "decode.json", tmp_path / "decode.md"
    assert main(["bench", "decode", str(tmp_path / "decode.yaml"), "--json", str(out), "--md", str(md)]) == 0
    res = json.loads(out.read_text())
    assert res["provenance"]["commit"] and res["comparisons"][0]["verdict"] in ("distinguishable", "not distinguishable")
    dep, afd = res["results"]["dep2"]["24"], res["results"]["afd"]["24"]
    assert dep["batch"] == 8 and afd["batch"] == 4  # max_num_seqs per group: 2 dep ranks, 1 afd instance
    assert all(len(r["runs"]) == 2 and r["tpot_s"]["n"] == 2 for r in (dep, afd))
    assert afd["split"]["ffn0"]["ffn"] > 0 and afd["split"]["afd_attention0"]["ffn"] == 0
    assert dep["split"]["dep0"]["attention"] > 0 and dep["split"]["dep0"]["ffn"] > 0
    assert "| afd / dep2 | 24 |" in md.read_text()
    prof = tmp_path / "profile.json"
    assert main(["profile", "--model", path, "--quick", "--repeats", "1", "--dtype", "float32", "--json", str(prof)]) == 0
    # the quick profile times experts for every local count a placement of the test model can hold
    pred = tmp_path / "pred.json"
    assert main(["predict", "afd", "--baseline", str(out), "--system", "dep2", "--profile", str(prof),
                 "--context", "24", "--micro-batches", "1", "2", "--measured", str(out), "--json", str(pred)]) == 0
    rows = json.loads(pred.read_text())["predictions"]
    assert [r["m"] for r in rows] == [1, 2] and rows[1]["measured"]["system"] == "afd"
    for r in rows:
        assert abs(r["speedup"] - r["b_ratio"] * r["t_ratio"] * r["node_factor"]) < 1e-9 and r["b_afd"] == 4
    # an afd run given its batch (bench decode --batch) is predicted at that batch, not the plan's
    assert main(["predict", "afd", "--baseline", str(out), "--system", "dep2", "--profile", str(prof),
                 "--context", "24", "--batch", "2", "--attention", "profile", "--json", str(pred)]) == 0
    got = json.loads(pred.read_text())
    assert [r["b_afd"] for r in got["predictions"]] == [2] and got["attention_model"] == "profile"
