"""The controller that sizes a deployment of ranks from its live load: the EP size of dep (every rank an
attention group and an expert device, all meeting at every MoE layer) and the ranks of dwdp (each the
whole model, its peers' experts pulled). Pure Python, so the simulator runs the very same decisions
(``sim/elastic_dep.py``).

Each observation (``EpSample``) is one window: the ranks, the requests decoding per rank, the p90 TPOT
and TTFT, the queue, the KV room and the expert load's imbalance at R - 1 to R + ``max_step`` ranks: the
most loaded expert device's tokens over the mean device's, summed over the MoE layers, for the placement
the change would make (``scheduler/eplb.resize`` on the window's tokens per expert, ``imbalance``);
1 where the ranks compute their own tokens' experts (dwdp).

**Expert load.** A step of dep ends at each MoE layer's barrier, so it is set by the most loaded
device: R ranks holding B requests each run experts for B I(R) tokens on the hottest device. The
step's time is taken as affine in that load, t(x) = a + b x with x = B I(R), fitted on the last
``history`` windows' (x, p90 TPOT) (proportional, t = b x, while the loads seen do not spread enough
to fit; it over-predicts what a shrink costs). At R' ranks each holds B R / R' and the hottest device
carries B R / R' I(R'). I need not fall as R grows: ``resize`` fills a joiner's slots with copies of the
hottest experts, so one joiner can become the hottest device (DeepSeek-R1's skew from 8 ranks: I 1.41
at 8, 2.07 at 9, 1.41 at 12), and a growth goes to the fewest ranks, within ``max_step``, that the model
predicts gain more than ``band`` (TPOT) or at least do not slow the step by more than it (KV room, TTFT);
none where no count within reach gains (TPOT).

**Memory.** The ranks must hold every expert: ``floor`` (the fewest ranks whose slots hold the model's
experts; dwdp's starting ranks, which every other rank reads from) bounds a shrink from below, and a
rank brings its KV cache. The KV in use, in ranks' worth (R (1 - free)), is followed over the last
windows: where what it will be by the next chance to act (its rate of growth times ``interval_s``) leaves
the caches less than ``band`` free (or requests are queued with them full), the ranks grow to the count
that keeps ``band`` free, at least one and at most ``max_step`` more (a load that rises fast fills a
rank's KV faster than one rank per interval brings: DeepSeek-R1 decode going from 30 to 90 requests/s
preempted requests for 75 s under a rule of one rank at a time, results/elastic.md); a shrink must leave
the KV in use (which grows as R / R') ``band`` to spare.

Decisions, one per window at most, as afd's and pd's controllers (``autoscale.py``,
``autoscale_pd.py``): out of KV room, at least one rank more; prompts waiting past the TTFT SLO, at least
R (wait / SLO - 1) more, at least one and at most ``max_step``; TPOT over its SLO, the fewest more that
the model predicts gain over ``band``; under it by ``band`` (nothing queued, TTFT under its SLO by ``band``), one fewer where the
prediction stays under the SLO by ``band`` / 2; idle, one fewer. Never within ``interval_s`` of the last
change, on the mean of the last ``window`` samples, and no shrink within ``hold_s`` back to a membership
it left for falling short. The budget counts processes (a rank of tensor-parallel size T is T).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from moeflow.autoscale_config import EpAutoscalePolicy
from moeflow.errors import ConfigError
from moeflow.layout.expert_map import ExpertMap
from moeflow.scheduler.autoscale_pd import averages, fit_step
from moeflow.scheduler.eplb import resize, resized_counts
from moeflow.scheduler.growth import kv_growth, kv_need, prompt_wait, ttft_growth

_UP = ("ttft", "over_slo", "kv_room")  # decisions that leave a membership short


@dataclass(frozen=True)
class EpSample:
    """One window of a deployment of ranks."""

    t_s: float
    ranks: int
    batch: float  # mean requests decoding per rank over the window (time-weighted)
    tpot_p90_s: float | None  # None: no request finished decoding in the window
    ttft_p90_s: float | None = None
    queue: int = 0  # requests waiting for a rank
    kv_free: float = 1.0  # share of the ranks' KV blocks free
    queue_wait_s: float = 0.0  # the oldest request without a first token: how long it has waited
    busy: float = 0.0  # mean share of wall time a rank computed (reported; no decision reads it)
    # the hottest expert device's load over the mean one's (summed over MoE layers) at R - 1, R, R + 1, ...
    # ranks (``EpController.sizes``); 1.0 where balanced or not a placement's (dwdp), nan where the ranks
    # cannot hold the experts; a count past the tuple's end: taken as R + 1's
    imbalance: tuple[float, ...] = (1.0, 1.0, 1.0)


@dataclass(frozen=True)
class EpDecision:
    t_s: float
    ranks: int
    reason: str  # idle | kv_room | ttft | over_slo | under_slo
    predicted_tpot_s: float  # at the new rank count (nan where TPOT did not decide)
    inputs: dict = field(default_factory=dict)


def imbalance(placement: ExpertMap, load: list[list[float]], ranks: int) -> float:
    """Sum over MoE layers of the most loaded device's tokens over the mean device's, for the placement
    ``resize`` makes for ``ranks`` expert devices out of ``placement`` and the window's ``load`` (tokens
    per layer and logical expert); nan where ``ranks`` devices cannot hold the experts; 1.0 without load."""
    if not any(any(row) for row in load):
        return 1.0
    try:
        m = placement if ranks == placement.num_devices else resize(placement, ranks, load)
    except ConfigError:
        return float("nan")
    dev = m.device_load(load)
    top, mean = sum(max(d) for d in dev), sum(sum(d) / len(d) for d in dev)
    return top / mean if mean > 0 else 1.0


def imbalance_at(placement: ExpertMap, load: list[list[float]], sizes: range) -> tuple[float, ...]:
    """``imbalance`` at each of ``sizes`` (nan below one rank)."""
    return tuple(imbalance(placement, load, r) if r >= 1 else float("nan") for r in sizes)


def memory_floor(placement: ExpertMap) -> int:
    """The fewest devices whose slots (each keeping its count, joiners the last one's) hold every expert."""
    slots = placement.slots_per_device
    return next(r for r in range(1, len(slots) + 1) if sum(resized_counts(slots, r)) >= placement.num_experts)


def predicted_tpot(s: EpSample, ranks: int, fit: tuple[float, float] | None) -> float:
    """The p90 TPOT at ``ranks``, the requests now decoding spread over them (module doc); nan where
    those ranks cannot hold the experts."""
    if s.tpot_p90_s is None:
        return float("nan")
    k = ranks - s.ranks + 1
    i_now, i_after = s.imbalance[1], s.imbalance[min(k, len(s.imbalance) - 1)] if k >= 0 else float("nan")
    if math.isnan(i_after):
        return float("nan")
    x, x_after = s.batch * i_now, s.batch * s.ranks / ranks * i_after
    if fit is None or x <= 0:
        return s.tpot_p90_s * (x_after / x if x > 0 else s.ranks / ranks)
    a, b = fit
    now = a + b * x
    return s.tpot_p90_s * (a + b * x_after) / now if now > 0 else s.tpot_p90_s


class EpController:
    def __init__(self, policy: EpAutoscalePolicy, floor: int = 1, processes_per_rank: int = 1):
        """``floor``: the fewest ranks that hold every expert (``memory_floor``; dwdp: its starting ranks)."""
        self.policy, self.procs = policy, processes_per_rank
        self.floor = max(policy.min_ranks, floor)
        self.samples: list[EpSample] = []
        self.points: list[tuple[float, float]] = []  # (hottest device's load per rank, p90 TPOT) per window
        self.kv: list[tuple[float, float]] = []  # (time, KV in use in ranks' worth), the last windows
        self.last_change_s: float | None = None
        self.decisions: list[EpDecision] = []
        self.short: dict[int, float] = {}  # ranks -> when they were left for falling short

    def sizes(self, ranks: int) -> range:
        """The rank counts a sample's imbalance covers: R - 1 to R + ``max_step``."""
        return range(ranks - 1, ranks + self.policy.max_step + 1)

    @property
    def most(self) -> int:
        p = self.policy
        return p.max_ranks if p.max_processes is None else min(p.max_ranks, p.max_processes // self.procs)

    def observe(self, s: EpSample) -> EpDecision | None:
        p = self.policy
        if s.tpot_p90_s is not None and s.batch > 0 and not math.isnan(s.imbalance[1]):
            self.points = (self.points + [(s.batch * s.imbalance[1], s.tpot_p90_s)])[-p.history:]
        self.kv = (self.kv + [(s.t_s, s.ranks * (1.0 - s.kv_free))])[-(p.window + 1):]
        if self.samples and self.samples[-1].ranks != s.ranks:
            self.samples = []  # another membership's window says nothing about this one
        self.samples = (self.samples + [s])[-p.window:]
        if len(self.samples) < p.window or (self.last_change_s is not None and s.t_s - self.last_change_s < p.interval_s):
            return None
        m, fit = _mean(self.samples), fit_step(self.points)
        r, reason = self._pick(m, fit)
        if r == m.ranks or not self.floor <= r <= self.most or (r < m.ranks and self._held(r, s.t_s)):
            return None
        return self._decide(s, m, r, reason, predicted_tpot(m, r, fit) if reason in ("over_slo", "under_slo")
                            else float("nan"), fit)

    def _pick(self, m: EpSample, fit) -> tuple[int, str]:
        p, r = self.policy, m.ranks
        if m.tpot_p90_s is None and m.queue == 0 and m.batch <= 0:
            return r - 1, "idle"
        need = kv_need(self.kv, p.interval_s)
        if (m.queue > 0 and m.kv_free < 0.05) or need > r * (1 - p.band):  # before the residents' growth preempts them
            return self._grow(m, fit, kv_growth(need, r, p.band, p.max_step)), "kv_room"
        wait = prompt_wait(m)
        if p.ttft_slo_s is not None and wait > p.ttft_slo_s:
            return self._grow(m, fit, ttft_growth(wait, r, p.ttft_slo_s, p.max_step)), "ttft"
        if m.tpot_p90_s is None:
            return r, ""
        if m.tpot_p90_s > p.tpot_slo_s:
            gains = [x for x in self._reach(r) if predicted_tpot(m, x, fit) < m.tpot_p90_s * (1 - p.band)]
            return (gains[0], "over_slo") if gains else (r, "")  # nan (no room) compares False
        ttft_ok = p.ttft_slo_s is None or max(m.ttft_p90_s or 0.0, m.queue_wait_s) < p.ttft_slo_s * (1 - p.band)
        used_after = (1.0 - m.kv_free) * r / max(1, r - 1)
        if (m.tpot_p90_s < p.tpot_slo_s * (1 - p.band) and m.queue == 0 and ttft_ok and used_after <= 1 - p.band
                and predicted_tpot(m, r - 1, fit) <= p.tpot_slo_s * (1 - p.band / 2)):
            return r - 1, "under_slo"
        return r, ""

    def _reach(self, r: int) -> range:
        return range(r + 1, min(self.most, r + self.policy.max_step) + 1)

    def _grow(self, m: EpSample, fit, least: int) -> int:
        """At least ``least`` ranks more (bounded by the budget): the fewest, within ``max_step``, whose
        predicted step is no slower than now by ``band`` (a joiner that would become the hottest device
        is passed over); ``least`` more where none is, or TPOT is unknown."""
        r, p = m.ranks, self.policy
        first = min(self.most, r + least)
        if m.tpot_p90_s is None:
            return first
        ok = [x for x in self._reach(r) if x >= first and predicted_tpot(m, x, fit) <= m.tpot_p90_s * (1 + p.band)]
        return ok[0] if ok else first

    def _held(self, r: int, now: float) -> bool:
        return any(now - t < self.policy.hold_s and r <= k for k, t in self.short.items())

    def _decide(self, s: EpSample, m: EpSample, r: int, reason: str, predicted: float, fit) -> EpDecision:
        d = EpDecision(s.t_s, r, reason, predicted,
                       {"ranks": m.ranks, "batch": m.batch, "tpot_p90_s": m.tpot_p90_s, "ttft_p90_s": m.ttft_p90_s,
                        "queue": m.queue, "queue_wait_s": m.queue_wait_s, "kv_free": m.kv_free, "busy": m.busy,
                        "imbalance": m.imbalance, "floor": self.floor, "fit": fit})
        self.decisions.append(d)
        if reason in _UP:
            self.short[m.ranks] = s.t_s
        self.last_change_s, self.samples = s.t_s, []
        return d


def _mean(samples: list[EpSample]) -> EpSample:
    last, (avg, avg_known) = samples[-1], averages(samples)
    imb = tuple(sum(x.imbalance[i] for x in samples) / len(samples) for i in range(len(last.imbalance)))
    return EpSample(last.t_s, last.ranks, avg("batch"), avg_known("tpot_p90_s"), avg_known("ttft_p90_s"),
                    round(avg("queue")), avg("kv_free"), last.queue_wait_s, avg("busy"), imb)
