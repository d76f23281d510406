"""One deployment across two "hosts" (network namespaces joined by a veth pair): node 0 runs the
engine and its workers in host A, ``moeflow worker-node`` runs the rest in host B; both match the
colocated reference (fp32), and killing host B's workers fails requests within seconds, after
which the restart brings the deployment back through the same worker node.

Needs root and ``ip`` (skipped otherwise, saying why); the namespaces are removed afterwards.
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time

import httpx
import pytest
from netns import two_hosts
from parity import PARAMS, PROMPTS
from multihost_harness import ROOT, worker_children, worker_node
from server_harness import ServerProcess

from moeflow import LLM

HERE = os.path.dirname(os.path.abspath(__file__))
NODE0 = os.path.join(HERE, "multihost_node0.py")


def _plain(outs) -> list:
    return [{"error": o.error, "token_ids": list(o.outputs[0].token_ids),
             "prompt_logprobs": [None if p is None else {t: lp.logprob for t, lp in p.items()}
                                 for p in o.prompt_logprobs]} for o in outs]


def _kill_line(r: dict) -> str:
    return f", a request failed {r['fail_s']:.2f} s after the kill, healed generate {r['heal_s']:.2f} s" if "fail_s" in r else ""


def _assert_same(outs: list, refs: list) -> None:
    for o, r in zip(outs, refs, strict=True):
        assert o["error"] is None and o["token_ids"] == r["token_ids"]
        for x, y in zip(o["prompt_logprobs"][1:], r["prompt_logprobs"][1:], strict=True):
            assert x.keys() == y.keys() and max(abs(x[t] - y[t]) for t in x) < 1e-3


def run_two_hosts(tmp_path, checkpoint: str, layout: dict, kill: bool = False, tag: str = "",
                  rounds: int = 1, scale: tuple[int, ...] = ()) -> dict:
    """Node 0 (the engine) in host A and a worker node in host B; returns node 0's result."""
    port = 29400  # node 0 is in a namespace of its own: every port is free there
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("GLOO_SOCKET_IFNAME", None)
    with two_hosts(tag) as (a, b):
        cluster = dict(nnodes=2, node_rank=0, master_addr=a.addr, master_port=port, connect_timeout_s=60.0,
                       heartbeat_timeout_s=3.0)
        req = tmp_path / "request.json"
        req.write_text(json.dumps({"cluster": cluster, "layout": layout, "kill": kill, "rounds": rounds,
                                   "scale": list(scale)}))
        out = tmp_path / "node0.pkl"
        procs = []
        try:
            # the worker node first: it waits for node 0, as a launcher may start them in any order
            procs.append(worker_node(b, a.addr, port))
            procs.append(subprocess.Popen(a.command(sys.executable, NODE0, checkpoint, str(req), str(out)),
                                          env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
            log0 = procs[1].communicate(timeout=150)[0]
            log1 = procs[0].communicate(timeout=20)[0]  # node 0 gone: the worker node exits by itself
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate(timeout=10)
        logs = f"--- node 0 ---\n{log0}\n--- node 1 ---\n{log1}"
        with open(out, "rb") as f:
            result = pickle.load(f)
        assert "fatal" not in result, result.get("fatal", "") + logs
        assert procs[0].returncode == 0, logs
        result["logs"] = logs
        return result


@pytest.fixture(scope="module")
def reference(checkpoints):
    with LLM(checkpoints("qwen3").path, dtype="float32") as llm:
        return _plain(llm.generate(PROMPTS, PARAMS))


@pytest.mark.parametrize("tp,moe,kill", [
    pytest.param(1, 2, True, marks=pytest.mark.slow),  # its one-sided transport over gloo: test_comm_netns, test_comm_stress
    pytest.param(2, 1, False, marks=pytest.mark.slow),  # a TP group on host A, its gloo group in the same rendezvous
])
def test_asap_attention_on_one_host_experts_on_the_other(checkpoints, reference, tmp_path, tp, moe, kill):
    layout = dict(mode="asap", attn_dp=1, attn_tp=tp, moe_workers=moe, min_batch_tokens=8, max_batch_tokens=128,
                  max_batch_wait_s=0.005)
    r = run_two_hosts(tmp_path, checkpoints("qwen3").path, layout, kill=kill, tag=f"a{tp}")
    print(f"asap T{tp} E{moe} on two hosts: start {r['start_s']:.1f} s, generate {r['generate_s']:.2f} s" +
          _kill_line(r))
    assert sum(r["nodes"].values()) == moe, r["nodes"]  # every MoE worker on host B
    _assert_same(r["outputs"], reference)
    if kill:
        # the first to notice may be node 0's attention worker (its gloo peer reset) or the worker node
        assert r["fail_error"] and ("exited" in r["fail_error"] or "failed" in r["fail_error"]), r["fail_error"]
        assert r["fail_s"] < 10
        assert r["restarts"] == 1
        _assert_same(r["healed_outputs"], reference)


EPLB = dict(num_redundant_experts=2, enable_eplb=True, eplb_config={"step_interval": 2, "window_size": 4})


@pytest.mark.parametrize("dp,kill,eplb", [
    # one rank per host: every link but a rank's own crosses hosts, and so does every expert a
    # live rebalance reads from the other rank (its weight server answers over gloo)
    (2, True, True),
    pytest.param(2, True, False, marks=pytest.mark.slow),
    pytest.param(4, False, False, marks=pytest.mark.slow),  # two per host: shm within a host, gloo across
])
def test_dep_across_two_hosts(checkpoints, reference, tmp_path, dp, kill, eplb):
    layout = dict(mode="dep", dp=dp, **(EPLB if eplb else {}))
    r = run_two_hosts(tmp_path, checkpoints("qwen3").path, layout, kill=kill, tag=f"d{dp}{'e' * eplb}",
                      rounds=3 if eplb else 1)
    moves = r["rebalances"]
    print(f"dep {dp} ranks on two hosts: start {r['start_s']:.1f} s, generate {r['generate_s']:.2f} s" +
          _kill_line(r) + (f", {len(moves)} rebalances read {sum(m[2] for m in moves)} bytes from the other "
                           f"host" if eplb else ""))
    assert sum(r["nodes"].values()) == dp // 2, r["nodes"]  # the odd ranks on host B
    _assert_same(r["outputs"], reference)
    for outs in r["rounds"]:  # each across live rebalances
        _assert_same(outs, reference)
    if eplb:
        assert sum(retired for retired, _, _ in moves) >= 2 and sum(m[2] for m in moves) > 0, moves
    if kill:
        assert r["fail_error"] and r["fail_s"] < 10, r["fail_error"]
        assert r["restarts"] == 1
        _assert_same(r["healed_outputs"], reference)


@pytest.mark.slow  # the links are asap's and dep's: make test-slow
def test_afd_attention_on_one_host_ffn_daemons_on_the_other(checkpoints, reference, tmp_path):
    layout = dict(mode="afd", attn_workers=2, ffn_workers=1, micro_batches=2)
    r = run_two_hosts(tmp_path, checkpoints("qwen3").path, layout, tag="f")
    print(f"afd on two hosts: start {r['start_s']:.1f} s, generate {r['generate_s']:.2f} s")
    assert sum(r["nodes"].values()) == 1, r["nodes"]  # the FFN daemon on host B
    _assert_same(r["outputs"], reference)


# make test-slow: ~20 s each; make test runs the pair links alone (test_comm_stress) and the joins on one host
@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    dict(mode="afd", attn_workers=2, ffn_workers=1, topology="all", max_ffn_workers=2, max_batch_tokens=64),
    dict(mode="asap", attn_dp=2, moe_workers=1, max_moe_workers=2, min_batch_tokens=8, max_batch_tokens=64,
         max_batch_wait_s=0.005),  # the same joins (engine/elastic.py), asap's attention side
])
def test_an_expert_holder_joins_and_leaves_on_the_second_host(checkpoints, reference, tmp_path, layout):
    """Elastic across hosts: the attention side on host A, the expert holders (afd's FFN daemons,
    asap's MoE workers) on host B; one forked there while serving reads its experts from its
    host-mate and reaches the attention side over gloo groups of its own (the deployment has no
    world to join), leaves, and joins again at the same index. Outputs equal colocated's during
    and after every change."""
    mode = layout["mode"]
    kind = {"afd": "ffn", "asap": "moe"}[mode]
    r = run_two_hosts(tmp_path, checkpoints("qwen3").path, layout, tag="e" + mode[1], scale=(2, 1, 2))
    _assert_same(r["outputs"], reference)
    for target, (status, during, after, nodes) in zip((2, 1, 2), r["scaled"], strict=True):
        event = status["events"][-1]
        print(f"{mode} on two hosts: {kind} -> {target} in {event['seconds']:.2f} s ({event['outcome']})")
        assert status[kind] == target and event["outcome"] == "done", status
        assert [on_b for name, on_b in nodes.items() if name.startswith(kind)] == [True] * target, nodes
        _assert_same(during, reference)
        _assert_same(after, reference)


