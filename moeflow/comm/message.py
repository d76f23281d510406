"""What the receive primitives return, and what a sender counts.

Legend: T TP members per group, n token rows of one message, H hidden size, Epw experts per
MoE worker. Payload tensors live in the receiver's private memory (never the shared buffer).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


class ProtocolError(RuntimeError):
    """A flag or header holds a value the protocol cannot produce (a stale or foreign writer)."""


@dataclass
class DispatchRow:
    member: int  # TP member j of the group that wrote this row
    layer_id: int  # model layer the tokens are for: the MoE worker runs whatever layer arrives
    batch_id: int  # the sender's batch (two are in flight under dual-batch interleaving)
    tokens_per_expert: list[int]  # [Epw] rows per local expert, in payload order; sums to n
    payload: torch.Tensor  # [n, H] hidden states (n may be 0); NOTE: valid until the next recv


@dataclass
class DispatchMessage:
    """One complete region: all T rows of one DP group, for one (batch, layer)."""

    group: int  # DP group i
    seq: int  # this region's message number at this MoE worker, from 1
    rows: list[DispatchRow]  # [T], by member

    @property
    def layer_id(self) -> int:
        return self.rows[0].layer_id

    @property
    def batch_id(self) -> int:
        return self.rows[0].batch_id


@dataclass
class CombineSegment:
    worker: int  # MoE worker e that wrote the segment
    seq: int  # this segment's message number at this attention rank, from 1
    layer_id: int
    batch_id: int
    payload: torch.Tensor  # [n, H] expert results; NOTE: valid until the next recv


@dataclass
class CombineMessage:
    """Results of every MoE worker the attention rank asked for, for one batch."""

    segments: dict[int, CombineSegment]  # by MoE worker: exactly the workers passed to recv


@dataclass
class SendStats:
    num_sends: int = 0
    num_backpressure: int = 0  # sends that found their slot still full and waited
    backpressure_s: float = 0.0  # total time those waits took
    num_overlapped: int = 0  # sends made while the lane's previous message was still unread
    blocked_s: float = 0.0  # total time inside send (copy + any wait)
