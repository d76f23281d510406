"""ShmHandshakeTransport: the shared-memory transport, but every send waits for its receiver.

The synchronous protocol on the one-sided transport: a send returns only after the receiver has
copied the message out and cleared its flag, so a sender to n receivers handshakes with each in
turn, as blocking point-to-point does (ASAP 5.4). The benchmark runs it next to ``shm`` and
``p2p`` so that the protocol's share of the gain shows apart from the transport's.
"""
from __future__ import annotations

from moeflow.comm.doorbell import NapDoorbell
from moeflow.comm.shm import ShmCombineSender, ShmDispatchSender, ShmTransport
from moeflow.comm.transport import register
from moeflow.comm.wait import POLICIES, wait_for


def _await_clear(writer, mb, slot: int) -> None:
    lane = writer.lane
    # NOTE: the receiver rings nobody when it clears a flag, so the handshake polls with
    # sched_yield until it does (never naps): a blocked sender has nothing else to run, and a
    # nap would add its granularity to every handshake.
    wait_for(lambda: True if mb.flag(lane, slot) == 0 else None, NapDoorbell(writer.policy.nap_s),
             POLICIES["yield"])


class HandshakeDispatchSender(ShmDispatchSender):
    def send(self, rank, payload, layer_id, batch_id, tokens_per_expert=None) -> None:
        mb, slot = self.writer.write(rank, self.header(payload, layer_id, batch_id, tokens_per_expert), payload)
        _await_clear(self.writer, mb, slot)


class HandshakeCombineSender(ShmCombineSender):
    def send(self, region, lane, payload, layer_id, batch_id) -> None:
        mb, slot = self.writer.write(self.spec.lane_id(region, lane), self.header(payload, layer_id, batch_id),
                                     payload)
        _await_clear(self.writer, mb, slot)


@register
class ShmHandshakeTransport(ShmTransport):
    name = "shm-handshake"
    dispatch_sender_cls = HandshakeDispatchSender
    combine_sender_cls = HandshakeCombineSender
