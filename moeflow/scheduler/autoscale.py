"""The controller that resizes an afd deployment from its live load: attention instances M and FFN
daemons N (pure Python, so the simulator runs the very same decisions).

Each observation (``Sample``) is one window of the serving deployment: its members, the share of
wall time its attention instances spent computing and the share they spent blocked on the FFN side
(combine-recv), the queue, the KV room left and the p90 TPOT. A step of afd overlaps the two sides
micro-batch by micro-batch, so its time is set by the longer side (FastAFD's three-factor model,
``moeflow predict afd``): per step, attention work A = busy and FFN work F = busy + wait when the
instances wait (FFN-bound), else F <= A and, unless the daemons' own busy share is known, taken as A
(the bound that never under-provisions). With M' instances each holds M/M' of the requests, A' =
A M/M'; with N' daemons each computes N/N' of the tokens, F' = F N/N'; the step, and so TPOT,
scales as max(A', F') / max(A, F).

``Controller.observe`` decides one change at a time, at most one daemon and, but for the growths
below, one instance:

- **out of KV room**: the KV in use, in instances' worth (M x the share used), is followed over the
  last windows; where what it will be by the next chance to act (its rate of growth times
  ``interval_s``) leaves the caches less than ``band`` free, or requests queue while they are full,
  the instances grow to the count that keeps ``band`` free, at least one and at most ``max_step``
  more, whatever the step time says (they bring the cache; contexts that grow 62-fold over five
  minutes outran one instance per interval, results/elastic.md);
- **over the TTFT SLO** (``ttft_slo_s``) with requests queued, or a request still without its first
  token for longer than it (queued, or placed on an instance that has not reached its prompt):
  prompts wait for the instances, which run prefill; M x (wait / SLO - 1) instances more, at least
  one and at most ``max_step`` (the wait is the larger of the two: finished requests tell of a
  backlog late, by their whole decode); with the KV rule, the larger of the two growths. Either
  growth adds a daemon too where TPOT is over its SLO and the model predicts the daemon gains more
  than ``band`` at the new instance count;
- **over the SLO** (p90 TPOT above it): the neighbour with the lowest predicted TPOT, if it gains
  more than ``band`` (fewer processes break a tie); a neighbour with fewer instances only where the
  KV in use by the next chance to act leaves them ``band`` free (an instance given up for a daemon
  when the caches are full queues the requests it held, and the TTFT rule takes it back: the two
  alternated at 32 instances, results/elastic.md). So at the instances' maximum, or with their caches
  full, a daemon comes without an instance going;
- **under the SLO** by more than ``band``: the neighbour with the fewest processes whose predicted
  TPOT stays below the SLO by ``band`` / 2 and whose instances still hold the KV in use by the next
  chance to act with ``band`` to spare (the used share grows as M/M'), if one has fewer processes
  than now; never while requests wait, nor while the TTFT is within ``band`` of its SLO or over it;
- **idle** (nothing decoded, nothing queued, the instances not computing): one member less per side,
  down to the minimums (a window with requests but none finished decides nothing);

never before ``interval_s`` since the last change, and on the mean of the last ``window`` samples,
so a single noisy window does not move it; and no shrink (under the SLO, idle) goes back to a
membership it left for falling short (over an SLO, out of KV room) within ``hold_s``, nor to one
with no more members on either side, so a prediction that a smaller membership would now do cannot
undo what was measured there (on a load that drifts upward, the prediction lags the measurement, and
the two alternate). Every decision carries its inputs and its prediction.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moeflow.autoscale_config import AutoscalePolicy
from moeflow.scheduler.growth import kv_growth, kv_need, prompt_wait, ttft_growth


@dataclass(frozen=True)
class Sample:
    """One window of the live load."""

    t_s: float
    attention: int  # members now
    ffn: int
    attn_busy: float  # mean share of wall time the instances computed
    attn_wait: float  # mean share they were blocked on the FFN side
    tpot_p90_s: float | None  # None: no request decoded in the window
    queue: int = 0  # waiting requests
    kv_free: float = 1.0  # share of the instances' KV blocks free
    ffn_busy: float | None = None  # the daemons' own busy share, when known
    ttft_p90_s: float | None = None  # of the requests that finished in the window
    queue_wait_s: float = 0.0  # how long the oldest request without a first token has waited, at the sample


@dataclass(frozen=True)
class Decision:
    t_s: float
    attention: int
    ffn: int
    reason: str  # over_slo | kv_room | ttft | under_slo | idle
    predicted_tpot_s: float
    inputs: dict = field(default_factory=dict)


def predicted_tpot(s: Sample, tpot_s: float, attention: int, ffn: int, wait_eps: float) -> float:
    """TPOT at (``attention``, ``ffn``) members from ``tpot_s`` measured with ``s``'s (module doc)."""
    a = s.attn_busy
    if s.attn_wait > wait_eps:
        f = a + s.attn_wait
    elif s.ffn_busy is not None:
        f = min(a, s.ffn_busy)
    else:
        f = a
    now = max(a, f)
    if now <= 0:
        return tpot_s
    return tpot_s * max(a * s.attention / attention, f * s.ffn / ffn) / now


