"""The engine interface every mode implements, and the mode registry."""
from __future__ import annotations

import abc
import time
from dataclasses import dataclass

from moeflow.config import ConfigError, EngineConfig
from moeflow.core import Request


def clock() -> float:
    """The engine's monotonic clock (seconds); request metrics use it."""
    return time.monotonic()


@dataclass
class StepResult:
    outputs: dict  # request id -> workers.runner.SeqOutput produced this step
    finished: list[Request]  # requests that finished (or failed) in this step


class Engine(abc.ABC):
    """One deployment: schedule -> execute -> update, one ``step`` at a time."""

    config: EngineConfig
    max_model_len: int

    @abc.abstractmethod
    def add_request(self, request: Request) -> None:
        """Validate and queue; raises ``RequestError`` without side effects on bad input."""

    @abc.abstractmethod
    def step(self) -> StepResult: ...

    @abc.abstractmethod
    def has_unfinished(self) -> bool: ...

    @abc.abstractmethod
    def abort(self, request_id: str) -> None: ...

    def shutdown(self) -> None:
        """Release processes and shared memory (nothing to do for in-process engines)."""


MODES: dict[str, type[Engine]] = {}


def register_mode(name: str):
    def deco(cls: type[Engine]) -> type[Engine]:
        MODES[name] = cls
        cls.mode_name = name
        return cls
    return deco


def create_engine(mode: str, model_path: str, config: EngineConfig, **mode_kwargs) -> Engine:
    from moeflow.engine import colocated  # noqa: F401  (registers the built-in modes)

    if mode not in MODES:
        raise ConfigError(f"unknown mode {mode!r}; available modes: {sorted(MODES)}")
    return MODES[mode](model_path, config, **mode_kwargs)
