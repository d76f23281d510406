"""pd whose prefill and decode instances follow the autoscaling controller while it serves (xPyD by
rate matching, ``scheduler/autoscale_pd.py``), fed by the same window code as the engine's
(``scheduler/load_window.PdWindow``) every ``sample_s`` of simulated time; a window with a change
under way decides nothing, as the engine skips it.

A decision is carried out as the engine carries it out (``engine/pd_members.py``), one change at a
time, prefill first:

- **up**: the new instance starts at the decision and serves once ready: ``member_start_s``
  (SimOptions) plus its share of the model's weights (each of its processes reads its own) over the
  link; from then on it takes prompts (prefill) or handoffs (decode);
- **down**: the last instances take nothing new from the decision on; a prefill instance leaves once
  every request it prefilled has left it (its KV read by a decode instance), a decode instance once
  its requests have finished (drained).

Each instance costs its processes from its start to its exit (``process_s``).
"""
from __future__ import annotations

import dataclasses
from functools import partial

from moeflow.experiment.system import autoscale_policy
from moeflow.scheduler.autoscale_pd import PdController
from moeflow.scheduler.handoff.sides import DecodeSide, PrefillSide
from moeflow.scheduler.load_window import PdWindow
from moeflow.sim.pd import PdSystem, _Copier


