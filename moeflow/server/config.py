"""ServerConfig: the HTTP server's settings (the engine's are ``EngineConfig`` and the mode's)."""
from __future__ import annotations

from dataclasses import dataclass

from moeflow.config import ConfigError


@dataclass(frozen=True)
class ServerConfig:
    model_name: str = "tiny"  # the only name /v1/models lists and requests may ask for
    host: str = "127.0.0.1"  # loopback by default: exposing the server is a deliberate choice
    port: int = 8000
    api_key: str | None = None  # when set, every route but /health needs "Authorization: Bearer <key>"
    # Admission bound: requests accepted and not yet finished (queued + running). Past it a new
    # request gets 429 at once, so a flood costs a refusal each, not unbounded queue memory.
    max_pending_requests: int = 256
    max_body_bytes: int = 4 << 20  # larger request bodies get 413 before any is parsed
    busy_window_s: float = 10.0  # per-worker busy fraction: compute seconds over this trailing window
    role: str | None = None  # "prefill" | "decode" behind moeflow router (kv_transfer_params honoured); None: whole requests

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ConfigError("ServerConfig.model_name must not be empty")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port!r}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key must not be empty (leave it unset for no authentication)")
        for name in ("max_pending_requests", "max_body_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"ServerConfig.{name} must be a positive int, got {v!r}")
        if self.role not in (None, "prefill", "decode"):
            raise ConfigError(f"ServerConfig.role must be prefill, decode or None, got {self.role!r}")
        if not self.busy_window_s > 0:
            raise ConfigError(f"busy_window_s must be > 0, got {self.busy_window_s!r}")
