"""AFD as the engine runs it: ``AfdScheduler`` gives each of the M attention instances m
micro-batches per step; every step ends when all M have sampled.

Within a step the layers pipeline (DBO): an instance runs micro-batch u's attention, dispatches,
and goes on to u+1 while the daemons compute u; a daemon starts (layer, u) once every instance
it serves has dispatched it and it finished (layer, u-1); an instance starts (layer+1, u) once
(layer, u) is combined back and its own previous attention is done. The step's timeline is a
closed form over layers x micro-batches (one event per step), as the engine's lockstep makes it.

With the router on the attention side an instance sends one row per (token, expert) pair and gets
pairs back; with ``router: ffn`` it sends each token row once to every daemon it uses and gets a
weighted sum back from each (FastAFD's daemons route, §3). Overlap scheduling hides the host's
per-step work (``host_step_s``); without it every step pays it (FastAFD §5's ablation).
"""
from __future__ import annotations

from moeflow.sim.ports import Ports
from moeflow.sim.shape import AttnShape
from moeflow.sim.step_system import StepSystem


def _uniform_shift(before: list[float] | None, after: list[float]) -> float | None:
    """The common increment when ``after`` is ``before`` moved uniformly (else None).

    NOTE: one MoE layer maps the timeline's state (instances, returns, daemons) by maxes and sums
    of fixed costs, so it commutes with a uniform shift: once a layer moves every entry by the same
    amount, every later layer moves it by that amount again, and the rest is a closed form."""
    if before is None:
        return None
    d = [a - b for a, b in zip(after, before)]
    tol = 1e-9 * max(abs(d[0]), 1e-9)
    return d[0] if all(abs(x - d[0]) <= tol for x in d) else None


