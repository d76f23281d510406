"""Running the experts of whatever (region, batch, layer) a dispatch message carries.

One message = one complete region: a row per lane, each row's tokens grouped by local expert.
The layer-oblivious grouped op takes the layer as an argument, so the same code serves every
layer in any order. The MoE worker (asap) and the dep rank both compute through this.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from moeflow.model.moe import experts_grouped
from moeflow.workers.dispatch import untag_layer
from moeflow.workers.expert_slots import FixedSlots
from moeflow.workers.tracer import Tracer


@dataclass
class Reply:
    """Expert results for one lane of one region, to combine-send back."""

    region: int  # the sender's DP group (its region in our dispatch buffer)
    lane: int  # the sender's TP member (its lane in that region)
    payload: torch.Tensor  # [n, H] in the row order it arrived
    layer_id: int
    batch_id: int


class ExpertCompute:
    def __init__(self, slots, tracer: Tracer):
        """``slots``: ``expert_slots.FixedSlots`` or ``ExpertSlots`` (which buffer a dispatch's layer word names)."""
        self.slots = slots if hasattr(slots, "for_word") else FixedSlots(slots)
        self.num_local = self.slots.shape().num_local
        self.tracer = tracer

    @torch.inference_mode()
    def run(self, msg, thread: str = "main") -> list[Reply]:
        t0 = time.monotonic()
        replies = []
        for row in msg.rows:
            counts = torch.tensor(row.tokens_per_expert[:self.num_local], dtype=torch.int64,
                                  device=row.payload.device)  # [El]
            layer, experts = self.slots.for_word(row.layer_id)
            y = experts_grouped(experts, layer, row.payload, counts)  # [n, H]
            replies.append(Reply(msg.region, row.lane, y, row.layer_id, row.batch_id))
        self.tracer.add("experts", t0, time.monotonic(), thread, group=msg.region,
                        layer=untag_layer(msg.rows[0].layer_id)[0],
                        tokens=sum(r.payload.shape[0] for r in msg.rows))
        return replies


def send_replies(sender, replies: list[Reply], tracer: Tracer, thread: str = "main") -> None:
    t0 = time.monotonic()
    for r in replies:
        sender.send(r.region, r.lane, r.payload, r.layer_id, r.batch_id)
    tracer.add("combine-send", t0, time.monotonic(), thread)
