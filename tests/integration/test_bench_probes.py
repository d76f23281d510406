"""The session 7-8 probes as bench commands, on a small checkpoint and one small shape each:
``bench contention`` (decode attention beside a process running the experts op) and ``bench
front-cpu`` (the front process's CPU while dep 2 and afd decode) write what docs/results/afd.md reads."""
from __future__ import annotations

import json

from moeflow.cli import main


def test_bench_contention_times_the_block_alone_beside_the_experts_and_again(checkpoints, tmp_path):
    out = tmp_path / "contention.json"
    assert main(["bench", "contention", "--model", checkpoints("qwen3").path, "--shapes", "2x40",
                 "--repeats", "2", "--settle-s", "0.5", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"].values()
    assert set(row) == {"alone_ms", "beside_experts_ms", "alone_again_ms"} and min(row.values()) > 0


def test_bench_front_cpu_measures_both_modes(checkpoints, tmp_path):
    out = tmp_path / "front_cpu.json"
    assert main(["bench", "front-cpu", "--model", checkpoints("qwen3").path, "--shapes", "2x16",
                 "--max-tokens", "3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["dep", "afd"]
    assert all(0 < r["front_cpu_s"] and 0 < r["decode_step_s"] < r["wall_s"] for r in rows)


def test_bench_kv_transfer_moves_the_bytes_and_writes_its_table(tmp_path):
    """The handoff between two worker processes by both paths, checked (the decode side's slots
    equal the prefill side's), timed beside memcpy, with the workers' own copy time: in place the
    prefill worker copies nothing."""
    out, md = tmp_path / "kv.json", tmp_path / "kv.md"
    assert main(["bench", "kv-transfer", "--layouts", "gqa,mla", "--sizes-mib", "0.25", "--repeats", "2",
                 "--layers", "2", "--cache", "hot", "--json", str(out), "--md", str(md)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["layout"], r["path"]) for r in rows] == [("gqa", "in-place"), ("gqa", "staged"), ("mla", "in-place"),
                                                        ("mla", "staged")]
    assert all(0 < r["worker_in_ms"] <= r["copy_in_ms"] for r in rows)
    assert all(0 < r["worker_out_ms"] <= r["copy_out_ms"] for r in rows if r["path"] == "staged")
    assert all(r["worker_out_ms"] == r["copy_out_ms"] == 0 for r in rows if r["path"] == "in-place")
    assert "| gqa | in-place | 0.25 |" in md.read_text() and "| gqa | staged | 0.25 |" in md.read_text()


def test_bench_decode_ops_counts_a_step_per_path_and_batch(tmp_path):
    """One colocated decode step counted: on the batched path its ops do not grow with the batch and
    it syncs once; the table names where each sync comes from."""
    out, md = tmp_path / "ops.json", tmp_path / "ops.md"
    assert main(["bench", "decode-ops", "--batches", "1,6", "--paths", "batched,gather", "--json", str(out),
                 "--md", str(md)]) == 0
    rows = {(r["path"], r["batch"]): r for r in json.loads(out.read_text())["rows"]}
    assert abs(rows[("batched", 6)]["ops"] - rows[("batched", 1)]["ops"]) <= 2
    assert rows[("batched", 6)]["syncs"] == 1 and rows[("gather", 6)]["ops"] > rows[("gather", 1)]["ops"] + 50
    assert "| batched | 6 |" in md.read_text() and "workers/runner.py" in md.read_text()  # the one sync: the tokens
