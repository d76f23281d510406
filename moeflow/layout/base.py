"""What every layout shares: the ``Layout`` base, the options that several modes have, and how
experts are assigned to the processes that hold them. Pure Python (the simulator imports it)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from moeflow.config import ConfigError, opt
from moeflow.layout.expert_map import ExpertMap

PLACEMENTS = ("least_loaded", "round_robin")  # how dep and dwdp assign requests to ranks


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def positive(layout: "Layout", *names: str) -> None:
    for n in names:
        v = getattr(layout, n)
        require(isinstance(v, int) and not isinstance(v, bool) and v > 0,
                f"{layout.mode} layout: {n} must be a positive int, got {v!r}")


def placement_opt():
    return opt("least_loaded", "a request's rank: the least loaded at its first step, or fixed in turn at arrival "
               "(SGLang's DP controller)", flag="--dp-placement", choices=PLACEMENTS)


def redundant_opt():
    return opt(0, "R: redundant expert slots per MoE layer, replicas of the hot experts (E + R slots over the expert "
               "devices; need not divide)", flag="--num-redundant-experts")


def check_redundant(layout: "Layout") -> None:
    r = layout.num_redundant_experts
    require(isinstance(r, int) and not isinstance(r, bool) and r >= 0,
            f"{layout.mode} layout: num_redundant_experts must be an int >= 0, got {r!r}")


def check_capacity(layout: "Layout") -> None:
    """An elastic layout's most expert holders (``expert_max``) is an int at least its count."""
    cap, n = getattr(layout, layout.expert_max), getattr(layout, layout.expert_count)
    require(cap is None or (isinstance(cap, int) and not isinstance(cap, bool) and cap >= n),
            f"{layout.mode} layout: {layout.expert_max} must be >= {layout.expert_count} ({n}), got {cap!r}")


def check_attention_capacity(layout: "Layout") -> None:
    """An elastic attention side's most members (``attention_max``) is an int at least its count."""
    cap, n = getattr(layout, layout.attention_max), getattr(layout, layout.attention_count)
    require(cap is None or (isinstance(cap, int) and not isinstance(cap, bool) and cap >= n),
            f"{layout.mode} layout: {layout.attention_max} must be >= {layout.attention_count} ({n}), got {cap!r}")


def spread_experts(layout: "Layout", num_devices: int, num_experts: int) -> tuple[tuple[int, ...], ...]:
    """E + R slots in contiguous shares over ``num_devices``; slot p holds expert p mod E (the
    placement before any load is known: the R redundant slots replicate experts 0..R-1)."""
    r = layout.num_redundant_experts
    require(r <= num_experts, f"{layout.mode} layout: num_redundant_experts ({r}) is more than the model's "
                              f"{num_experts} experts: some would be held three times before any is held twice")
    return ExpertMap.contiguous(num_experts, num_devices, 1, r).layers[0]


def chunk_opt():
    return opt(None, "C: prompts advance at most C tokens per step (ChunkedPrefill)")


def check_dp_options(layout: "Layout") -> None:
    """The request placement and chunk size that dep, dwdp and afd share."""
    m = layout.mode
    require(layout.placement in PLACEMENTS, f"{m} layout: placement must be one of {PLACEMENTS}, got {layout.placement!r}")
    c = layout.chunked_prefill_size
    require(c is None or (isinstance(c, int) and 0 < c <= layout.max_batch_tokens),
            f"{m} layout: chunked_prefill_size must be in [1, max_batch_tokens={layout.max_batch_tokens}], got {c!r}")


@dataclass(frozen=True)
class Layout:
    """The modes whose processes hold experts also answer ``experts_held(num_experts)``: per
    expert-holding process (a rank, a MoE worker, an FFN daemon), the expert ids it holds. Where
    requests go is ``placement`` (dep, dwdp, afd), a different thing."""

    mode: ClassVar[str]
    summary: ClassVar[str]  # one line for --help and docs

    @property
    def num_processes(self) -> int:
        """Worker processes (devices, in the simulator) the deployment runs on."""
        return 1

    @property
    def num_groups(self) -> int:
        """Scheduler groups: each holds its own requests and KV cache (a DP group, a rank)."""
        return 1

    def describe(self) -> str:
        """The non-default fields, as a log line would show them."""
        parts = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                 if getattr(self, f.name) != field_default(f)]
        return f"{self.mode}({', '.join(parts)})"


def field_default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def assign_experts(given: tuple[tuple[int, ...], ...] | None, num_workers: int,
                   num_experts: int) -> tuple[tuple[int, ...], ...]:
    """``given``, checked against the model, or contiguous ranges over ``num_workers``."""
    if given is None:
        require(num_workers <= num_experts, f"{num_workers} expert workers for {num_experts} experts: some would hold none")
        bounds = [w * num_experts // num_workers for w in range(num_workers + 1)]
        return tuple(tuple(range(bounds[w], bounds[w + 1])) for w in range(num_workers))
    held = {e for ids in given for e in ids}
    require(all(0 <= e < num_experts for e in held), f"expert_placement names experts outside [0, {num_experts})")
    missing = sorted(set(range(num_experts)) - held)
    require(not missing, f"expert_placement leaves experts {missing} on no worker")
    return given
