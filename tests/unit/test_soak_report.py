"""The soak verdict on records built by hand: what counts as expected and what fails the run; where
the soak writes."""
from __future__ import annotations

import json

import pytest

from moeflow.bench.soak_report import classify, judge

KILL = {"pid": 9, "at_s": 100.0, "healed_at_s": 110.0}


def _a(kind="ok", sent=10.0, end=11.0, status=200, code=None, finish="length", note=None):
    return {"kind": kind, "sent_s": sent, "end_s": end, "status": status, "code": code, "retry_after": None,
            "ttft_s": None, "finish": finish, "note": note}


def test_classify():
    assert classify(_a(), KILL) == "ok"
    assert classify(_a("bad_model", status=404, finish=None, code="model_not_found"), KILL) == "refused"
    assert classify(_a("too_big", status=200), KILL) == "wrong"
    # in flight at the kill and ended soon after: the kill's error
    assert classify(_a(sent=99.0, end=101.0, status=500, code="engine_failed", finish=None), KILL) == "kill_500"
    # the same error long after the kill, or for a request sent after the restart: unexpected
    assert classify(_a(sent=99.0, end=130.0, status=500, code="engine_failed", finish=None), KILL) == "unexpected_5xx"
    assert classify(_a(sent=105.0, end=105.1, status=503, code="engine_unavailable", finish=None), KILL) == "restart_503"
    assert classify(_a(sent=150.0, end=150.1, status=503, code="engine_unavailable", finish=None), KILL) == "unexpected_5xx"
    assert classify(_a("ok_stream", status=200, code="engine_failed", sent=150, end=151), KILL) == "unexpected_5xx"
    assert classify(_a(note="ReadTimeout: "), KILL) == "unanswered"
    assert classify(_a("disconnect", note="disconnected", finish=None), KILL) == "disconnected"


def _record(rss_growth_mb: float, leftover_files: int = 0, num_samples: int = 40) -> dict:
    samples = []
    for i in range(num_samples):
        t = 5.0 * i
        samples.append({"t": t, "health": 200, "shm": {"mb": 10.0, "files": 4, "deployments": 1},
                        "procs": {"1": {"role": "server", "rss_mb": 500 + rss_growth_mb * t / 195, "fds": 30},
                                  "2": {"role": "worker", "rss_mb": 800.0, "fds": 12}}})
    answers = [_a(), _a(sent=99.0, end=101.0, status=500, code="engine_failed", finish=None)]
    return {"kill": KILL, "samples": samples, "answers": answers,
            "after_shutdown": {"processes_left": [], "shm": {"mb": 0, "files": leftover_files, "deployments": 0}}}


def test_judge_passes_a_clean_run_and_names_each_failure():
    v = judge(_record(rss_growth_mb=2.0))
    assert v["pass"], v["checks"]
    json.dumps(v)  # plain types only: it goes into the result file
    assert v["heal_s"] == 10.0 and v["answers"] == {"ok": 1, "kill_500": 1}
    grown = judge(_record(rss_growth_mb=200.0))  # 40% of the server's RSS over the run
    assert not grown["pass"] and not grown["checks"]["bounded memory after warm-up"]
    assert not grown["memory"]["1"]["bounded"] and grown["memory"]["2"]["bounded"]
    left = judge(_record(2.0, leftover_files=3))
    assert not left["checks"]["nothing left after shutdown"]


def test_report_writes_the_figure_and_the_summary(tmp_path):
    from moeflow.bench.soak_report import write_report

    r = {**_record(2.0), "command": ["python", "-m", "moeflow", "serve", "--model", "tiny"], "duration_s": 200.0,
         "rps": 0.6, "length_scale": 0.1}
    r["verdict"] = judge(r)
    write_report(r, str(tmp_path / "soak"))
    text = (tmp_path / "soak.md").read_text()
    assert "PASS" in text and "moeflow serve --model tiny" in text and "soak.png" in text
    assert (tmp_path / "soak.png").stat().st_size > 10_000


def test_the_soak_writes_only_where_it_is_told(capsys):
    from moeflow.cli import main

    with pytest.raises(SystemExit) as e:  # no default under docs/results: --out is required
        main(["bench", "soak", "--duration-s", "1"])
    assert e.value.code == 2 and "--out" in capsys.readouterr().err


def test_a_restarted_worker_gets_its_own_warm_up():
    """A worker started by the restart at 100 s fills its caches over its first minute like the first
    one did; that ramp is not growth, but growth after its own first minute is."""
    def record(late_growth_mb: float) -> dict:
        r = _record(rss_growth_mb=2.0, num_samples=60)  # to 295 s: 135 s after its warm-up
        for s in r["samples"]:
            age = s["t"] - 100.0
            if age >= 0:  # ramp 300 MB over its first 50 s, then ``late_growth_mb`` over the rest
                rss = 600 + 300 * min(age, 50.0) / 50 + late_growth_mb * max(0.0, age - 60.0) / 135
                s["procs"]["3"] = {"role": "worker", "rss_mb": rss, "fds": 12}
        return r

    flat = judge(record(0.0))
    assert flat["memory"]["3"]["bounded"] and flat["pass"], flat["memory"]
    grown = judge(record(200.0))
    assert not grown["memory"]["3"]["bounded"] and not grown["checks"]["bounded memory after warm-up"], grown["memory"]
