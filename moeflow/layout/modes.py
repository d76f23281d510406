"""The layout of each mode: processes per role, where experts and requests go, and the scheduling
policy it runs; one frozen, validated dataclass each (``layout/__init__.py`` is their table)."""
from __future__ import annotations

from dataclasses import dataclass

from moeflow.config import SchedulerConfig, opt
from moeflow.layout.base import (Layout, assign_experts, check_attention_capacity, check_capacity, check_dp_options,
                                 check_redundant, chunk_opt, placement_opt, positive, redundant_opt, require,
                                 spread_experts)

MAX_DP_HELP = ("elastic: the most ranks the deployment may scale to while serving (dwdp: its starting dp is the "
               "fewest); default: dp, fixed")


@dataclass(frozen=True)
class ColocatedLayout(Layout):
    mode = "colocated"
    summary = "the whole model in one process; the reference every other mode must match"


@dataclass(frozen=True)
class DepLayout(Layout):
    mode = "dep"
    summary = "synchronous baselines: N ranks of DP attention + expert parallelism, a barrier at every MoE layer"

    dp: int = opt(1, "N: ranks of DP attention + expert parallelism")
    placement: str = placement_opt()
    chunked_prefill_size: int | None = chunk_opt()
    max_batch_tokens: int = opt(16384, "S: most tokens of one rank's batch")
    tp: int = opt(1, "devices per rank (the simulator's; the engine runs tp 1)", cli=False)
    num_redundant_experts: int = redundant_opt()
    # elastic: the most ranks this deployment may grow to while it serves (POST /scale); every rank's
    # buffers are sized for them at start. A rank brings (or drains) a DP attention group with its experts.
    max_dp: int | None = opt(None, MAX_DP_HELP)

    def __post_init__(self) -> None:
        positive(self, "dp", "max_batch_tokens", "tp")
        check_dp_options(self)
        check_redundant(self)
        check_capacity(self)

    num_processes = property(lambda self: self.dp * self.tp)
    num_groups = property(lambda self: self.dp)  # a rank is a group
    # the expert holders that may join and leave (engine/elastic.py): the ranks themselves
    expert_kind, expert_count, expert_max = "dep", "dp", "max_dp"
    elastic = property(lambda self: self.max_dp is not None)
    expert_capacity = property(lambda self: self.max_dp or self.dp)
    attention_role, attention_count = "dep", "dp"

    def experts_held(self, num_experts: int) -> tuple[tuple[int, ...], ...]:
        """Experts each rank holds: the r-th contiguous 1/N of every layer's E + R slots."""
        return spread_experts(self, self.dp, num_experts)


