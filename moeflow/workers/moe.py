"""MoE worker: a stateless daemon that runs whatever (group, batch, layer) arrives.

No scheduler, no KV cache. Its loop: receive a complete dispatch region -> run the experts of
that region's layer through the layer-oblivious grouped op -> combine-send each TP member's rows
back. ASAP's triple-stream design becomes three threads (``ThreadedLoop``: receive/migrate,
compute, send); ``InlineLoop`` is the ablation where the compute thread does all three. The loop
is chosen once, at start. torch releases the GIL inside its kernels and copies, so the threads
overlap for real.
"""
from __future__ import annotations

import queue
import threading
import time

from moeflow.membership_messages import ForgetRegion
from moeflow.messages import MoveExperts, WorkerSetup
from moeflow.workers.control import LockedConn, serve_control
from moeflow.workers.expert_slots import begin_join, worker_slots
from moeflow.model.weights import TORCH_DTYPES, LoadSpec, load_weights
from moeflow.workers.experts import ExpertCompute, send_replies
from moeflow.workers.tracer import Tracer

_POLL_S = 0.25  # longest a blocking wait lasts before the control pipe is looked at again


class MoEWorker:
    kv_region = None  # it holds no KV cache

    def __init__(self, setup: WorkerSetup, transport):
        self.setup = setup
        self.index = setup.index
        join = setup.join  # joining a serving deployment: its experts come from its peers, not the checkpoint
        cfg, w = load_weights(setup.model_path, TORCH_DTYPES[setup.engine.dtype],
                              LoadSpec(attention=False, experts=None if join else setup.held_by(setup.index),
                                       routed_experts=join is None), setup.device)
        self.receiver = transport.dispatch_receiver(setup.index)  # owns this worker's dispatch buffer
        self.sender = transport.combine_sender(setup.index)
        self.tracer = Tracer("moe", setup.index, setup.engine.trace)
        self.slots = worker_slots(setup, transport, cfg, w.experts, self.tracer)
        self.compute = ExpertCompute(self.slots, self.tracer)
        self.loop = (ThreadedLoop if setup.layout.comm_threads else InlineLoop)(self)

    def receive(self, thread: str, timeout_s: float):
        """One complete region in private memory, or None after ``timeout_s``."""
        t0 = time.monotonic()
        msg = self.receiver.recv(timeout_s=timeout_s)
        if msg is not None:
            # waiting for a complete region + migrating it to private memory
            self.tracer.add("recv", t0, time.monotonic(), thread, group=msg.region, layer=msg.rows[0].layer_id)
        return msg

    def step(self) -> bool:
        """Serve one region if one is complete now (no waiting); whether there was one. The
        in-process deployment pumps the expert side with this."""
        msg = self.receiver.poll()
        if msg is not None:
            send_replies(self.sender, self.compute.run(msg), self.tracer)
        return msg is not None

    def serve(self, conn) -> None:
        conn = LockedConn(conn)  # the expert mover reports from its thread

        def turn() -> bool:
            self.slots.check()
            self.loop.turn()
            return not self.loop.stopped()

        def on_message(msg) -> None:
            if isinstance(msg, MoveExperts):
                self.slots.begin(msg, conn.send)
            elif isinstance(msg, ForgetRegion):  # its group left: nothing of it is in flight
                self.receiver.forget_region(msg.region)
                self.sender.detach_region(msg.region)

        begin_join(self.slots, self.setup, conn.send)  # joining: its slots come from its peers
        self.loop.start()
        try:
            serve_control(conn, "moe", self.index, self.tracer, on_message, turn=turn)
        finally:
            self.loop.stop()
        if self.loop.error is not None:
            raise self.loop.error

    def memory(self) -> dict[str, int]:
        return {"routed_experts": self.slots.nbytes()}

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()
        self.slots.close()


class InlineLoop:
    """One thread receives, computes and sends in turn."""

    error: BaseException | None = None

    def __init__(self, worker: MoEWorker):
        self.w = worker

    def start(self) -> None:
        pass

    def stopped(self) -> bool:
        return False

    def turn(self) -> None:
        msg = self.w.receive("main", _POLL_S)
        if msg is not None:
            send_replies(self.w.sender, self.w.compute.run(msg), self.w.tracer)

    def stop(self) -> None:
        pass


class ThreadedLoop:
    """Receive and send on their own threads (ASAP's streams); the main thread computes."""

    def __init__(self, worker: MoEWorker):
        self.w = worker
        self._stop = threading.Event()
        self._inbox: queue.Queue = queue.Queue(maxsize=4)
        self._outbox: queue.Queue = queue.Queue(maxsize=4)
        self._threads = [threading.Thread(target=self._guard(self._receive_loop), name="recv", daemon=True),
                         threading.Thread(target=self._guard(self._send_loop), name="send", daemon=True)]
        self.error: BaseException | None = None

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
            msg = self.w.receive("recv", _POLL_S)
            if msg is not None:
                for row in msg.rows:  # the payloads are views valid until the next recv
                    row.payload = row.payload.clone()
                self._inbox.put(msg)

    def _send_loop(self) -> None:
        while not self._stop.is_set():
            try:
                replies = self._outbox.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            send_replies(self.w.sender, replies, self.w.tracer, "send")

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stopped(self) -> bool:
        return self._stop.is_set()

    def turn(self) -> None:
        try:
            msg = self._inbox.get(timeout=_POLL_S)
        except queue.Empty:
            return
        self._outbox.put(self.w.compute.run(msg))

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=1.0)
