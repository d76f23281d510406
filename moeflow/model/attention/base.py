"""What every attention kind provides: its weights and their checkpoint keys, its KV layout, its
tensor-parallel sharding, and its forward.

A kind is built per model from the (possibly TP-sharded) ``ModelConfig``. Shape legend: T tokens
in the batch, H hidden size.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar

import torch

from moeflow.config import ModelConfig

if TYPE_CHECKING:  # NOTE: kv_cache builds its cache from a kind's layout; importing it here would be a cycle
    from moeflow.model.checkpoint import CheckpointReader
    from moeflow.model.kv_cache import AttentionMetadata, KVCache

KVLayout = dict[str, tuple[int, ...]]  # entry name -> what one token stores in one layer, in write/gather order


@dataclass
class AttentionWeights:
    """The norms around attention, the same for every kind; a kind's weights extend this."""

    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]


class AttentionKind(abc.ABC):
    name: ClassVar[str]  # the value of ModelConfig.attention_kind

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    @abc.abstractmethod
    def kv_layout(self) -> KVLayout: ...

    def rotaries(self) -> tuple:
        """The kind's rotary tables (``model/rope.py``), sized per batch from ``meta.max_position``."""
        return ()

    def fit_rotaries(self, meta: AttentionMetadata) -> None:
        """Every rotary table covers the batch's positions (a host number: no sync)."""
        for r in self.rotaries():
            r.cover(meta.max_position)

    @abc.abstractmethod
    def load(self, r: CheckpointReader, prefix: str, input_norm: torch.Tensor,
             post_norm: torch.Tensor) -> AttentionWeights:
        """One layer's weights; ``prefix`` is the attention module's, e.g. ``model.layers.3.self_attn.``."""

    @abc.abstractmethod
    def check_tp(self, size: int) -> None:
        """Raise ConfigError unless ``size`` members can split this model's attention."""

    @abc.abstractmethod
    def shard(self, w: AttentionWeights, rank: int, size: int) -> AttentionWeights:
        """Member ``rank`` of ``size``'s slice of one layer's weights."""

    @abc.abstractmethod
    def member_config(self, size: int) -> ModelConfig:
        """The config a TP member's model (and KV cache) is built from."""

    @abc.abstractmethod
    def forward(self, w: AttentionWeights, x: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache | None,
                layer: int, reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
        """x: [T, H] after the input norm -> [T, H] attention output, before the residual add.

        ``reduce`` sums the members' partial output projections under TP (None: not sharded).
        """
