"""ServerMetrics: the Prometheus registry behind ``GET /metrics``.

Histograms and counters are observed by the engine thread as tokens come out; gauges are read
at scrape time from the engine thread's latest snapshot (``AsyncEngine.snapshot``), so a scrape
never touches the engine. A registry per server (not the global one) lets several servers live
in one process, as the tests do.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(self, busy_window_s: float, clock: Callable[[], float]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("moeflow_time_to_first_token_seconds", "Arrival to first output token",
                              buckets=_LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("moeflow_inter_token_latency_seconds", "Time between consecutive output tokens",
                             buckets=_LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram("moeflow_e2e_request_latency_seconds", "Arrival to finish of finished requests",
                             buckets=_LATENCY_BUCKETS_S, registry=r)
        self.finished = Counter("moeflow_requests_finished", "Accepted requests by how they ended "
                                "(stop, length, error, abort)", ["finish_reason"], registry=r)
        self.errors = Counter("moeflow_http_errors", "Error answers of the routes by HTTP status (401 and "
                              "413 come from the guards before any route and are not counted)", ["status"], registry=r)
        self.prompt_tokens = Counter("moeflow_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("moeflow_generation_tokens", "Output tokens produced", registry=r)
        self.busy_seconds = Counter("moeflow_worker_busy_seconds", "Compute seconds reported per worker",
                                    ["worker"], registry=r)
        self.restarts = Counter("moeflow_engine_restarts", "Deployment restarts after a failure, by result (ok: "
                                "serving again; failed: the policy's attempts were spent)", ["result"], registry=r)
        self.restart_seconds = Histogram("moeflow_engine_restart_seconds", "Failure to serving again, per restart "
                                         "(back-off included)", buckets=_LATENCY_BUCKETS_S, registry=r)
        self.stalls = Counter("moeflow_engine_stalls", "Work items that went unanswered past --stall-timeout-s "
                              "(each failed the deployment, or a dwdp rank, as a dead worker would)", registry=r)
        self.kv_transfer = Histogram("moeflow_kv_transfer_seconds", "pd: one request's KV handoff, decode room "
                                     "found to KV in place on the decode side, by path (shm: one host's shared "
                                     "memory; gloo: pulled from another host; stage: a prefill server's copy out; "
                                     "in-place: its offer of the blocks where they are, nothing copied)",
                                     ["path"], buckets=_LATENCY_BUCKETS_S, registry=r)
        self.kv_bytes = Counter("moeflow_kv_transfer_bytes", "pd: KV bytes handed from prefill to decode instances, "
                                "by path", ["path"], registry=r)
        self.kv_prealloc = Histogram("moeflow_kv_prealloc_wait_seconds", "pd: first token sampled to decode blocks "
                                     "pre-allocated (waiting for decode room)", buckets=_LATENCY_BUCKETS_S, registry=r)
        self.autoscale = Counter("moeflow_autoscale_decisions", "--autoscale: the controller's decisions, by reason "
                                 "(over_slo, kv_room, under_slo, idle; refused: the deployment would not take it)",
                                 ["reason"], registry=r)
        self._busy_window_s = busy_window_s
        self._busy: deque[tuple[float, str, float]] = deque()  # (when, worker, seconds), oldest first
        self._workers: set[str] = set()
        self._lock = threading.Lock()  # the engine thread appends while a scrape reads
        self._clock = clock
        self._start_s = clock()
        self._snapshot: Callable[[], object] | None = None
        self._work_age: Callable[[], float] = lambda: 0.0

    def observe_token(self, first: bool, gap_s: float) -> None:
        """Engine thread: a token reached a client: its TTFT (the first) or its gap since the token
        before (ITL), and one more generation token."""
        (self.ttft if first else self.itl).observe(gap_s)
        self.generation_tokens.inc()

    def observe_finished(self, reason: str, e2e_s: float) -> None:
        """Engine thread: a request finished (its end-to-end latency counts when it completed)."""
        self.finished.labels(reason).inc()
        if reason in ("stop", "length"):
            self.e2e.observe(e2e_s)

    def observe_busy(self, busy_s: dict[str, float]) -> None:
        """Engine thread: the compute each worker reported in one step."""
        now = self._clock()
        with self._lock:
            for worker, secs in busy_s.items():
                self.busy_seconds.labels(worker).inc(secs)
                self._busy.append((now, worker, secs))
                self._workers.add(worker)
            while self._busy and self._busy[0][0] < now - self._busy_window_s:
                self._busy.popleft()

    def observe_handoffs(self, transfers: list, prealloc_waits_s: list[float]) -> None:
        """Engine thread: the KV handoffs (``engine.base.KvTransfer``) a pd deployment completed in one step."""
        for t in transfers:
            self.kv_transfer.labels(t.path).observe(t.seconds)
            self.kv_bytes.labels(t.path).inc(t.nbytes)
        for secs in prealloc_waits_s:
            self.kv_prealloc.observe(secs)

    def busy_fractions(self) -> dict[str, float]:
        """Per worker, compute seconds over the trailing window (or since start, if shorter)."""
        now = self._clock()
        span = max(min(self._busy_window_s, now - self._start_s), 1e-9)
        with self._lock:
            totals = dict.fromkeys(self._workers, 0.0)
            for t, worker, secs in self._busy:
                if t >= now - self._busy_window_s:
                    totals[worker] += secs
        return {w: min(1.0, s / span) for w, s in totals.items()}

    def watch(self, snapshot: Callable[[], object], work_age: Callable[[], float] | None = None) -> None:
        """Export the gauges of ``snapshot()`` (a ``health.Snapshot``) and ``work_age()`` (seconds the
        oldest unanswered work item has been out) at every scrape."""
        self._snapshot = snapshot
        if work_age is not None:
            self._work_age = work_age
        self.registry.register(_Gauges(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Gauges:
    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        s = self.metrics._snapshot()
        gauges = [
            ("moeflow_healthy", "1 while the engine serves, 0 after a failure", float(s.healthy)),
            ("moeflow_restarting", "1 while a failed deployment is being rebuilt", float(s.restarting)),
            ("moeflow_degraded", "1 while the deployment serves with a lost part (a dwdp rank) being replaced",
             float(s.degraded is not None)),
            ("moeflow_oldest_work_age_seconds", "How long the oldest work item without an answer from its "
             "workers has been out (the stall watchdog fails it past --stall-timeout-s)", self.metrics._work_age()),
            ("moeflow_requests_pending", "Accepted and not finished (the admission bound counts these)",
             s.num_pending),
            ("moeflow_requests_waiting", "Queue depth: accepted, not yet admitted to a group", s.num_waiting),
            ("moeflow_requests_running", "Admitted (KV blocks reserved), not finished", s.num_running),
            ("moeflow_kv_blocks_free", "Free KV-cache blocks, summed over attention groups", s.num_free_kv_blocks),
            ("moeflow_kv_blocks_total", "KV-cache blocks, summed over attention groups", s.num_kv_blocks),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
        usage = GaugeMetricFamily("moeflow_kv_cache_usage_ratio", "Share of the KV-cache blocks in use, over all "
                                  "attention groups (vLLM's kv_cache_usage_perc)")
        usage.add_metric([], 1 - s.num_free_kv_blocks / s.num_kv_blocks if s.num_kv_blocks else 0.0)
        yield usage
        preempted = CounterMetricFamily("moeflow_preemptions", "Requests preempted by recompute when their group ran "
                                        "out of KV blocks, per attention group, since the deployment started",
                                        labels=["group"])
        for g, n in enumerate(s.preemptions_per_group):
            preempted.add_metric([str(g)], n)
        yield preempted
        per_group = GaugeMetricFamily("moeflow_requests_running_per_group", "Resident requests of each attention "
                                      "group (afd instance, dep/dwdp rank, asap DP group)", labels=["group"])
        for g, n in enumerate(s.running_per_group):
            per_group.add_metric([str(g)], n)
        yield per_group
        if s.running_per_role:
            role = GaugeMetricFamily("moeflow_requests_running_per_role", "pd: requests on the prefill side "
                                     "(prefilling) and on the decode side (decoding)", labels=["role"])
            for name, n in s.running_per_role:
                role.add_metric([name], n)
            yield role
            flight = GaugeMetricFamily("moeflow_kv_transfers_in_flight", "pd: prefilled requests whose KV is "
                                       "not yet on a decode instance (waiting for room, or being copied)")
            flight.add_metric([], s.num_handoffs)
            yield flight
            outcomes = CounterMetricFamily("moeflow_kv_handoffs_given_up", "pd: handoffs given up, by why "
                                           "(failures, lease_expiries) and how many were recomputed on the decode "
                                           "side (recomputes)", labels=["outcome"])
            for name, n in s.handoff_counts:
                outcomes.add_metric([name], n)
            yield outcomes
        yield from _eplb(s)
        yield from _membership(s)
        busy = GaugeMetricFamily("moeflow_worker_busy_fraction", "Compute seconds per wall second of each "
                                 "worker over the trailing window (attention groups, dep ranks, colocated)",
                                 labels=["worker"])
        for worker, frac in sorted(self.metrics.busy_fractions().items()):
            busy.add_metric([worker], frac)
        yield busy


def _eplb(s):
    """The expert placement's gauges (the modes that spread experts over processes)."""
    if not s.eplb_physical_experts:
        return
    slots = GaugeMetricFamily("moeflow_eplb_physical_experts", "Expert slots per MoE layer over the expert "
                              "devices: the model's experts plus the redundant replicas")
    slots.add_metric([], s.eplb_physical_experts)
    yield slots
    if s.eplb_balancedness:
        bal = GaugeMetricFamily("moeflow_eplb_balancedness", "Mean / max tokens per expert device over the load "
                                "window, per MoE layer (1: perfectly balanced; vLLM's balancedness)", labels=["layer"])
        for layer, b in s.eplb_balancedness:
            bal.add_metric([str(layer)], b)
        yield bal
    hot = GaugeMetricFamily("moeflow_eplb_hottest_expert_share", "Share of a MoE layer's routed tokens that its "
                            "hottest experts took over the load window", labels=["layer", "expert"])
    for layer, e, share in s.eplb_hottest:
        hot.add_metric([str(layer), str(e)], share)
    yield hot


def _membership(s):
    """An elastic deployment's members and scale events (POST /scale)."""
    if not s.members:
        return
    members = GaugeMetricFamily("moeflow_members", "Processes of each role serving now (an elastic deployment)",
                                labels=["role"])
    for role, n in s.members:
        members.add_metric([role], n)
    yield members
    events = CounterMetricFamily("moeflow_scale_events", "Membership changes that ended, by kind and "
                                 "outcome (done, failed)", labels=["kind", "outcome"])
    for kind, outcome, n in s.scale_events:
        events.add_metric([kind, outcome], n)
    yield events

