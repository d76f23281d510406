"""CommSpec: the geometry of the one-sided buffers, sized from the deployment as in ASAP Table 2.

Legend: R regions per dispatch buffer, W lanes per region (R x W lane writers in all), E expert
ranks (one dispatch buffer each), E_total experts, K top-k, H hidden size, S most tokens of one
region's batch, Epr = E_total / E experts per expert rank. ``transport.py`` says how each mode
maps onto these nouns.

Every buffer is allocated once from these numbers and reused for life, so a message never
allocates: the largest message any sender may write fits its slot by construction.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from moeflow.config import ConfigError

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(f"CommSpec: {msg}")


@dataclass(frozen=True)
class CommSpec:
    num_regions: int  # R: regions of every dispatch buffer; one completes when all its W lanes hold a message
    lanes_per_region: int  # W: lanes of one region, one writer each
    num_expert_ranks: int  # E: owners of a dispatch buffer each; one lane each in every combine buffer
    num_experts: int  # E_total: routed experts of the model
    top_k: int  # K: experts per token
    hidden_size: int  # H: elements per token row
    max_batch_tokens: int  # S: most tokens the W lanes of one region send together in one batch
    dtype: str = "bfloat16"  # payload element type, same on both sides
    num_slots: int = 2  # per lane of either buffer: 2 keeps the two batches of a dual-batch pair in flight
    combine_rows: int = 0  # rows of one combine lane's slot; 0: the worst case, see segment_rows
    max_local_experts: int = 0  # most experts one expert rank holds; 0: E_total / E (even placement)
    # dep: lane writer r and expert rank r are one process, so one world rank (torch.distributed
    # transports); else the E expert ranks come after the R x W lane writers
    shared_ranks: bool = False

    def __post_init__(self) -> None:
        for name in ("num_regions", "lanes_per_region", "num_expert_ranks", "num_experts", "top_k", "hidden_size",
                     "max_batch_tokens", "num_slots"):
            v = getattr(self, name)
            _require(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"{name} must be a positive int, got {v!r}")
        _require(self.dtype in DTYPE_BYTES, f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.max_local_experts:
            _require(isinstance(self.max_local_experts, int) and self.max_local_experts <= self.num_experts,
                     f"max_local_experts must be in [1, num_experts={self.num_experts}], got {self.max_local_experts!r}")
        else:
            _require(self.num_experts % self.num_expert_ranks == 0,
                     f"num_experts ({self.num_experts}) must be a multiple of num_expert_ranks "
                     f"({self.num_expert_ranks}), or give max_local_experts for an uneven placement")
        _require(self.top_k <= self.num_experts, f"top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        _require(2 <= self.num_slots <= 8, f"num_slots must be in [2, 8] (one flag cache line), got {self.num_slots}")
        _require(isinstance(self.combine_rows, int) and self.combine_rows >= 0,
                 f"combine_rows must be an int >= 0, got {self.combine_rows!r}")
        _require(not self.shared_ranks or self.num_lanes == self.num_expert_ranks,
                 f"shared_ranks needs a lane writer per expert rank: {self.num_lanes} lanes, "
                 f"{self.num_expert_ranks} expert ranks")

    # --- derived sizes -------------------------------------------------------------------------

    @property
    def experts_per_rank(self) -> int:  # Epr: header counts per expert rank (a rank holding fewer pads with 0)
        return self.max_local_experts or self.num_experts // self.num_expert_ranks

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def tokens_per_lane(self) -> int:
        """Tokens one lane carries: its 1/W share of the region's batch (ceil, so S need not divide)."""
        return math.ceil(self.max_batch_tokens / self.lanes_per_region)

    @property
    def copies_per_token(self) -> int:
        """Most copies of one token one expert rank can receive: the K experts are distinct, and a
        rank holds Epr of them. Equals K in ASAP's setting (Epr 16 >= K 8)."""
        return min(self.top_k, self.experts_per_rank)

    @property
    def dispatch_rows(self) -> int:
        """Capacity of one dispatch lane's slot, in token rows of H (Table 2, MoE 2: K x S / T per row)."""
        return self.copies_per_token * self.tokens_per_lane

    @property
    def segment_rows(self) -> int:
        """Capacity of one combine lane's slot (a segment: one expert rank's results).

        NOTE: Table 2 (attention 2) gives K x S / T rows for all E segments together: ASAP packs the
        segments by routing. Here every segment is sized for the worst case of its own expert rank,
        so a rank writes without knowing what the others send; this costs E x more memory at most,
        and ``combine_rows`` caps it where the routing is known to be balanced.
        """
        return self.combine_rows or self.copies_per_token * self.tokens_per_lane

    @property
    def dispatch_header_words(self) -> int:
        """int64 words of a dispatch header: layer id, batch id, token rows, rows per local expert."""
        return 3 + self.experts_per_rank

    @property
    def combine_header_words(self) -> int:
        """int64 words of a combine segment header: layer id, batch id, token rows."""
        return 3

    @property
    def num_lanes(self) -> int:
        """R x W: the lanes of one dispatch buffer, one per lane writer."""
        return self.num_regions * self.lanes_per_region

    def lane_id(self, region: int, lane: int) -> int:
        """Global index of lane ``lane`` of region ``region``: its lane in every dispatch buffer, and
        its writer's rank in a torch.distributed world (lane writers come first)."""
        _require(0 <= region < self.num_regions and 0 <= lane < self.lanes_per_region,
                 f"no lane ({region}, {lane}) in R={self.num_regions}, W={self.lanes_per_region}")
        return region * self.lanes_per_region + lane

    def expert_world_rank(self, rank: int) -> int:
        """Rank of expert rank ``rank`` in a torch.distributed world: after the R x W lane writers
        (or the lane writer's own, with ``shared_ranks``)."""
        _require(0 <= rank < self.num_expert_ranks, f"no expert rank {rank} in E={self.num_expert_ranks}")
        return rank if self.shared_ranks else self.num_lanes + rank

    @property
    def dispatch_buffer_bytes(self) -> int:
        """Payload bytes of one expert rank's dispatch buffer (its receive side; headers aside)."""
        return self.num_lanes * self.num_slots * self.dispatch_rows * self.hidden_size * self.dtype_bytes

    @property
    def combine_buffer_bytes(self) -> int:
        """Payload bytes of one lane writer's combine buffer (a segment per expert rank)."""
        return self.num_expert_ranks * self.num_slots * self.segment_rows * self.hidden_size * self.dtype_bytes

    @property
    def world_size(self) -> int:
        return self.num_lanes if self.shared_ranks else self.num_lanes + self.num_expert_ranks

    def table2_bytes(self) -> dict[str, int]:
        """ASAP Table 2's formulas for one slot, literally (the paper counts ids and metadata as one
        byte each: 256 experts fit a byte). Its example config gives 64 KiB, 0.875 GiB, 14 GiB.
        In its names D = R attention DP groups, T = W TP members, E expert ranks (MoE workers).

        Attention side: 1 expert ids K x S / T, 2 expert results H x K x S x Dsize / T, 3 E-bit
        bitmap. MoE side: 1 token metadata D x T x E_total / E, 2 tokens D x H x K x S x Dsize,
        3 D T-bit bitmaps.
        """
        d, t, e, k, h, s, b = (self.num_regions, self.lanes_per_region, self.num_expert_ranks, self.top_k,
                               self.hidden_size, self.max_batch_tokens, self.dtype_bytes)
        return {
            "attention_expert_ids": k * s // t,
            "attention_expert_results": h * k * s * b // t,
            "attention_bitmap": math.ceil(e / 8),
            "moe_token_metadata": d * t * self.experts_per_rank,
            "moe_tokens": d * h * k * s * b,
            "moe_bitmaps": math.ceil(d * t / 8),
        }
