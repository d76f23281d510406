"""Per-request serving measurements and their summary: TTFT statistics, throughput, and the
ASAP Fig. 15 decomposition of TTFT per prompt-length bucket. Pure Python + numpy."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# ASAP Fig. 15 buckets: < 512 tokens, 512-1024, ... doubling; the last bucket is open-ended.
# ``bucket_edges`` scales them by the workload's length_scale so a shrunk workload keeps its buckets.
FIG15_EDGES = (512, 1024, 2048, 4096, 8192, 16384)

# per-request arrays in a point: what a result needs while it is computed (the SLO metrics'
# quantiles), not what a committed result keeps; ``without_raw`` drops them
RAW_KEYS = frozenset({"ttfts_s"})


@dataclass(frozen=True)
class RequestRecord:
    """One completed request, on the engine clock (seconds)."""

    prompt_len: int
    arrival_s: float  # nominal arrival (the replay's schedule), not when it was handed over
    first_scheduled_s: float  # its first batch started
    first_token_s: float
    compute_s: float | None  # compute of every batch it took part in until its first token; None: not reported
    finished_s: float
    num_output: int = 1  # output tokens
    handoff_s: float | None = None  # pd: its KV handoff (decode room found to KV in place)

    def __post_init__(self) -> None:
        if not self.arrival_s <= self.first_token_s <= self.finished_s:
            raise ValueError(f"RequestRecord: times out of order: arrival {self.arrival_s}, "
                             f"first token {self.first_token_s}, finished {self.finished_s}")

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT); None with a single output token."""
        return (self.finished_s - self.first_token_s) / (self.num_output - 1) if self.num_output > 1 else None

    @property
    def queue_s(self) -> float:
        """Waiting before its first batch started (ASAP's "request queuing delay")."""
        return max(0.0, self.first_scheduled_s - self.arrival_s)

    @property
    def other_s(self) -> float | None:
        """The rest of TTFT: waiting on synchronization or on other stages (ASAP Fig. 15)."""
        return None if self.compute_s is None else self.ttft_s - self.queue_s - self.compute_s


def bucket_edges(length_scale: float = 1.0) -> list[int]:
    """Upper edges of the Fig. 15 buckets for a workload scaled by ``length_scale`` (strictly increasing)."""
    edges: list[int] = []
    for e in FIG15_EDGES:
        v = max(1, round(e * length_scale))
        if not edges or v > edges[-1]:
            edges.append(v)
    return edges


def _mean(xs: list[float]) -> float | None:
    return float(np.mean(xs)) if xs else None


def buckets(records: list[RequestRecord], edges: list[int]) -> list[dict]:
    """Per bucket [lo, hi) of prompt length: count and mean TTFT, queueing, compute, other."""
    bounds = [0, *edges, None]
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        rs = [r for r in records if r.prompt_len >= lo and (hi is None or r.prompt_len < hi)]
        with_compute = [r for r in rs if r.compute_s is not None]
        out.append({"lo_tokens": lo, "hi_tokens": hi, "count": len(rs),
                    "ttft_mean_s": _mean([r.ttft_s for r in rs]),
                    "queue_mean_s": _mean([r.queue_s for r in rs]),
                    "compute_mean_s": _mean([r.compute_s for r in with_compute]),
                    "other_mean_s": _mean([r.other_s for r in with_compute])})
    return out


def summarize(rps: float, records: list[RequestRecord], start_s: float, length_scale: float = 1.0,
              num_rejected: int = 0, num_failed: int = 0, num_aborted: int = 0,
              slo: tuple[float, float] | None = None) -> dict:
    """One point of the TTFT-vs-rate curve (the ``points`` entries of ``bench serve``'s JSON).

    prefill_tok_s: prompt tokens of completed requests / time from the replay's start to the
    last completion. ``ttft_p*`` are interpolated percentiles over completed requests (vLLM's
    convention for reporting); the SLO metrics use nearest ranks over all requests (``measure.slo``).
    ``slo`` = (TTFT s, TPOT s): adds goodput (DistServe's): the requests per second that met both,
    and the share of all requests that did (one that failed or was refused met neither).
    """
    ttft = [r.ttft_s for r in records]
    pct = {q: float(np.percentile(ttft, q)) if ttft else None for q in (50, 90, 99)}
    num_requests = len(records) + num_rejected + num_failed + num_aborted
    wall = max((r.finished_s for r in records), default=start_s) - start_s
    tokens = sum(r.prompt_len for r in records)
    return {"rps": rps, "completed": len(records), "rejected": num_rejected, "failed": num_failed,
            "aborted": num_aborted, "ttft_mean_s": _mean(ttft), "ttft_p50_s": pct[50], "ttft_p90_s": pct[90],
            "ttft_p99_s": pct[99], "prefill_tok_s": tokens / wall if wall > 0 else None,
            "prompt_tokens": tokens, "duration_s": wall, "buckets": buckets(records, bucket_edges(length_scale)),
            # every request's TTFT (a request that never got a first token counts in num_requests
            # only): the SLO metrics' quantiles and attainment come from these
            "num_requests": num_requests, "ttfts_s": sorted(round(t, 6) for t in ttft), **decode_side(records),
            **(goodput(records, num_requests, wall, *slo) if slo is not None else {})}


