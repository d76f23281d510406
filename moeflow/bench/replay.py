"""Replays a workload against the wall clock on an in-process deployment and measures each request.

The loop: hand over every request whose arrival time has passed, step the engine while it has
work, otherwise sleep until the next arrival. A request's ``arrival_s`` is its *nominal* time on
the engine clock, so a request that fell due while the loop was inside a long step still counts
that wait in its TTFT (as it would behind an HTTP front end).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np

from moeflow.core import RequestError, SamplingParams
from moeflow.engine.base import clock
from moeflow.engine.output import OutputTracker
from moeflow.measure.metrics import RequestRecord, mean_ttft_lower_bound
from moeflow.measure.slo import StopRule
from moeflow.measure.workload import WorkloadRequest

_IDLE_POLL_S = 0.001  # a step that returned nothing: back off this long instead of spinning
_BOUND_EVERY_S = 0.25  # how often the early-stop bound is re-evaluated


@dataclass(frozen=True)
class ReplayResult:
    records: list[RequestRecord]  # completed requests, in completion order
    start_s: float  # engine-clock time of the workload's t = 0
    num_rejected: int  # refused by add_request (too long for the deployment, ...)
    num_failed: int  # finished with an error (a worker died)
    num_aborted: int  # still pending when the replay stopped early
    stopped_early: bool
    mean_ttft_bound_s: float | None  # when stopped early: the mean TTFT is at least this
    resident_s: float = 0.0  # the integral of admitted requests over the steps' time (request-seconds)
    output_tokens: int = 0  # tokens generated for the replay's requests


class _Tracked:
    """An OutputTracker plus the compute of every batch the request took part in up to its first
    token: a prompt prefilled in several chunks has spent compute in each, not only the last."""

    def __init__(self, tracker: OutputTracker):
        self.tracker = tracker
        self.compute_s: float | None = None

    def on_step(self, out) -> None:
        if self.tracker.metrics.first_token_s is None and out.timing is not None:
            self.compute_s = (self.compute_s or 0.0) + out.timing.compute_s
        self.tracker.on_step(out)


def random_prompts(requests: list[WorkloadRequest], vocab_size: int, seed: int) -> list[list[int]]:
    """Token ids in [0, min(256, vocab)): bytes, valid for the byte-level tokenizer of ``tiny``."""
    rng = np.random.default_rng([seed, 1])
    high = min(256, vocab_size)
    return [rng.integers(0, high, r.prompt_len).tolist() for r in requests]


def replay(llm, requests: list[WorkloadRequest], prompts: list[list[int]], label: str = "r",
           stop: StopRule | None = None, progress: bool = True) -> ReplayResult:
    """Run ``requests`` through ``llm.engine`` at their arrival times; blocks until all are done.

    With ``stop``, the replay stops as soon as the run has certainly missed the SLO: what is
    pending is aborted, and work already on the workers is drained before this returns, so the
    next probe starts on an idle deployment (the probes stay independent).
    """
    engine, n = llm.engine, len(requests)
    bar = _Progress(n, label, progress)
    tracked: dict[str, _Tracked] = {}
    records: list[RequestRecord] = []
    num_rejected = num_failed = 0
    next_bound_s = 0.0
    resident_s, output_tokens = 0.0, 0
    i = 0
    start_s = clock()
    while i < n or tracked:
        now = clock()
        while i < n and start_s + requests[i].arrival_s <= now:
            w = requests[i]
            params = SamplingParams(max_tokens=w.output_len, ignore_eos=True, temperature=0.0)
            r = llm.make_request(prompts[i], params, request_id=f"{label}-{i}")
            r.arrival_s = start_s + w.arrival_s
            i += 1
            try:
                engine.add_request(r)
            except RequestError:
                num_rejected += 1
                bar.update()
                continue
            tracked[r.request_id] = _Tracked(OutputTracker(r, llm.tokenizer))
        if stop is not None and now >= next_bound_s:
            next_bound_s = now + _BOUND_EVERY_S
            done, waiting = _progress(records, tracked)
            if stop.fails(done, waiting, n - num_rejected, now):
                for rid in tracked:
                    engine.abort(rid)
                engine.drain()
                bar.close()
                bound = mean_ttft_lower_bound(done, waiting, n - num_rejected, now)
                return ReplayResult(records, start_s, num_rejected, num_failed, len(tracked) + n - i, True, bound,
                                    resident_s, output_tokens)
        if engine.has_unfinished():
            resident = engine.load().num_running
            result = engine.step()
            resident_s += resident * (clock() - now)
            for rid, out in result.outputs.items():
                if rid in tracked:
                    tracked[rid].on_step(out)
                    output_tokens += out.token_id is not None
            for r in result.finished:
                t = tracked.pop(r.request_id, None)
                if t is None:
                    continue
                out = t.tracker.output()
                m = out.metrics
                if out.error is not None or m.first_token_s is None:
                    if not num_failed:  # why, once per replay: a failed deployment fails every request alike
                        print(f"{label}: request {r.request_id} failed: {out.error or 'no first token'}",
                              file=sys.stderr, flush=True)
                    num_failed += 1
                else:
                    records.append(RequestRecord(len(r.prompt_token_ids), m.arrival_s, m.first_scheduled_s,
                                                 m.first_token_s, t.compute_s, m.finished_s,
                                                 len(out.outputs[0].token_ids), m.kv_handoff_s))
                bar.update()
            if not result.outputs and not result.finished:
                time.sleep(_IDLE_POLL_S)
        elif tracked:
            raise RuntimeError(f"the engine went idle with {len(tracked)} requests pending")
        elif i < n:
            time.sleep(max(0.0, start_s + requests[i].arrival_s - clock()))
    bar.close()
    return ReplayResult(records, start_s, num_rejected, num_failed, 0, False, None, resident_s, output_tokens)


def _progress(records: list[RequestRecord], tracked: dict[str, _Tracked]) -> tuple[list[float], list[float]]:
    """TTFTs known so far, and the arrival times of requests still waiting for their first token."""
    done = [r.ttft_s for r in records]
    waiting = []
    for t in tracked.values():
        m = t.tracker.metrics
        if m.first_token_s is not None:
            done.append(m.first_token_s - m.arrival_s)
        else:
            waiting.append(m.arrival_s)
    return done, waiting


class _Progress:
    """tqdm on stderr when available, else a plain line redrawn at most twice a second."""

    def __init__(self, total: int, label: str, enabled: bool):
        self.total, self.label, self.done, self._last = total, label, 0, 0.0
        self.bar = None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=label, unit="req", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def update(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled and (time.monotonic() - self._last > 0.5 or self.done == self.total):
            self._last = time.monotonic()
            print(f"\r{self.label}: {self.done}/{self.total} requests", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(file=sys.stderr)
