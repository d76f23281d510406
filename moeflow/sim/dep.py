"""The synchronous baselines (ASAP §5.1 Default / ChunkedPrefill) as the real engine runs them:
``DepScheduler`` hands every rank one batch per global step, and every MoE layer is a barrier.

Because every layer of a step ends at a barrier, a step's length has a closed form (walked layer
by layer instead where the ranks share fewer cores than they are, sim/cores.py): per layer, the
slowest rank's attention, the all-to-all dispatch, the most loaded expert device's compute, the
all-to-all combine. An all-to-all takes as long as its busiest endpoint: the rank that sends the
most or, with skewed expert loads (sim/expert_load.py), the device that receives the most. One
event per step keeps the simulator fast; the trace still shows every layer of the window it covers
(on shared cores, the step as one span).
"""
from __future__ import annotations

import math

import numpy as np

from moeflow.sim.shape import AttnShape
from moeflow.sim.step_system import StepSystem


def remote_share(model, ep: int, dedup: bool) -> float:
    """The fraction of a token's K expert rows that leave its device in the all-to-all: (ep-1)/ep of
    them when one row goes per (token, expert) pair (moeflow's engine); with ``dedup`` one row per
    remote device that holds any of its experts (DeepEP's dispatch layout), under uniform routing."""
    if not dedup:
        return (ep - 1) / ep
    e, k = model.num_experts, model.top_k
    elsewhere = e - e // ep  # experts not on a given device
    missed = math.comb(elsewhere, k) / math.comb(e, k)  # none of a token's K experts on that device
    return (ep - 1) * (1 - missed) / k


