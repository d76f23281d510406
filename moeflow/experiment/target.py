"""What the simulator prices a deployment on: a hardware preset and a cost model.

Both experiment files (serving: ``serve.py``, decode: ``decode.py``) hold one, read once here from
the same keys at the file's top level:

    hardware: gb200                 # a preset of sim/hardware.py (cpu-here: a machine like this one)
    cost: analytic                  # or profiled, with profile: FILE.json (what `moeflow profile` wrote)
    machine: FILE.json              # hardware cpu-here: that machine's `moeflow env --json` report
    hardware_overrides: {mem_bw_Bps: 15e9}   # preset fields replaced

The engine ignores all of them. Whether ``hardware`` names a preset, and the overrides its fields, the
simulator checks when it builds the cost model: the presets live there.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from moeflow.config import ConfigError

COSTS = ("analytic", "profiled")


@dataclass(frozen=True)
class SimTarget:
    hardware: str | None = None  # hardware preset (sim/hardware.py); the analytic cost needs one
    cost: str = "analytic"
    profile: str | None = None  # profiled cost: the JSON ``moeflow profile`` wrote
    machine: str | None = None  # hardware cpu-here: the `moeflow env --json` report of that machine
    hardware_overrides: tuple[tuple[str, float], ...] = ()  # (preset field, value), sorted by field

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(f"experiment: {msg}")

        for f in ("hardware", "profile", "machine"):
            v = getattr(self, f)
            need(v is None or (isinstance(v, str) and v != ""), f"{f} must be a name or a path, got {v!r}")
        need(self.cost in COSTS, f"cost must be one of {COSTS}, got {self.cost!r}")
        need(self.cost != "profiled" or bool(self.profile), "cost: profiled needs profile: FILE.json")
        need(all(isinstance(k, str) and isinstance(v, float) for k, v in self.hardware_overrides),
             f"hardware_overrides must be (field, number) pairs, got {self.hardware_overrides!r}")


TARGET_KEYS = tuple(f.name for f in fields(SimTarget))


def pop_target(d: dict) -> SimTarget:
    """Take the target's keys out of a file's top level ``d`` (a copy the caller owns; the keys left
    are the file's own) and read them."""
    t = {k: d.pop(k) for k in TARGET_KEYS if k in d}
    over = t.get("hardware_overrides") or {}
    if not isinstance(over, dict):
        raise ConfigError(f"experiment: hardware_overrides must be a mapping of preset fields, got {over!r}")
    t["hardware_overrides"] = tuple(sorted((k, _number(v, f"hardware_overrides.{k}")) for k, v in over.items()))
    return SimTarget(**t)


def _number(v, where: str) -> float:
    # NOTE: YAML 1.1 reads 28e9 (no dot, no sign) as a string; accept what float() accepts
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"experiment: {where} must be a number, got {v!r}") from None
