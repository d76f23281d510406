"""Rank of mode ``dep`` (the synchronous baseline): attention for its own DP batch, 1/N of the
experts of every layer, and a blocking all-to-all at every MoE layer.

Per MoE layer every rank dispatches to every rank (0 rows included), serves the N regions that
arrive for its experts, and only then sends the results back: no rank can get a layer's results
before every rank has dispatched that layer — the barrier of DP attention + expert parallelism.
The transport is the same shared-memory one the asap mode uses, so only the protocol differs.
"""
from __future__ import annotations

import time

import torch

from moeflow.model.moe import experts_grouped
from moeflow.model.weights import LoadSpec
from moeflow.workers.attention import AttentionWorker, InFlight


class DepWorker(AttentionWorker):
    def load_spec(self) -> LoadSpec:
        return LoadSpec(experts=self.setup.placement[self.setup.index])

    def make_endpoints(self, transport) -> None:
        rank = self.setup.index
        self.moe_receiver = transport.dispatch_receiver(rank)  # our dispatch buffer, before anyone attaches
        super().make_endpoints(transport)
        self.moe_sender = transport.combine_sender(rank)
        self.num_ranks = self.setup.parallel.attn_dp
        self.num_local = len(self.setup.placement[rank])

    def targets(self, topk_ids: torch.Tensor) -> list[int]:
        return list(range(self.num_ranks))  # all-to-all: every rank, even with nothing for it

    def layers(self, flights: list[InFlight]) -> None:
        (f,) = flights  # one batch per rank per step (possibly empty: a dummy step)
        for layer in range(self.cfg.num_layers):
            self._attention_and_dispatch(layer, f)
            if self.cfg.sparse_layers[layer]:
                self._serve_experts(layer, f)
            self._combine(layer, f)

    @torch.inference_mode()
    def _serve_experts(self, layer: int, f: InFlight) -> None:
        replies = []
        for _ in range(self.num_ranks):
            w0 = time.monotonic()
            msg = self.moe_receiver.recv()
            c0 = time.monotonic()
            assert msg.layer_id == layer, f"rank {self.setup.index}: layer {msg.layer_id} arrived during {layer}"
            (row,) = msg.rows
            counts = torch.tensor(row.tokens_per_expert[:self.num_local], dtype=torch.int64)
            replies.append((msg.group, experts_grouped(self.weights.experts, layer, row.payload, counts),
                            row.batch_id))
            c1 = time.monotonic()
            self.tracer.add("wait-dispatch", w0, c0, layer=layer)
            self.tracer.add("experts", c0, c1, layer=layer, tokens=row.payload.shape[0])
            f.wait_s += c0 - w0
            f.compute_s += c1 - c0
        s0 = time.monotonic()
        for group, y, batch_id in replies:
            self.moe_sender.send(group, 0, y, layer, batch_id)
        self.tracer.add("combine-send", s0, time.monotonic(), layer=layer)

    def close(self) -> None:
        super().close()
        self.moe_sender.close()
        self.moe_receiver.close()
