"""The controller that resizes a pd deployment from its live load: X prefill and Y decode instances
(xPyD), by rate matching (``sim/rate_match.py``: the slower side sets the rate). Pure Python, so the
simulator runs the very same decisions (``sim/elastic_pd.py``).

Each observation (``PdSample``) is one window: the members, the share of wall time the prefill
instances' processes computed (their utilization), the requests decoding per decode instance, the
p90 TPOT and TTFT, the prompts queued, the prefilled requests waiting for decode room and the decode
side's KV room. The two sides are sized on their own evidence:

- **prefill** (its SLO is TTFT): X instances at utilization u serve a prompt rate whose work is X u;
  at X' instances each computes u X / X'. Over ``target_utilization`` (by more than ``band``) it asks
  for ceil(X u / target) instances, at most ``max_step`` more; a TTFT over its SLO with prompts
  queued (or a prompt without its first token for longer than the SLO) adds X (wait / SLO - 1), at
  least one; one fewer when the others would stay at or below the target and TTFT (and the oldest
  prompt's wait) is under its SLO by ``band``;
- **decode** (its SLO is TPOT): a decode step's time is affine in its batch, t(B) = a + b B, fitted
  on the last ``history`` windows' (batch per instance, p90 TPOT) (the proportional t = b B when the
  windows' batches do not spread enough to fit, which over-predicts a shrink's TPOT and never
  under-provisions); at Y' instances each holds B Y / Y'. Over the SLO: one more if it predicts a gain
  over ``band``; the decode caches with less than ``band`` free (or prefilled requests waiting with
  them full): one more (``kv_room``: an instance brings KV room, and a decode side that runs out
  preempts requests whose contexts keep growing, each recomputed whole); one fewer when the prediction stays under the SLO by ``band`` / 2 and the
  caches would still hold the KV in use with ``band`` to spare;
- **idle** (nothing decoded, queued or computed): one fewer per side, down to the minimums.

As the afd controller (``autoscale.py``): never within ``interval_s`` of the last change, on the mean
of the last ``window`` samples, and no shrink back within ``hold_s`` to a membership it left for
falling short, nor to one with no more instances on either side.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from moeflow.autoscale_config import PdAutoscalePolicy
from moeflow.scheduler.growth import prompt_wait

_UP = ("ttft", "prefill_rate_up", "over_slo", "kv_room")  # decisions that leave a membership short


@dataclass(frozen=True)
class PdSample:
    """One window of a pd deployment's live load."""

    t_s: float
    prefill: int  # instances now
    decode: int
    prefill_busy: float  # mean share of wall time a prefill instance's processes computed
    decode_batch: float  # mean requests decoding per decode instance over the window
    tpot_p90_s: float | None  # None: no request finished decoding in the window
    ttft_p90_s: float | None = None
    queue: int = 0  # requests without their first token, on the prefill side
    handoffs_waiting: int = 0  # prefilled, waiting for decode room
    decode_kv_free: float = 1.0  # share of the decode instances' KV blocks free
    queue_wait_s: float = 0.0  # the oldest request without a first token: how long it has waited


@dataclass(frozen=True)
class PdDecision:
    t_s: float
    prefill: int
    decode: int
    reason: str  # each side's, "+"-joined: ttft | prefill_rate_up | prefill_rate_down | over_slo | kv_room | under_slo | idle
    predicted_tpot_s: float  # at the new decode count (nan where TPOT did not decide)
    inputs: dict = field(default_factory=dict)


