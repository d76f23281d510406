"""The handoff's lifecycle on both sides: injected copy failures under load, leases that run out
while the decode side is full, aborts at every stage; every request ends with an answer or an
explicit error and every block returns (zero stranded blocks on either side)."""
from __future__ import annotations

import pytest

from moeflow import LLM, SamplingParams
from moeflow.core import Request

from test_pd_engine import assert_all_returned

COLO = {"mode": "colocated"}


def _prompts(n: int, length: int = 24) -> list[list[int]]:
    return [[(7 * i + j) % 200 + 1 for j in range(length + i % 5)] for i in range(n)]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_injected_transfer_failures(checkpoints, monkeypatch, policy):
    """5% of copies fail (SGLang's failure injection): nothing crashes, every request ends; with
    recompute every answer equals the reference's, with fail the failed ones say why."""
    monkeypatch.setenv("MOEFLOW_PD_FAIL_PROB", "0.05")
    path = checkpoints("qwen3").path
    prompts, sp = _prompts(60), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with LLM(path, dtype="float32") as ref:
        expected = [o.outputs[0].token_ids for o in ref.generate(prompts, sp)]
    with LLM(path, dtype="float32", mode="pd", prefill=COLO, decode=COLO, kv_load_failure_policy=policy) as llm:
        outs = llm.generate(prompts, sp)
        stats = llm.engine.kv.stats
        assert_all_returned(llm.engine)
    assert stats.failures > 0  # the seeded injection hit some copies
    failed = [o for o in outs if o.error is not None]
    if policy == "recompute":
        assert not failed and stats.recomputes == stats.failures
        assert [o.outputs[0].token_ids for o in outs] == expected
    else:
        assert len(failed) == stats.failures and all("KV copy" in o.error for o in failed)
        assert all(o.outputs[0].token_ids == e for o, e in zip(outs, expected) if o.error is None)
        assert all(len(o.outputs[0].token_ids) == 1 for o in failed)  # the first token came from the prefill side


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_lease_expires_while_decode_is_full(checkpoints, policy):
    """The decode cache holds one request's whole life (reserve admission, 8 blocks): the second
    handoff waits past its lease; its prefill blocks are freed and the policy decides."""
    with LLM(checkpoints("qwen3").path, dtype="float32", mode="pd", prefill=COLO, decode=COLO, num_kv_blocks=8,
             kv_admission="reserve", kv_lease_s=0.05, kv_load_failure_policy=policy) as llm:
        sp = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
        outs = llm.generate(_prompts(2, 30), sp)
        stats = llm.engine.kv.stats
        assert_all_returned(llm.engine)
    assert stats.lease_expiries >= 1
    if policy == "recompute":
        assert all(o.error is None and len(o.outputs[0].token_ids) == 80 for o in outs)
    else:
        assert sum("lease expired" in (o.error or "") for o in outs) == stats.lease_expiries
        assert any(o.error is None and len(o.outputs[0].token_ids) == 80 for o in outs)


def test_abort_at_every_stage(checkpoints):
    """Requests aborted while prefilling, waiting for decode room, mid-copy and decoding: nothing stays held."""
    with LLM(checkpoints("qwen3").path, dtype="float32", mode="pd", num_kv_blocks=16,
             prefill={"mode": "asap", "attn_dp": 1, "moe_workers": 1, "min_batch_tokens": 8},
             decode={"mode": "afd", "attn_workers": 1, "ffn_workers": 1}) as llm:
        e = llm.engine
        sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        ids = [f"r{i}" for i in range(12)]
        for rid, p in zip(ids, _prompts(12, 40)):
            e.add_request(Request(rid, p, sp))
        seen = set()
        for _ in range(400):
            e.step()
            states = {rid: (h.state if (h := e.handoffs.get(rid)) else e.where.get(rid, ("done",))[0]) for rid in ids}
            for rid, s in states.items():
                if s not in seen and s != "done":  # abort the first request seen in each stage
                    seen.add(s)
                    e.abort(rid)
            if not e.has_unfinished():
                break
        for rid in ids:
            e.abort(rid)
        e.drain()
        for _ in range(50):  # abandoned stages close once their copies answered
            e.step()
        assert {"prefill", "decode"} <= seen
        assert_all_returned(e)


