"""The synchronous baselines (ASAP §5.1 Default / ChunkedPrefill) as the real engine runs them:
``DepScheduler`` hands every rank one batch per global step, and every MoE layer is a barrier.

Because every layer of a step ends at a barrier, a step's length has a closed form: per layer, the
slowest rank's attention, the all-to-all dispatch, the expert compute, the all-to-all combine. One
event per step keeps the simulator fast; the trace still shows every layer of the window it covers.
"""
from __future__ import annotations

import math

from moeflow.sim.shape import AttnShape
from moeflow.sim.system import StepSystem


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
        self.remote_share = remote_share(cost.model, self.ep, spec.sim.dedup_dispatch)
        self.num_entities = {"rank": layout.dp}
        self.busy_s = {"rank": 0.0}
        # summed over ranks: a step's time by what the rank did (attention includes embedding and head)
        self.split_s = {"attention": 0.0, "ffn": 0.0, "transport": 0.0, "wait": 0.0}

    def run_step(self, works, now: float) -> None:
        batches = [w.batches[0] for w in works]
        m, c, tp = self.model, self.cost, self.layout.tp
        shapes = [AttnShape.of_batch(b, m.index_topk) for b in batches]
        tokens = [s.num_tokens for s in shapes]
        attn = [c.attention_s(s, tp, False) for s in shapes]
        attn_dense = [c.attention_s(s, tp, True) for s in shapes]
        head = [c.head_s(s, tp) for s in shapes]
        # balanced routing: every expert device gets its share of every rank's (token, expert) pairs
        experts = c.experts_s(round(sum(tokens) * m.top_k / self.ep), max(1, m.num_experts // self.ep))
        share = self.remote_share
        dispatch = c.all_to_all_s(max(c.dispatch_bytes(t) for t in tokens) / tp * share)
        combine = c.all_to_all_s(max(c.combine_bytes(t) for t in tokens) / tp * share)
        if not self.spec.sim.super_kernel:  # the host launches each MoE layer's kernels
            experts += c.host_dispatch_s
        moe_layer = max(attn) + dispatch + experts + combine
        dense_layer = max(attn_dense)
        step = max(head) + m.num_dense_layers * dense_layer + m.num_moe_layers * moe_layer
        for i, b in enumerate(batches):
            own = head[i] + m.num_dense_layers * attn_dense[i] + m.num_moe_layers * (attn[i] + experts)
            self.busy_s["rank"] += own
            mine = head[i] + m.num_dense_layers * attn_dense[i] + m.num_moe_layers * attn[i]
            self.split_s["attention"] += mine
            self.split_s["ffn"] += m.num_moe_layers * experts
            self.split_s["transport"] += m.num_moe_layers * (dispatch + combine)
            self.split_s["wait"] += step - mine - m.num_moe_layers * (experts + dispatch + combine)
            self.started([s.request_id for s in b.seqs], own, now)
        if now < self.trace_until_s:
            self._trace(now, attn, attn_dense, head, dispatch, experts, combine)
        self.loop.at(now + step, self._step_done, batches)

    def _step_done(self, batches) -> None:
        now = self.loop.now
        for rank, b in enumerate(batches):
            if not b.seqs:
                continue
            finished = self.sched.update(rank, b, {s.request_id: 0 for s in b.seqs if s.is_last_chunk})
            self.sampled(b, finished, now)
        self._step()

    def _trace(self, t, attn, attn_dense, head, dispatch, experts, combine) -> None:
        m = self.model
        for layer in range(m.num_layers):
            dense = layer < m.num_dense_layers
            a = attn_dense if dense else attn
            for rank, x in enumerate(a):
                self.span(f"rank{rank}/main", "attention", t, t + x)
                if x < max(a):
                    self.span(f"rank{rank}/main", "wait-sync", t + x, t + max(a))
            t += max(a)
            if dense:
                continue
            for rank in range(len(attn)):
                tr = f"rank{rank}/main"
                self.span(tr, "dispatch", t, t + dispatch)
                self.span(tr, "experts", t + dispatch, t + dispatch + experts)
                self.span(tr, "combine", t + dispatch + experts, t + dispatch + experts + combine)
            t += dispatch + experts + combine
        for rank, x in enumerate(head):
            self.span(f"rank{rank}/main", "head", t, t + x)