class DepSystem(StepSystem):
    def __init__(self, spec, cost, trace_until_s=0.0):
        super().__init__(spec, cost, trace_until_s)
        self.sched = self._scheduler()
        layout = spec.layout
        self.ep = layout.dp * layout.tp  # expert devices: every device of every rank
        self.loads = self.expert_loads(self.ep)
        self.local = max(1, cost.model.num_experts // self.ep)  # experts a device holds (an elastic one: its slots)
        self.remote_share = remote_share(cost.model, self.ep, spec.sim.dedup_dispatch)
        self.num_entities = {"rank": layout.dp}
        self.busy_s = {"rank": 0.0}
        # summed over ranks: a step's time by what the rank did (attention includes embedding and head)
        self.split_s = {"attention": 0.0, "ffn": 0.0, "transport": 0.0, "wait": 0.0}
        idle, c = AttnShape.of([], self.model.index_topk), self.cost  # an idle rank's dummy step
        self._idle = idle, c.attention_s(idle, layout.tp, False), c.attention_s(idle, layout.tp, True), c.head_s(idle, layout.tp)

    def run_step(self, works, now: float) -> None:
        batches = [w.batches[0] for w in works]
        m, c, tp = self.model, self.cost, self.layout.tp
        shapes, attn, attn_dense, head = [], [], [], []
        for b in batches:
            if b.seqs:
                s = AttnShape.of_batch(b, m.index_topk)
                s, a, d, h = s, c.attention_s(s, tp, False), c.attention_s(s, tp, True), c.head_s(s, tp)
            else:  # most ranks of a lightly loaded deployment idle: their dummy step's costs, kept
                s, a, d, h = self._idle
            shapes.append(s)
            attn.append(a)
            attn_dense.append(d)
            head.append(h)
        tokens = [s.num_tokens for s in shapes]
        dispatch, experts, combine, experts_mean, per_device = self._moe_layers(tokens)
        j = self.jitter
        # per layer, the slowest rank's attention (each rank's TP group waits for its slowest member)
        attn_moe = j.slowest(m.num_moe_layers, np.array(attn), tp)
        attn_dense_l = j.slowest(m.num_dense_layers, np.array(attn_dense), tp)
        sent, sent_back = sum(dispatch), sum(combine)
        if self.cores is None:
            step = (max(head) + float(attn_dense_l.sum()) + float(attn_moe.sum())
                    + sent + sum(experts) + sent_back)
        else:
            step = self._step_on_shared_cores(now, attn, attn_dense, head, dispatch, per_device, combine) - now
        for i, b in enumerate(batches):
            own = head[i] + m.num_dense_layers * attn_dense[i] + m.num_moe_layers * attn[i] + experts_mean
            self.busy_s["rank"] += own
            mine = head[i] + m.num_dense_layers * attn_dense[i] + m.num_moe_layers * attn[i]
            self.split_s["attention"] += mine
            # a rank's own expert device computes the mean load; waiting for the most loaded one is wait
            self.split_s["ffn"] += experts_mean
            self.split_s["transport"] += sent + sent_back
            self.split_s["wait"] += step - mine - experts_mean - sent - sent_back
            self.started([s.request_id for s in b.seqs], own, now)
        if now < self.trace_until_s:
            if self.cores is None:
                self._trace(now, attn, attn_dense, attn_moe, attn_dense_l, head, dispatch, experts, combine)
            else:  # the layers' times interleave with the core calendar: the step as a whole
                for rank in range(len(batches)):
                    self.span(f"rank{rank}/main", f"step ({self.cores.cores} shared cores)", now, now + step)
        self.loop.at(now + step, self._step_done, batches)

    def _step_on_shared_cores(self, now: float, attn: list[float], attn_dense: list[float], head: list[float],
                              dispatch: list[float], per_device: list[list[float]], combine: list[float]) -> float:
        """When the step ends if the ranks take turns on fewer cores than they are: every phase
        of a layer (attention, the experts) waits for its last rank or device, and each one's
        compute waits for a core. Returns the end time."""
        m, ranks, tp, t = self.model, range(len(attn)), self.layout.tp, now
        f_attn = self.jitter.factors(m.num_layers, len(attn), tp).max(axis=2)  # a TP group: its slowest member
        f_experts = self.jitter.factors(m.num_moe_layers, len(per_device[0]))
        for layer in range(m.num_layers):
            a = attn_dense if layer < m.num_dense_layers else attn
            t = max(self.finish_at(t, a[r] * f_attn[layer, r], tp) for r in ranks)
            if layer < m.num_dense_layers:
                continue
            i = layer - m.num_dense_layers
            t = max(self.finish_at(t + dispatch[i], x * f) for x, f in zip(per_device[i], f_experts[i])) + combine[i]
        return max(self.finish_at(t, head[r], tp) for r in ranks)

    def _moe_layers(self, tokens: list[int]):
        """Per MoE layer: the all-to-all dispatch, the slowest expert device's compute, the
        all-to-all combine; one rank's expert compute summed over the layers (for busy); and per
        MoE layer every expert device's compute (for shared cores)."""
        m, c, ep, n = self.model, self.cost, self.ep, self.model.num_moe_layers
        local = self.local
        share = self.remote_share  # the rows that leave the device (per pair, or per device with dedup)
        # each TP member of a rank sends 1/tp of its tokens' pairs; the busiest sender bounds the collective
        send = max(c.dispatch_bytes(t) for t in tokens) / self.layout.tp * share
        send_back = max(c.combine_bytes(t) for t in tokens) / self.layout.tp * share
        host = 0.0 if self.spec.sim.super_kernel else c.host_dispatch_s  # the host launches each MoE layer
        pairs = sum(tokens) * m.top_k
        if self.loads.balanced:  # every expert device its exact share; receivers no busier than senders
            experts = c.experts_s(round(pairs / ep), local) + host
            slowest = (self.jitter.slowest(n, np.full(ep, experts)).tolist() if self.jitter.on and pairs
                       else [experts] * n)
            return ([c.all_to_all_s(send)] * n, slowest, [c.all_to_all_s(send_back)] * n, n * experts,
                    [[experts] * ep] * n)
        loads = self.loads.draw(pairs)  # [L, ep]
        peak = loads.max(axis=1)  # the most loaded receiver of each layer
        per_pair_in, per_pair_out = c.dispatch_bytes(1) / m.top_k, c.combine_bytes(1) / m.top_k
        dispatch = c.all_to_all_s_many(np.maximum(send, peak * per_pair_in * share)).tolist()
        combine = c.all_to_all_s_many(np.maximum(send_back, peak * per_pair_out * share)).tolist()
        per_device = c.experts_s_many(loads, local) + host
        experts = self.jitter.slowest(n, per_device).tolist()  # the slowest device: load and jitter
        experts_mean = float(per_device.mean(axis=1).sum())
        return dispatch, experts, combine, experts_mean, per_device  # [L, ep], read only on shared cores

    def _step_done(self, batches) -> None:
        now = self.loop.now
        for rank, b in enumerate(batches):
            if not b.seqs:
                continue
            finished = self.sched.update(rank, b, {s.request_id: 0 for s in b.seqs if s.is_last_chunk})
            self.sampled(b, finished, now)
        self._step()

    def _trace(self, t, attn, attn_dense, attn_moe, attn_dense_l, head, dispatch, experts, combine) -> None:
        m = self.model
        for layer in range(m.num_layers):
            dense = layer < m.num_dense_layers
            a = attn_dense if dense else attn
            slowest = float(attn_dense_l[layer] if dense else attn_moe[layer - m.num_dense_layers])
            for rank, x in enumerate(a):
                self.span(f"rank{rank}/main", "attention", t, t + x)
                if x < slowest:
                    self.span(f"rank{rank}/main", "wait-sync", t + x, t + slowest)
            t += slowest
            if dense:
                continue
            i = layer - m.num_dense_layers
            d, x, cb = dispatch[i], experts[i], combine[i]
            for rank in range(len(attn)):
                tr = f"rank{rank}/main"
                self.span(tr, "dispatch", t, t + d)
                self.span(tr, "experts", t + d, t + d + x)
                self.span(tr, "combine", t + d + x, t + d + x + cb)
            t += d + x + cb
        for rank, x in enumerate(head):
            self.span(f"rank{rank}/main", "head", t, t + x)