@dataclass(frozen=True)
class AsapLayout(Layout):
    mode = "asap"
    summary = "D*T attention workers + E MoE workers joined by one-sided dispatch/combine, no global barrier"

    attn_dp: int = opt(1, "D: attention data-parallel groups")
    attn_tp: int = opt(1, "T: tensor-parallel members per group")
    moe_workers: int = opt(1, "E: MoE worker processes")
    # per MoE worker, the global expert ids it holds; None: contiguous ranges. An expert listed
    # for several workers is replicated (token row t of a batch uses copy t mod copies).
    expert_placement: tuple[tuple[int, ...], ...] | None = opt(None, "experts of each MoE worker", cli=False)
    # ASAP's three streams: MoE workers receive and send on their own threads while computing
    comm_threads: bool = opt(True, "ablation: MoE workers receive/send inline", flag="--no-comm-threads")
    scheduler: SchedulerConfig = opt(SchedulerConfig(), "batching policy")
    num_redundant_experts: int = redundant_opt()
    # elastic: the most MoE workers this deployment may grow to while it serves (POST /scale); the
    # buffers every attention worker writes and reads are sized for them at start
    max_moe_workers: int | None = opt(None, "elastic: the most MoE workers the deployment may scale to while "
                                            "serving; default: moe_workers, fixed")
    max_attn_dp: int | None = opt(None, "elastic: the most attention groups the deployment may scale to while "
                                        "serving; default: attn_dp, fixed")

    def __post_init__(self) -> None:
        positive(self, "attn_dp", "attn_tp", "moe_workers")
        check_redundant(self)
        check_capacity(self)
        check_attention_capacity(self)
        p = self.expert_placement
        require(p is None or not self.num_redundant_experts,
                "asap layout: give either expert_placement (which may list an expert twice) or "
                "num_redundant_experts, not both")
        if p is not None:
            p = tuple(tuple(int(e) for e in ids) for ids in p)
            object.__setattr__(self, "expert_placement", p)  # lists from YAML or Python, frozen as tuples
            require(len(p) == self.moe_workers,
                    f"asap layout: expert_placement lists {len(p)} workers, moe_workers is {self.moe_workers}")
            for w, ids in enumerate(p):
                require(len(ids) > 0 and len(set(ids)) == len(ids),
                        f"asap layout: expert_placement[{w}] must list distinct expert ids, got {ids}")

    num_attention_workers = property(lambda self: self.attn_dp * self.attn_tp)
    num_processes = property(lambda self: self.attn_dp * self.attn_tp + self.moe_workers)
    num_groups = property(lambda self: self.attn_dp)
    # the expert holders that may join and leave (engine/elastic.py)
    expert_kind, expert_count, expert_max = "moe", "moe_workers", "max_moe_workers"
    elastic = property(lambda self: self.max_moe_workers is not None)
    expert_capacity = property(lambda self: self.max_moe_workers or self.moe_workers)
    attention_role, attention_count, attention_max = "attention", "attn_dp", "max_attn_dp"
    attention_capacity = property(lambda self: self.max_attn_dp or self.attn_dp)  # groups the buffers hold

    def experts_held(self, num_experts: int) -> tuple[tuple[int, ...], ...]:
        """Experts held by each MoE worker; validated against the model's expert count."""
        if self.expert_placement is None:
            return spread_experts(self, self.moe_workers, num_experts)
        return assign_experts(self.expert_placement, self.moe_workers, num_experts)


COPY_PLANS = ("sliced", "naive")


