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
from server_harness import ServerProcess

from moeflow import LLM

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
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


def _worker_node(host, master_addr: str, port: int, env: dict[str, str] | None = None) -> subprocess.Popen:
    penv = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    penv.pop("GLOO_SOCKET_IFNAME", None)
    return subprocess.Popen(host.command(sys.executable, "-m", "moeflow", "worker-node", "--nnodes", "2", "--node-rank",
                                         "1", "--master-addr", master_addr, "--master-port", str(port), env=env),
                            env=penv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _children(pid: int) -> list[int]:
    """The worker processes a worker node spawned (multiprocessing's spawn_main children)."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if ppid == pid and b"spawn_main" in f.read():
                    out.append(int(entry))
        except OSError:
            continue
    return out


def run_two_hosts(tmp_path, checkpoint: str, layout: dict, kill: bool = False, tag: str = "") -> dict:
    """Node 0 (the engine) in host A and a worker node in host B; returns node 0's result."""
    port = 29400  # node 0 is in a namespace of its own: every port is free there
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("GLOO_SOCKET_IFNAME", None)
    with two_hosts(tag) as (a, b):
        cluster = dict(nnodes=2, node_rank=0, master_addr=a.addr, master_port=port, connect_timeout_s=60.0,
                       heartbeat_timeout_s=3.0)
        req = tmp_path / "request.json"
        req.write_text(json.dumps({"cluster": cluster, "layout": layout, "kill": kill}))
        out = tmp_path / "node0.pkl"
        procs = []
        try:
            # the worker node first: it waits for node 0, as a launcher may start them in any order
            procs.append(_worker_node(b, a.addr, port))
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
    (1, 2, True),
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


@pytest.mark.parametrize("dp,kill", [
    (2, True),  # one rank per host: every link but a rank's own crosses hosts
    pytest.param(4, False, marks=pytest.mark.slow),  # two per host: shm within a host, gloo across
])
def test_dep_across_two_hosts(checkpoints, reference, tmp_path, dp, kill):
    r = run_two_hosts(tmp_path, checkpoints("qwen3").path, dict(mode="dep", dp=dp), kill=kill, tag=f"d{dp}")
    print(f"dep {dp} ranks on two hosts: start {r['start_s']:.1f} s, generate {r['generate_s']:.2f} s" +
          _kill_line(r))
    assert sum(r["nodes"].values()) == dp // 2, r["nodes"]  # the odd ranks on host B
    _assert_same(r["outputs"], reference)
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


@pytest.mark.parametrize("dp", [pytest.param(2, marks=pytest.mark.slow), 4])  # 4: pulls from a host-mate (shm) and over gloo
def test_dwdp_pulls_a_peer_hosts_experts_over_gloo(checkpoints, reference, tmp_path, dp):
    r = run_two_hosts(tmp_path, checkpoints("qwen3").path, dict(mode="dwdp", dp=dp), tag=f"w{dp}")
    print(f"dwdp {dp} ranks on two hosts: start {r['start_s']:.1f} s, generate {r['generate_s']:.2f} s")
    assert sum(r["nodes"].values()) == dp // 2, r["nodes"]  # the odd ranks on host B
    _assert_same(r["outputs"], reference)


def test_the_server_survives_and_heals_a_lost_worker_node(checkpoints, tmp_path, monkeypatch):
    """``moeflow serve --nnodes 2 --node-rank 0`` here, the MoE workers on host B: after a kill of
    host B's workers a request ends with an error within seconds, /health stays answered, and the
    restarted deployment (whose workers host B starts again) serves."""
    from moeflow.workers.launch import free_port

    port = free_port()  # node 0 is in this namespace: a port free here
    with two_hosts("s", a_is_here=True) as (a, b):
        monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)  # the server finds the veth on its route to B
        node = _worker_node(b, a.addr, port)
        s = None
        try:
            s = ServerProcess(checkpoints("qwen3").path, "--mode", "asap", "--moe-workers", "2", "--dtype", "float32",
                              "--nnodes", "2", "--node-rank", "0", "--master-addr", a.addr, "--master-port", str(port),
                              "--max-restarts", "3", "--restart-backoff-s", "0.2", log_path=str(tmp_path / "s.log"))
            body = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
            assert httpx.post(s.url + "/v1/completions", json=body, timeout=30).status_code == 200, s.log()
            victims = _children(node.pid)
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
            assert len(_children(node.pid)) == 2  # host B started the new deployment's workers
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


def test_a_node_that_never_comes_is_named(checkpoints):
    """No worker node: node 0 gives up after connect_timeout_s and says which node and what to run."""
    from moeflow.config import ClusterConfig
    from moeflow.workers.launch import WorkerDied, free_port

    cluster = ClusterConfig(nnodes=2, master_port=free_port(), connect_timeout_s=3.0)
    t0 = time.monotonic()
    with pytest.raises(WorkerDied, match="node 1 did not connect within 3 s: start 'moeflow worker-node --node-rank 1"):
        LLM(checkpoints("qwen3").path, dtype="float32", mode="asap", moe_workers=1, cluster=cluster)
    assert time.monotonic() - t0 < 30


