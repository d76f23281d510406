"""How an engine with worker processes starts: a mode describes its deployment (a ``Blueprint``)
and ``Startup._build`` takes the steps every mode takes, in one order.

Two shapes. Ranks (dep, dwdp): processes of one role that each hold attention and experts, rank
r on host r mod N. Disaggregated (asap, afd): an attention side and an expert side; the attention
side takes world ranks 0..n-1 and stays on host 0 beside the engine (its control pipes are the
busy ones), the expert side takes the ranks after and spreads over the other hosts.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import uuid

from moeflow.comm import CommConfig, WaitPolicy
from moeflow.comm.cuda_ipc import check_engine as check_cuda_ipc
from moeflow.config import ConfigError, EngineConfig
from moeflow.engine.base import Engine, context_len
from moeflow.engine.eplb import attach, check_live, start_placement
from moeflow.engine.memory import apply_budget
from moeflow.layout import Layout
from moeflow.layout.expert_map import ExpertMap
from moeflow.layout.memory import comm_spec
from moeflow.logs import get_logger
from moeflow.messages import WorkerSetup, World
from moeflow.hardware.device import resolve_device
from moeflow.model.attention import attention_for
from moeflow.model.kv_cache import storage_bytes
from moeflow.model.sharding import check_tp
from moeflow.model.weights import TORCH_DTYPES, load_config
from moeflow.scheduler import make_scheduler
from moeflow.workers import rendezvous
from moeflow.workers.launch import Deployment, WorkerHandle, describe_nodes, free_port
from moeflow.workers.world import DIST_TRANSPORTS

log = get_logger("moeflow.engine")


@dataclasses.dataclass(frozen=True)
class Blueprint:
    side: tuple[str, int]  # (role, count) of the attention side, or of the ranks
    experts: tuple[str, int] | None = None  # (role, count) of the expert side; None: ranks
    attn_tp: int | None = None  # the attention side's TP size (asap), checked against the model
    computes: bool = True  # whether the expert holders compute their experts' pairs (engine/eplb.py)

    @property
    def size(self) -> int:
        return self.side[1] + (self.experts[1] if self.experts else 0)

    @property
    def tp_groups(self) -> tuple[tuple[int, ...], ...]:
        t = self.attn_tp or 1
        return tuple(tuple(range(g * t, (g + 1) * t)) for g in range(self.side[1] // t)) if t > 1 else ()

    def nodes(self, nnodes: int, expert_ranks: int | None = None) -> tuple[int, ...]:
        """The host of each world rank; ``expert_ranks``: as many expert holders (an elastic layout's
        capacity: where one that joins later runs), else the count it starts with."""
        n = self.side[1]
        if self.experts is None:
            return tuple(r % nnodes for r in range(n))
        count = self.experts[1] if expert_ranks is None else expert_ranks
        return (0,) * n + tuple(1 + i % (nnodes - 1) if nnodes > 1 else 0 for i in range(count))

    def workers(self, nnodes: int) -> list[tuple[str, int, int, int]]:
        """(role, index, world rank, host) of each worker, in launch order: the expert side first,
        since it owns the dispatch buffers the attention side attaches to."""
        nodes, (role, n) = self.nodes(nnodes), self.side
        ours = [(role, r, r, nodes[r]) for r in range(n)]
        if self.experts is None:
            return ours
        theirs, e = self.experts
        return [(theirs, i, n + i, nodes[n + i]) for i in range(e)] + ours

    def sides(self, workers: list) -> tuple[list, list]:
        """(expert holders, attention side) among the started ``workers`` (a rank is both)."""
        if self.experts is None:
            return list(workers), list(workers)
        return [w for w in workers if w.role == self.experts[0]], [w for w in workers if w.role == self.side[0]]


class Startup(Engine):
    """An engine whose deployment is worker processes, up to their start."""

    def __init__(self, config: EngineConfig, layout: Layout):
        self.config, self.layout = config, layout
        self.deployment_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.deployment: Deployment | None = None

    def _build(self, model_path: str, bp: Blueprint) -> list[WorkerHandle]:
        """Start the deployment ``bp`` describes; its attention side's workers (a rank's: every rank).
        Every refusal comes before anything starts; the scheduler before the world, so that a
        refused one has hosted no rendezvous."""
        config, layout, mode = self.config, self.layout, self.mode_name
        self.model_config, family = load_config(model_path)
        mc = self.model_config
        if not mc.num_moe_layers:
            raise ConfigError(f"mode '{mode}' needs a model with MoE layers")
        self._refuse()
        check_live(config, mode, bp.computes)
        held = self._place(mc, bp.computes)
        if bp.attn_tp is not None:
            check_tp(mc, bp.attn_tp)
        self.max_model_len = context_len(config, mc)
        spec = comm_spec(layout, mc.num_experts, mc.num_experts_per_tok, mc.hidden_size, config.dtype)
        transport, rank_nodes = self._transport(bp.nodes(config.cluster.nnodes, spec.num_expert_ranks
                                                         if bp.experts and layout.elastic else None))
        cluster = config.cluster
        comm = CommConfig(spec, transport, self.deployment_id, WaitPolicy(), rank_nodes=rank_nodes,
                          store=(cluster.master_addr, cluster.master_port) if transport == "pairs" else None)
        config = self._budget(config, model_path)
        self.scheduler = make_scheduler(layout, config, self.max_model_len)
        groups = bp.tp_groups
        world = self._world(bp.size, groups) if groups or transport in DIST_TRANSPORTS else None
        setup = functools.partial(self._setup, model_path, comm, held, world)
        self._worker_setup = setup  # (role, index, rank, node) -> a setup: for workers that join later
        self._launch([setup(*w) for w in bp.workers(config.cluster.nnodes)],
                     self._shm_bytes(model_path, family) + self._shared_kv_bytes(mc, bp))
        experts, attention = bp.sides(self.deployment.workers)
        attach(self, mc, held, experts, attention, polls=bp.experts is not None, computes=bp.computes)
        return attention

    def _refuse(self) -> None:
        """The mode's own refusals of its config and layout (before the placement's)."""

    def _place(self, mc, computes: bool):
        """The placement the expert holders start with (``eplb.start_placement``)."""
        held = self.layout.experts_held(mc.num_experts)
        return start_placement(self.config, self.layout, mc, held, self.mode_name, computes=computes)

    def _shared_kv_bytes(self, mc, bp: Blueprint) -> int:
        """The KV caches this deployment's attention side keeps in /dev/shm (``share_kv_cache`` on a
        CPU host; on a GPU they are device memory)."""
        config = self.config
        if not config.share_kv_cache or resolve_device(config.device) != "cpu":
            return 0
        member = attention_for(mc).member_config(bp.attn_tp) if bp.attn_tp else mc
        per = storage_bytes(attention_for(member).kv_layout(), member.num_layers,
                            config.num_kv_blocks * config.kv_block_size, TORCH_DTYPES[config.dtype])
        return bp.side[1] * per

    def _shm_bytes(self, model_path: str, family) -> int:
        """Bytes this host's workers publish in /dev/shm beside their buffers (checked for room)."""
        return 0

    def _budget(self, config: EngineConfig, model_path: str) -> EngineConfig:
        """``config`` with its KV blocks from the memory budget, if one is set (``engine/memory.py``)."""
        self.config, self.memory_plan = apply_budget(config, model_path, self.layout)
        return self.config

    def _setup(self, model_path: str, comm, experts_held, world, role: str, index: int, rank: int,
               node: int = 0) -> WorkerSetup:
        """A worker's setup; ``rank``: its world rank (pinned to CPU rank mod cores); ``node``: its host."""
        c, m = self.config, experts_held  # a tuple per device, or an ExpertMap (a placement by layer)
        held, layers = (m.layers[0], m.layers) if isinstance(m, ExpertMap) else (m, None)
        return WorkerSetup(role, index, model_path, c, self.layout, comm, held, world, rank,
                           cpu=rank % (os.cpu_count() or 1) if c.pin_cpus else None, node=node, expert_layers=layers)

    def _world(self, size: int, tp_groups=()) -> World:
        """The deployment's torch.distributed world: on one host its own rendezvous on a free local
        port; across hosts the cluster's (node 0 hosts it from now on, for every deployment)."""
        if not (cluster := self.config.cluster).is_multinode:
            return World(size, free_port(), tuple(tp_groups))
        rendezvous.host(cluster)
        return World(size, cluster.master_port, tuple(tp_groups), cluster.master_addr,
                     f"moeflow/{self.deployment_id}/world")

    def _transport(self, rank_nodes: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
        """(transport, its ``rank_nodes``) for world ranks on these hosts: the configured one on one
        host; across hosts shm or gloo per link (``links``), unless gloo everywhere was asked for."""
        check_cuda_ipc(c := self.config)
        if c.cluster.is_multinode and c.transport == "shm":
            # members that join while serving cannot take a rank in a world: a gloo group per pair
            return ("pairs" if getattr(self.layout, "elastic", False) else "links"), tuple(rank_nodes)
        return c.transport, ()

    def _launch(self, setups, published_shm_bytes: int = 0) -> None:
        cluster = self.config.cluster
        if cluster.is_multinode:
            rendezvous.host(cluster)  # before any node's workers need it
            log.info("%s across %d nodes (rendezvous %s:%d): %s", self.mode_name, cluster.nnodes,
                     cluster.master_addr, cluster.master_port, describe_nodes(setups, cluster.nnodes))
        self.deployment = Deployment(setups, self.deployment_id, cluster=cluster, published_shm_bytes=published_shm_bytes)