@dataclass(frozen=True)
class DwdpLayout(Layout):
    mode = "dwdp"
    summary = ("distributed-weight data parallelism: N ranks, each the whole model on its own requests, "
               "peers' experts pulled one layer ahead; no rank waits for another")

    dp: int = opt(1, "N: ranks of DP attention + expert parallelism")
    placement: str = placement_opt()
    chunked_prefill_size: int | None = chunk_opt()
    max_batch_tokens: int = opt(16384, "S: most tokens of one rank's batch")
    experts_per_rank: int | None = opt(None, "resident experts per rank (default ceil(E/N); more: some held twice, "
                                             "fewer to pull)")
    copy_plan: str = opt("sliced", "sliced: each pull cut into slices, interleaved over the sources; naive: "
                                   "whole pulls, one source after another", choices=COPY_PLANS)
    slice_bytes: int = opt(1 << 20, "slice size of the sliced copy plan (the paper's 1 MB)")
    merge: bool = opt(False, "ablation: copy resident and pulled experts into one buffer before the experts op",
                      flag="--merge-experts")
    # elastic: ranks added while serving hold a copy of a starting rank's residents and publish
    # nothing, so the starting ranks, which hold every expert between them, are the floor
    max_dp: int | None = opt(None, MAX_DP_HELP)

    def __post_init__(self) -> None:
        positive(self, "dp", "max_batch_tokens", "slice_bytes")
        check_dp_options(self)
        check_attention_capacity(self)
        require(self.copy_plan in COPY_PLANS, f"dwdp layout: copy_plan must be one of {COPY_PLANS}, "
                                              f"got {self.copy_plan!r}")
        require(self.experts_per_rank is None or (isinstance(self.experts_per_rank, int) and self.experts_per_rank > 0),
                f"dwdp layout: experts_per_rank must be a positive int, got {self.experts_per_rank!r}")

    num_processes = property(lambda self: self.dp)
    num_groups = property(lambda self: self.dp)
    # a rank is an attention group (engine/elastic_attention.py joins and drains it) and an expert holder
    # whose experts never move: the expert side itself is not elastic
    expert_kind, expert_count, expert_max, elastic = "dwdp", "dp", None, False
    attention_role, attention_count, attention_max = "dwdp", "dp", "max_dp"
    attention_capacity = property(lambda self: self.max_dp or self.dp)

    def experts_held(self, num_experts: int) -> tuple[tuple[int, ...], ...]:
        """The experts each rank holds: ``experts_per_rank`` consecutive ids (mod E) from r*E/N, so
        every expert is held somewhere; E need not divide by N, and more than E/N per rank holds
        some twice (fewer to pull)."""
        per = self.experts_per_rank or -(-num_experts // self.dp)
        require(per * self.dp >= num_experts and per <= num_experts,
                f"dwdp layout: {self.dp} ranks x {per} experts cannot hold all {num_experts} experts once")
        return tuple(tuple((r * num_experts // self.dp + i) % num_experts for i in range(per)) for r in range(self.dp))


AFD_TOPOLOGIES = ("block", "all")
AFD_ROUTERS = ("attention", "ffn")


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
    placement: str = placement_opt()
    chunked_prefill_size: int | None = chunk_opt()
    max_batch_tokens: int = opt(4096, "S: most tokens of one attention instance's step (all its micro-batches)")
    num_redundant_experts: int = redundant_opt()
    # elastic: the most FFN daemons this deployment may grow to while it serves (POST /scale); the
    # buffers every instance writes and reads are sized for them at start
    max_ffn_workers: int | None = opt(None, "elastic: the most FFN daemons the deployment may scale to while "
                                            "serving (topology 'all'); default: ffn_workers, fixed")
    max_attn_workers: int | None = opt(None, "elastic: the most attention instances the deployment may scale to "
                                             "while serving (topology 'all'); default: attn_workers, fixed")

    def __post_init__(self) -> None:
        positive(self, "attn_workers", "ffn_workers", "micro_batches", "max_batch_tokens")
        check_redundant(self)
        check_capacity(self)
        check_attention_capacity(self)
        for option in ("max_ffn_workers", "max_attn_workers"):
            require(getattr(self, option) is None or self.topology == "all",
                    f"afd layout: {option} (members that join and leave while serving) needs topology 'all': "
                    f"with 'block' each daemon serves its own instances")
        require(self.topology == "all" or not self.num_redundant_experts,
                f"afd layout: num_redundant_experts={self.num_redundant_experts} needs topology 'all': with 'block' "
                f"every FFN daemon holds every expert already, so a replica would have nothing to balance")
        require(1 <= self.micro_batches <= 4, f"afd layout: micro_batches must be in [1, 4], got {self.micro_batches}")
        require(self.topology in AFD_TOPOLOGIES, f"afd layout: topology must be one of {AFD_TOPOLOGIES}, "
                                                 f"got {self.topology!r}")
        require(self.router in AFD_ROUTERS, f"afd layout: router must be one of {AFD_ROUTERS}, got {self.router!r}")
        require(self.topology == "all" or self.attn_workers >= self.ffn_workers,
                f"afd layout: topology 'block' gives each FFN daemon a block of attention instances, so "
                f"attn_workers ({self.attn_workers}) must be >= ffn_workers ({self.ffn_workers}); use topology 'all'")
        check_dp_options(self)

    num_processes = property(lambda self: self.attn_workers + self.ffn_workers)
    num_groups = property(lambda self: self.attn_workers)
    # the expert holders that may join and leave (engine/elastic.py)
    expert_kind, expert_count, expert_max = "ffn", "ffn_workers", "max_ffn_workers"
    elastic = property(lambda self: self.max_ffn_workers is not None)
    expert_capacity = property(lambda self: self.max_ffn_workers or self.ffn_workers)  # expert ranks the buffers hold
    attention_role, attention_count, attention_max = "afd_attention", "attn_workers", "max_attn_workers"
    attention_capacity = property(lambda self: self.max_attn_workers or self.attn_workers)  # regions the buffers hold

    def ffns_of(self, instance: int) -> tuple[int, ...]:
        """The FFN daemons attention instance ``instance`` sends every MoE layer to."""
        return (instance % self.ffn_workers,) if self.topology == "block" else tuple(range(self.ffn_workers))

    def served_by(self, ffn: int) -> tuple[int, ...]:
        """The attention instances FFN daemon ``ffn`` aggregates, in order."""
        return tuple(i for i in range(self.attn_workers) if ffn in self.ffns_of(i))

    def experts_held(self, num_experts: int) -> tuple[tuple[int, ...], ...]:
        """Experts each FFN daemon holds: all of them (block), or contiguous shares (all)."""
        if self.topology == "block":
            return (tuple(range(num_experts)),) * self.ffn_workers
        return spread_experts(self, self.ffn_workers, num_experts)
