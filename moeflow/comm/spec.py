"""CommSpec: the geometry of the one-sided buffers, sized from the deployment as in ASAP Table 2.

Legend: D attention DP groups, T TP members per group, E MoE workers, E_total experts, K top-k,
H hidden size, S most tokens of one DP group's batch, Epw = E_total / E experts per MoE worker.

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
    num_groups: int  # D: attention DP groups; one dispatch region each in every MoE buffer
    tp_size: int  # T: TP members per group; one dispatch row each in a region
    num_moe_workers: int  # E: one combine segment each in every attention buffer
    num_experts: int  # E_total: routed experts of the model
    top_k: int  # K: experts per token
    hidden_size: int  # H: elements per token row
    max_batch_tokens: int  # S: most tokens one DP group sends in one batch
    dtype: str = "bfloat16"  # payload element type, same on both sides
    num_slots: int = 2  # per row and per segment: 2 keeps the two batches of a dual-batch pair in flight
    combine_rows: int = 0  # rows of one combine segment; 0: the worst case, see segment_rows
    max_local_experts: int = 0  # most experts one MoE worker holds; 0: E_total / E (even placement)

    def __post_init__(self) -> None:
        for name in ("num_groups", "tp_size", "num_moe_workers", "num_experts", "top_k", "hidden_size",
                     "max_batch_tokens", "num_slots"):
            v = getattr(self, name)
            _require(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"{name} must be a positive int, got {v!r}")
        _require(self.dtype in DTYPE_BYTES, f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.max_local_experts:
            _require(isinstance(self.max_local_experts, int) and self.max_local_experts <= self.num_experts,
                     f"max_local_experts must be in [1, num_experts={self.num_experts}], got {self.max_local_experts!r}")
        else:
            _require(self.num_experts % self.num_moe_workers == 0,
                     f"num_experts ({self.num_experts}) must be a multiple of num_moe_workers "
                     f"({self.num_moe_workers}), or give max_local_experts for an uneven placement")
        _require(self.top_k <= self.num_experts, f"top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        _require(2 <= self.num_slots <= 8, f"num_slots must be in [2, 8] (one flag cache line), got {self.num_slots}")
        _require(isinstance(self.combine_rows, int) and self.combine_rows >= 0,
                 f"combine_rows must be an int >= 0, got {self.combine_rows!r}")

    # --- derived sizes -------------------------------------------------------------------------

    @property
    def experts_per_worker(self) -> int:  # Epw: header counts per worker (a worker holding fewer pads with 0)
        return self.max_local_experts or self.num_experts // self.num_moe_workers

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def tokens_per_member(self) -> int:
        """Tokens one TP member sends: its 1/T share of the batch (ceil, so S need not divide)."""
        return math.ceil(self.max_batch_tokens / self.tp_size)

    @property
    def copies_per_token(self) -> int:
        """Most copies of one token one MoE worker can receive: the K experts are distinct, and a
        worker holds Epw of them. Equals K in ASAP's setting (Epw 16 >= K 8)."""
        return min(self.top_k, self.experts_per_worker)

    @property
    def dispatch_rows(self) -> int:
        """Capacity of one dispatch row slot, in token rows of H (Table 2, MoE 2: K x S / T per row)."""
        return self.copies_per_token * self.tokens_per_member

    @property
    def segment_rows(self) -> int:
        """Capacity of one combine segment slot.

        NOTE: Table 2 (attention 2) gives K x S / T rows for all E segments together: ASAP packs the
        segments by routing. Here every segment is sized for the worst case of its own worker, so a
        MoE worker writes without knowing what the others send; this costs E x more memory at most,
        and ``combine_rows`` caps it where the routing is known to be balanced.
        """
        return self.combine_rows or self.copies_per_token * self.tokens_per_member

    @property
    def dispatch_header_words(self) -> int:
        """int64 words of a dispatch row header: layer id, batch id, token rows, rows per local expert."""
        return 3 + self.experts_per_worker

    @property
    def combine_header_words(self) -> int:
        """int64 words of a combine segment header: layer id, batch id, token rows."""
        return 3

    @property
    def num_attention_ranks(self) -> int:
        return self.num_groups * self.tp_size

    def attention_rank(self, group: int, member: int) -> int:
        """Global rank of TP member ``member`` of DP group ``group``; attention ranks come first."""
        _require(0 <= group < self.num_groups and 0 <= member < self.tp_size,
                 f"no attention member ({group}, {member}) in D={self.num_groups}, T={self.tp_size}")
        return group * self.tp_size + member

    def moe_rank(self, worker: int) -> int:
        """Global rank of MoE worker ``worker``: after the D x T attention ranks."""
        _require(0 <= worker < self.num_moe_workers, f"no MoE worker {worker} in E={self.num_moe_workers}")
        return self.num_attention_ranks + worker

    @property
    def world_size(self) -> int:
        return self.num_attention_ranks + self.num_moe_workers

    def table2_bytes(self) -> dict[str, int]:
        """ASAP Table 2's formulas for one slot, literally (the paper counts ids and metadata as one
        byte each: 256 experts fit a byte). Its example config gives 64 KiB, 0.875 GiB, 14 GiB.

        Attention side: 1 expert ids K x S / T, 2 expert results H x K x S x Dsize / T, 3 E-bit
        bitmap. MoE side: 1 token metadata D x T x E_total / E, 2 tokens D x H x K x S x Dsize,
        3 D T-bit bitmaps.
        """
        d, t, e, k, h, s, b = (self.num_groups, self.tp_size, self.num_moe_workers, self.top_k,
                               self.hidden_size, self.max_batch_tokens, self.dtype_bytes)
        return {
            "attention_expert_ids": k * s // t,
            "attention_expert_results": h * k * s * b // t,
            "attention_bitmap": math.ceil(e / 8),
            "moe_token_metadata": d * t * self.experts_per_worker,
            "moe_tokens": d * h * k * s * b,
            "moe_bitmaps": math.ceil(d * t / 8),
        }