def test_the_trace_shows_each_handoff_between_the_two_sides(checkpoints, tmp_path):
    """trace=True: each instance's worker tracks under its side, and one handoff track between them
    with each request's wait for decode room and its one copy (in place: the decode members read
    the prefill cache), in order."""
    import json

    from moeflow.engine.trace import write_chrome_trace

    with LLM(checkpoints("qwen3").path, dtype="float32", mode="pd", trace=True,
             prefill={"mode": "asap", "attn_dp": 1, "moe_workers": 1, "min_batch_tokens": 8},
             decode={"mode": "afd", "attn_workers": 1, "ffn_workers": 1}) as llm:
        llm.generate(_prompts(3), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        spans = llm.engine.collect_spans()
    tracks = {s.track.partition("/")[0] for s in spans}
    assert any(t.startswith("prefill0:") for t in tracks) and any(t.startswith("decode0:") for t in tracks)
    hand = [s for s in spans if s.track == "handoff/prefill0->decode0"]
    assert len(hand) == 6 and {s.args["request"] for s in hand} == {"0", "1", "2"}
    for rid in ("0", "1", "2"):
        wait, into = sorted((s for s in hand if s.args["request"] == rid), key=lambda s: s.start_s)
        assert (wait.name, into.name) == ("handoff: wait for decode room",
                                          "handoff: in, from the prefill cache (sent to done)")
        assert wait.end_s <= into.start_s <= into.end_s
    copies = [s for s in spans if s.name in ("kv copy out", "kv copy in")]  # the members' own, inside those
    assert len(copies) == 3 and all(s.name == "kv copy in" and 0 < s.end_s - s.start_s for s in copies)
    write_chrome_trace(spans, str(tmp_path / "t.json"))
    names = {e["args"]["name"] for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]
             if e["name"] == "process_name"}
    assert "handoff" in names


def test_bench_decode_measures_the_decode_instances(checkpoints, tmp_path):
    """bench decode of a pd deployment: its requests resident on the decode instances, the window
    timed there (the pools it sizes the batch from are the decode side's)."""
    import json

    from moeflow.cli import main

    out = tmp_path / "d.json"
    assert main(["bench", "decode", "--model", checkpoints("qwen3").path, "--dtype", "float32", "--mode", "pd",
                 "--prefill", "mode=colocated", "--decode", "mode=colocated", "--num-kv-blocks", "64",
                 "--context", "64", "--batch", "2", "--steps", "3", "--repeats", "1", "--json", str(out)]) == 0
    run = json.loads(out.read_text())["results"]["pd"]["64"]
    assert run["batch"] == 2 and run["tok_s_per_process"]["mean"] > 0


def test_a_copy_sent_to_a_dead_decode_member_fails_that_instance_only(checkpoints):
    """A decode worker dies while idle; the next handoff's copy message finds its pipe closed before
    anything polled the processes. That decode instance fails (not the deployment, not a raise out
    of step), the handoff is recomputed on the other decode instance, which serves on."""
    import os
    import signal

    with LLM(checkpoints("qwen3").path, dtype="float32", mode="pd", prefill=COLO,
             decode={"mode": "afd", "attn_workers": 1, "ffn_workers": 1}, decode_instances=2,
             kv_load_failure_policy="recompute") as llm:
        e = llm.engine
        victim = e.decode[0].attention[0].process
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        # both are idle: the tie goes to instance 0, the one with the dead member
        sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        e.add_request(Request("a", _prompts(1)[0], sp))
        finished = []
        for _ in range(2000):
            finished += e.step().finished  # step only: check_workers would find the death first
            if not e.has_unfinished():
                break
        assert e.decode[0].failed is not None and "gone" in e.decode[0].failed and e.decode[1].failed is None
        (r,) = finished  # recomputed on instance 1 (test_pd_heal sees the error under policy fail)
        assert r.error is None and len(r.output_token_ids) == 6 and e.kv.stats.recomputes == 1
