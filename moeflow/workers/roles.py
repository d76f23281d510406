"""Process roles, in a registry keyed by ``WorkerSetup.role``: each builds the worker object a
process runs (``serve(conn)``, ``close()``) from its setup, the comm transport (injected: a test
runs an attention/MoE pair in one process on the reference transport) and its TP group.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from moeflow.messages import WorkerSetup
from moeflow.model.moe import ExpertWeights
from moeflow.model.weights import LoadSpec
from moeflow.workers.afd_attention import AfdStages
from moeflow.workers.attention import AttentionWorker
from moeflow.workers.expert_slots import worker_slots
from moeflow.workers.ffn import FfnDaemon
from moeflow.workers.moe import MoEWorker
from moeflow.workers.prefetch import ExpertPrefetcher
from moeflow.workers.schedule import Interleaved, Lockstep, Prefetching
from moeflow.workers.stages import AttentionStages
from moeflow.workers.world import TPGroup

ROLES: dict[str, Callable] = {}


def role(name: str):
    def deco(fn: Callable) -> Callable:
        ROLES[name] = fn
        return fn
    return deco


def build_worker(setup: WorkerSetup, transport, tp: TPGroup | None):
    if setup.role not in ROLES:
        raise ValueError(f"unknown worker role {setup.role!r}; roles: {sorted(ROLES)}")
    return ROLES[setup.role](setup, transport, tp)


@role("attention")
def _asap_attention(setup: WorkerSetup, transport, tp: TPGroup | None) -> AttentionWorker:
    """asap: one TP member of one attention DP group; routed experts live on the MoE workers."""
    t = setup.layout.attn_tp
    group, member = divmod(setup.index, t)
    stages = AttentionStages(setup, transport, tp, group, member, t, LoadSpec(routed_experts=False))
    return AttentionWorker(stages, Interleaved(stages), replies=member == 0)


@role("moe")
def _asap_moe(setup: WorkerSetup, transport, tp: TPGroup | None) -> MoEWorker:
    return MoEWorker(setup, transport)


@role("dep")
def _dep_rank(setup: WorkerSetup, transport, tp: TPGroup | None) -> AttentionWorker:
    """dep: attention for its own DP batch, 1/N of every layer's experts, lockstep all-to-all."""
    rank, join = setup.index, setup.join  # joining a serving deployment: its experts come from its peers
    receiver = transport.dispatch_receiver(rank)  # our dispatch buffer, before anyone attaches to it
    load = LoadSpec(experts=setup.held_by(rank)) if join is None else LoadSpec(experts=None, routed_experts=False)
    stages = AttentionStages(setup, transport, tp, rank, 0, 1, load, send_to=tuple(range(len(setup.experts_held))))
    slots = worker_slots(setup, transport, stages.cfg, stages.weights.experts, stages.tracer)
    if join is None:
        stages.weights.experts = slots.for_word(0)[1]  # under live rebalancing: the published copy, not a second one
    schedule = Lockstep(stages, receiver, transport.combine_sender(rank), len(setup.experts_held), slots)
    return AttentionWorker(stages, schedule, replies=True, expert_slots=slots)


@role("dwdp")
def _dwdp_rank(setup: WorkerSetup, transport, tp: TPGroup | None) -> AttentionWorker:
    """dwdp: the whole model for its own requests; its resident experts published in shared memory
    for its peers to pull, theirs pulled one layer ahead of use."""
    rank, layout, like = setup.index, setup.layout, None if setup.join is None else setup.join.like
    load = LoadSpec(experts=setup.experts_held[rank]) if like is None else LoadSpec(routed_experts=False)
    stages = AttentionStages(setup, transport, tp, rank, 0, 1, load, dispatch=False)
    store = transport.weight_store()
    if like is None:  # a starting rank publishes (before it waits for its peers' to appear)
        w = stages.weights.experts
        shared = store.publish(rank, {"w13": w.w13, "w2": w.w2})  # shared memory (cuda-ipc: device memory), for the peers
        if shared["w13"].device == stages.device:  # compute from the published copy; drop ours
            stages.weights.experts = dataclasses.replace(w, w13=shared["w13"], w2=shared["w2"])
    peers = {r: store.peer(r) for r in range(len(setup.experts_held)) if r != rank}
    if like is not None:  # a joiner (``JoinReplica``): its residents, a copy of a starting rank's
        stages.weights.experts = replica_experts(stages.cfg, setup.experts_held[like], peers[like].tensors, stages.device)
    # NOTE: an accelerator over the shm store keeps its own resident copy and each pull copies host -> device
    w = stages.weights.experts
    prefetcher = ExpertPrefetcher(rank, setup.experts_held, list(w.layer_ids), (w.w13, w.w2), peers,
                                  layout.copy_plan, layout.slice_bytes, stages.tracer, like=like)
    return AttentionWorker(stages, Prefetching(stages, prefetcher, layout.merge, store), replies=True)


def replica_experts(cfg, held: tuple[int, ...], published: dict, device) -> ExpertWeights:
    """A copy of a peer's published resident experts (``held``, every MoE layer), in this process."""
    return ExpertWeights(w13=published["w13"].to(device, copy=True), w2=published["w2"].to(device, copy=True),
                         layer_ids=tuple(l for l in range(cfg.num_layers) if cfg.sparse_layers[l]), expert_ids=held)


@role("afd_attention")
def _afd_attention(setup: WorkerSetup, transport, tp: TPGroup | None) -> AttentionWorker:
    """afd: one attention instance; each step's m micro-batches interleave over its FFN daemons (DBO)."""
    stages = AfdStages(setup, transport, setup.index)
    return AttentionWorker(stages, Interleaved(stages), replies=True)


@role("ffn")
def _afd_ffn(setup: WorkerSetup, transport, tp: TPGroup | None) -> FfnDaemon:
    return FfnDaemon(setup, transport)
