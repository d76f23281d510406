"""ASAP (§3) as the real engine runs it: ``AsapScheduler`` hands work items to idle attention
groups; each batch walks its layers on its own, joined to the MoE workers by one-sided transfers.

Entities: ``attn_dp`` attention groups (a compute resource with a ready queue: two interleaved
batches take turns) and ``moe_workers`` expert devices, each with a receive port, a compute
stream and a send port. Ports and compute streams are FIFO, so a dispatch can be priced through
every worker the moment it is sent: two events per batch and layer (attention done, combine back).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from moeflow.core import Batch, Request, Work
from moeflow.sim.shape import AttnShape
from moeflow.sim.system import System


@dataclass
class _Flight:
    """One batch on its way through the layers."""

    group: int
    batch: Batch
    attn_s: float  # one MoE layer's attention block on the group
    attn_dense_s: float
    # [MoE layer (one row for all layers when expert loads are balanced and undisturbed), MoE worker]:
    pairs: np.ndarray  # (token, expert) pairs sent to the worker (its dispatch and combine size)
    experts_s: np.ndarray  # the layer's experts on the worker
    # derived once per batch, not per layer: the ports' seconds and each row's totals
    in_add: np.ndarray  # pairs x seconds per pair on the receive link
    out_add: np.ndarray
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
    vectorised = True  # price all MoE workers of a layer with array operations (False: the loop, its oracle)

    def __init__(self, spec, cost, trace_until_s=0.0):
        super().__init__(spec, cost, trace_until_s)
        cfg = spec.layout
        self.sched = self._scheduler()
        self.overlap = cfg.comm_threads and spec.sim.comm_overlap  # MoE workers receive/compute/send at once
        self.groups = [_Group() for _ in range(cfg.attn_dp)]
        e = cfg.moe_workers
        self.local_experts = max(1, self.model.num_experts // e)
        self.moe_in_free = np.zeros(e)  # receive port
        self.moe_free = np.zeros(e)  # compute stream
        self.moe_out_free = np.zeros(e)  # send port
        self.loads = self.expert_loads(e)
        self.bw = self.cost.link_bw_Bps
        # seconds one (token, expert) pair takes on a link, sent to the experts and back
        self.in_s, self.out_s = (self.cost.dispatch_bytes(1) / self.model.top_k / self.bw,
                                 self.cost.combine_bytes(1) / self.model.top_k / self.bw)
        self.latency = self.cost.transfer_s(0)
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
                        pairs, times, pairs * self.in_s, pairs * self.out_s, times.sum(axis=1).tolist(),
                        (pairs.sum(axis=1) * self.out_s / cfg.attn_tp).tolist(),
                        j.factors(m.num_layers, cfg.attn_tp).max(axis=1).tolist() if j.on else None)
            self.started([s.request_id for s in b.seqs], m.num_dense_layers * f.attn_dense_s
                          + m.num_moe_layers * f.attn_s, now)
            g.ready.append(f)
        self._run_group(work.group)

    def _run_group(self, gid: int) -> None:
        g = self.groups[gid]
        if g.busy or not g.ready:
            return
        f = g.ready.popleft()
        g.busy = True
        now = self.loop.now
        dense = f.layer < self.model.num_dense_layers
        dur = (f.attn_dense_s if dense else f.attn_s) * (f.attn_f[f.layer] if f.attn_f else 1.0)
        self.busy_s["attention"] += dur
        end = self.finish_at(now, dur, self.layout.attn_tp)
        if now < self.trace_until_s:
            self.span(f"attn{gid}/main", f"attention L{f.layer}", end - dur, end)
        self.loop.at(end, self._attention_done, f)

    def _attention_done(self, f: _Flight) -> None:
        now = self.loop.now
        g = self.groups[f.group]
        g.busy = False
        if f.layer < self.model.num_dense_layers:
            self._next_layer(f)
        else:
            self.loop.at(self._through_experts(f, now), self._combined, f)
        self._run_group(f.group)

    def _through_experts(self, f: _Flight, sent_s: float) -> float:
        """Price the dispatch, expert compute and combine of one layer on every MoE worker (FIFO
        ports and streams); returns when the last combine has reached the group."""
        i = f.layer - self.model.num_dense_layers
        t, p = i if len(f.busy_s) > 1 else 0, i if len(f.gather_s) > 1 else 0
        self.busy_s["moe"] += f.busy_s[t]
        if self.vectorised and self.cores is None and not sent_s < self.trace_until_s:
            back = self._workers_at_once(f.in_add[p], f.experts_s[t], f.out_add[p], sent_s)
        else:
            back = self._worker_by_worker(f, f.pairs[p].tolist(), f.experts_s[t].tolist(), sent_s)
        g = self.groups[f.group]
        # the group's T devices take the combines in through its links, one message after another
        arrive = max(back, g.in_port_free_s + f.gather_s[p])
        g.in_port_free_s = arrive
        return arrive

    def _workers_at_once(self, in_add: np.ndarray, times: np.ndarray, out_add: np.ndarray, sent_s: float) -> float:
        """The fast path: the workers' FIFO recurrences are independent, so one array operation
        prices them all (``_worker_by_worker`` is its oracle, and the only path with shared cores
        or a trace)."""
        lat = self.latency
        in_free, free, out_free = self.moe_in_free, self.moe_free, self.moe_out_free
        if self.overlap:
            np.maximum(in_free, sent_s, out=in_free)
            in_free += in_add
            np.maximum(in_free + lat, free, out=free)
            free += times
            np.maximum(free, out_free, out=out_free)
            out_free += out_add
            return float(out_free.max()) + lat
        np.maximum(free, sent_s + lat, out=free)  # one stream: receive, compute, send
        free += in_add
        free += times
        free += out_add
        return float(free.max()) + lat

    def _worker_by_worker(self, f: _Flight, pairs: list[float], times: list[float], sent_s: float) -> float:
        lat, in_s, out_s = self.latency, self.in_s, self.out_s
        in_free, free, out_free = self.moe_in_free, self.moe_free, self.moe_out_free
        cores, now = self.cores, self.loop.now
        back = 0.0
        for w in range(self.layout.moe_workers):
            if self.overlap:
                recv_end = max(sent_s, in_free[w]) + pairs[w] * in_s
                in_free[w] = recv_end
                start = max(recv_end + lat, free[w])
                if cores is not None:
                    start = cores.reserve(start, times[w], now)
                end = start + times[w]
                free[w] = end
                send_end = max(end, out_free[w]) + pairs[w] * out_s
                out_free[w] = send_end
            else:  # one stream: receive, compute and send one after another, all on the worker's core
                start = max(sent_s + lat, free[w])
                if cores is not None:
                    start = cores.reserve(start, pairs[w] * (in_s + out_s) + times[w], now)
                end = start + pairs[w] * in_s + times[w]
                send_end = end + pairs[w] * out_s
                free[w] = send_end
            if start < self.trace_until_s:
                self.span(f"moe{w}/main", f"experts L{f.layer} g{f.group}", start, end)
            back = max(back, send_end + lat)
        return back

    def _combined(self, f: _Flight) -> None:
        self._next_layer(f)
        self._run_group(f.group)

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
