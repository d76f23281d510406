"""RestartPolicy: when a deployment whose worker died is rebuilt, and how often.

A failure ends the requests it affected (the engine's ``_fail``); the policy then decides whether
to build the same deployment again. Attempts back off exponentially, so a deployment that cannot
start (a bad host, memory gone) is retried a bounded number of times, not in a hot loop; a
successful restart resets the count, a crash loop faster than ``min_uptime_s`` does not.
"""
from __future__ import annotations

from dataclasses import dataclass

from moeflow.config import ConfigError


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 0  # consecutive attempts after a failure; 0: a failed deployment stays failed
    backoff_s: float = 1.0  # wait before the first attempt; doubled before each next one
    max_backoff_s: float = 30.0
    # a deployment that fails again sooner than this after a restart continues the same run of
    # attempts (and its back-off) instead of starting a fresh one
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
