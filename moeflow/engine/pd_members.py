"""A pd deployment's instances that join and leave while it serves: X prefill -> X', Y decode -> Y'
(``POST /scale {"prefill": X'}`` or ``{"decode": Y'}``, ``LLM.scale(prefill=...)``, the xPyD
controller of ``--autoscale``).

- **up**: the new instance is built on a thread of its own (its workers forked by the fork server,
  its weights loaded) while the deployment serves; a failed build fails only its change. Once built
  it joins between two steps: a prefill instance takes prompts from then on, a decode instance
  handoffs (the handoffs' state machine gets its side).
- **down**: the last instances take nothing new from the request on (a prefill instance no prompt,
  a decode instance no handoff or recompute); a prefill instance leaves once every request it
  prefilled has left it (its KV read by a decode instance, or given up), a decode instance once its
  requests have finished (drained); then it is shut down and its side dropped.

Only the last instances leave, so the indices of those that stay never change. One change at a time.
"""
from __future__ import annotations

import dataclasses
import threading

from moeflow.config import ConfigError
from moeflow.engine.base import Engine, clock
from moeflow.engine.scale_event import ScaleEvent, event_counts, scale_event
from moeflow.scheduler.handoff.sides import DecodeSide, PrefillSide

SIDES = ("prefill", "decode")


class PdMembers:
    def __init__(self, engine):
        """``engine``: the ``PdEngine``, its handoffs' machine built; a side may grow to its layout's
        ``max_*_instances`` (none: it stays as it started)."""
        lay = engine.layout
        self.engine = engine
        self.max = {side: getattr(lay, f"max_{side}_instances") or getattr(lay, f"{side}_instances") for side in SIDES}
        self.leaving = {"prefill": 0, "decode": 0}  # the last instances of a side, taking nothing new
        self.events: list[ScaleEvent] = []
        self._built: list = []  # the joiners' engines, once their thread has built them
        self._error: list[str] = []
        self._thread: threading.Thread | None = None
        live = engine.machine.live  # a leaving decode instance takes no handoff (nor a recompute)
        engine.machine.live = lambda side, i: live(side, i) and (side != "decode" or i < self.serving(side))

    @property
    def busy(self) -> bool:
        return bool(self.events) and self.events[-1].outcome == "running"

    def serving(self, side: str) -> int:
        return len(getattr(self.engine, side)) - self.leaving[side]

    def scale(self, prefill: int | None, decode: int | None, other: dict) -> dict:
        """``PdEngine.scale``: one side's target; the other modes' names (``ffn``, ``ep_size``...) refused."""
        asked = sorted(k for k, v in other.items() if v is not None and k != "drain")
        if asked or (prefill is not None and decode is not None):
            raise ConfigError(f"scale: a pd deployment changes its prefill or its decode instances, one side at a "
                              f"time (prefill, decode), got {asked or ['prefill', 'decode']}")
        for side, target in (("prefill", prefill), ("decode", decode)):
            if target is not None:
                self.ask(side, target)
        return self.status()

    def ask(self, side: str, target: int) -> None:
        now = self.serving(side)
        if target == now:
            return
        if self.busy:
            e = self.events[-1]
            raise ConfigError(f"scale {side}: a change ({e.kind} {e.before} -> {e.after}) is under way; ask again once "
                              f"GET /scale says it is done")
        if not 1 <= target <= self.max[side]:
            raise ConfigError(f"scale {side}: {target} instances is outside [1, {self.max[side]}] (the most is "
                              f"max_{side}_instances, --max-{side}-instances)")
        self.events.append(ScaleEvent(side, now, target, clock()))
        if target < now:
            self.leaving[side] = now - target
            self.turn()
            return
        layout = getattr(self.engine.layout, side)
        self._built, self._error = [], []

        def build() -> None:
            try:
                for _ in range(target - now):
                    self._built.append(self.engine._instance(layout))
                    check_compatible(self.engine.prefill[0], self._built[-1])
            except Exception as e:  # noqa: BLE001  (a failed join fails its change, not the deployment)
                self._error.append(f"{type(e).__name__}: {e}")
        self._thread = threading.Thread(target=build, name=f"pd-join-{side}", daemon=True)
        self._thread.start()

    def turn(self) -> None:
        """Between steps: the change under way goes as far as it can."""
        if not self.busy:
            return
        e = self.events[-1]
        if e.after > e.before:
            self._join(e)
        else:
            self._leave(e)

    def _join(self, e: ScaleEvent) -> None:
        if self._thread is None or self._thread.is_alive():
            return
        self._thread = None
        if self._error:
            for x in self._built:
                x.shutdown()
            self._end(e, f"failed: {self._error[0]}")
            return
        eng, drv = self.engine, self.engine.driver
        instances = getattr(eng, e.kind)
        for x in self._built:
            instances.append(x)
            getattr(drv.machine, e.kind).append((PrefillSide if e.kind == "prefill" else DecodeSide)(
                *drv._port(e.kind, len(instances) - 1)))
        self._built = []
        eng.layout = dataclasses.replace(eng.layout, **{f"{e.kind}_instances": len(instances)})
        self._end(e, "done")

    def _leave(self, e: ScaleEvent) -> None:
        eng = self.engine
        instances, target = getattr(eng, e.kind), e.after
        held = set(range(target, len(instances)))
        if e.switched_s is None:
            e.switched_s = clock()  # the deployment serves without them from the request on
        # a prefill leaver holds its prompts and the leases of what it prefilled; a decode one its requests
        # and the handoffs that reserved its blocks
        if any(side == e.kind and i in held for side, i in eng.where.values()) or any(
                getattr(h, e.kind) in held for h in eng.handoffs.values()):
            return
        drv = eng.driver
        while len(instances) > target:
            i = len(instances) - 1
            instances.pop().shutdown()
            getattr(drv.machine, e.kind).pop()
            drv.copiers.pop((e.kind, i), None)
        self.leaving[e.kind] = 0
        eng.layout = dataclasses.replace(eng.layout, **{f"{e.kind}_instances": target})
        self._end(e, "done")

    def _end(self, e: ScaleEvent, outcome: str) -> None:
        now = clock()
        e.outcome = outcome
        if outcome == "done":
            e.switched_s = e.switched_s if e.switched_s is not None else now
            e.left_s = now

    def status(self) -> dict:
        out = {side: self.serving(side) for side in SIDES}
        out |= {f"{side}_capacity": self.max[side] for side in SIDES}
        out |= {"in_progress": self.busy, "events": [scale_event(e) for e in self.events]}
        if self.busy:
            e = self.events[-1]
            out[f"{e.kind}_target"] = e.after
        return out

    def counts(self) -> tuple[tuple[str, str, int], ...]:
        return event_counts(self.events)

    def shutdown(self) -> None:
        """A join under way is waited for and its instances stopped (they never served)."""
        if self._thread is not None:
            self._thread.join()
        for x in self._built:
            x.shutdown()
        self._built = []


def check_compatible(prefill: Engine, decode: Engine) -> None:
    """A decode instance must run the prefill instance's model in its dtype, or the KV means nothing."""
    a, b = prefill.model_config, decode.model_config
    if a != b or prefill.config.dtype != decode.config.dtype or prefill.config.kv_block_size <= 0:
        raise ConfigError(f"the decode layout runs {b.architecture} ({b.num_layers} layers, {decode.config.dtype}) "
                          f"but the prefill layout runs {a.architecture} ({a.num_layers} layers, "
                          f"{prefill.config.dtype}): a KV cache can only pass between the same model and dtype")
