"""Layer schedules: how an attention-side worker walks the layers of one work item's batches with
its ``AttentionStages``. Siblings, chosen once per role: ``Interleaved`` (asap's dual-batch walk),
``Lockstep`` (dep's all-to-all barrier at every MoE layer) and ``Prefetching`` (dwdp: every layer
here, peers' experts pulled one layer ahead).
"""
from __future__ import annotations

import time

from moeflow.model.moe import experts_list, experts_merged, plan_pairs, weighted_sum
from moeflow.workers.dispatch import untag_layer
from moeflow.workers.experts import ExpertCompute, send_replies
from moeflow.workers.stages import AttentionStages, InFlight, guarded


class LayerSchedule:
    def __init__(self, stages: AttentionStages):
        self.stages = stages

    def run(self, flights: list[InFlight]) -> None:
        raise NotImplementedError

    def experts_changed(self) -> None:
        """The stages route by another placement from the next work item (``UseExperts``)."""

    def memory(self) -> dict[str, int]:
        """Bytes the schedule holds beyond the stages' (buffers)."""
        return {}

    def close(self) -> None:
        pass


class Interleaved(LayerSchedule):
    """ASAP dual-batch interleaving: with two batches, one's attention runs while the MoE workers
    compute the other's experts."""

    def run(self, flights: list[InFlight]) -> None:
        s, num_layers = self.stages, self.stages.cfg.num_layers
        for f in flights:
            s.attention_and_dispatch(0, f)
        # NOTE: each batch goes on to its next layer right after its own combine, so while one
        # batch's experts run the worker is busy with the other batch's attention; combining all
        # batches before any next-layer attention would idle the worker on the last batch's experts.
        for layer in range(num_layers):
            for f in flights:
                s.combine(layer, f)
                if layer + 1 < num_layers:
                    s.attention_and_dispatch(layer + 1, f)


class Lockstep(LayerSchedule):
    """The synchronous baseline's rank: per MoE layer it dispatches to every rank (0 rows
    included), serves the N regions that arrive for its own experts, and only then sends the
    results back. No rank gets a layer's results before every rank dispatched that layer: the
    barrier of DP attention + expert parallelism."""

    def __init__(self, stages: AttentionStages, receiver, sender, num_ranks: int, slots=None):
        super().__init__(stages)
        self.receiver, self.sender, self.num_ranks = receiver, sender, num_ranks  # our expert-side endpoints
        self.compute = ExpertCompute(slots or stages.weights.experts, stages.tracer)

    def run(self, flights: list[InFlight]) -> None:
        (f,) = flights  # one batch per rank per step (possibly empty: a dummy step)
        s = self.stages
        for layer in range(s.cfg.num_layers):
            s.attention_and_dispatch(layer, f)
            if s.cfg.sparse_layers[layer]:
                self._serve_experts(layer, f)
            s.combine(layer, f)

    def experts_changed(self) -> None:
        """An elastic deployment's ranks change with its placement (read between work items, and so
        from the same global step on every rank): dispatch to all of them, wait for as many regions;
        the regions of ranks that left are forgotten at once (one that joins at their index later,
        maybe before this rank runs another item, writes from seq 1)."""
        n = self.stages.expert_devices
        for j in range(n, self.num_ranks):
            self.receiver.forget_region(j)
            self.sender.detach_region(j)
        self.num_ranks = n
        self.stages.send_to = list(range(n))

    def _serve_experts(self, layer: int, f: InFlight) -> None:
        replies = []
        tracer = self.stages.tracer
        for _ in range(self.num_ranks):
            w0 = time.monotonic()
            msg = self.receiver.recv()
            c0 = time.monotonic()
            assert untag_layer(msg.rows[0].layer_id)[0] == layer, f"layer {msg.rows[0].layer_id} arrived during {layer}"
            replies += self.compute.run(msg)
            tracer.add("wait-dispatch", w0, c0, layer=layer)
            f.wait_s += c0 - w0
            f.compute_s += time.monotonic() - c0
        send_replies(self.sender, replies, tracer)

    def close(self) -> None:
        # NOTE: every sender of this process before any receiver: over torch.distributed a receiver's
        # close waits for its peers' goodbyes, which they send as they close their senders.
        self.sender.close()
        self.stages.close_sender()
        self.receiver.close()


class Prefetching(LayerSchedule):
    """DWDP: the whole model on this rank, each MoE layer's experts run from two stacks — the
    resident ones and the ones the prefetcher pulled — never merged (unless ``merge``: the ablation)."""

    def __init__(self, stages: AttentionStages, prefetcher, merge: bool = False, store=None):
        super().__init__(stages)
        self.prefetcher, self.store = prefetcher, store  # the store keeps our published experts mapped
        self.experts_op = experts_merged if merge else experts_list

    def run(self, flights: list[InFlight]) -> None:
        (f,) = flights
        s, m = self.stages, self.stages.model
        n = f.hidden.shape[0]
        for layer in range(s.cfg.num_layers):
            if not s.attend(layer, f):
                continue
            c1, a = time.monotonic(), f.attn
            ids, wts = s.route(layer, f, a.moe_input)  # [n, K]
            plan = plan_pairs(ids, self.prefetcher.index)
            w0 = time.monotonic()
            # NOTE: acquired and released even for a failed batch: the copy thread's ping-pong
            # must stay in step with the layers
            parts = self.prefetcher.acquire(layer)
            e0 = time.monotonic()
            try:
                f.hidden = guarded(f, f"experts of layer {layer}", lambda: m.combine(layer, a, weighted_sum(
                    n, plan, self.experts_op(parts, a.moe_input[plan.token_index], plan.counts), wts)),
                    lambda: s.zeros(n))
            finally:
                self.prefetcher.release(layer)
            c2 = time.monotonic()
            # every pair is computed here (resident or pulled, a rank runs every expert): a shape, not a read back
            s.tracer.add("experts", e0, c2, layer=layer, tokens=ids.numel())
            f.wait_s += e0 - w0
            f.compute_s += (w0 - c1) + (c2 - e0)

    def memory(self) -> dict[str, int]:
        return {"pull_buffers": self.prefetcher.buffer_bytes}

    def close(self) -> None:
        self.prefetcher.close()
        if self.store is not None:
            self.store.close()
