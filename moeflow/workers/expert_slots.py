"""An expert-holding worker's routed-expert slots, and how a live rebalance refills them.

Without live rebalancing (``FixedSlots``) a worker computes from the weights it loaded. With it
(``ExpertSlots``) the worker keeps two buffers of the same slots, published in the weight store
(``comm/weights.py``: host shared memory, read one-sidedly by the peers on its host; a peer on
another host reads through the owner's weight server, ``comm/remote_weights.py``): placement
``epoch`` lives in buffer ``epoch % 2``. A rebalance to placement e + 1 fills the other buffer
layer by layer on a copy thread while the worker goes on serving placement e: a slot whose expert
it already holds there is left alone, the rest are copied from its own live buffer or read from a
peer's. Each dispatch carries its placement's parity in the layer word (``dispatch.tag_layer``), so
regions routed before and after the switch are computed with the buffer they were routed for. The
engine starts the next rebalance only after every work item routed by the older placement is
back, so the buffer being filled is never read.

Legend: Lm MoE layers, S slots of this worker, F expert width, H hidden.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from moeflow.messages import ExpertsMoved, MoveExperts
from moeflow.model.moe import ExpertWeights
from moeflow.model.weights import TORCH_DTYPES
from moeflow.workers.dispatch import untag_layer
from moeflow.workers.tracer import Tracer


class FixedSlots:
    """The loaded weights, the same for every dispatch (no live rebalancing)."""

    def __init__(self, experts: ExpertWeights):
        self.experts = experts

    def for_word(self, word: int) -> tuple[int, ExpertWeights]:
        """(model layer, the weights to compute it with) for a dispatch header's layer word."""
        return untag_layer(word)[0], self.experts

    def shape(self) -> ExpertWeights:
        """Weights with the slots' shape and device (not to compute with)."""
        return self.experts

    def nbytes(self) -> int:
        return self.experts.w13.nbytes + self.experts.w2.nbytes

    def begin(self, msg: MoveExperts, notify) -> None:
        raise RuntimeError(f"placement {msg.epoch} asked for, but live rebalancing is off (--enable-eplb)")

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass


