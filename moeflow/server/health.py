"""What the server says about its deployment (``Snapshot``: /health and the gauges), and the
engine thread's decisions when it is not whole (``Supervisor``): rebuild a failed deployment under
the restart policy, heal a degraded one in place, or give up.

Giving up ends the server by default (``on_give_up``, vLLM's behaviour when its engine dies), so
that a supervisor (systemd, Kubernetes) restarts the process rather than routing to a server that
answers 503 forever; ``moeflow serve --keep-alive-on-failure`` keeps it answering instead.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

from moeflow.engine.base import clock
from moeflow.server.metrics import ServerMetrics

logger = logging.getLogger("moeflow.server")


@dataclass(frozen=True)
class Snapshot:
    """The engine's state after the thread's latest iteration (what /metrics and /health read)."""

    healthy: bool
    failure: str | None  # why not healthy
    num_pending: int  # accepted by submit, not finished
    num_waiting: int = 0
    num_running: int = 0
    num_free_kv_blocks: int = 0
    num_kv_blocks: int = 0
    running_per_group: tuple[int, ...] = ()
    preemptions_per_group: tuple[int, ...] = ()  # since the deployment started (a restart starts again at 0)
    restarting: bool = False  # a failed deployment is being rebuilt (healthy again when it is up)
    degraded: str | None = None  # serving, but with less than it was built with (a lost dwdp rank): why
    running_per_role: tuple[tuple[str, int], ...] = ()  # pd: requests on the prefill and the decode side
    num_handoffs: int = 0  # pd: KV handoffs in flight (prefilled, not yet decoding)
    handoff_counts: tuple[tuple[str, int], ...] = ()  # pd: failures, lease expiries, recomputes so far
    eplb_physical_experts: int = 0  # expert slots per MoE layer (E + redundant); 0: no expert devices
    eplb_balancedness: tuple[tuple[int, float], ...] = ()  # (layer, mean / max device load over the window)
    eplb_hottest: tuple[tuple[int, int, float], ...] = ()  # (layer, expert, share of the layer's tokens)
    members: tuple[tuple[str, int], ...] = ()  # an elastic deployment's processes by role now
    scale_events: tuple[tuple[str, str, int], ...] = ()  # (kind, outcome, count) of its ended changes


class Overloaded(Exception):
    """``max_pending`` requests are unfinished already."""


class EngineUnavailable(Exception):
    """The engine failed (a worker died, a step raised) or is shutting down; ``retry_after_s``
    is set while the deployment is being restarted (the server answers 503 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Stopping(Exception):
    """Shutdown was asked for during a restart's back-off."""


class Supervisor:
    """The engine thread's restart and heal decisions; it reports what it decided."""

    def __init__(self, metrics: ServerMetrics, stopping: threading.Event,
                 on_give_up: Callable[[str], None] | None):
        self.metrics, self.stopping, self.on_give_up = metrics, stopping, on_give_up
        self._degraded: str | None = None
        self._degraded_since = 0.0
        self._stalls: tuple[object, int] = (None, 0)  # (engine, stalls of it counted)

    def restart(self, llm, reason: str) -> str | None:
        """Rebuild ``llm``'s failed deployment; None once it serves again, else why it stays failed.
        Raises Stopping if shutdown cuts a back-off short."""
        logger.warning("restarting the deployment after: %s", reason)
        t0 = clock()
        try:
            llm.restart(sleep=self._backoff)
        except Stopping:
            raise
        except Exception as e:  # noqa: BLE001  (failed attempts spent, or a build that raised)
            self.metrics.restarts.labels("failed").inc()
            return f"{reason}; restart failed: {e}"
        self.metrics.restarts.labels("ok").inc()
        self.metrics.restart_seconds.observe(clock() - t0)
        logger.warning("serving again after %.1f s", clock() - t0)
        return None

    def give_up(self, reason: str) -> None:
        logger.error("the deployment stays failed: %s", reason)
        if self.on_give_up is not None:
            self.on_give_up(reason)

    def mend(self, engine, may_heal: bool) -> str | None:
        """Heal a degraded deployment in place (when the policy allows); returns a reason to
        rebuild it instead (it cannot be healed in place), else None."""
        why = engine.load().degraded
        if why is not None and self._degraded is None:
            logger.warning("the deployment is degraded: %s", why)
            self._degraded_since = clock()
        elif why is None and self._degraded is not None:
            logger.warning("the deployment is whole again after %.1f s", clock() - self._degraded_since)
            self.metrics.restarts.labels("ok").inc()
            self.metrics.restart_seconds.observe(clock() - self._degraded_since)
        self._degraded = why
        if why is not None and may_heal and not engine.heal():
            return f"{why}; rebuilding the whole deployment"
        return None

    @property
    def degraded(self) -> str | None:
        return self._degraded

    def count_stalls(self, engine) -> None:
        """After every step: the stalls ``engine`` noticed that are not counted yet."""
        seen, counted = self._stalls
        counted = counted if seen is engine else 0
        if engine.stalls > counted:
            self.metrics.stalls.inc(engine.stalls - counted)
        self._stalls = (engine, engine.stalls)

    def _backoff(self, seconds: float) -> None:
        if self.stopping.wait(seconds):
            raise Stopping()
