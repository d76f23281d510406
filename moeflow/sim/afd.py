"""AFD as the engine runs it: ``AfdScheduler`` gives each of the M attention instances m
micro-batches per step; every step ends when all M have sampled.

Within a step the layers pipeline (DBO): an instance runs micro-batch u's attention, dispatches,
and goes on to u+1 while the daemons compute u; a daemon starts (layer, u) once every instance
it serves has dispatched it and it finished (layer, u-1); an instance starts (layer+1, u) once
(layer, u) is combined back and its own previous attention is done. The step's timeline is a
closed form over layers x micro-batches (one event per step), as the engine's lockstep makes it.
The engine's overlap scheduling hides its own per-step overhead, which the simulator does not
charge anyway.
"""
from __future__ import annotations

from moeflow.sim.shape import AttnShape
from moeflow.sim.system import StepSystem


class AfdSystem(StepSystem):
    def __init__(self, spec, cost, trace_until_s=0.0):
        super().__init__(spec, cost, trace_until_s)
        self.sched = self._scheduler()
        lay, m = spec.layout, cost.model
        self.served = [lay.served_by(j) for j in range(lay.ffn_workers)]
        self.ffns = [lay.ffns_of(i) for i in range(lay.attn_workers)]
        self.local = [len(ids) for ids in lay.placement_of_experts(m.num_experts)]
        self.num_entities = {"attention": lay.attn_workers, "ffn": lay.ffn_workers}
        self.busy_s = {"attention": 0.0, "ffn": 0.0}

    def run_step(self, works, now: float) -> None:
        m, c = self.model, self.cost
        ubs = [w.batches for w in works]  # [instance][micro-batch]
        shapes = [[AttnShape.of_batch(b, m.index_topk) for b in bs] for bs in ubs]
        attn = [[c.attention_s(s, 1, False) for s in ss] for ss in shapes]
        dense = [[c.attention_s(s, 1, True) for s in ss] for ss in shapes]
        tokens = [[s.num_tokens for s in ss] for ss in shapes]
        nub = len(ubs[0])
        share = [1 / len(f) for f in self.ffns]  # "all": a daemon gets its 1/N of each token's experts
        ffn = [[c.experts_s(round(sum(tokens[i][u] * m.top_k * share[i] for i in srv)), self.local[j])
                for u in range(nub)] for j, srv in enumerate(self.served)]
        move = [[c.transfer_s(c.dispatch_bytes(t)) for t in ts] for ts in tokens]  # one way, per micro-batch
        back = [[c.transfer_s(c.combine_bytes(t)) for t in ts] for ts in tokens]
        inst = [now] * len(ubs)  # when each instance is free
        ready = [[now] * nub for _ in ubs]  # when (layer, u)'s input is back on the instance
        daemon = [now] * len(ffn)
        for layer in range(m.num_layers):
            is_dense = layer < m.num_dense_layers
            sent = [[0.0] * nub for _ in ubs]
            for u in range(nub):
                for i in range(len(ubs)):
                    inst[i] = max(inst[i], ready[i][u]) + (dense[i][u] if is_dense else attn[i][u])
                    sent[i][u] = inst[i] + (0.0 if is_dense else move[i][u])
                    if is_dense:
                        ready[i][u] = inst[i]
            if is_dense:
                continue
            for u in range(nub):
                for j, srv in enumerate(self.served):
                    daemon[j] = max([daemon[j]] + [sent[i][u] for i in srv]) + ffn[j][u]
                for i in range(len(ubs)):
                    ready[i][u] = max(daemon[j] for j in self.ffns[i]) + back[i][u]
        end = max(max(inst[i], *ready[i]) for i in range(len(ubs)))
        end += max(c.head_s(s, 1) for ss in shapes for s in ss)
        for i, bs in enumerate(ubs):
            own = sum(m.num_dense_layers * dense[i][u] + m.num_moe_layers * attn[i][u] for u in range(nub))
            self.busy_s["attention"] += own
            self.started([s.request_id for b in bs for s in b.seqs], own, now)
        self.busy_s["ffn"] += m.num_moe_layers * sum(map(sum, ffn))
        if now < self.trace_until_s:
            for i in range(len(ubs)):
                self.span(f"attention{i}/main", "step", now, end)
        self.loop.at(end, self._step_done, works)

    def _step_done(self, works) -> None:
        now = self.loop.now
        for w in works:
            for b in w.batches:
                if b.seqs:
                    finished = self.sched.update(w.group, b, {s.request_id: 0 for s in b.seqs if s.is_last_chunk})
                    self.sampled(b, finished, now)
        self._step()
