"""Several hosts without hosts: the cluster config, the launcher's flags and environment, the
placement line, and the rendezvous's channel (in process, on loopback)."""
from __future__ import annotations

import argparse
import threading

import pytest

from moeflow.comm import CommSpec
from moeflow.config import ClusterConfig, ConfigError, EngineConfig
from moeflow.engine.args import add_cluster_args, cluster_config
from moeflow.workers.launch import describe_nodes
from moeflow.messages import WorkerSetup
from moeflow.workers.launch import free_port


def test_cluster_config_validates():
    assert not ClusterConfig().is_multinode and ClusterConfig(nnodes=2, node_rank=1).is_multinode
    for bad in (dict(nnodes=0), dict(nnodes=2, node_rank=2), dict(master_port=70000), dict(master_addr="")):
        with pytest.raises(ConfigError):
            ClusterConfig(**bad)
    assert EngineConfig(cluster={"nnodes": 2}).cluster == ClusterConfig(nnodes=2)  # from a result file


def _parse(argv):
    p = argparse.ArgumentParser()
    add_cluster_args(p)
    return p.parse_args(argv)


def test_flags_override_the_launchers_environment(monkeypatch):
    for k in _LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    for k, v in dict(WORLD_SIZE="3", NODE_RANK="2", MASTER_ADDR="10.0.0.1", MASTER_PORT="1234").items():
        monkeypatch.setenv(k, v)
    assert cluster_config(_parse([])) == ClusterConfig(nnodes=3, node_rank=2, master_addr="10.0.0.1", master_port=1234)
    assert cluster_config(_parse(["--node-rank", "0"])).node_rank == 0
    monkeypatch.setenv("NODE_RANK", "5")
    with pytest.raises(ConfigError, match="node_rank"):
        cluster_config(_parse([]))


_LAUNCHER_VARS = ("WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_WORLD_SIZE", "GROUP_RANK",
                  "TORCHELASTIC_USE_AGENT_STORE")


def test_one_host_without_flags_or_environment(monkeypatch):
    for k in _LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    assert cluster_config(_parse([])) == ClusterConfig()


def test_torchruns_variables(monkeypatch):
    """torchrun --nnodes 2 --nproc-per-node 1: its node count and rank, and its agent's store."""
    for k in _LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    for k, v in dict(WORLD_SIZE="2", GROUP_WORLD_SIZE="2", RANK="1", GROUP_RANK="1", MASTER_ADDR="10.0.0.1",
                     MASTER_PORT="29500", TORCHELASTIC_USE_AGENT_STORE="True").items():
        monkeypatch.setenv(k, v)
    assert cluster_config(_parse([])) == ClusterConfig(nnodes=2, node_rank=1, master_addr="10.0.0.1",
                                                       master_port=29500, agent_store=True)


def test_placement_line_names_every_node():
    setups = [WorkerSetup(role, i, "", EngineConfig(), None, None, (), node=node)
              for role, i, node in (("moe", 0, 1), ("moe", 1, 1), ("attention", 0, 0))]
    assert describe_nodes(setups, 3) == "node 0: attention 0 + engine; node 1: moe 0, moe 1; node 2: nothing"


def test_shared_ranks_put_a_ranks_experts_on_its_own_world_rank():
    kw = dict(num_regions=3, lanes_per_region=1, num_expert_ranks=3, num_experts=6, top_k=2, hidden_size=8,
              max_batch_tokens=4)
    assert CommSpec(**kw).expert_world_rank(1) == 4 and CommSpec(**kw).world_size == 6
    shared = CommSpec(**kw, shared_ranks=True)
    assert shared.expert_world_rank(1) == 1 and shared.world_size == 3
    with pytest.raises(ConfigError, match="shared_ranks"):
        CommSpec(**{**kw, "num_expert_ranks": 2}, shared_ranks=True)


def test_channel_is_a_fifo_between_threads():
    from moeflow.workers.rendezvous import Channel, connect, host

    cluster = ClusterConfig(nnodes=2, master_port=free_port(), connect_timeout_s=10)
    host(cluster)
    tx, rx = Channel(connect(cluster), "q"), Channel(connect(cluster), "q")
    assert rx.get(0.01) is None
    t = threading.Thread(target=lambda: [tx.put({"n": i}) for i in range(50)])
    t.start()
    got = [rx.get(5.0) for _ in range(50)]
    t.join()
    assert got == [{"n": i} for i in range(50)]


def test_links_split_each_endpoints_peers_by_host():
    from moeflow.comm import CommConfig
    from moeflow.comm.links import split_peers

    spec = CommSpec(num_regions=2, lanes_per_region=2, num_expert_ranks=2, num_experts=4, top_k=2, hidden_size=8,
                    max_batch_tokens=4)
    config = CommConfig(spec, "links", rank_nodes=(0, 0, 1, 1, 0, 1))  # lanes 0-3, expert ranks at 4, 5
    assert split_peers(config, 0, [4, 5]) == ({0: 0}, {1: 0})  # lane 0: expert 0 here, expert 1 away
    assert split_peers(config, 5, [0, 1, 2, 3]) == ({2: 0, 3: 1}, {0: 0, 1: 1})
    assert split_peers(CommConfig(spec, "links"), 0, [4, 5]) == ({0: 0, 1: 1}, {})  # one host: all shm
    with pytest.raises(ConfigError, match="rank_nodes"):
        CommConfig(spec, "links", rank_nodes=(0, 1))
