"""AFD attention instance: ``AttentionStages`` whose MoE layers go through the AFD connector.

The instance holds requests, KV cache, embeddings, attention, norms, dense layers and shared
experts (the small, per-token parts) and samples; routed experts live on the FFN daemons. Its
layer schedule is asap's ``Interleaved`` over the step's m micro-batches: micro-batch u+1's
attention runs while the daemons compute micro-batch u (DBO). With the router here (default) it
sends (token, expert) pairs and weighs the results itself, as asap's attention worker does;
with ``router="ffn"`` it sends token rows and adds up the daemons' weighted sums.
"""
from __future__ import annotations

import time

import torch

from moeflow.messages import WorkerSetup
from moeflow.model.weights import LoadSpec
from moeflow.workers.afd_connector import AttnConnector
from moeflow.workers.dispatch import ExpertRoutes, tag_layer
from moeflow.workers.stages import AttentionStages, InFlight


class AfdStages(AttentionStages):
    def __init__(self, setup: WorkerSetup, transport, instance: int):
        ffns = setup.layout.ffns_of(instance)
        super().__init__(setup, transport, None, instance, 0, 1, LoadSpec(routed_experts=False), send_to=ffns)
        self.routes_there = setup.layout.router == "ffn"
        if setup.layout.topology == "block" and self.routes is not None:  # its one daemon holds every expert
            held = tuple(ids if j in ffns else () for j, ids in enumerate(setup.experts_held))
            self.routes = ExpertRoutes(held, self.cfg.num_experts, instance, self.device)
        self.connector = AttnConnector(self.sender, self.receiver, ffns, self.epw)

    def use_experts(self, epoch: int, layers: tuple) -> None:
        """As every attention process; with topology "all" its daemons are the placement's devices."""
        super().use_experts(epoch, layers)
        connector = getattr(self, "connector", None)  # None: the starting placement, set while building
        if connector is not None and self.setup.layout.topology == "all":
            connector.ffns = list(range(len(layers[0])))

    def _dispatch(self, layer: int, f: InFlight) -> float:
        x = f.attn.moe_input  # [n, H] (no TP: the instance's whole micro-batch)
        f.workers = self.connector.ffns
        if self.routes_there:
            if self.expert_load is not None:  # the daemons route; the same router here counts their load
                self.route(layer, f, x)
            c2 = time.monotonic()
            self.connector.send_attn_output(tag_layer(layer, self.expert_epoch), f.batch.batch_id,
                                            {j: (x, None) for j in f.workers})
            return c2
        ids, f.topk_w = self.route(layer, f, x)  # [n, K] each
        f.shares = self.routes_for(layer).split(ids, f.workers)
        c2 = time.monotonic()
        k = ids.shape[1]
        self.connector.send_attn_output(tag_layer(layer, self.expert_epoch), f.batch.batch_id,
                                        {sh.worker: (x[sh.pair_index // k], sh.counts) for sh in f.shares})
        return c2

    def _receive(self, f: InFlight) -> dict[int, torch.Tensor]:
        return self.connector.recv_ffn_output()

    def _routed(self, f: InFlight, payloads: dict[int, torch.Tensor]) -> torch.Tensor:
        if not self.routes_there:
            return super()._routed(f, payloads)
        parts = iter(payloads.values())
        routed = next(parts).clone()  # [n, H]
        for y in parts:  # experts split over daemons: each sent its partial sum
            routed += y
        return routed
