"""PairsTransport: ``links`` for a deployment whose members change while it serves, across hosts.

Within a host, shared memory as ``links`` (and ``shm``); between hosts, each pair of processes meets
in a gloo group of its own (``pair_link.py``) instead of the deployment's world, which forms once
with the members of the start. So an expert holder started later on another host (an elastic
deployment's FFN daemon, or asap MoE worker) reaches its peers as the others do: the attention side
opens its link to a new expert rank at the first dispatch after the switch, the expert side opens
its links to every lane writer at its start; a link forms once both have asked.

The expert holders of such a deployment share one host (``check_elastic``): a member's moves read
its peers' published weights through shared memory, the one-host weight store.
"""
from __future__ import annotations

from moeflow.comm.links import (LinksCombineReceiver, LinksCombineSender, LinksDispatchReceiver, LinksDispatchSender,
                                LinksTransport)
from moeflow.comm.pair_link import pair_links
from moeflow.comm.transport import register
from moeflow.comm.weights import ShmWeightStore


def own_links(config, me: int):
    """How an endpoint of ``pairs`` reaches a peer on another host: its pair link."""
    return pair_links(config, me).link


class PairsDispatchSender(LinksDispatchSender):
    link_of = staticmethod(own_links)

    def detach(self, rank: int) -> None:
        super().detach(rank)
        pair_links(self.config, self.lane_id).drop(self.spec.expert_world_rank(rank))


class PairsDispatchReceiver(LinksDispatchReceiver):
    link_of = staticmethod(own_links)


class PairsCombineSender(LinksCombineSender):
    link_of = staticmethod(own_links)


class PairsCombineReceiver(LinksCombineReceiver):
    link_of = staticmethod(own_links)


@register
class PairsTransport(LinksTransport):
    name = "pairs"
    dispatch_sender_cls = PairsDispatchSender
    dispatch_receiver_cls = PairsDispatchReceiver
    combine_sender_cls = PairsCombineSender
    combine_receiver_cls = PairsCombineReceiver
    weight_store_cls = ShmWeightStore  # the expert holders share a host (see above)