@pytest.mark.parametrize("dp", [pytest.param(2, marks=pytest.mark.slow), 4])  # 4: pulls from a host-mate (shm) and over gloo
def test_dwdp_pulls_a_peer_hosts_experts_over_gloo(checkpoints, reference, tmp_path, dp):
    r = run_two_hosts(tmp_path, checkpoints("qwen3").path, dict(mode="dwdp", dp=dp), tag=f"w{dp}")
    print(f"dwdp {dp} ranks on two hosts: start {r['start_s']:.1f} s, generate {r['generate_s']:.2f} s")
    assert sum(r["nodes"].values()) == dp // 2, r["nodes"]  # the odd ranks on host B
    _assert_same(r["outputs"], reference)


def test_the_server_survives_and_heals_a_lostworker_node(checkpoints, tmp_path, monkeypatch):
    """``moeflow serve --nnodes 2 --node-rank 0`` here, the MoE workers on host B: after a kill of
    host B's workers a request ends with an error within seconds, /health stays answered, and the
    restarted deployment (whose workers host B starts again) serves."""
    from moeflow.workers.launch import free_port

    port = free_port()  # node 0 is in this namespace: a port free here
    with two_hosts("s", a_is_here=True) as (a, b):
        monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)  # the server finds the veth on its route to B
        node = worker_node(b, a.addr, port)
        s = None
        try:
            s = ServerProcess(checkpoints("qwen3").path, "--mode", "asap", "--moe-workers", "2", "--dtype", "float32",
                              "--nnodes", "2", "--node-rank", "0", "--master-addr", a.addr, "--master-port", str(port),
                              "--max-restarts", "3", "--restart-backoff-s", "0.2", log_path=str(tmp_path / "s.log"))
            body = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
            assert httpx.post(s.url + "/v1/completions", json=body, timeout=30).status_code == 200, s.log()
            victims = worker_children(node.pid)
            assert len(victims) == 2, victims
            with httpx.Client(base_url=s.url, timeout=30) as c:
                t0 = time.monotonic()
                for pid in victims:
                    os.kill(pid, signal.SIGKILL)
                r = c.post("/v1/completions", json={**body, "max_tokens": 300, "ignore_eos": True})
                fail_s = time.monotonic() - t0
                assert r.status_code != 200 or r.json()["choices"][0]["finish_reason"] == "error", r.text
                assert c.get("/health").status_code in (200, 503)  # the server is up
                while (r := c.post("/v1/completions", json=body)).status_code != 200:
                    assert time.monotonic() - t0 < 60, f"not healed after 60 s:\n{s.log()}"
                    time.sleep(0.1)
                heal_s = time.monotonic() - t0
            print(f"server on two hosts: a request failed {fail_s:.2f} s after the kill; serving again after "
                  f"{heal_s:.1f} s")
            assert fail_s < 10
            assert len(worker_children(node.pid)) == 2  # host B started the new deployment's workers
        finally:
            if s is not None:
                assert s.stop() in (0, 143), s.log()  # 143: SIGTERM re-raised after a clean release
            try:
                node.wait(timeout=20)  # node 0 gone: it exits by itself
            finally:
                if node.poll() is None:
                    node.kill()
                    node.wait(10)
        assert node.returncode == 0, node.stdout.read()
