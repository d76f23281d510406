"""DWDP's expert prefetcher: the experts a rank lacks, pulled from its peers one MoE layer ahead.

A copy thread (the CPU stand-in for a GPU's copy engine; torch copies release the GIL) walks the
MoE layers in the order every forward pass visits them, cyclically, and fills a two-slot buffer:
while layer L computes from one slot, layer L+1's pulls land in the other; once L is released its
slot takes L+2. The first two MoE layers of the next pass are pulled while this one finishes, so
a rank that starts a batch usually finds them there. The compute thread waits only when a pull is
late, and the wait is recorded. Pulls follow the copy plan (``scheduler/copy_plan.py``) and read
peers' shared memory one-sidedly (``comm/weights.py``).

Legend: M experts this rank lacks, F expert width, H hidden.
"""
from __future__ import annotations

import threading
import time

import torch

from moeflow.comm.weights import PeerWeights
from moeflow.model.moe import ExpertIndex
from moeflow.scheduler.copy_plan import copy_plan
from moeflow.workers.tracer import Tracer


class ExpertPrefetcher:
    def __init__(self, rank: int, placement: tuple[tuple[int, ...], ...], moe_layers: list[int],
                 resident: tuple[torch.Tensor, torch.Tensor], peers: dict[int, PeerWeights], kind: str,
                 slice_bytes: int, tracer: Tracer, like: int | None = None):
        """``like``: the rank whose residents this one holds a copy of (a dwdp rank that joined while
        serving: it pulls what that rank pulls, from the same peers); default ``rank``."""
        self.rank, self.moe_layers, self.tracer = rank, list(moe_layers), tracer
        me = rank if like is None else like
        self.resident = resident  # (w13 [Lm, El, 2F, H], w2 [Lm, El, H, F]) in this rank's shared memory
        w13, w2 = resident
        num_experts = 1 + max(e for ids in placement for e in ids)
        self.missing = [e for e in range(num_experts) if e not in placement[me]]
        self.index = ExpertIndex(tuple(placement[me]) + tuple(self.missing))  # resident first, then pulled
        m = len(self.missing)
        self.slots = [(w13.new_empty(m, *w13.shape[2:]), w2.new_empty(m, *w2.shape[2:])) for _ in range(2)]
        unit_bytes = {"w13": w13[0, 0].numel() * w13.element_size(), "w2": w2[0, 0].numel() * w2.element_size()}
        self.plan = copy_plan(placement, me, num_experts, unit_bytes, kind, slice_bytes)
        self.buffer_bytes = 2 * m * sum(unit_bytes.values())
        self._src_local = {(s, e): placement[s].index(e) for s, ids in enumerate(placement) for e in ids}
        self.peers = peers
        self._cond = threading.Condition()
        self._holds = [None, None]  # per slot: the layer it holds (ready), or None (free or filling)
        self._k = 0  # the copy thread's position in the endless layer cycle
        self._gen = 0  # bumped by a resync: a pull started before it is thrown away
        self._stop = False
        self.error: BaseException | None = None
        # on a GPU: pulls on a side stream; a slot is refilled only after the experts op that read
        # it has run (an event recorded at release), and marked ready once its pulls are complete
        dev = w13.device
        self.stream = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None
        self._freed: list = [None, None]  # per slot: the event after its last reader, or None
        self._thread = threading.Thread(target=self._run, name="copy", daemon=True)
        if m:
            self._thread.start()

    # -- copy thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stop and self._holds[self._k % 2] is not None:
                        self._cond.wait()
                    if self._stop:
                        return
                    k, gen = self._k, self._gen
                slot, layer = k % 2, self.moe_layers[k % len(self.moe_layers)]
                t0 = time.monotonic()
                self._pull_on_stream(slot, layer)
                self.tracer.add("pull", t0, time.monotonic(), "copy", layer=layer)
                with self._cond:
                    if gen == self._gen:
                        self._holds[slot] = layer
                        self._k = k + 1
                        self._cond.notify_all()
        except BaseException as e:  # the compute thread raises it at its next acquire
            with self._cond:
                self.error = e
                self._cond.notify_all()

    def _pull_on_stream(self, slot: int, layer: int) -> None:
        if self.stream is None:
            return self._pull(layer, self.slots[slot])
        if self._freed[slot] is not None:
            self.stream.wait_event(self._freed[slot])
        with torch.cuda.stream(self.stream):
            self._pull(layer, self.slots[slot])
        self.stream.synchronize()

    def _pull(self, layer: int, buf: tuple[torch.Tensor, torch.Tensor]) -> None:
        l_slot = self.moe_layers.index(layer)
        dst = {"w13": buf[0], "w2": buf[1]}
        for s in self.plan:
            out = dst[s.unit][self.missing.index(s.expert)].reshape(-1).view(torch.uint8)
            self.peers[s.src].read(s.unit, (l_slot, self._src_local[(s.src, s.expert)]), s.offset,
                                   out[s.offset:s.offset + s.nbytes])

    # -- compute thread -------------------------------------------------------------------------

    def acquire(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The weight stacks of ``layer`` — [resident, pulled] — once its pulls are in."""
        l_slot = self.moe_layers.index(layer)
        parts = [(self.resident[0][l_slot], self.resident[1][l_slot])]
        if not self.missing:
            return parts
        t0 = time.monotonic()
        with self._cond:
            while layer not in self._holds and self.error is None:
                if None not in self._holds:  # out of step (a pass that stopped half-way): restart at layer
                    self._holds, self._k, self._gen = [None, None], l_slot, self._gen + 1
                    self._cond.notify_all()
                self._cond.wait()
            if self.error is not None:
                raise RuntimeError(f"rank {self.rank}: pulling experts failed") from self.error
            slot = self._holds.index(layer)
        t1 = time.monotonic()
        if t1 - t0 > 1e-5:
            self.tracer.add("wait-pull", t0, t1, layer=layer)
        return parts + [self.slots[slot]]

    def release(self, layer: int) -> None:
        """``layer``'s experts have run: its slot may take the layer after next."""
        with self._cond:
            if layer in self._holds:
                slot = self._holds.index(layer)
                if self.stream is not None:  # the experts op may still be running on the compute stream
                    self._freed[slot] = torch.cuda.Event()
                    self._freed[slot].record()
                self._holds[slot] = None
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
