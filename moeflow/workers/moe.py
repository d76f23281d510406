"""MoE worker: a stateless daemon that runs whatever (group, batch, layer) arrives.

No scheduler, no KV cache. Its loop: receive a complete dispatch region -> run the experts of
that region's layer through the layer-oblivious grouped op -> combine-send each TP member's rows
back. ASAP's triple-stream design becomes three threads here: receive/migrate, compute, send;
each of the two communication threads can be switched off (then the compute thread does it).
torch releases the GIL inside its kernels and copies, so the threads overlap for real.
"""
from __future__ import annotations

import queue
import threading
import time

import torch

from moeflow.comm import make_transport
from moeflow.messages import DumpSpans, Shutdown, Spans, WorkerSetup
from moeflow.model.moe import experts_grouped
from moeflow.model.weights import LoadSpec, TORCH_DTYPES, load_weights
from moeflow.workers.tracer import Tracer

_POLL_S = 0.05  # longest a blocking wait lasts before the control pipe is looked at again


class MoEWorker:
    def __init__(self, setup: WorkerSetup):
        self.setup = setup
        self.index = setup.index
        held = setup.placement[setup.index]
        _, w = load_weights(setup.model_path, TORCH_DTYPES[setup.engine.dtype],
                            LoadSpec(attention=False, experts=held))
        self.experts = w.experts
        self.num_local = len(held)
        transport = make_transport(setup.comm)
        self.receiver = transport.dispatch_receiver(setup.index)  # owns this worker's dispatch buffer
        self.sender = transport.combine_sender(setup.index)
        self.tracer = Tracer("moe", setup.index, setup.trace)
        self._stop = threading.Event()
        self._inbox: queue.Queue = queue.Queue(maxsize=4)
        self._outbox: queue.Queue = queue.Queue(maxsize=4)
        self.error: BaseException | None = None

    # -- the three stages ---------------------------------------------------------------------

    def _receive(self, thread: str):
        """One complete region in private memory, or None after a short wait."""
        t0 = time.monotonic()
        msg = self.receiver.recv(timeout_s=_POLL_S)
        if msg is not None:
            # waiting for a complete region + migrating it to private memory
            self.tracer.add("recv", t0, time.monotonic(), thread, group=msg.group, layer=msg.layer_id)
            if thread != "main":  # the payloads are views valid until the next recv
                for row in msg.rows:
                    row.payload = row.payload.clone()
        return msg

    @torch.inference_mode()
    def _compute(self, msg) -> list[tuple]:
        t0 = time.monotonic()
        replies = []
        for row in msg.rows:
            counts = torch.tensor(row.tokens_per_expert[:self.num_local], dtype=torch.int64)
            y = experts_grouped(self.experts, row.layer_id, row.payload, counts)  # [n, H]
            replies.append((msg.group, row.member, y, row.layer_id, row.batch_id))
        self.tracer.add("experts", t0, time.monotonic(), "main", group=msg.group, layer=msg.layer_id,
                        tokens=sum(r.payload.shape[0] for r in msg.rows))
        return replies

    def _send(self, replies: list[tuple], thread: str) -> None:
        t0 = time.monotonic()
        for group, member, y, layer, batch in replies:
            self.sender.send(group, member, y, layer, batch)
        self.tracer.add("combine-send", t0, time.monotonic(), thread)

    # -- threads ------------------------------------------------------------------------------

    def _guard(self, fn):
        def run():
            try:
                fn()
            except BaseException as e:  # surfaced by the main loop, which then exits with it
                self.error = e
                self._stop.set()
        return run

    def _receive_loop(self) -> None:
        while not self._stop.is_set():
            msg = self._receive("recv")
            if msg is not None:
                self._inbox.put(msg)

    def _send_loop(self) -> None:
        while not self._stop.is_set():
            try:
                replies = self._outbox.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            self._send(replies, "send")

    # -- loop ---------------------------------------------------------------------------------

    def serve(self, conn) -> None:
        s = self.setup
        threads = []
        if s.recv_thread:
            threads.append(threading.Thread(target=self._guard(self._receive_loop), name="recv", daemon=True))
        if s.send_thread:
            threads.append(threading.Thread(target=self._guard(self._send_loop), name="send", daemon=True))
        for t in threads:
            t.start()
        try:
            while not self._stop.is_set():
                if conn.poll():
                    msg = conn.recv()
                    if isinstance(msg, Shutdown):
                        break
                    if isinstance(msg, DumpSpans):
                        conn.send(Spans("moe", self.index, self.tracer.drain()))
                if s.recv_thread:
                    try:
                        msg = self._inbox.get(timeout=_POLL_S)
                    except queue.Empty:
                        continue
                else:
                    msg = self._receive("main")
                    if msg is None:
                        continue
                replies = self._compute(msg)
                if s.send_thread:
                    self._outbox.put(replies)
                else:
                    self._send(replies, "main")
        finally:
            self._stop.set()
            for t in threads:
                t.join(timeout=1.0)
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()
