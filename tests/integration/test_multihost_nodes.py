"""Starting a deployment's nodes: a node that never comes and one started for another cluster size
are named, ``serve --node-rank`` and torchrun start worker nodes from the launcher's environment,
and gloo binds the interface on the route to node 0 (a loopback one is refused)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from multihost_harness import ROOT, worker_node
from netns import two_hosts

from moeflow import LLM


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
        node = worker_node(b, a.addr, 29400, env={"GLOO_SOCKET_IFNAME": "lo"})
        log = node.communicate(timeout=60)[0]
        assert node.returncode == 2 and time.monotonic() - t0 < 30, log
        assert "127.0.0.1 (interface lo, chosen by GLOO_SOCKET_IFNAME)" in log and "set GLOO_SOCKET_IFNAME" in log, log