class AfdSystem(StepSystem):
    def __init__(self, spec, cost, trace_until_s=0.0):
        super().__init__(spec, cost, trace_until_s)
        self.sched = self._scheduler()
        self.busy_s = {"attention": 0.0, "ffn": 0.0}
        self.members(spec.layout)

    def members(self, lay) -> None:
        """Who serves from the next step: ``lay``'s instances and daemons (an elastic system changes it)."""
        self.layout, m = lay, self.model
        self.served = [lay.served_by(j) for j in range(lay.ffn_workers)]
        self.ffns = [lay.ffns_of(i) for i in range(lay.attn_workers)]
        self.local = [len(ids) for ids in lay.experts_held(m.num_experts)]
        self.num_entities = {"attention": lay.attn_workers, "ffn": lay.ffn_workers}
        # compute jitter (sim/jitter.py) as its expected cost, not drawn: a daemon takes (layer, u) once
        # every instance sent it, an instance goes on once its daemons answered; drawn factors would
        # walk every layer of every step (no periodic shortcut), too slow for serving runs
        self.slow_attn = self.jitter.expected_max(lay.attn_workers)
        self.slow_ffn = self.jitter.expected_max(lay.ffn_workers)

    def run_step(self, works, now: float) -> None:
        m = self.model
        c, cf, cl = self.cost_of("attention"), self.cost_of("ffn"), self.link_cost("attention", "ffn")
        ubs = [w.batches for w in works]  # [instance][micro-batch]
        shapes = [[AttnShape.of_batch(b, m.index_topk) for b in bs] for bs in ubs]
        attn = [[c.attention_s(s, 1, False) for s in ss] for ss in shapes]
        dense = [[c.attention_s(s, 1, True) for s in ss] for ss in shapes]
        tokens = [[s.num_tokens for s in ss] for ss in shapes]
        nub = len(ubs[0])
        share = [1 / len(f) for f in self.ffns]  # "all": a daemon gets its 1/N of each token's experts
        ffn = [[cf.experts_s(round(sum(tokens[i][u] * m.top_k * share[i] for i in srv)), self.local[j])
                for u in range(nub)] for j, srv in enumerate(self.served)]
        # every message crosses two ports (its sender's out, its receiver's in), each FIFO: a daemon
        # takes M instances' rows through one link, as dep's all-to-all waits for its busiest endpoint
        lat, bw = cl.transfer_s(0.0), cl.link_bw_Bps
        out = [[self._sent_bytes(i, t) / len(self.ffns[i]) / bw for t in ts]
               for i, ts in enumerate(tokens)]  # one message to one daemon, per micro-batch
        back = [[self._back_bytes(i, t) / len(self.ffns[i]) / bw for t in ts] for i, ts in enumerate(tokens)]
        sa, sf = self.slow_attn, self.slow_ffn  # (layer, u) waits for the slowest instance / daemon
        inst = [now] * len(ubs)  # when each instance is free
        ready = [[now] * nub for _ in ubs]  # when (layer, u)'s input is back on the instance
        daemon = [now] * len(ffn)
        ports = Ports(len(ubs), len(ffn), now)
        before = None
        for layer in range(m.num_layers):
            is_dense = layer < m.num_dense_layers
            sent = [[0.0] * nub for _ in ubs]
            for u in range(nub):
                for i in range(len(ubs)):
                    inst[i] = self.finish_at(max(inst[i], ready[i][u]), (dense[i][u] if is_dense else attn[i][u]) * sa)
                    sent[i][u] = inst[i]
                    if is_dense:
                        ready[i][u] = inst[i]
            if is_dense:
                continue
            for u in range(nub):
                arrive = ports.dispatch([s[u] for s in sent], self.ffns, [o[u] for o in out], lat)
                for j, srv in enumerate(self.served):
                    daemon[j] = self.finish_at(max(daemon[j], arrive[j]), ffn[j][u] * sf)
                got = ports.combine(daemon, self.served, [b[u] for b in back], lat)
                for i in range(len(ubs)):
                    ready[i][u] = got[i]
            state = [*inst, *(x for r in ready for x in r), *daemon, *ports.state()]
            # the core calendar (sim/cores.py) is state the shift does not see: walk every layer there
            shift = None if self.cores is not None else _uniform_shift(before, state)
            if shift is not None:  # periodic: every later MoE layer moves all of it by the same shift
                k = m.num_layers - layer - 1
                inst = [x + k * shift for x in inst]
                ready = [[x + k * shift for x in r] for r in ready]
                break
            before = state
        end = max(max(inst[i], *ready[i]) for i in range(len(ubs)))
        end = max(self.finish_at(end, max(c.head_s(s, 1) for s in ss)) for ss in shapes)
        if not self.layout.overlap_scheduling:
            end += c.host_step_s
        owns = []
        for i, bs in enumerate(ubs):
            own = sum(m.num_dense_layers * dense[i][u] + m.num_moe_layers * attn[i][u] for u in range(nub))
            owns.append(own)
            self.busy_s["attention"] += own
            self.started([s.request_id for b in bs for s in b.seqs], own, now)
        self.stepped(owns, [max(inst[i], *ready[i]) for i in range(len(ubs))], now, end)
        self.busy_s["ffn"] += m.num_moe_layers * sum(map(sum, ffn))
        if now < self.trace_until_s:
            for i in range(len(ubs)):
                self.span(f"attention{i}/main", "step", now, end)
        self.loop.at(end, self._step_done, works)

    def stepped(self, owns: list[float], done_s: list[float], start_s: float, end_s: float) -> None:
        """A step spans [start_s, end_s]; instance i computed ``owns[i]`` of it and had its last
        micro-batch back at ``done_s[i]``."""

    def _sent_bytes(self, instance: int, num_tokens: int) -> float:
        """What ``instance`` sends its daemons for one micro-batch of one layer."""
        c, m = self.cost, self.model
        if self.layout.router == "ffn":  # token rows, once to each daemon
            return num_tokens * m.hidden_size * m.act_bytes * len(self.ffns[instance])
        return c.dispatch_bytes(num_tokens)

    def _back_bytes(self, instance: int, num_tokens: int) -> float:
        c, m = self.cost, self.model
        if self.layout.router == "ffn":  # one weighted sum per token from each daemon
            return num_tokens * m.hidden_size * m.base_bytes * len(self.ffns[instance])
        return c.combine_bytes(num_tokens)

    def _step_done(self, works) -> None:
        now = self.loop.now
        for w in works:
            for b in w.batches:
                if b.seqs:
                    finished = self.sched.update(w.group, b, {s.request_id: 0 for s in b.seqs if s.is_last_chunk})
                    self.sampled(b, finished, now)
        self._step()