class ExpertSlots:
    def __init__(self, role: str, index: int, experts: ExpertWeights, layers: tuple, store, tracer: Tracer,
                 world_rank: Callable[[int], int] = lambda d: d):
        """``layers``: the deployment's placement (``ExpertMap.layers``), which ``experts`` loaded;
        ``world_rank``: an expert device's rank in the world, under which the store publishes it
        (and serves it to hosts whose moves read it over gloo)."""
        self.role, self.index, self.tracer, self.world_rank = role, index, tracer, world_rank
        w13, w2 = experts.w13, experts.w2
        host = {"w13_0": w13.cpu(), "w2_0": w2.cpu(), "w13_1": w13.cpu(), "w2_1": w2.cpu()}
        self.store, pub = store, store.publish(world_rank(index), host)  # [Lm, S, 2F, H], [Lm, S, H, F] each
        self.host = [(pub["w13_0"], pub["w2_0"]), (pub["w13_1"], pub["w2_1"])]
        # compute from the published copy where it is on the compute device (the host, or a GPU under
        # cuda-ipc); an accelerator over host shared memory keeps its own
        same = self.host[0][0].device == w13.device
        self.compute = self.host if same else [(w13, w2), (w13.clone(), w2.clone())]
        self.layer_ids = experts.layer_ids
        self.weights = [ExpertWeights(c[0], c[1], self.layer_ids, experts.slots) for c in self.compute]
        self.layers = [tuple(layers), tuple(layers)]  # the placement each buffer holds
        self.filled = [True, True]  # whether each buffer holds its placement's experts (a joiner's: once moved)
        self.peers: dict[int, object] = {}
        self._thread: threading.Thread | None = None
        self._moving = False
        self.error: BaseException | None = None

    @classmethod
    def joining(cls, role: str, index: int, layer_ids: tuple[int, ...], shape: tuple, dtype, device, join, store,
                tracer: Tracer, world_rank: Callable[[int], int] = lambda d: d) -> "ExpertSlots":
        """A worker that joins an elastic deployment while it serves: both buffers published empty, then
        its slots of placement ``join.epoch`` read from the peers' live buffers (``join.live_layers``,
        placement ``join.epoch - 1``) on the copy thread, as any rebalance fills its other buffer;
        ``shape``: (S, 2F, H, F)."""
        s, f2, h, f = shape
        mine = tuple(tuple(layer[index]) for layer in join.layers)
        w13 = torch.zeros(len(layer_ids), s, f2, h, dtype=dtype, device=device)
        w2 = torch.zeros(len(layer_ids), s, h, f, dtype=dtype, device=device)
        # NOTE: it holds nothing yet: its row of the live placement names no expert (-1), so every slot
        # is read from a holder; its weights of the live parity are never routed to (it joins at the next)
        live = tuple(tuple(layer) + ((-1,) * s,) * (index + 1 - len(layer)) for layer in join.live_layers)
        slots = cls(role, index, ExpertWeights(w13, w2, tuple(layer_ids), mine), live, store, tracer, world_rank)
        slots.filled = [False, False]
        return slots

    def for_word(self, word: int) -> tuple[int, ExpertWeights]:
        layer, parity = untag_layer(word)
        if not self.filled[parity]:  # its zeros would be computed with, silently
            raise RuntimeError(f"{self.role} {self.index}: a dispatch routed by a placement of parity {parity}, "
                               f"whose experts this worker never received (it joined at the other parity)")
        return layer, self.weights[parity]

    def shape(self) -> ExpertWeights:
        """Weights with the slots' shape and device (not to compute with: a joiner's may be empty yet)."""
        return self.weights[0]

    def nbytes(self) -> int:
        return 2 * sum(t.nbytes for t in self.host[0])

    # -- a rebalance ----------------------------------------------------------------------------

    def begin(self, msg: MoveExperts, notify: Callable[[ExpertsMoved], None]) -> None:
        """Fill buffer ``msg.epoch % 2`` with ``msg.layers`` on a copy thread; ``notify`` when done."""
        if self._moving:
            raise RuntimeError(f"{self.role} {self.index}: placement {msg.epoch} asked for while a move runs")
        self._moving = True

        def run() -> None:
            try:
                t0 = time.monotonic()
                nbytes, peer_bytes = self._move(msg.epoch, tuple(msg.layers))
                t1 = time.monotonic()
                self.tracer.add("move-experts", t0, t1, "copy", epoch=msg.epoch, bytes=nbytes)
                self._moving = False  # before the report: the next move may be asked for at once
                notify(ExpertsMoved(self.role, self.index, msg.epoch, t1 - t0, nbytes, peer_bytes))
            except BaseException as e:  # noqa: BLE001  (the worker's next turn raises it)
                self.error = e

        self._thread = threading.Thread(target=run, name="move-experts", daemon=True)
        self._thread.start()

    def _move(self, epoch: int, layers: tuple) -> tuple[int, int]:
        """(bytes copied, of which read from peers)."""
        target, live = epoch % 2, 1 - epoch % 2
        now = self.layers[live]
        total = from_peers = 0
        slots = []
        for l in range(len(self.layer_ids)):
            want, have = layers[l][self.index], self.layers[target][l][self.index]
            for s, e in enumerate(want):
                if have[s] != e:
                    n, from_peer = self._fetch(l, s, e, now[l], target, live)
                    total, from_peers = total + n, from_peers + (n if from_peer else 0)
            if self.compute is not self.host:  # the accelerator's copy of the layer
                for i in (0, 1):
                    self.compute[target][i][l].copy_(self.host[target][i][l])
            slots.append(tuple(want))
        dev = self.compute[target][0].device
        if dev.type == "cuda":  # the copies were queued: in place before the report goes out
            torch.cuda.synchronize(dev)
        self.weights[target] = ExpertWeights(*self.compute[target], self.layer_ids, tuple(slots))
        self.layers[target] = layers
        self.filled[target] = True
        for d in [d for d in self.peers if d >= len(layers[0])]:  # it left: one at its index later is another
            self.peers.pop(d).close()
        return total, from_peers

    def _fetch(self, l: int, s: int, e: int, placement: tuple, target: int, live: int) -> tuple[int, bool]:
        """Expert ``e`` of MoE layer ``l`` into slot ``s`` of buffer ``target``, from a live buffer:
        ours if we hold it, else a holder's chosen by (our index + e), so pullers spread. Returns
        (bytes, whether a peer's)."""
        holders = [(d, ids.index(e)) for d, ids in enumerate(placement) if e in ids]
        mine = [h for h in holders if h[0] == self.index]
        d, src = mine[0] if mine else holders[(self.index + e) % len(holders)]
        n = 0
        for i, name in enumerate(("w13", "w2")):
            out = self.host[target][i][l, s]
            if d == self.index:
                out.copy_(self.host[live][i][l, src])
            else:
                if d not in self.peers:
                    self.peers[d] = self.store.peer(self.world_rank(d))
                self.peers[d].read(f"{name}_{live}", (l, src), 0, out.reshape(-1).view(torch.uint8))
            n += out.nbytes
        return n, d != self.index

    def check(self) -> None:
        """Raise what the copy thread raised (the worker's loop calls this every turn)."""
        if self.error is not None:
            raise RuntimeError(f"{self.role} {self.index}: moving experts failed") from self.error

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        for p in self.peers.values():
            p.close()
        self.store.close()


def slots_for(setup, transport, experts: ExpertWeights, tracer: Tracer):
    """The worker's slots: two published buffers under live rebalancing (``--enable-eplb``) or in an
    elastic deployment (its peers may join and read them), else the loaded weights alone."""
    if not (setup.engine.enable_eplb or getattr(setup.layout, "elastic", False)):
        return FixedSlots(experts)
    layers = tuple(setup.placement(i) for i in range(len(experts.layer_ids)))
    spec = transport.config.spec
    return ExpertSlots(setup.role, setup.index, experts, layers, transport.weight_store(_publishers(spec)), tracer,
                       spec.expert_world_rank)


def worker_slots(setup, transport, cfg, experts: ExpertWeights | None, tracer: Tracer):
    """An expert holder's slots: those of the weights it loaded (``slots_for``) or, joining an elastic
    deployment (``setup.join``), empty ones it fills from its peers once it serves (``begin_join``)."""
    if setup.join is None:
        return slots_for(setup, transport, experts, tracer)
    layer_ids = tuple(l for l in range(cfg.num_layers) if cfg.sparse_layers[l])
    f = cfg.moe_intermediate_size
    shape = (len(setup.join.layers[0][setup.index]), 2 * f, cfg.hidden_size, f)
    spec = transport.config.spec
    return ExpertSlots.joining(setup.role, setup.index, layer_ids, shape, TORCH_DTYPES[setup.engine.dtype], setup.device,
                               setup.join, transport.weight_store(_publishers(spec)), tracer, spec.expert_world_rank)


def begin_join(slots, setup, send: Callable) -> None:
    """A joining worker's first act once it serves: read its slots of the placement it joins at."""
    if setup.join is not None:
        slots.begin(MoveExperts(setup.join.epoch, setup.join.layers), send)


def _publishers(spec) -> tuple[int, ...]:
    return tuple(spec.expert_world_rank(d) for d in range(spec.num_expert_ranks))
