"""RestartPolicy: when a deployment whose worker died is rebuilt, and how often; RestartCount: the
attempts so far.

A failure ends the requests it affected (the engine's ``_fail``); the policy then decides whether
to build the same deployment again. Only attempts that fail to bring the deployment up count
towards ``max_restarts``: a deployment that cannot start (a bad host, /dev/shm full, a checkpoint
gone) is retried a bounded number of times, then given up; one that comes up and later fails again
is rebuilt again, however often. Waits back off exponentially over the failed attempts and over
the restarts of a crash loop (a deployment that fails again sooner than ``min_uptime_s`` after
coming up), so neither runs hot.
"""
from __future__ import annotations

from dataclasses import dataclass

from moeflow.config import ConfigError


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 0  # attempts in a row that may fail to bring it up; 0: a failed deployment stays failed
    backoff_s: float = 1.0  # wait before the first attempt; doubled before each next one
    max_backoff_s: float = 30.0
    # a deployment that fails again sooner than this after a restart is in a crash loop: its next
    # restart waits longer (the back-off goes on growing) instead of starting from backoff_s
    min_uptime_s: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ConfigError(f"max_restarts must be an int >= 0, got {self.max_restarts!r}")
        for name in ("backoff_s", "max_backoff_s", "min_uptime_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v < 0:
                raise ConfigError(f"{name} must be a number >= 0, got {v!r}")

    @property
    def enabled(self) -> bool:
        return self.max_restarts > 0

    def delay_s(self, attempt: int) -> float:
        """Wait before attempt ``attempt`` (0-based) of one run of attempts."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** attempt)


@dataclass
class RestartCount:
    """A deployment's restarts under a policy. The engine's owner calls ``failed`` when the
    deployment fails, then, per attempt, ``delay_s`` (the wait before it) and ``attempt_failed``
    or ``came_up``; ``exhausted`` says when to give up."""

    policy: RestartPolicy
    restarts: int = 0  # deployments rebuilt so far
    failed_attempts: int = 0  # attempts in a row that did not bring the deployment up
    crash_loop: int = 0  # restarts in a row after which it failed again within min_uptime_s
    up_since_s: float = 0.0

    def failed(self, now_s: float) -> None:
        if now_s - self.up_since_s >= self.policy.min_uptime_s:
            self.crash_loop = 0

    def delay_s(self) -> float:
        return self.policy.delay_s(self.crash_loop + self.failed_attempts)

    @property
    def exhausted(self) -> bool:
        return self.failed_attempts >= self.policy.max_restarts

    def attempt_failed(self) -> None:
        self.failed_attempts += 1

    def came_up(self, now_s: float) -> None:
        self.restarts += 1
        self.crash_loop += 1
        self.failed_attempts = 0
        self.up_since_s = now_s
