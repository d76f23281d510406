"""The torch.distributed world of a deployment, as the engine laid it out (``messages.World``).

It exists only when something needs it: tensor-parallel attention (a gloo group per TP group for
all-reduce / all-gather) or a torch.distributed comm transport. Between hosts gloo picks its
network interface from $GLOO_SOCKET_IFNAME, which a world across hosts sets to the interface on the
route to node 0 unless it is set already (``interface.py``).
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from moeflow.messages import WorkerSetup
from moeflow.workers.interface import use_between_hosts

DIST_TRANSPORTS = ("dist", "p2p", "links")  # comm transports that need the world


class TPGroup:
    """Collectives inside one attention DP group (all members call each one, in the same order)."""

    def __init__(self, group, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_rows(self, share: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate each member's [sizes[m], H] share; shares may differ by a row (padded)."""
        rows = max(sizes)
        padded = share.new_zeros(rows, share.shape[1])
        padded[:share.shape[0]] = share
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)])

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Member 0's ``x`` on every member (in place)."""
        dist.broadcast(x, src=dist.get_global_rank(self.group, 0), group=self.group)
        return x


def init_world(setup: WorkerSetup) -> TPGroup | None:
    """Join the world (if the deployment has one); returns this process's TP group, if any."""
    if setup.comm is not None and setup.comm.transport == "pairs":  # its pair links are gloo groups too
        use_between_hosts(setup.comm.store[0])
    w = setup.world
    if w is None:
        return None
    if w.store_prefix is None:
        dist.init_process_group("gloo", init_method=f"tcp://{w.addr}:{w.port}", world_size=w.size,
                                rank=setup.world_rank)
    else:  # several hosts: the world meets in the cluster's rendezvous, hosted by node 0's engine
        use_between_hosts(w.addr)
        timeout = timedelta(seconds=setup.engine.cluster.connect_timeout_s)
        store = dist.TCPStore(w.addr, w.port, None, False, timeout=timeout)
        dist.init_process_group("gloo", store=dist.PrefixStore(w.store_prefix, store), world_size=w.size,
                                rank=setup.world_rank)
    tp = None
    for ranks in w.tp_groups:  # NOTE: new_group is collective over the whole world, in order
        grp = dist.new_group(list(ranks))
        if setup.world_rank in ranks:
            tp = TPGroup(grp, len(ranks), ranks.index(setup.world_rank))
    return tp


def close_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
