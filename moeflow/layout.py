"""Deployment layouts: one frozen, validated dataclass per mode, in a registry keyed by mode name.

A layout is the shape of a deployment (processes per role, where experts and requests go) and the
scheduling policy it runs. ``LLM``, the command line (generated from the fields), ``create_engine``
and the simulator's systems are all built from it, so a ``systems:`` entry of an experiment file
means one thing to the engine and to the simulator. What only one side knows is not here: the
engine's runtime settings are ``EngineConfig``, the simulator's modelling options ``SimOptions``.

Pure Python, no torch: the simulator imports it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from moeflow.config import ConfigError, SchedulerConfig, opt

PLACEMENTS = ("least_loaded", "round_robin")  # how dep and dwdp assign requests to ranks


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _positive(layout: "Layout", *names: str) -> None:
    for n in names:
        v = getattr(layout, n)
        _require(isinstance(v, int) and not isinstance(v, bool) and v > 0,
                 f"{layout.mode} layout: {n} must be a positive int, got {v!r}")


def _placement_opt():
    return opt("least_loaded", "a request's rank: the least loaded at its first step, or fixed in turn at arrival "
               "(SGLang's DP controller)", flag="--dp-placement", choices=PLACEMENTS)


def _chunk_opt():
    return opt(None, "C: prompts advance at most C tokens per step (ChunkedPrefill)")


def _check_dp_options(layout: "Layout") -> None:
    """The request placement and chunk size that dep, dwdp and afd share."""
    m = layout.mode
    _require(layout.placement in PLACEMENTS, f"{m} layout: placement must be one of {PLACEMENTS}, got {layout.placement!r}")
    c = layout.chunked_prefill_size
    _require(c is None or (isinstance(c, int) and 0 < c <= layout.max_batch_tokens),
             f"{m} layout: chunked_prefill_size must be in [1, max_batch_tokens={layout.max_batch_tokens}], got {c!r}")


@dataclass(frozen=True)
class Layout:
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
                 if getattr(self, f.name) != _default(f)]
        return f"{self.mode}({', '.join(parts)})"


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


LAYOUTS: dict[str, type[Layout]] = {}


def register_layout(cls: type[Layout]) -> type[Layout]:
    LAYOUTS[cls.mode] = cls
    return cls


def layout_class(mode: str) -> type[Layout]:
    if mode not in LAYOUTS:
        raise ConfigError(f"unknown mode {mode!r}: mode must be one of {sorted(LAYOUTS)}")
    return LAYOUTS[mode]


def nested(cls: type[Layout]) -> dict[str, type]:
    """Fields of ``cls`` that are sub-configs whose own fields are accepted flat (e.g. asap's
    scheduler: ``min_batch_tokens=64`` means ``scheduler=SchedulerConfig(min_batch_tokens=64)``)."""
    return {f.name: type(_default(f)) for f in dataclasses.fields(cls) if dataclasses.is_dataclass(_default(f))}


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
    for name, sub in nested(cls).items():
        given = kw.get(name)
        sub_kw = {k: v for k, v in kw.items() if k in {f.name for f in dataclasses.fields(sub)} and k not in own}
        if isinstance(given, sub):
            _require(not sub_kw, f"pass {name} options either as {name}=... or as keywords, not both: {sorted(sub_kw)}")
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
    return {"mode": layout.mode, **dataclasses.asdict(layout)}


# -- the modes ------------------------------------------------------------------------------------


@register_layout
@dataclass(frozen=True)
class ColocatedLayout(Layout):
    mode = "colocated"
    summary = "the whole model in one process; the reference every other mode must match"


@register_layout
@dataclass(frozen=True)
class DepLayout(Layout):
    mode = "dep"
    summary = "synchronous baselines: N ranks of DP attention + expert parallelism, a barrier at every MoE layer"

    dp: int = opt(1, "N: ranks of DP attention + expert parallelism")
    placement: str = _placement_opt()
    chunked_prefill_size: int | None = _chunk_opt()
    max_batch_tokens: int = opt(16384, "S: most tokens of one rank's batch")
    tp: int = opt(1, "devices per rank (the simulator's; the engine runs tp 1)", cli=False)

    def __post_init__(self) -> None:
        _positive(self, "dp", "max_batch_tokens", "tp")
        _check_dp_options(self)

    num_processes = property(lambda self: self.dp * self.tp)
    num_groups = property(lambda self: self.dp)  # a rank is a group


@register_layout
@dataclass(frozen=True)
class AsapLayout(Layout):
    mode = "asap"
    summary = "D*T attention workers + E MoE workers joined by one-sided dispatch/combine, no global barrier"

    attn_dp: int = opt(1, "D: attention data-parallel groups")
    attn_tp: int = opt(1, "T: tensor-parallel members per group")
    moe_workers: int = opt(1, "E: MoE worker processes")
    # per MoE worker, the global expert ids it holds; None: contiguous ranges. An expert listed
    # for several workers is replicated (DP group g uses replica g mod copies).
    expert_placement: tuple[tuple[int, ...], ...] | None = opt(None, "experts of each MoE worker", cli=False)
    # ASAP's three streams: MoE workers receive and send on their own threads while computing
    comm_threads: bool = opt(True, "ablation: MoE workers receive/send inline", flag="--no-comm-threads")
    scheduler: SchedulerConfig = opt(SchedulerConfig(), "batching policy")

    def __post_init__(self) -> None:
        _positive(self, "attn_dp", "attn_tp", "moe_workers")
        p = self.expert_placement
        if p is not None:
            p = tuple(tuple(int(e) for e in ids) for ids in p)
            object.__setattr__(self, "expert_placement", p)  # lists from YAML or Python, frozen as tuples
            _require(len(p) == self.moe_workers,
                     f"asap layout: expert_placement lists {len(p)} workers, moe_workers is {self.moe_workers}")
            for w, ids in enumerate(p):
                _require(len(ids) > 0 and len(set(ids)) == len(ids),
                         f"asap layout: expert_placement[{w}] must list distinct expert ids, got {ids}")

    num_attention_workers = property(lambda self: self.attn_dp * self.attn_tp)
    num_processes = property(lambda self: self.attn_dp * self.attn_tp + self.moe_workers)
    num_groups = property(lambda self: self.attn_dp)

    def placement(self, num_experts: int) -> tuple[tuple[int, ...], ...]:
        """Experts held by each MoE worker; validated against the model's expert count."""
        return expert_placement(self.expert_placement, self.moe_workers, num_experts)


