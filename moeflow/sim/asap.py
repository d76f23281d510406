"""ASAP (§3) as the real engine runs it: ``AsapScheduler`` hands work items to idle attention
groups; each batch walks its layers on its own, joined to the MoE workers by one-sided transfers.

Entities: ``attn_dp`` attention groups (a compute resource with a ready queue: two interleaved
batches take turns) and ``moe_workers`` expert devices, each with a receive port, a compute
stream and a send port. Ports and compute streams are FIFO, so a dispatch can be priced through
every worker the moment it is sent (``sim/moe_workers.py``): two events per batch and layer
(attention done, combine back). Nearly every one of them is the next event anyway when it is
scheduled, so it runs in place (``EventLoop.take``): a lone batch walks its layers without the heap.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from moeflow.core import Batch, Request, Work
from moeflow.sim.moe_workers import MoeWorkers
from moeflow.sim.shape import AttnShape
from moeflow.sim.system import System


@dataclass
class _Flight:
    """One batch on its way through the layers."""

    group: int
    batch: Batch
    attn_s: float  # one MoE layer's attention block on the group
    attn_dense_s: float
    # [MoE layer (one row for all layers when expert loads are balanced and undisturbed)][MoE worker]:
    pairs: np.ndarray  # (token, expert) pairs sent to the worker (its dispatch and combine size)
    experts_s: list[list[float]]  # the layer's experts on the worker
    # derived once per batch, not per layer: the ports' seconds and each row's totals
    in_add: list[list[float]]  # pairs x seconds per pair on the receive link
    out_add: list[list[float]]
    busy_s: list[float]  # per experts_s row: the workers' compute summed
    gather_s: list[float]  # per pairs row: the combines taken in through the group's links
    attn_f: list[float] | None = None  # per layer, the group's jitter factor (its slowest device's); None: 1
    layer: int = 0


@dataclass
class _Group:
    ready: deque = field(default_factory=deque)  # flights waiting for the attention stream
    busy: bool = False
    flights: int = 0  # unfinished batches of the current work item
    in_port_free_s: float = 0.0  # combines arrive through the group's links, one at a time
    done: list = field(default_factory=list)


class AsapSystem(System):
    # False: every layer's events through the event heap and the workers priced one by one: the oracle
    # of the fast path (events run in place, ``EventLoop.take``; the workers' recurrences on floats)
    fast = True

    def __init__(self, spec, cost, trace_until_s=0.0):
        super().__init__(spec, cost, trace_until_s)
        cfg = spec.layout
        self.sched = self._scheduler()
        self.overlap = cfg.comm_threads and spec.sim.comm_overlap  # MoE workers receive/compute/send at once
        self.groups = [_Group() for _ in range(cfg.attn_dp)]
        e = cfg.moe_workers
        self.local_experts = max(1, self.model.num_experts // e)
        self.loads = self.expert_loads(e)
        self.bw = self.cost.link_bw_Bps
        # seconds one (token, expert) pair takes on a link, sent to the experts and back
        self.in_s, self.out_s = (self.cost.dispatch_bytes(1) / self.model.top_k / self.bw,
                                 self.cost.combine_bytes(1) / self.model.top_k / self.bw)
        self.workers = MoeWorkers(e, self.overlap, self.cost.transfer_s(0))
        self._wakeup_at: float | None = None
        self.num_entities = {"attention": cfg.attn_dp, "moe": e}
        self.busy_s = {"attention": 0.0, "moe": 0.0}

    def add(self, request: Request) -> None:
        self.sched.add(request)
        self._schedule()

    def poke(self) -> None:
        self._schedule()

    def _schedule(self) -> None:
        now = self.loop.now
        for work in self.sched.schedule(now):
            self._start(work, now)
        due = self.sched.next_wakeup_s()
        if due is not None and due > now and (self._wakeup_at is None or due < self._wakeup_at or self._wakeup_at <= now):
            self._wakeup_at = due
            self.loop.at(due, self._schedule)

    def _start(self, work: Work, now: float) -> None:
        c, m, cfg = self.cost, self.model, self.layout
        g = self.groups[work.group]
        g.flights = len(work.batches)
        e = cfg.moe_workers
        host = 0.0 if self.spec.sim.super_kernel else c.host_dispatch_s
        for b in work.batches:
            shape = AttnShape.of_batch(b, m.index_topk)
            t = shape.num_tokens
            if self.loads.balanced:  # every worker its exact share
                pairs = np.full((1, e), t * m.top_k / e)
                times = np.full((1, e), c.experts_s(round(t * m.top_k / e), self.local_experts) + host)
            else:
                loads = self.loads.draw(t * m.top_k)  # [L, E] pairs per worker
                pairs, times = loads.astype(float), c.experts_s_many(loads, self.local_experts) + host
            j = self.jitter
            if j.on:  # every worker's time of every layer drawn apart; the layer waits for the last combine
                times = np.broadcast_to(times, (m.num_moe_layers, e)) * j.factors(m.num_moe_layers, e)
            f = _Flight(work.group, b, c.attention_s(shape, cfg.attn_tp, False), c.attention_s(shape, cfg.attn_tp, True),
                        pairs, times.tolist(), (pairs * self.in_s).tolist(), (pairs * self.out_s).tolist(),
                        times.sum(axis=1).tolist(), (pairs.sum(axis=1) * self.out_s / cfg.attn_tp).tolist(),
                        j.factors(m.num_layers, cfg.attn_tp).max(axis=1).tolist() if j.on else None)
            self.started([s.request_id for s in b.seqs], m.num_dense_layers * f.attn_dense_s
                          + m.num_moe_layers * f.attn_s, now)
            g.ready.append(f)
        nxt = self._start_attention(work.group)
        if nxt is not None:
            self.loop.at(nxt[0], self._attention_done, nxt[1])

    def _start_attention(self, gid: int) -> tuple[float, _Flight] | None:
        """The group's next ready flight starts its attention now: (when it ends, the flight); None
        while the group computes or has nothing ready."""
        g = self.groups[gid]
        if g.busy or not g.ready:
            return None
        f = g.ready.popleft()
        g.busy = True
        now = self.loop.now
        dense = f.layer < self.model.num_dense_layers
        dur = (f.attn_dense_s if dense else f.attn_s) * (f.attn_f[f.layer] if f.attn_f else 1.0)
        self.busy_s["attention"] += dur
        end = self.finish_at(now, dur, self.layout.attn_tp)
        if now < self.trace_until_s:
            self.span(f"attn{gid}/main", f"attention L{f.layer}", end - dur, end)
        return end, f

    def _attention_done(self, f: _Flight) -> None:
        self._flight(self._handle(f, True))

    def _combined(self, f: _Flight) -> None:
        self._flight(self._handle(f, False))

    def _handle(self, f: _Flight, attention: bool) -> tuple[float, _Flight, bool] | None:
        """``f``'s event now (its attention ended, or its combine is back); returns the one it
        leaves to schedule last."""
        if not (self.fast and self.cores is None):
            return self._after_attention(f) if attention else self._after_combine(f)
        if attention and f.layer < self.model.num_dense_layers:
            return self._after_attention(f)
        return self._moe_layers(f, not attention)

    def _flight(self, ev: tuple[float, _Flight, bool] | None) -> None:
        """``ev`` (when, the flight, whether its attention ends then or else its combine is back)
        and the events that follow it, run in place while each is the next event anyway; the first
        that is not goes on the heap."""
        loop = self.loop
        while ev is not None:
            t, f, attention = ev
            if not (self.fast and loop.take(t)):
                loop.at(t, self._attention_done if attention else self._combined, f)
                return
            ev = self._handle(f, attention)

    def _moe_layers(self, f: _Flight, combined: bool) -> tuple[float, _Flight, bool] | None:
        """``_after_attention`` (at a MoE layer) and ``_after_combine``, written out for the case
        that takes nearly all of a run's events, and run in place layer after layer while each
        event is the next one anyway: a group with no other flight ready (nor computing, when a
        combine comes back), cores of their own, outside the trace window. ``f``'s event is now:
        its combine back (``combined``) or its attention ended; returns the event left to
        schedule, as they do."""
        loop, g, busy, workers = self.loop, self.groups[f.group], self.busy_s, self.workers
        first, last = self.model.num_dense_layers, self.model.num_layers - 1
        by_layer_t, by_layer_p = len(f.busy_s) > 1, len(f.gather_s) > 1
        while True:
            if not combined:
                sent = loop.now
                if g.ready or sent < self.trace_until_s:
                    return self._after_attention(f)
                g.busy = False
                i = f.layer - first
                t, p = i if by_layer_t else 0, i if by_layer_p else 0
                busy["moe"] += f.busy_s[t]
                price = workers.price_free if workers.free_by(sent) else workers.price
                back = price(f.in_add[p], f.experts_s[t], f.out_add[p], sent)
                port = g.in_port_free_s + f.gather_s[p]
                arrive = back if back >= port else port
                g.in_port_free_s = arrive
                if not loop.take(arrive):  # the combine: the only event this attention leaves
                    loop.at(arrive, self._combined, f)
                    return None
            combined = False
            now = loop.now
            if f.layer == last or g.ready or g.busy or now < self.trace_until_s:
                return self._after_combine(f)
            f.layer += 1  # _next_layer and _start_attention: the group's stream takes f's next layer at once
            g.busy = True
            dur = f.attn_s * (f.attn_f[f.layer] if f.attn_f else 1.0)
            busy["attention"] += dur
            if not loop.take(now + dur):
                loop.at(now + dur, self._attention_done, f)
                return None

    def _after_attention(self, f: _Flight) -> tuple[float, _Flight, bool] | None:
        """``f``'s attention has ended: the group's stream is free, a MoE layer's dispatch goes out.
        Returns the event this leaves to schedule last (None: nothing)."""
        g = self.groups[f.group]
        g.busy = False
        if f.layer < self.model.num_dense_layers:
            self._next_layer(f)
            nxt = self._start_attention(f.group)
            return None if nxt is None else (*nxt, True)
        back = self._through_experts(f, self.loop.now)
        nxt = self._start_attention(f.group)
        if nxt is None:
            return back, f, False
        self.loop.at(back, self._combined, f)  # NOTE: before the group's next attention, as the heap orders ties
        return (*nxt, True)

    def _after_combine(self, f: _Flight) -> tuple[float, _Flight, bool] | None:
        self._next_layer(f)
        nxt = self._start_attention(f.group)
        return None if nxt is None else (*nxt, True)

    def _through_experts(self, f: _Flight, sent_s: float) -> float:
        """Price the dispatch, expert compute and combine of one layer on every MoE worker (FIFO
        ports and streams); returns when the last combine has reached the group."""
        i = f.layer - self.model.num_dense_layers
        t, p = i if len(f.busy_s) > 1 else 0, i if len(f.gather_s) > 1 else 0
        self.busy_s["moe"] += f.busy_s[t]
        if self.fast and self.cores is None and not sent_s < self.trace_until_s:
            back = self.workers.price(f.in_add[p], f.experts_s[t], f.out_add[p], sent_s)
        else:
            cores, now = self.cores, self.loop.now

            def span(w: int, start: float, end: float) -> None:
                if start < self.trace_until_s:
                    self.span(f"moe{w}/main", f"experts L{f.layer} g{f.group}", start, end)
            back = self.workers.price_one_by_one(
                f.pairs[p].tolist(), f.experts_s[t], sent_s, self.in_s, self.out_s,
                None if cores is None else (lambda ready, d: cores.reserve(ready, d, now)), span)
        g = self.groups[f.group]
        # the group's T devices take the combines in through its links, one message after another
        arrive = max(back, g.in_port_free_s + f.gather_s[p])
        g.in_port_free_s = arrive
        return arrive

    def _next_layer(self, f: _Flight) -> None:
        f.layer += 1
        g = self.groups[f.group]
        if f.layer < self.model.num_layers:
            g.ready.append(f)
            return
        g.done.append(f)
        g.flights -= 1
        if g.flights == 0:  # the work item is complete: sample, then report every batch
            shape = AttnShape.sum([AttnShape.of_batch(x.batch) for x in g.done])
            head = self.cost.head_s(shape, self.layout.attn_tp)
            self.started([s.request_id for x in g.done for s in x.batch.seqs], head / len(g.done), self.loop.now)
            self.busy_s["attention"] += head
            self.loop.at(self.finish_at(self.loop.now, head, self.layout.attn_tp), self._work_done, f.group)

    def _work_done(self, gid: int) -> None:
        now = self.loop.now
        g = self.groups[gid]
        for f in g.done:
            b = f.batch
            finished = self.sched.update(gid, b, {s.request_id: 0 for s in b.seqs if s.is_last_chunk})
            self.sampled(b, finished, now)
        g.done = []
        self.sched.release(gid)
        self._schedule()
