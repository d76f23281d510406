"""Deployment layouts: one frozen, validated dataclass per mode (``modes.py``), in the table below.

A layout is the shape of a deployment (processes per role, where experts and requests go) and the
scheduling policy it runs. ``LLM``, the command line (generated from the fields), ``create_engine``
and the simulator's systems are all built from it, so a ``systems:`` entry of an experiment file
means one thing to the engine and to the simulator. What only one side knows is not here: the
engine's runtime settings are ``EngineConfig``, the simulator's modelling options ``SimOptions``.

Pure Python, no torch: the simulator imports it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from moeflow.config import ConfigError
from moeflow.layout.base import PLACEMENTS, Layout, assign_experts, field_default, require
from moeflow.layout.modes import (AFD_ROUTERS, AFD_TOPOLOGIES, COPY_PLANS, AfdLayout, AsapLayout, ColocatedLayout,
                                  DepLayout, DwdpLayout)
from moeflow.layout.pd import DECODE_MODES, PREFILL_MODES, PdLayout, is_layout_field, parse_parts

LAYOUTS: dict[str, type[Layout]] = {c.mode: c for c in (ColocatedLayout, DepLayout, AsapLayout, DwdpLayout, AfdLayout,
                                                        PdLayout)}


def layout_class(mode: str) -> type[Layout]:
    if mode not in LAYOUTS:
        raise ConfigError(f"unknown mode {mode!r}: mode must be one of {sorted(LAYOUTS)}")
    return LAYOUTS[mode]


def nested(cls: type[Layout]) -> dict[str, type]:
    """Fields of ``cls`` that are sub-configs whose own fields are accepted flat (e.g. asap's
    scheduler: ``min_batch_tokens=64`` means ``scheduler=SchedulerConfig(min_batch_tokens=64)``)."""
    return {f.name: type(field_default(f)) for f in dataclasses.fields(cls)
            if dataclasses.is_dataclass(field_default(f)) and not is_layout_field(f)}


def flat_names(cls: type[Layout]) -> set[str]:
    """Every keyword a layout of ``cls`` accepts: its fields and its sub-configs' fields."""
    names = {f.name for f in dataclasses.fields(cls)}
    for sub in nested(cls).values():
        names |= {f.name for f in dataclasses.fields(sub)}
    return names


def make_layout(mode: str, **kw: Any) -> Layout:
    """The layout of ``mode`` from flat keywords (sub-config fields included), validated."""
    cls = layout_class(mode)
    unknown = set(kw) - flat_names(cls)
    if unknown:
        raise ConfigError(f"mode {mode!r} has no option(s) {sorted(unknown)}; its options: {sorted(flat_names(cls))}")
    own = {f.name for f in dataclasses.fields(cls)}
    args = {k: v for k, v in kw.items() if k in own and k not in nested(cls)}
    for f in filter(is_layout_field, dataclasses.fields(cls)):  # a layout of layouts (pd): its parts as mappings
        if isinstance(args.get(f.name), dict):
            args[f.name] = layout_from_dict(args[f.name], f"{mode} {f.name}")
    for name, sub in nested(cls).items():
        given = kw.get(name)
        sub_kw = {k: v for k, v in kw.items() if k in {f.name for f in dataclasses.fields(sub)} and k not in own}
        if isinstance(given, sub):
            require(not sub_kw, f"pass {name} options either as {name}=... or as keywords, not both: {sorted(sub_kw)}")
            args[name] = given
        else:
            args[name] = sub(**{**(given or {}), **sub_kw})
    return cls(**args)


def layout_from_dict(d: dict, where: str = "layout") -> Layout:
    """A layout from a mapping with a ``mode`` key (an experiment file's ``systems:`` entry)."""
    if not isinstance(d, dict) or "mode" not in d:
        raise ConfigError(f"{where}: needs a mapping with a 'mode' key, got {d!r}")
    try:
        known = flat_names(layout_class(d["mode"]))
        unknown = set(d) - known - {"mode"}
        if unknown:
            raise ConfigError(f"unknown keys in {where}: {sorted(unknown)} (known: {sorted(known)})")
        return make_layout(**d)
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{where}: {e}") from None


def layout_to_dict(layout: Layout) -> dict:
    """The inverse of ``layout_from_dict`` (for result files)."""
    out = {"mode": layout.mode}
    for f in dataclasses.fields(layout):
        v = getattr(layout, f.name)
        out[f.name] = layout_to_dict(v) if is_layout_field(f) else (
            dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v)
    return out
