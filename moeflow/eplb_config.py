"""Live expert load balancing's settings (vLLM's ``--eplb-config``): ``EngineConfig.eplb_config``.

How many redundant slots a deployment has is its layout's (``num_redundant_experts``): the
simulator and the memory plan need it whether or not the engine rebalances.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from moeflow.errors import ConfigError

EPLB_POLICIES = ("auto", "hierarchical", "global")


@dataclass(frozen=True)
class EplbConfig:
    window_size: int = 1000  # work items of routed load a new placement is computed from
    step_interval: int = 3000  # work items between two rebalances
    num_groups: int | None = None  # expert groups of the hierarchical policy (None: the model's, else 1)
    policy: str = "auto"  # scheduler/eplb.py: hierarchical where the nodes divide the groups, else global
    log_balancedness: bool = False  # log every layer's balancedness at each rebalance

    def __post_init__(self) -> None:
        for name in ("window_size", "step_interval"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
                raise ConfigError(f"eplb_config.{name} must be a positive int (work items), got {v!r}")
        g = self.num_groups
        if g is not None and not (isinstance(g, int) and not isinstance(g, bool) and g > 0):
            raise ConfigError(f"eplb_config.num_groups must be None or a positive int, got {g!r}")
        if self.policy not in EPLB_POLICIES:
            raise ConfigError(f"eplb_config.policy must be one of {EPLB_POLICIES}, got {self.policy!r}")

    @classmethod
    def parse(cls, given) -> "EplbConfig":
        """From a mapping (JSON on the command line, YAML, a dict): unknown keys are refused by name."""
        if isinstance(given, cls):
            return given
        if not isinstance(given, dict):
            raise ConfigError(f"eplb_config must be a mapping, got {given!r}")
        if "num_redundant_experts" in given:
            raise ConfigError("eplb_config.num_redundant_experts: give it as --num-redundant-experts "
                              "(num_redundant_experts=...), a field of the layout")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(given) - known - {"use_async"})
        if unknown:
            raise ConfigError(f"eplb_config: unknown keys {unknown} (known: {sorted(known)})")
        if given.get("use_async", True) is not True:
            raise ConfigError("eplb_config.use_async: moeflow always moves experts while serving goes on")
        return cls(**{k: v for k, v in given.items() if k != "use_async"})


def check_engine(config) -> None:
    """An ``EngineConfig``'s expert-balancing fields: ``eplb_config`` parsed in place, the rest checked."""
    object.__setattr__(config, "eplb_config", EplbConfig.parse(config.eplb_config or {}))
    if not isinstance(config.enable_eplb, bool):
        raise ConfigError(f"EngineConfig.enable_eplb must be a bool, got {config.enable_eplb!r}")
    loc = config.init_expert_location
    if not (isinstance(loc, str) and (loc == "trivial" or os.path.isfile(loc))):
        # the file's contents need the model (scheduler/expert_location.py reads them at the engine's start)
        raise ConfigError(f"init_expert_location: {loc!r} is neither 'trivial' nor a file")
