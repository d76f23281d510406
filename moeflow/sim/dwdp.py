"""DWDP as the engine runs it: ``DwdpScheduler`` gives each idle rank its next batch; a rank runs
every layer itself, its lacking experts pulled one MoE layer ahead into a two-slot buffer.

Per rank, a copy engine works through the MoE layers in the order every pass visits them (one pull
per MoE layer, endlessly): pull k starts once the copy engine is free and its slot was released
(the experts of pull k-2 have run), and lasts the transfer of the lacking experts' bytes. A layer's
experts start when both its attention is done and its pull is in: per layer
max(compute, prefetch) in steady state, as DWDP models it. Ranks never wait for one another; one
event per batch (its layer timeline has a closed form).
"""
from __future__ import annotations

from moeflow.core import Request
from moeflow.sim.shape import AttnShape
from moeflow.sim.system import System


class DwdpSystem(System):
    def __init__(self, spec, cost, trace_until_s=0.0):
        super().__init__(spec, cost, trace_until_s)
        layout, m = spec.layout, cost.model
        self.sched = self._scheduler()
        placement = layout.resident(m.num_experts)
        self.pull_bytes = [(m.num_experts - len(ids)) * m.expert_params * m.weight_bytes for ids in placement]
        n = layout.dp
        self.copy_free = [0.0] * n  # when each rank's copy engine is next free
        self.released = [[0.0, 0.0] for _ in range(n)]  # per rank and slot: when its last layer's experts ended
        self.cycle = [0] * n  # per rank: pulls issued so far (k)
        self.pulled_at: list[dict[int, float]] = [{} for _ in range(n)]  # per rank: pull k -> when it is in
        self.next_pass = [0] * n  # per rank: the pull index of its next pass's first MoE layer
        self.num_entities = {"rank": n}
        self.busy_s = {"rank": 0.0}
        self.pull_wait_s = 0.0  # summed over ranks: experts waiting on a late pull

    def add(self, request: Request) -> None:
        self.sched.add(request)
        self._schedule()

    def _schedule(self) -> None:
        for work in self.sched.schedule(self.loop.now):
            self._run(work.group, work.batches[0])

    def _pull_done(self, rank: int, k: int) -> float:
        """When pull k of ``rank`` is in (issuing the pulls up to it, in order, as the copy engine does)."""
        while self.cycle[rank] <= k:
            j = self.cycle[rank]
            start = max(self.copy_free[rank], self.released[rank][j % 2])
            self.copy_free[rank] = start + self.cost.transfer_s(self.pull_bytes[rank])
            self.pulled_at[rank][j] = self.copy_free[rank]
            self.cycle[rank] += 1
        return self.pulled_at[rank].pop(k)

    def _run(self, rank: int, batch) -> None:
        m, c = self.model, self.cost
        shape = AttnShape.of_batch(batch, m.index_topk)
        attn, attn_dense = c.attention_s(shape, 1, False), c.attention_s(shape, 1, True)
        experts = c.experts_s(round(shape.num_tokens * m.top_k), m.num_experts)  # every expert runs here
        t = now = self.loop.now
        k0 = self.next_pass[rank]
        for layer in range(m.num_layers):
            if layer < m.num_dense_layers:
                t += attn_dense
                continue
            t += attn
            k = k0 + layer - m.num_dense_layers
            ready = self._pull_done(rank, k) if self.pull_bytes[rank] else t
            self.pull_wait_s += max(0.0, ready - t)
            t = max(t, ready) + experts
            self.released[rank][k % 2] = t
        self.next_pass[rank] = k0 + m.num_moe_layers
        t += c.head_s(shape, 1)
        compute = m.num_dense_layers * attn_dense + m.num_moe_layers * (attn + experts) + c.head_s(shape, 1)
        self.busy_s["rank"] += compute
        self.started([s.request_id for s in batch.seqs], compute, now)
        if now < self.trace_until_s:
            self.span(f"rank{rank}/main", "batch", now, t)
        self.loop.at(t, self._done, rank, batch)

    def _done(self, rank: int, batch) -> None:
        finished = self.sched.update(rank, batch, {s.request_id: 0 for s in batch.seqs if s.is_last_chunk})
        self.sampled(batch, finished, self.loop.now)
        self.sched.release(rank)
        self._schedule()
