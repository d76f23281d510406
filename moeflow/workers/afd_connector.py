"""The AFD connector: how attention instances and FFN daemons exchange one (layer, micro-batch).

Four calls, as in vLLM's afd-plugin connector: the attention side ``send_attn_output`` /
``recv_ffn_output``, the FFN side ``recv_attn_output`` / ``send_ffn_output``. Underneath they are
moeflow's dispatch/combine endpoints (``comm/transport.py``) over whichever transport the
deployment runs (shared memory, torch.distributed): an attention instance is a region of one lane
in every FFN daemon's dispatch buffer, an FFN daemon an expert rank.

Control plane: each message's header (layer, the instance's micro-batch id, token rows, rows per
local expert); an FFN daemon reads the (layer, micro-batch) of every instance it serves from them
and refuses a step that is out of order. Data plane: the payload rows, written once into the
receiver's buffer; nothing is pickled per step.

Legend: n token rows of one instance's micro-batch, H hidden, Epr experts per daemon.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch


@dataclass
class AfdControl:
    """One (layer, micro-batch) as the FFN daemon sees it, per attention instance served."""

    layer: int
    batch_ids: dict[int, int]  # instance -> its micro-batch's id
    rows: dict[int, int]  # instance -> rows it sent
    tokens_per_expert: dict[int, list[int]]  # instance -> rows per local expert (router on the attention side)


@dataclass
class FfnInput:
    control: AfdControl
    payloads: dict[int, torch.Tensor]  # instance -> [n, H], the daemon's own copy


class AttnConnector:
    """The attention instance's half. ``ffns``: the daemons it sends every MoE layer to."""

    def __init__(self, sender, receiver, ffns: tuple[int, ...], experts_per_rank: int):
        self.sender, self.receiver = sender, receiver
        self.ffns = list(ffns)
        self.epr = experts_per_rank

    def send_attn_output(self, layer: int, batch_id: int, parts: dict[int, tuple[torch.Tensor, list[int] | None]]) -> None:
        """To every daemon of this instance its rows [n, H] and rows per local expert (None: token rows
        for a daemon that routes). Every daemon gets a message, empty ones included: it aggregates
        this (layer, micro-batch) from all the instances it serves."""
        for j in self.ffns:
            x, counts = parts[j]
            counts = [x.shape[0]] + [0] * (self.epr - 1) if counts is None else counts + [0] * (self.epr - len(counts))
            self.sender.send(j, x, layer, batch_id, counts)

    def recv_ffn_output(self) -> dict[int, torch.Tensor]:
        """Each daemon's result rows [n, H] for the oldest micro-batch sent, valid until the next call."""
        msg = self.receiver.recv(self.ffns)
        return {j: msg.segments[j].payload for j in self.ffns}


class FfnConnector:
    """The FFN daemon's half: aggregates the same (layer, micro-batch) from every instance it serves."""

    def __init__(self, transport, rank: int, served: tuple[int, ...]):
        self.rank, self.served = rank, tuple(served)
        self.receiver = transport.dispatch_receiver(rank)  # owns its buffer: built before anyone attaches
        self.sender = transport.combine_sender(rank)
        # an instance may be up to m micro-batches ahead of the slowest one; keep its messages in order
        self._queues: dict[int, deque] = {i: deque() for i in self.served}

    def recv_attn_output(self, timeout_s: float) -> FfnInput | None:
        """The next (layer, micro-batch) of every served instance, or None after ``timeout_s``."""
        while not all(self._queues.values()):
            msg = self.receiver.recv(timeout_s=timeout_s)
            if msg is None:
                return None
            if msg.region not in self._queues:
                raise RuntimeError(f"FFN daemon {self.rank} got a message from attention instance {msg.region}, "
                                   f"which it does not serve (it serves {list(self.served)})")
            (row,) = msg.rows
            # NOTE: the payload is a view of the receiver's staging, overwritten by the next recv
            self._queues[msg.region].append((row.layer_id, row.batch_id, list(row.tokens_per_expert),
                                             row.payload.clone()))
        heads = {i: q.popleft() for i, q in self._queues.items()}
        layers = {h[0] for h in heads.values()}
        if len(layers) != 1:
            raise RuntimeError(f"FFN daemon {self.rank}: attention instances out of step, layers "
                               f"{ {i: h[0] for i, h in heads.items()} } arrived as one micro-batch")
        control = AfdControl(layers.pop(), {i: h[1] for i, h in heads.items()},
                             {i: h[3].shape[0] for i, h in heads.items()}, {i: h[2] for i, h in heads.items()})
        return FfnInput(control, {i: h[3] for i, h in heads.items()})

    def serve(self, served: tuple[int, ...]) -> None:
        """Aggregate ``served`` from the next message on (between steps: nothing is queued). An instance
        that left is forgotten: one that joins at its index later writes new buffers from seq 1."""
        for i in set(self.served) - set(served):
            if self._queues.pop(i):
                raise RuntimeError(f"FFN daemon {self.rank}: attention instance {i} left with messages queued")
            self.receiver.forget_region(i)
            self.sender.detach_region(i)
        self._queues.update({i: deque() for i in served if i not in self._queues})
        self.served = tuple(served)

    def send_ffn_output(self, inp: FfnInput, outputs: dict[int, torch.Tensor]) -> None:
        """Each served instance's result rows back into its combine buffer."""
        c = inp.control
        for i in self.served:
            self.sender.send(i, 0, outputs[i], c.layer, c.batch_ids[i])

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()