def expert_placement(given: tuple[tuple[int, ...], ...] | None, num_workers: int,
                     num_experts: int) -> tuple[tuple[int, ...], ...]:
    """``given``, checked against the model, or contiguous ranges over ``num_workers``."""
    if given is None:
        _require(num_workers <= num_experts, f"{num_workers} expert workers for {num_experts} experts: some would hold none")
        bounds = [w * num_experts // num_workers for w in range(num_workers + 1)]
        return tuple(tuple(range(bounds[w], bounds[w + 1])) for w in range(num_workers))
    held = {e for ids in given for e in ids}
    _require(all(0 <= e < num_experts for e in held), f"expert_placement names experts outside [0, {num_experts})")
    missing = sorted(set(range(num_experts)) - held)
    _require(not missing, f"expert_placement leaves experts {missing} on no worker")
    return given


COPY_PLANS = ("sliced", "naive")


@register_layout
@dataclass(frozen=True)
class DwdpLayout(Layout):
    mode = "dwdp"
    summary = ("distributed-weight data parallelism: N ranks, each the whole model on its own requests, "
               "peers' experts pulled one layer ahead; no rank waits for another")

    dp: int = opt(1, "N: ranks of DP attention + expert parallelism")
    placement: str = _placement_opt()
    chunked_prefill_size: int | None = _chunk_opt()
    max_batch_tokens: int = opt(16384, "S: most tokens of one rank's batch")
    experts_per_rank: int | None = opt(None, "resident experts per rank (default ceil(E/N); more: some held twice, "
                                             "fewer to pull)")
    copy_plan: str = opt("sliced", "sliced: each pull cut into slices, interleaved over the sources; naive: "
                                   "whole pulls, one source after another", choices=COPY_PLANS)
    slice_bytes: int = opt(1 << 20, "slice size of the sliced copy plan (the paper's 1 MB)")
    merge: bool = opt(False, "ablation: copy resident and pulled experts into one buffer before the experts op",
                      flag="--merge-experts")

    def __post_init__(self) -> None:
        _positive(self, "dp", "max_batch_tokens", "slice_bytes")
        _check_dp_options(self)
        _require(self.copy_plan in COPY_PLANS, f"dwdp layout: copy_plan must be one of {COPY_PLANS}, "
                                               f"got {self.copy_plan!r}")
        _require(self.experts_per_rank is None or (isinstance(self.experts_per_rank, int) and self.experts_per_rank > 0),
                 f"dwdp layout: experts_per_rank must be a positive int, got {self.experts_per_rank!r}")

    num_processes = property(lambda self: self.dp)
    num_groups = property(lambda self: self.dp)

    def resident(self, num_experts: int) -> tuple[tuple[int, ...], ...]:
        """The experts each rank holds: ``experts_per_rank`` consecutive ids (mod E) from r*E/N, so
        every expert is held somewhere; E need not divide by N, and more than E/N per rank holds
        some twice (fewer to pull)."""
        per = self.experts_per_rank or -(-num_experts // self.dp)
        _require(per * self.dp >= num_experts and per <= num_experts,
                 f"dwdp layout: {self.dp} ranks x {per} experts cannot hold all {num_experts} experts once")
        return tuple(tuple((r * num_experts // self.dp + i) % num_experts for i in range(per)) for r in range(self.dp))


AFD_TOPOLOGIES = ("block", "all")
AFD_ROUTERS = ("attention", "ffn")


@register_layout
@dataclass(frozen=True)
class AfdLayout(Layout):
    mode = "afd"
    summary = ("attention-FFN disaggregation for decode: M attention instances (scheduling, KV, sampling) and N "
               "stateless FFN daemons, m micro-batches per step overlapping attention with the FFN")

    attn_workers: int = opt(1, "M: attention instances (each its own requests and KV cache)")
    ffn_workers: int = opt(1, "N: FFN daemons (experts only, no request state)")
    micro_batches: int = opt(2, "m: micro-batches per step, split on request boundaries (1: no overlap)")
    # block: FFN j holds every expert and serves the attention instances i with i % N == j (M >= N);
    # all: the experts are split over the N daemons and every instance sends to every daemon
    topology: str = opt("block", "which attention instances an FFN daemon serves", choices=AFD_TOPOLOGIES)
    router: str = opt("attention", "where tokens are routed: on the attention instance (pairs are sent) or on "
                      "the FFN daemon (token rows are sent, weighted sums come back)", flag="--afd-router",
                      choices=AFD_ROUTERS)
    overlap_scheduling: bool = opt(True, "ablation: schedule step t+1 only after step t returned")
    placement: str = _placement_opt()
    chunked_prefill_size: int | None = _chunk_opt()
    max_batch_tokens: int = opt(4096, "S: most tokens of one attention instance's step (all its micro-batches)")

    def __post_init__(self) -> None:
        _positive(self, "attn_workers", "ffn_workers", "micro_batches", "max_batch_tokens")
        _require(1 <= self.micro_batches <= 4, f"afd layout: micro_batches must be in [1, 4], got {self.micro_batches}")
        _require(self.topology in AFD_TOPOLOGIES, f"afd layout: topology must be one of {AFD_TOPOLOGIES}, "
                                                  f"got {self.topology!r}")
        _require(self.router in AFD_ROUTERS, f"afd layout: router must be one of {AFD_ROUTERS}, got {self.router!r}")
        _require(self.topology == "all" or self.attn_workers >= self.ffn_workers,
                 f"afd layout: topology 'block' gives each FFN daemon a block of attention instances, so "
                 f"attn_workers ({self.attn_workers}) must be >= ffn_workers ({self.ffn_workers}); use topology 'all'")
        _check_dp_options(self)

    num_processes = property(lambda self: self.attn_workers + self.ffn_workers)
    num_groups = property(lambda self: self.attn_workers)

    def ffns_of(self, instance: int) -> tuple[int, ...]:
        """The FFN daemons attention instance ``instance`` sends every MoE layer to."""
        return (instance % self.ffn_workers,) if self.topology == "block" else tuple(range(self.ffn_workers))

    def served_by(self, ffn: int) -> tuple[int, ...]:
        """The attention instances FFN daemon ``ffn`` aggregates, in order."""
        return tuple(i for i in range(self.attn_workers) if ffn in self.ffns_of(i))

    def placement_of_experts(self, num_experts: int) -> tuple[tuple[int, ...], ...]:
        """Experts each FFN daemon holds: all of them (block), or contiguous shares (all)."""
        if self.topology == "block":
            return (tuple(range(num_experts)),) * self.ffn_workers
        return expert_placement(None, self.ffn_workers, num_experts)