def goodput(records: list[RequestRecord], num_requests: int, wall_s: float, ttft_s: float, tpot_s: float) -> dict:
    """Requests within both SLOs (a one-token answer has no TPOT: its TTFT decides) per second of the
    point, and as a share of every request sent."""
    good = sum(r.ttft_s <= ttft_s and (r.tpot_s is None or r.tpot_s <= tpot_s) for r in records)
    return {"goodput_rps": good / wall_s if wall_s > 0 else 0.0,
            "slo_attainment": good / num_requests if num_requests else 0.0}


def decode_side(records: list[RequestRecord]) -> dict:
    """TPOT and TPS/user (1/TPOT, per request: DWDP's "TPS/user" axis) over requests with more than
    one output token, and the mean KV handoff of a pd deployment; empty for prefill-only runs."""
    tpot = [r.tpot_s for r in records if r.tpot_s is not None and r.tpot_s > 0]
    out: dict = {}
    if tpot:
        tps = [1.0 / t for t in tpot]
        out.update(tpot_mean_s=_mean(tpot), tpot_p50_s=float(np.percentile(tpot, 50)),
                   tpot_p90_s=float(np.percentile(tpot, 90)), tps_user_mean=_mean(tps),
                   tps_user_p50=float(np.percentile(tps, 50)), tps_user_p10=float(np.percentile(tps, 10)))
    handoff = [r.handoff_s for r in records if r.handoff_s is not None]
    if handoff:
        out["handoff_mean_s"] = _mean(handoff)
    return out


def without_raw(result):
    """``result`` without the per-request arrays (``RAW_KEYS``, at any depth): the summary that a
    committed result keeps. A simulated result's arrays are regenerated from its config and
    commit (``moeflow simulate --raw`` writes them)."""
    if isinstance(result, dict):
        return {k: without_raw(v) for k, v in result.items() if k not in RAW_KEYS}
    if isinstance(result, (list, tuple)):
        return [without_raw(v) for v in result]
    return result


def mean_ttft_lower_bound(ttft_done_s: list[float], waiting_since_s: list[float], num_total: int,
                          now_s: float) -> float:
    """A lower bound on the mean TTFT of a run still in progress: requests with a first token count
    their TTFT, requests still waiting count what they have waited so far, requests yet to arrive
    count 0. Once it exceeds the SLO the run has failed it whatever happens next."""
    if num_total <= 0:
        return 0.0
    return (sum(ttft_done_s) + sum(max(0.0, now_s - a) for a in waiting_since_s)) / num_total


def format_point(p: dict) -> str:
    """The per-rate table ``bench serve`` prints."""
    def s(v: float | None, fmt: str = "8.3f") -> str:
        return format(v, fmt) if v is not None and math.isfinite(v) else f"{'-':>{fmt.split('.')[0]}}"

    head = (f"rate {p['rps']:g} rps: {p['completed']} completed, {p['rejected']} rejected, {p['failed']} failed"
            + (f", {p['aborted']} aborted (stopped early: mean TTFT >= {p['ttft_mean_s']:.3f} s)"
               if p.get("stopped_early") else "")
            + f" | {p['duration_s']:.1f} s")
    lines = [head,
             f"  TTFT mean {s(p['ttft_mean_s'], '.3f')} s  p50 {s(p['ttft_p50_s'], '.3f')}  "
             f"p90 {s(p['ttft_p90_s'], '.3f')}  p99 {s(p['ttft_p99_s'], '.3f')}  |  "
             f"prefill {s(p['prefill_tok_s'], '.0f')} tok/s",
             *([f"  TPOT mean {s(p['tpot_mean_s'] * 1e3, '.1f')} ms  p90 {s(p['tpot_p90_s'] * 1e3, '.1f')}  |  "
                f"TPS/user mean {s(p['tps_user_mean'], '.1f')}  p10 {s(p['tps_user_p10'], '.1f')}  |  "
                f"output {s(p.get('output_tok_s'), '.1f')} tok/s"
                + (f" ({s(p['output_tok_s_per_process'], '.1f')} per process)" if 'output_tok_s_per_process' in p
                   else "")
                + (f"  |  KV handoff mean {s(p['handoff_mean_s'] * 1e3, '.1f')} ms" if 'handoff_mean_s' in p else "")]
               if 'tpot_mean_s' in p else []),
             f"  {'prompt tokens':>15} {'count':>6} {'TTFT s':>8} {'queue s':>8} {'compute s':>9} {'other s':>8}"]
    for b in p["buckets"]:
        if not b["count"]:
            continue
        rng = f"{b['lo_tokens']}-{b['hi_tokens'] - 1}" if b["hi_tokens"] is not None else f">={b['lo_tokens']}"
        lines.append(f"  {rng:>15} {b['count']:>6} {s(b['ttft_mean_s'])} {s(b['queue_mean_s'])} "
                     f"{s(b['compute_mean_s'], '9.3f')} {s(b['other_mean_s'])}")
    return "\n".join(lines)
