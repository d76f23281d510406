"""The simulator's fast paths against their oracles: the same run, bit for bit.

Events run in place (``EventLoop.take``) where the heap would pop them next anyway, and the
systems' own fast paths (``fast = False`` on a system class: every event through the heap, the
plain loops) must give identical points: every time, count and the stop rule's decision."""
from __future__ import annotations

import math

import pytest

from moeflow.experiment.serve import parse_experiment
from moeflow.measure.slo import SloMetric, StopRule
from moeflow.plan.candidates import check_memory, enumerate_candidates
from moeflow.sim.events import EventLoop
from moeflow.sim.hardware import hardware_preset
from moeflow.sim.model_spec import model_preset
from moeflow.sim.run import SYSTEMS, build_cost, run_point


def test_an_event_runs_in_place_only_when_the_heap_would_pop_it_next():
    loop, seen = EventLoop(), []

    def chain(name: str, t: float) -> None:
        seen.append((name, loop.now))
        if loop.take(t):  # its follow-up, in place
            seen.append((name + "'", loop.now))
        else:
            loop.at(t, seen.append, (name + "' queued", t))

    loop.at(1.0, chain, "a", 1.5)  # nothing due by 1.5: in place
    loop.at(2.0, chain, "b", 3.0)  # c is due at 3.0 and was queued first: it wins the tie
    loop.at(3.0, seen.append, ("c", 3.0))
    loop.run()
    assert seen == [("a", 1.0), ("a'", 1.5), ("b", 2.0), ("c", 3.0), ("b' queued", 3.0)]
    assert loop.num_events == 5  # the in-place event counts as one


def test_a_stop_checked_every_k_events_ends_an_in_place_chain_where_the_heap_would_end():
    def run(in_place: bool) -> tuple[int, float]:
        loop = EventLoop()

        def tick(k: int) -> None:
            t = loop.now + 1.0
            while in_place and k < 100 and loop.take(t):
                k, t = k + 1, t + 1.0
            if k < 100:
                loop.at(t, tick, k + 1)

        loop.at(0.0, tick, 0)
        loop.run(lambda: loop.now >= 10.0, every=4)
        return loop.num_events, loop.now

    assert run(True) == run(False) == (12, 11.0)  # the first check after now >= 10 is at event 12


_BASE = {"model": "deepseek-r1", "hardware": "gb200", "slo_ttft_s": 3.0, "slo_metric": "p90",
         "workload": {"kind": "uniform", "isl": 4096, "isl_ratio": 0.5, "output_len": 48, "num_requests": 16, "seed": 1}}


def _deepseek(name: str, devices: int = 8) -> dict:
    c = next(c for c in enumerate_candidates(devices) if c.name == name)
    c = check_memory(c, model_preset("deepseek-r1"), hardware_preset("gb200").hbm_bytes, 0.9, 4096 + 48, 8192, 256, 16)
    return c.system if c.kind != "pd" else {**c.system, "prefill_instances": 1, "decode_instances": 1}


def _both(system: dict, rate: float, base: dict = _BASE, stop: bool = True, num_requests: int | None = None):
    """The point with every fast path on, and with every system's turned off."""
    cfg = parse_experiment({**base, "rps": [rate], "systems": {"s": system}})
    cost = build_cost(cfg)
    rule = StopRule(SloMetric.parse("p90"), cfg.slo_ttft_s) if stop else None
    fast, _ = run_point(cfg.systems["s"], cost, cfg, rate, stop=rule, num_requests=num_requests)
    saved = {cls: cls.__dict__.get("fast") for cls in SYSTEMS.values()}
    try:
        for cls in SYSTEMS.values():
            cls.fast = False
        slow, _ = run_point(cfg.systems["s"], cost, cfg, rate, stop=rule, num_requests=num_requests)
    finally:
        for cls, v in saved.items():
            if v is None:
                del cls.fast
            else:
                cls.fast = v
    return fast, slow


@pytest.mark.parametrize("name,rate", [("asap_d3t1e5", 0.5), ("asap_d2t2e4", 4.0), ("asap_d1t4e4", 30.0)])
def test_asap_in_place_is_the_heap(name, rate):
    """A lone flight at a time (0.5 rps), groups interleaving on the workers (4 rps), and a probe so
    far over its rate that the stop rule ends it."""
    fast, slow = _both(_deepseek(name), rate, num_requests=None if rate < 10 else math.ceil(rate * 30))
    assert fast == slow
    assert fast["sim_events"] > 0 and (rate < 10 or fast.get("stopped_early"))


@pytest.mark.parametrize("devices,rate,plan", [(8, 0.5, "sliced"), (8, 6.0, "sliced"), (4, 3.0, "naive")])
def test_dwdp_written_out_layers_are_the_loop(devices, rate, plan):
    """Lone batches, every rank busy, and naive pulls (drawn contention: the loop's own _issue)."""
    fast, slow = _both({**_deepseek(f"dwdp{devices}", devices), "copy_plan": plan}, rate)
    assert fast == slow and fast["completed"] > 0
