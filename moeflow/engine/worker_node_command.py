"""``moeflow worker-node``: a host that runs only workers, for node 0's engine (``workers/worker_node.py``).

``moeflow serve`` with ``--node-rank`` > 0 runs the same, so one command line fits every host of
a torchrun- or SLURM-style launcher.
"""
from __future__ import annotations

import argparse

from moeflow.config import ClusterConfig, ConfigError
from moeflow.engine.args import add_cluster_args, cluster_config


def add_parser(sub) -> None:
    p = sub.add_parser("worker-node", help="run the workers node 0 places on this host (several hosts)")
    add_cluster_args(p)
    p.set_defaults(func=cmd_worker_node)


def cmd_worker_node(args: argparse.Namespace) -> int:
    return run_node(cluster_config(args))


def run_node(cluster: ClusterConfig) -> int:
    from moeflow.workers.worker_node import run_worker_node

    if cluster.node_rank == 0:
        raise ConfigError("node 0 runs the engine: moeflow serve (or LLM(..., cluster=...)); give --node-rank >= 1")
    return run_worker_node(cluster)
