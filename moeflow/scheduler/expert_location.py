"""Where a deployment's expert slots start (SGLang's ``--init-expert-location``): ``trivial`` (the
contiguous placement, ``ExpertMap.contiguous``) or a JSON file holding one of

- ``logical_count``: [MoE layer][logical expert] recorded load (tokens, or any non-negative weight),
  placed with the EPLB policy (``scheduler/eplb.rebalance``), as a live rebalance would place it;
  what ``GET /expert_distribution`` and ``LLM.expert_distribution()`` write, so a recorded run
  seeds the next deployment, of any shape;
- ``physical_to_logical_map``: [MoE layer][physical slot] the logical expert of every slot,
  device-major (device 0's slots first), for exactly this deployment's slots.

Optional keys are checked against the model: ``moe_layers`` (the model layer id of each row),
``num_experts``; ``work_items`` (how many work items the recording counted) and ``provenance``
(where a benchmark recorded it) are informational.
Pure Python: the engine and the simulator read the same file alike.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from moeflow.config import ConfigError
from moeflow.layout.expert_map import ExpertMap
from moeflow.scheduler.eplb import rebalance

TRIVIAL = "trivial"
_PLACEMENTS = ("logical_count", "physical_to_logical_map")
_INFO = ("moe_layers", "num_experts", "work_items", "provenance")


def read(path: str) -> dict:
    """The file's mapping, with its keys checked (exactly one placement key, nothing unknown)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"init_expert_location: {path!r} is neither {TRIVIAL!r} nor a file")
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"init_expert_location: {path} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"init_expert_location: {path} must hold a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_PLACEMENTS) - set(_INFO))
    given = [k for k in _PLACEMENTS if k in data]
    if unknown:
        raise ConfigError(f"init_expert_location: {path} has unknown keys {unknown} "
                          f"(known: {sorted(_PLACEMENTS + _INFO)})")
    if len(given) != 1:
        raise ConfigError(f"init_expert_location: {path} must hold exactly one of {list(_PLACEMENTS)}, "
                          f"it holds {given or 'neither'}")
    return data


def initial_map(source: str, held: tuple[tuple[int, ...], ...], num_experts: int, moe_layers: list[int],
                num_nodes: int = 1, num_groups: int = 1, policy: str = "auto") -> ExpertMap:
    """The placement a deployment starts with. ``held``: its expert devices' slots under the
    trivial placement (their count per device is the deployment's, whatever the file says)."""
    trivial = ExpertMap((tuple(held),) * len(moe_layers), num_experts)
    if source == TRIVIAL:
        return trivial
    data = read(source)
    _check_info(source, data, num_experts, moe_layers)
    rows = data.get("logical_count", data.get("physical_to_logical_map"))
    if not isinstance(rows, list) or len(rows) != len(moe_layers) or not all(isinstance(r, list) for r in rows):
        raise ConfigError(f"init_expert_location: {source}: expected a list of {len(moe_layers)} rows (one per MoE "
                          f"layer), got {_shape(rows)}")
    if "logical_count" in data:
        if not all(len(r) == num_experts and all(_number(x) for x in r) for r in rows):
            raise ConfigError(f"init_expert_location: {source}: logical_count needs {num_experts} finite non-negative "
                              f"numbers per layer (the model's experts), got {_shape(rows)}")
        return rebalance(rows, trivial.num_devices, trivial.num_redundant, num_groups, num_nodes, policy)
    slots = trivial.num_slots
    if not all(len(r) == slots and all(isinstance(x, int) and not isinstance(x, bool) for x in r) for r in rows):
        raise ConfigError(f"init_expert_location: {source}: physical_to_logical_map needs {slots} expert ids per "
                          f"layer (this deployment's slots: {list(trivial.slots_per_device)} per device), got "
                          f"{_shape(rows)}; give a logical_count to place for any deployment")
    return ExpertMap.from_physical(rows, trivial.slots_per_device, num_experts)


def _check_info(source: str, data: dict, num_experts: int, moe_layers: list[int]) -> None:
    if "num_experts" in data and data["num_experts"] != num_experts:
        raise ConfigError(f"init_expert_location: {source} was recorded for {data['num_experts']} experts, "
                          f"the model has {num_experts}")
    if "moe_layers" in data and data["moe_layers"] != list(moe_layers):
        raise ConfigError(f"init_expert_location: {source} was recorded for MoE layers {data['moe_layers']}, "
                          f"the model's are {list(moe_layers)}")


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _shape(rows) -> str:
    if not isinstance(rows, list):
        return type(rows).__name__
    return f"{len(rows)} rows of lengths {sorted({len(r) if isinstance(r, list) else -1 for r in rows})}"