class ElasticPdSystem(PdSystem):
    def __init__(self, spec, cost, trace_until_s=0.0, make_system=None):
        super().__init__(spec, cost, trace_until_s, make_system)
        lay = self.layout
        policy, self.sample_s = autoscale_policy(spec)
        self.controller = PdController(policy, lay.prefill.num_processes, lay.decode.num_processes)
        self.cores = self.core_pool(self.controller.budget)
        for s in self.prefill + self.decode:
            s.cores = self.cores
        self.make_system, self.window = make_system, PdWindow(0.0)
        self.leaving = {"prefill": 0, "decode": 0}  # the last instances of a side, taking nothing new
        self.machine.live = lambda side, i: side != "decode" or i < self.decode_serving
        self.decoding: set[str] = set()
        self._todo: list[tuple[str, int, str]] = []
        self._change: tuple[str, int] | None = None
        self.changes: list[dict] = []
        self.windows: list[dict] = []
        self.warming = {"prefill": 0, "decode": 0}
        self.instance_s = {"prefill": 0.0, "decode": 0.0}
        self.gone: list = []  # instances that left: their compute stays in the totals
        self._since = 0.0
        self._busy_seen = 0.0

    # -- the controller's inputs -------------------------------------------------------------------

    @property
    def prefill_serving(self) -> int:
        return len(self.prefill) - self.leaving["prefill"]

    @property
    def decode_serving(self) -> int:
        return len(self.decode) - self.leaving["decode"]

    def _prefill_busy_s(self) -> float:
        return sum(s.compute_s() for s in self.prefill + [g for g, side in self.gone if side == "prefill"])

    def _landed(self, rid: str) -> None:
        handing = rid in self.machine.handoffs
        super()._landed(rid)
        if handing and rid not in self.machine.handoffs:
            self._decoding(rid, True)
        self._settle()  # its lease on a leaving prefill instance ended

    def _given_up(self, g) -> None:
        super()._given_up(g)
        if g.recompute_on is not None:
            self._decoding(g.handoff.request_id, True)

    def _decoding(self, rid: str, on: bool) -> None:
        (self.decoding.add if on else self.decoding.discard)(rid)
        self.window.decoding(len(self.decoding), self.loop.now)

    def _record(self, r, t, now, num_output=1, handoff_s=None) -> None:
        self.window.request(t.first_token_s, now, num_output, t.arrival_s)
        if r.request_id in self.decoding:
            self._decoding(r.request_id, False)
        super()._record(r, t, now, num_output, handoff_s)
        self._settle()

    def _tick(self) -> None:
        now = self.loop.now
        busy = self._prefill_busy_s()
        self.window.step(busy - self._busy_seen, 0.0)
        self._busy_seen = busy
        serving = self.decode[:self.decode_serving]
        kv = [s.kv_blocks() for s in serving]
        oldest = min((t for s in self.prefill if (t := s.oldest_unanswered_s()) is not None), default=None)
        sample = self.window.sample_pd(
            now, self.prefill_serving, len(serving), self.layout.prefill.num_processes,
            sum(len(s.track) for s in self.prefill), len(self.waiting), sum(f for f, _ in kv), sum(n for _, n in kv),
            oldest)
        if self._change is None and not self._todo:
            self.windows.append({k: round(v, 4) if isinstance(v, float) else v for k, v in vars(sample).items()})
            if (d := self.controller.observe(sample)) is not None:
                sides = [(side, n) for side, n, cur in (("prefill", d.prefill, sample.prefill),
                                                        ("decode", d.decode, sample.decode)) if n != cur]
                why = d.reason.split("+") if len(sides) == 2 and "+" in d.reason else [d.reason] * len(sides)
                self._todo = [(side, n, r) for (side, n), r in zip(sides, why)]  # each side its own reason
                self._begin()
        self._settle()
        self.loop.timer(now + self.sample_s, self._tick)

    # -- carrying a change out ---------------------------------------------------------------------

    def _account(self) -> None:
        now = self.loop.now
        for side in ("prefill", "decode"):
            self.instance_s[side] += (len(getattr(self, side)) + self.warming[side]) * (now - self._since)
        self._since = now

    def _begin(self) -> None:
        if not self._todo:
            return
        side, target, reason = self._todo.pop(0)
        now, instances = self.loop.now, getattr(self, side)
        cur = len(instances)
        self.changes.append({"side": side, "before": cur, "after": target, "reason": reason, "asked_s": now,
                             "done_s": None})
        self._change = (side, target)
        self._account()
        if target > cur:
            self.warming[side] = target - cur
            lay = getattr(self.layout, side)
            m = self.model
            weights = (m.attention_side_bytes + m.expert_bytes * m.num_experts * m.num_moe_layers) / lay.num_processes
            ready = now + self.spec.sim.member_start_s + self.link_cost(side, side).transfer_s(weights)
            self.loop.timer(ready, self._joined)
        else:
            self.leaving[side] = cur - target
            self._settle()

    def _joined(self) -> None:
        side, target = self._change
        self._account()
        self.warming[side] = 0
        instances, lay = getattr(self, side), getattr(self.layout, side)
        while len(instances) < target:
            i = len(instances)
            if side == "prefill":
                s = self._instance(self.make_system, lay, f"prefill{i}", partial(self._prefilled, i), "prefill")
                self.machine.prefill.append(PrefillSide(s.handoff_port(), _Copier(self, self._copied_out)))
            else:
                s = self._instance(self.make_system, lay, f"decode{i}", self._decoded, "decode")
                self.machine.decode.append(DecodeSide(s.handoff_port(), _Copier(self, self._landed)))
            instances.append(s)
        self._done()
        self._place()

    def _settle(self) -> None:
        """A leaving instance that holds nothing more leaves."""
        if self._change is None or self.leaving[self._change[0]] == 0:
            return
        side, target = self._change
        instances = getattr(self, side)
        # a prefill instance holds its prompts and the leases of what it prefilled; a decode one what
        # decodes there (its track) and the handoffs that reserved its blocks
        if any(instances[i].track or any(getattr(h, side) == i for h in self.machine.handoffs.values())
               for i in range(target, len(instances))):
            return
        self._account()
        while len(instances) > target:
            self.gone.append((instances.pop(), side))
            getattr(self.machine, side).pop()
        self.leaving[side] = 0
        self._done()

    def _done(self) -> None:
        side, target = self._change
        self.layout = dataclasses.replace(self.layout, **{f"{side}_instances": target})
        self.changes[-1]["done_s"] = self.loop.now
        self._change = None
        self._begin()

    # -- the run -------------------------------------------------------------------------------------

    def run(self, workload, stop=None):
        self.loop.timer(self.sample_s, self._tick)
        res = super().run(workload, stop)
        lay = self.layout
        res.process_s = (self.instance_s["prefill"] * lay.prefill.num_processes
                         + self.instance_s["decode"] * lay.decode.num_processes)
        res.changes, res.windows = self.changes, self.windows
        return res

    def totals(self):
        """Per role, the mean processes over the run; the compute of the instances that left included."""
        self._account()
        busy_s, entities, preemptions, split_s = super().totals()
        end = max(self.loop.now, 1e-12)
        for s, side in self.gone:
            b, _, p, _ = s.totals()
            preemptions += p
            for role, v in b.items():
                busy_s[f"{side}.{role}"] = busy_s.get(f"{side}.{role}", 0.0) + v
        for key in entities:
            side = key.split(".")[0]
            per = entities[key] / max(1, len(getattr(self, side)))
            entities[key] = per * self.instance_s[side] / end
        return busy_s, entities, preemptions, split_s
