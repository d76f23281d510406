"""What the receive primitives return, and what a sender counts.

Legend: W lanes per region, n token rows of one message, H hidden size, Epr experts per expert
rank. Payload tensors live in the receiver's private memory (never the shared buffer).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


class ProtocolError(RuntimeError):
    """A flag or header holds a value the protocol cannot produce (a stale or foreign writer)."""


@dataclass
class DispatchRow:
    lane: int  # the lane of the region (0 .. W-1) whose writer wrote this row
    layer_id: int  # model layer the tokens are for: the expert rank runs whatever layer arrives
    batch_id: int  # the sender's batch (two are in flight under dual-batch interleaving)
    tokens_per_expert: list[int]  # [Epr] rows per local expert, in payload order; sums to n
    payload: torch.Tensor  # [n, H] hidden states (n may be 0); NOTE: valid until the next recv


@dataclass
class DispatchMessage:
    """One complete region: a row from each of its W lanes, for one (batch, layer)."""

    region: int  # 0 .. R-1: the buffer's lanes region * W .. region * W + W - 1
    seq: int  # this region's message number at this expert rank, from 1
    rows: list[DispatchRow]  # [W], by lane

    @property
    def layer_id(self) -> int:
        return self.rows[0].layer_id

    @property
    def batch_id(self) -> int:
        return self.rows[0].batch_id


@dataclass
class CombineSegment:
    rank: int  # expert rank e that wrote the segment
    seq: int  # this segment's message number at this lane writer, from 1
    layer_id: int
    batch_id: int
    payload: torch.Tensor  # [n, H] expert results; NOTE: valid until the next recv


@dataclass
class CombineMessage:
    """Results of every expert rank the lane writer asked for, for one batch."""

    segments: dict[int, CombineSegment]  # by expert rank: exactly the ranks passed to recv


@dataclass
class SendStats:
    num_sends: int = 0
    num_backpressure: int = 0  # sends that found their slot still full and waited
    backpressure_s: float = 0.0  # total time those waits took
    num_overlapped: int = 0  # sends made while the lane's previous message was still unread
    blocked_s: float = 0.0  # total time inside send (copy + any wait)