def predicted_kv_used(s: Sample, attention: int) -> float:
    """The share of the instances' KV blocks in use at ``attention`` instances, the requests now resident
    spread over them (each instance brings the same cache)."""
    return (1.0 - s.kv_free) * s.attention / attention


class Controller:
    def __init__(self, policy: AutoscalePolicy):
        self.policy = policy
        self.samples: list[Sample] = []
        self.last_change_s: float | None = None
        self.decisions: list[Decision] = []
        self.short: dict[tuple[int, int], float] = {}  # membership -> when it was left for falling short
        self.kv: list[tuple[float, float]] = []  # (time, KV in use in instances' worth), the last windows

    def observe(self, s: Sample) -> Decision | None:
        """Take one window; the change to make now, or None."""
        p = self.policy
        self.kv = (self.kv + [(s.t_s, s.attention * (1.0 - s.kv_free))])[-(p.window + 1):]
        if self.samples and (self.samples[-1].attention, self.samples[-1].ffn) != (s.attention, s.ffn):
            self.samples = []  # a window of another membership says nothing about this one
        self.samples = (self.samples + [s])[-p.window:]
        if len(self.samples) < p.window or (self.last_change_s is not None and s.t_s - self.last_change_s < p.interval_s):
            return None
        m, need = _mean(self.samples), kv_need(self.kv, p.interval_s)
        options = [(a, f) for a in (m.attention - 1, m.attention, m.attention + 1)
                   for f in (m.ffn - 1, m.ffn, m.ffn + 1)
                   if (a, f) != (m.attention, m.ffn) and p.min_attention <= a <= p.max_attention
                   and p.min_ffn <= f <= p.max_ffn and a + f <= p.budget]
        short = [o for o, t in self.short.items() if s.t_s - t < p.hold_s]
        held = {o for o in options if any(o[0] <= a and o[1] <= f for a, f in short)}  # no fewer on either side
        room = {o for o in options if o[0] >= m.attention or need / o[0] <= 1 - p.band}  # KV the change leaves
        grown = self._grow(m, need)
        if grown is not None:
            return self._decide(s, m, *grown, need)
        if m.tpot_p90_s is None:  # nothing decoded: idle, it gives back a member per side; else no evidence
            fewer = [o for o in options if sum(o) < m.attention + m.ffn and o in room and o not in held]
            if m.queue > 0 or m.attn_busy > p.wait_eps or not fewer:
                return None
            return self._decide(s, m, min(fewer, key=lambda o: (sum(o), -o[0])), "idle", float("nan"), need)
        tpot = {o: predicted_tpot(m, m.tpot_p90_s, *o, p.wait_eps) for o in options}
        pick, reason = None, ""
        ttft = m.ttft_p90_s if p.ttft_slo_s is not None else None
        if m.tpot_p90_s > p.tpot_slo_s:
            best = min((o for o in options if o in room), key=lambda o: (tpot[o], sum(o)), default=None)
            if best is not None and tpot[best] < m.tpot_p90_s * (1 - p.band):
                pick, reason = best, "over_slo"
        elif m.tpot_p90_s < p.tpot_slo_s * (1 - p.band) and m.queue == 0 and (
                p.ttft_slo_s is None or max(ttft or 0.0, m.queue_wait_s) < p.ttft_slo_s * (1 - p.band)):
            fits = [o for o in options if sum(o) < m.attention + m.ffn and tpot[o] <= p.tpot_slo_s * (1 - p.band / 2)
                    and o in room and o not in held]
            if fits:
                pick, reason = min(fits, key=lambda o: (sum(o), tpot[o])), "under_slo"
        if pick is None:
            return None
        return self._decide(s, m, pick, reason, tpot[pick], need)

    def _grow(self, m: Sample, need: float) -> tuple[tuple[int, int], str, float] | None:
        """More instances where the KV or the prompts' wait asks for them (module doc), with a daemon more
        where TPOT is over its SLO and the model predicts the daemon gains ``band`` at the new count; None
        where neither asks, or the instances are at their maximum (the TPOT rules may still add a daemon)."""
        p, full = self.policy, m.queue > 0 and m.kv_free < 0.05
        k, reason = 0, ""
        if full or need > m.attention * (1 - p.band):  # before the residents' growth fills the caches
            k, reason = kv_growth(need, m.attention, p.band, p.max_step), "kv_room"
        wait = prompt_wait(m)
        if p.ttft_slo_s is not None and wait > p.ttft_slo_s and not full:
            t = ttft_growth(wait, m.attention, p.ttft_slo_s, p.max_step)
            k, reason = (t, "ttft") if t > k else (k, reason)
        a = min(m.attention + k, p.max_attention, p.budget - m.ffn)
        if a <= m.attention:
            return None
        if m.tpot_p90_s is None:
            return (a, m.ffn), reason, float("nan")
        f = m.ffn
        tp = lambda n: predicted_tpot(m, m.tpot_p90_s, a, n, p.wait_eps)  # noqa: E731
        if m.tpot_p90_s > p.tpot_slo_s and f < p.max_ffn and a + f < p.budget and tp(f + 1) < tp(f) * (1 - p.band):
            f += 1
        return (a, f), reason, tp(f)

    def _decide(self, s: Sample, m: Sample, pick: tuple[int, int], reason: str, predicted: float,
                need: float) -> Decision:
        d = Decision(s.t_s, pick[0], pick[1], reason, predicted,
                     {"attention": m.attention, "ffn": m.ffn, "attn_busy": m.attn_busy, "attn_wait": m.attn_wait,
                      "tpot_p90_s": m.tpot_p90_s, "ttft_p90_s": m.ttft_p90_s, "queue": m.queue,
                      "queue_wait_s": m.queue_wait_s, "kv_free": m.kv_free,
                      "kv_need": need, "kv_used_after": predicted_kv_used(m, pick[0])})
        self.decisions.append(d)
        if reason in ("over_slo", "kv_room", "ttft"):
            self.short[(m.attention, m.ffn)] = s.t_s
        self.last_change_s, self.samples = s.t_s, []
        return d


def _mean(samples: list[Sample]) -> Sample:
    n = len(samples)
    tpots = [x.tpot_p90_s for x in samples if x.tpot_p90_s is not None]
    busy = [x.ffn_busy for x in samples if x.ffn_busy is not None]
    last = samples[-1]
    ttfts = [x.ttft_p90_s for x in samples if x.ttft_p90_s is not None]
    return Sample(last.t_s, last.attention, last.ffn, sum(x.attn_busy for x in samples) / n,
                  sum(x.attn_wait for x in samples) / n, sum(tpots) / len(tpots) if tpots else None,
                  round(sum(x.queue for x in samples) / n), sum(x.kv_free for x in samples) / n,
                  sum(busy) / len(busy) if busy else None, sum(ttfts) / len(ttfts) if ttfts else None,
                  last.queue_wait_s)  # the queue's age now, not an average of ages