def test_a_worker_node_started_for_another_cluster_size_is_refused_with_the_reason(checkpoints):
    from moeflow.config import ClusterConfig
    from moeflow.workers.launch import WorkerDied, free_port

    cluster = ClusterConfig(nnodes=2, master_port=free_port(), connect_timeout_s=30.0)
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.Popen([sys.executable, "-m", "moeflow", "worker-node", "--nnodes", "3", "--node-rank", "1",
                          "--master-port", str(cluster.master_port)], env=env, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with pytest.raises(WorkerDied, match="was started with --nnodes 3; node 0 runs 2"):
            LLM(checkpoints("qwen3").path, dtype="float32", mode="asap", moe_workers=1, cluster=cluster)
    finally:
        from moeflow.workers import rendezvous

        rendezvous._servers.pop(cluster.master_port, None)  # node 0 goes away: the worker node exits
        try:
            p.communicate(timeout=30)
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=10)


def test_serve_with_a_node_rank_runs_a_worker_node_from_the_launchers_environment():
    """``moeflow serve`` on a node other than 0, told by torchrun's variables: it connects to node
    0's rendezvous and beats; when node 0 goes away, it exits 0 by itself."""
    from moeflow.config import ClusterConfig
    from moeflow.workers import rendezvous
    from moeflow.workers.launch import free_port

    cluster = ClusterConfig(nnodes=2, master_port=free_port())
    store = rendezvous.host(cluster)
    env = {**os.environ, "WORLD_SIZE": "2", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(cluster.master_port), "PYTHONPATH": ROOT}
    p = subprocess.Popen([sys.executable, "-m", "moeflow", "serve", "--model", "tiny"], env=env, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while store.add("moeflow/heartbeat/1", 0) < 2:
            assert p.poll() is None and time.monotonic() < deadline, p.communicate(timeout=10)[0]
            time.sleep(0.1)
        del rendezvous._servers[cluster.master_port], store  # node 0 goes away
        out = p.communicate(timeout=30)[0]
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate(timeout=10)
    assert p.returncode == 0, out
    assert "node 1 of 2: waiting for node 0 at 127.0.0.1" in out


def test_torchrun_launches_both_nodes(checkpoints):
    """Under torchrun (static rendezvous: its agent on node 0 hosts the store on --master-port) the
    same moeflow commands work unchanged: node 0 uses the agent's store, and the worker node ends
    when node 0's command has (torchrun's agents wait for every node before they exit)."""
    from moeflow.workers.launch import free_port

    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT}
    for k in ("WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_WORLD_SIZE", "GROUP_RANK"):
        env.pop(k, None)
    torchrun = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nnodes", "2", "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(port)]
    cmds = [[*torchrun, "--node-rank", "1", "-m", "moeflow", "worker-node"],
            [*torchrun, "--node-rank", "0", "-m", "moeflow", "generate", "--model", checkpoints("qwen3").path,
             "--mode", "asap", "--moe-workers", "1", "--dtype", "float32", "--prompt", "hi", "--max-tokens", "3",
             "--ignore-eos"]]
    procs = [subprocess.Popen(c, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in cmds]
    try:
        outs = [p.communicate(timeout=90)[0] for p in reversed(procs)][::-1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=10)
    logs = "\n".join(f"--- node {1 - i} ---\n{o}" for i, o in enumerate(outs))
    assert [p.returncode for p in procs] == [0, 0], logs
    assert "output (3 tokens" in outs[1] and "node 1: moe 0" in outs[1], logs


def test_gloo_finds_the_shared_interface_and_refuses_a_loopback_one():
    """Each host picks the interface on its route to node 0 (the veth, though the host name resolves
    to a loopback address here); an interface whose address is loopback while node 0 is not (here
    GLOO_SOCKET_IFNAME=lo) is refused before the node waits for anything, naming the address, the
    interface and the fix."""
    probe = "from moeflow.workers.interface import choose; import sys; print(choose(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("GLOO_SOCKET_IFNAME", None)
    with two_hosts("i") as (a, b):
        for here, there in ((a, a), (b, a)):  # node 0 reaches its own address, node 1 node 0's
            out = subprocess.run(here.command(sys.executable, "-c", probe, there.addr), env=env, capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 0 and f"name='{here.dev}', addr='{here.addr}'" in out.stdout, out
        t0 = time.monotonic()
        node = _worker_node(b, a.addr, 29400, env={"GLOO_SOCKET_IFNAME": "lo"})
        log = node.communicate(timeout=60)[0]
        assert node.returncode == 2 and time.monotonic() - t0 < 30, log
        assert "127.0.0.1 (interface lo, chosen by GLOO_SOCKET_IFNAME)" in log and "set GLOO_SOCKET_IFNAME" in log, log
