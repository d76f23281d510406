"""Weight pulls across hosts (dwdp's, and a live rebalance's expert moves, over gloo): what
``ShmWeightStore`` does one-sidedly within a host, a peer on another host answers for it.

gloo has no one-sided read, so every rank with peers on other hosts runs a ``WeightServer``
thread that receives pull requests from any source and sends back the asked byte range of its
published tensors. The owner's compute is not involved (the thread releases the GIL in gloo), so
a busy owner still does not stop a puller. ``LinksWeightStore`` picks per peer: its shm mapping on
the same host, a ``RemotePeerWeights`` elsewhere (``CommConfig.rank_nodes``).

Request: int64 [op, name id, i0, i1, byte offset, byte count] with tag REQUEST_TAG; the reply is the
bytes with tag REPLY_TAG. Names are numbered in sorted order (the same on every rank). Closing: a
rank sends ``op = BYE`` to each remote peer (it pulls nothing more), and its server stops once
every remote peer said the same.
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from moeflow.comm.weights import PeerWeights, ShmWeightStore, WeightStore

REQUEST_TAG, REPLY_TAG = 64, 65
READ, BYE = 1, 0


class WeightServer:
    """Answers remote peers' pulls of ``tensors`` until each of ``num_peers`` said goodbye."""

    def __init__(self, tensors: dict[str, torch.Tensor], num_peers: int):
        self.flat = [tensors[n] for n in sorted(tensors)]  # by name id
        self.num_peers, self.error = num_peers, None
        self._thread = threading.Thread(target=self._run, name="weight-server", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        req = torch.empty(6, dtype=torch.int64, device="cpu")  # gloo: host tensors
        byes = 0
        try:
            while byes < self.num_peers:
                src = dist.recv(req, tag=REQUEST_TAG)  # from any source
                op, name_id, i0, i1, offset, count = req.tolist()
                if op == BYE:
                    byes += 1
                    continue
                data = self.flat[name_id][i0, i1].reshape(-1).view(torch.uint8)[offset:offset + count]
                dist.send(data.contiguous(), src, tag=REPLY_TAG)
        except Exception as e:  # a peer died or the group went away: pullers see their own errors
            self.error = e

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


class RemotePeerWeights(PeerWeights):
    """A peer on another host: each read is a request to its ``WeightServer`` and the reply."""

    def __init__(self, rank: int, names: list[str]):
        super().__init__({})
        self.rank, self.ids = rank, {n: i for i, n in enumerate(sorted(names))}

    def read(self, name: str, index: tuple[int, ...], offset: int, out: torch.Tensor) -> None:
        i0, i1 = index
        request = torch.tensor([READ, self.ids[name], i0, i1, offset, out.numel()], dtype=torch.int64, device="cpu")
        dist.send(request, self.rank, tag=REQUEST_TAG)
        buf = out if out.is_contiguous() else torch.empty_like(out)
        dist.recv(buf, self.rank, tag=REPLY_TAG)
        if buf is not out:
            out.copy_(buf)


class LinksWeightStore(WeightStore):
    """Per peer: shared memory on this host, a ``WeightServer`` away."""

    def __init__(self, config, publishers=None):
        super().__init__(config, publishers)
        self.shm = ShmWeightStore(config)
        self.nodes = config.rank_nodes
        self.rank: int | None = None
        self.names: list[str] = []
        self.server: WeightServer | None = None

    def _remote(self, rank: int) -> list[int]:
        """The publishers on other hosts than ``rank``'s: whom its server answers and it says goodbye to."""
        ranks = range(len(self.nodes)) if self.publishers is None else self.publishers
        return [r for r in ranks if self.nodes[r] != self.nodes[rank]]

    def publish(self, rank, tensors):
        self.rank, self.names = rank, list(tensors)
        shared = self.shm.publish(rank, tensors)
        if self._remote(rank):
            self.server = WeightServer(shared, len(self._remote(rank)))
        return shared

    def peer(self, rank, timeout_s=None):
        if self.nodes and self.nodes[rank] != self.nodes[self.rank]:
            return RemotePeerWeights(rank, self.names)  # every rank publishes the same names
        return self.shm.peer(rank, timeout_s)

    def close(self):
        if self.rank is not None:
            for r in self._remote(self.rank):
                try:
                    dist.send(torch.tensor([BYE, 0, 0, 0, 0, 0], dtype=torch.int64, device="cpu"), r, tag=REQUEST_TAG)
                except RuntimeError:
                    pass  # it is gone: nothing to say goodbye to
        if self.server is not None:
            self.server.join(timeout_s=30.0)
        self.shm.close()