def fit_step(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(a, b) of t(B) = a + b B by least squares over (batch, TPOT) points, a and b >= 0; None when
    fewer than three points or their batches spread less than a quarter of their mean."""
    if len(points) < 3:
        return None
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    if mx <= 0 or max(xs) - min(xs) < 0.25 * mx:
        return None
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    if b < 0:
        return my, 0.0  # no growth with the batch seen: TPOT flat
    if a < 0:
        return 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return a, b


def predicted_tpot(s: PdSample, decode: int, fit: tuple[float, float] | None) -> float:
    """The p90 TPOT at ``decode`` instances, the requests now decoding spread over them (module doc)."""
    if s.tpot_p90_s is None:
        return float("nan")
    after = s.decode_batch * s.decode / decode
    if fit is None or s.decode_batch <= 0:
        return s.tpot_p90_s * s.decode / decode
    a, b = fit
    now = a + b * s.decode_batch
    return s.tpot_p90_s * (a + b * after) / now if now > 0 else s.tpot_p90_s


class PdController:
    def __init__(self, policy: PdAutoscalePolicy, prefill_processes: int = 1, decode_processes: int = 1):
        """``*_processes``: one instance's processes on each side (the budget counts processes)."""
        self.policy, self.procs = policy, (prefill_processes, decode_processes)
        self.samples: list[PdSample] = []
        self.points: list[tuple[float, float]] = []  # (batch per decode instance, p90 TPOT) per window
        self.last_change_s: float | None = None
        self.decisions: list[PdDecision] = []
        self.short: dict[tuple[int, int], float] = {}

    @property
    def budget(self) -> int:
        p = self.policy
        if p.max_processes is not None:
            return p.max_processes
        return p.max_prefill * self.procs[0] + p.max_decode * self.procs[1]

    def observe(self, s: PdSample) -> PdDecision | None:
        p = self.policy
        if s.tpot_p90_s is not None and s.decode_batch > 0:
            self.points = (self.points + [(s.decode_batch, s.tpot_p90_s)])[-p.history:]
        if self.samples and (self.samples[-1].prefill, self.samples[-1].decode) != (s.prefill, s.decode):
            self.samples = []  # another membership's window says nothing about this one
        self.samples = (self.samples + [s])[-p.window:]
        if len(self.samples) < p.window or (self.last_change_s is not None and s.t_s - self.last_change_s < p.interval_s):
            return None
        m, fit = _mean(self.samples), fit_step(self.points)
        (x, why_x), (y, why_y) = self._prefill(m), self._decode(m, fit)
        if m.tpot_p90_s is None and m.queue == 0 and m.prefill_busy < 0.02 and m.decode_batch <= 0:
            x, why_x = max(p.min_prefill, m.prefill - 1), "idle"
            y, why_y = max(p.min_decode, m.decode - 1), "idle"
        picks = [(x, y), (m.prefill, y), (x, m.decode)]  # both; else each side's alone, decode first
        picks = [o for o in picks if o != (m.prefill, m.decode) and self._fits(o) and not self._held(o, m, s.t_s)]
        if not picks:
            return None
        px, py = picks[0]
        reason = "+".join(r for r, changed in ((why_x, px != m.prefill), (why_y, py != m.decode)) if changed)
        return self._decide(s, m, (px, py), reason, predicted_tpot(m, py, fit) if py != m.decode else float("nan"), fit)

    def _prefill(self, m: PdSample) -> tuple[int, str]:
        p, x = self.policy, m.prefill
        need = math.ceil(x * m.prefill_busy / p.target_utilization * (1 - 1e-9))  # rate matching's count
        wait = prompt_wait(m)
        if wait > p.ttft_slo_s and not self._decode_full(m):  # prompts that wait on a full decode side: its to fix
            k = max(1, math.ceil(x * (wait / p.ttft_slo_s - 1)), need - x)
            return min(p.max_prefill, x + min(k, p.max_step)), "ttft"
        if m.prefill_busy > p.target_utilization * (1 + p.band) and need > x:
            return min(p.max_prefill, x + min(need - x, p.max_step)), "prefill_rate_up"
        ttft_ok = max(m.ttft_p90_s or 0.0, m.queue_wait_s) < p.ttft_slo_s * (1 - p.band)
        if x > p.min_prefill and ttft_ok and m.prefill_busy * x / (x - 1) <= p.target_utilization:
            return x - 1, "prefill_rate_down"
        return x, ""

    def _decode(self, m: PdSample, fit) -> tuple[int, str]:
        p, y = self.policy, m.decode
        if self._decode_full(m) or m.decode_kv_free < p.band:  # before the residents' growth preempts them
            return min(p.max_decode, y + 1), "kv_room"
        if m.tpot_p90_s is None:
            return y, ""
        if m.tpot_p90_s > p.tpot_slo_s:
            if y < p.max_decode and predicted_tpot(m, y + 1, fit) < m.tpot_p90_s * (1 - p.band):
                return y + 1, "over_slo"
            return y, ""
        used_after = (1.0 - m.decode_kv_free) * y / max(1, y - 1)
        if (y > p.min_decode and m.tpot_p90_s < p.tpot_slo_s * (1 - p.band) and m.handoffs_waiting == 0
                and predicted_tpot(m, y - 1, fit) <= p.tpot_slo_s * (1 - p.band / 2) and used_after <= 1 - p.band):
            return y - 1, "under_slo"
        return y, ""

    @staticmethod
    def _decode_full(m: PdSample) -> bool:
        return m.handoffs_waiting > 0 and m.decode_kv_free < 0.05

    def _fits(self, o: tuple[int, int]) -> bool:
        p = self.policy
        return (p.min_prefill <= o[0] <= p.max_prefill and p.min_decode <= o[1] <= p.max_decode
                and o[0] * self.procs[0] + o[1] * self.procs[1] <= self.budget)

    def _held(self, o: tuple[int, int], m: PdSample, now: float) -> bool:
        """A shrink (no side grows) back to a membership left short, or below one, within the hold."""
        if o[0] > m.prefill or o[1] > m.decode:
            return False
        return any(now - t < self.policy.hold_s and o[0] <= a and o[1] <= b for (a, b), t in self.short.items())

    def _decide(self, s: PdSample, m: PdSample, pick: tuple[int, int], reason: str, predicted: float,
                fit) -> PdDecision:
        d = PdDecision(s.t_s, pick[0], pick[1], reason, predicted,
                       {"prefill": m.prefill, "decode": m.decode, "prefill_busy": m.prefill_busy,
                        "decode_batch": m.decode_batch, "tpot_p90_s": m.tpot_p90_s, "ttft_p90_s": m.ttft_p90_s,
                        "queue": m.queue, "handoffs_waiting": m.handoffs_waiting, "decode_kv_free": m.decode_kv_free,
                        "queue_wait_s": m.queue_wait_s, "fit": fit})
        self.decisions.append(d)
        if any(r in _UP for r in reason.split("+")):
            self.short[(m.prefill, m.decode)] = s.t_s
        self.last_change_s, self.samples = s.t_s, []
        return d


def averages(samples: list) -> tuple:
    """(avg, avg_known) over ``samples``: a field's mean, and the mean of its known (not None) values."""
    def avg(k: str) -> float:
        return sum(getattr(x, k) for x in samples) / len(samples)

    def avg_known(k: str) -> float | None:
        xs = [getattr(x, k) for x in samples if getattr(x, k) is not None]
        return sum(xs) / len(xs) if xs else None
    return avg, avg_known


def _mean(samples: list[PdSample]) -> PdSample:
    last, (avg, avg_known) = samples[-1], averages(samples)
    return PdSample(last.t_s, last.prefill, last.decode, avg("prefill_busy"), avg("decode_batch"),
                    avg_known("tpot_p90_s"), avg_known("ttft_p90_s"), round(avg("queue")),
                    round(avg("handoffs_waiting")), avg("decode_kv_free"), last.queue_wait_s)
