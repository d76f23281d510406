"""Serving metrics of an HTTP benchmark run, named and defined as ``vllm bench serve``'s.

Per successful request (``RequestOutcome``, seconds on the client's clock):

- TTFT = first streamed chunk - send time;
- E2EL = last streamed chunk - send time;
- TPOT = (E2EL - TTFT) / (output_tokens - 1), only for requests with more than one output token
  (goodput counts TPOT as 0 for the others, as vLLM does);
- ITL = every gap between consecutive streamed chunks (all requests' gaps pooled);
- TPS/user = 1 / TPOT per request (DWDP's per-user axis): mean, median and p10 (the slow users).

Statistics are numpy's mean / median / std / linear percentiles, reported in milliseconds under
``{mean,median,std}_{metric}_ms`` and ``p{P}_{metric}_ms`` (P written as ``99`` or ``99.9``).
Throughputs divide by ``duration``, the wall time of the whole run. Pure Python + numpy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILE_METRICS = ("ttft", "tpot", "itl")  # vLLM's default; e2el on request
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
_TITLES = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
           "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}


@dataclass(frozen=True)
class RequestOutcome:
    """One request of the run, as the client saw it."""

    prompt_len: int
    success: bool
    ttft_s: float = 0.0  # first chunk - send
    latency_s: float = 0.0  # last chunk - send (E2EL)
    itl_s: tuple[float, ...] = ()  # gaps between consecutive chunks after the first
    output_tokens: int = 0  # usage.completion_tokens
    error: str = ""

    def __post_init__(self) -> None:
        if self.success and not 0 <= self.ttft_s <= self.latency_s:
            raise ValueError(f"RequestOutcome: need 0 <= ttft {self.ttft_s} <= latency {self.latency_s}")

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def parse_percentile_metrics(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in METRICS]
    if not names or bad:
        raise ValueError(f"--percentile-metrics: expected a comma-separated subset of {METRICS}, got {text!r}")
    return names


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        ps = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--metric-percentiles: expected comma-separated numbers, got {text!r}") from None
    if not ps or any(not 0 < p < 100 for p in ps):
        raise ValueError(f"--metric-percentiles: every percentile must be in (0, 100), got {text!r}")
    return ps


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    out: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput: expected NAME:MS with NAME in {GOODPUT_METRICS}, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {item!r}: {value!r} is not a number") from None
        if not ms > 0 or not math.isfinite(ms):
            raise ValueError(f"--goodput: {item!r}: the SLO must be a positive number of milliseconds")
        out[name] = ms
    return out


def percentile_key(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def compute_metrics(outcomes: list[RequestOutcome], duration_s: float,
                    percentile_metrics: tuple[str, ...] = DEFAULT_PERCENTILE_METRICS,
                    percentiles: tuple[float, ...] = (99.0,), goodput_ms: dict[str, float] | None = None) -> dict:
    """The run's metrics under vLLM's names (``request_goodput`` only when ``goodput_ms`` is given)."""
    ok = [o for o in outcomes if o.success]
    samples = {"ttft": [o.ttft_s for o in ok], "e2el": [o.latency_s for o in ok],
               "tpot": [o.tpot_s for o in ok if o.tpot_s is not None],
               "itl": [g for o in ok for g in o.itl_s]}
    num_out = sum(o.output_tokens for o in ok)
    num_in = sum(o.prompt_len for o in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    m: dict = {"duration": duration_s, "completed": len(ok), "failed": len(outcomes) - len(ok),
               "total_input_tokens": num_in, "total_output_tokens": num_out,
               "request_throughput": per_s(len(ok)), "output_throughput": per_s(num_out),
               "total_token_throughput": per_s(num_in + num_out)}
    if goodput_ms:
        m["request_goodput"] = per_s(sum(_is_good(o, goodput_ms) for o in ok))
    tps = [1.0 / t for t in samples["tpot"] if t > 0]
    if tps:
        m.update(mean_tps_user=float(np.mean(tps)), median_tps_user=float(np.median(tps)),
                 p10_tps_user=float(np.percentile(tps, 10)))
    for name in percentile_metrics:
        xs = np.asarray(samples[name] or [0.0]) * 1000.0  # vLLM reports 0 for an empty sample
        m[f"mean_{name}_ms"] = float(np.mean(xs))
        m[f"median_{name}_ms"] = float(np.median(xs))
        m[f"std_{name}_ms"] = float(np.std(xs))
        for p in percentiles:
            m[f"p{percentile_key(p)}_{name}_ms"] = float(np.percentile(xs, p))
    return m


def _is_good(o: RequestOutcome, goodput_ms: dict[str, float]) -> bool:
    value_s = {"ttft": o.ttft_s, "tpot": o.tpot_s or 0.0, "e2el": o.latency_s}
    return all(value_s[name] * 1000.0 <= slo for name, slo in goodput_ms.items())


def format_table(m: dict, percentile_metrics: tuple[str, ...], percentiles: tuple[float, ...],
                 header: dict[str, str] | None = None) -> str:
    """The result table in ``vllm bench serve``'s layout (50 columns, labels padded to 40)."""
    def row(label: str, value) -> str:
        v = f"{value:<10.2f}" if isinstance(value, float) else f"{value:<10}"
        return f"{label:<40} {v}".rstrip()

    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [row(k, v) for k, v in (header or {}).items()]
    lines += [row("Successful requests:", m["completed"]), row("Failed requests:", m["failed"]),
              row("Benchmark duration (s):", m["duration"]), row("Total input tokens:", m["total_input_tokens"]),
              row("Total generated tokens:", m["total_output_tokens"]),
              row("Request throughput (req/s):", m["request_throughput"])]
    if "request_goodput" in m:
        lines.append(row("Request goodput (req/s):", m["request_goodput"]))
    lines += [row("Output token throughput (tok/s):", m["output_throughput"]),
              row("Total Token throughput (tok/s):", m["total_token_throughput"])]
    if "mean_tps_user" in m:
        lines += [row("Mean TPS/user (tok/s):", m["mean_tps_user"]), row("P10 TPS/user (tok/s):", m["p10_tps_user"])]
    for name in percentile_metrics:
        title, short = _TITLES[name]
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        lines.append(row(f"Mean {short} (ms):", m[f"mean_{name}_ms"]))
        lines.append(row(f"Median {short} (ms):", m[f"median_{name}_ms"]))
        for p in percentiles:
            lines.append(row(f"P{percentile_key(p)} {short} (ms):", m[f"p{percentile_key(p)}_{name}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)
