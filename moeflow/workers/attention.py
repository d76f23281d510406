"""Attention-side worker process: receive -> handle -> reply on the control pipe.

It owns ``AttentionStages`` (model, KV cache, request state, dispatch/combine endpoints) and a
``LayerSchedule`` that walks the layers with them; the role decides which schedule (asap:
``Interleaved``, dep: ``Lockstep``).
"""
from __future__ import annotations

import time
from collections import deque

import torch

from moeflow.messages import BatchTiming, KvRecv, KvSend, MoveExperts, RunWork, UseExperts, WorkDone
from moeflow.workers.control import LockedConn, serve_control
from moeflow.workers.expert_slots import begin_join
from moeflow.workers.kv_transfer import KvTransfers
from moeflow.workers.schedule import LayerSchedule
from moeflow.workers.stages import AttentionStages


class AttentionWorker:
    def __init__(self, stages: AttentionStages, schedule: LayerSchedule, replies: bool, expert_slots=None):
        self.stages, self.schedule = stages, schedule
        self.expert_slots = expert_slots  # a dep rank's own experts (it takes MoveExperts)
        self.replies = replies  # the group's leader reports WorkDone; other TP members stay silent
        self.kv = KvTransfers(stages.runner.kv_cache, stages.member)  # the prefill/decode handoff
        self.kv_region = stages.kv_region  # reported at start: where others read this cache in place

    def serve(self, conn) -> None:
        pipe = EarlyKv(LockedConn(conn), self._copy)  # a dep rank's expert mover reports from its thread
        # NOTE: a KV copy touches only blocks no batch holds (a finished request's leased blocks, or an
        # arriving one's reserved blocks), so it runs between two layers of a work item instead of
        # waiting for the item's end: measured here, a handoff waited ~85% of its time for the members
        self.stages.between_layers = pipe.copy_waiting

        def on_message(msg) -> None:
            if isinstance(msg, RunWork):
                done = self.run_work(msg)
                if self.replies:
                    conn.send(done)
            elif isinstance(msg, (KvSend, KvRecv)):
                self._copy(msg)
            elif isinstance(msg, UseExperts):  # in order: before the next work item
                self.stages.use_experts(msg.epoch, msg.layers)
                self.schedule.experts_changed()
            elif isinstance(msg, MoveExperts):
                self.expert_slots.begin(msg, pipe.send)

        s = self.stages
        if self.expert_slots is not None:  # a dep rank joining a serving deployment: its slots from its peers
            begin_join(self.expert_slots, s.setup, pipe.send)
        serve_control(pipe, s.setup.role, s.setup.index, s.tracer, on_message)

    def _copy(self, msg: KvSend | KvRecv) -> None:
        t0 = time.monotonic()
        with torch.inference_mode():
            self.kv.handle(msg)
        # the copy itself, beside the engine's handoff spans (which also hold the wait for this process)
        self.stages.tracer.add("kv copy out" if isinstance(msg, KvSend) else "kv copy in", t0, time.monotonic(),
                               tokens=msg.stage.num_tokens)

    def memory(self) -> dict[str, int]:
        return {**self.stages.memory(), **self.schedule.memory()}

    def close(self) -> None:
        self.kv.close()
        self.schedule.close()
        self.stages.close()
        if self.expert_slots is not None:
            self.expert_slots.close()

    @torch.inference_mode()
    def run_work(self, work: RunWork) -> WorkDone:
        s = self.stages
        if self.expert_slots is not None:
            self.expert_slots.check()
        for rid in work.freed:
            s.runner.remove_request(rid)
        for r in work.new_requests:
            s.runner.add_request(r.request_id, r.prompt_token_ids, r.params, r.eos_token_ids, r.generated)
        flights = s.begin(work.batches, time.monotonic())
        self.schedule.run(flights)
        outputs, timings, errors = {}, [], {}
        for f in flights:
            c0 = time.monotonic()
            outputs[f.batch.batch_id] = s.sample(f)
            end = time.monotonic()
            f.compute_s += end - c0
            s.tracer.add("sample", c0, end, batch=f.batch.batch_id)
            timings.append(BatchTiming(f.batch.batch_id, f.start_s, end, f.compute_s, f.wait_s))
            if f.error is not None:
                errors[f.batch.batch_id] = f.error
                outputs[f.batch.batch_id] = {}
        return WorkDone(s.group, work.work_id, outputs, timings, errors,
                        s.expert_load.take() if s.expert_load is not None else None)


class EarlyKv:
    """The worker's end of its control pipe, from which KV copy messages are taken early: between two
    layers, every message already in the pipe is read; the KV ones are copied at once, the others
    kept, in order, for the control loop (which reads through this object)."""

    def __init__(self, conn, copy):
        self.conn, self.copy = conn, copy
        self.kept: deque = deque()

    def copy_waiting(self) -> None:
        while self.conn.poll():
            msg = self.conn.recv()
            if isinstance(msg, (KvSend, KvRecv)) and not self.kept:  # behind a kept message: keep the order
                self.copy(msg)
            else:
                self.kept.append(msg)

    def poll(self, timeout: float = 0.0) -> bool:
        return bool(self.kept) or self.conn.poll(timeout)

    def recv(self):
        return self.kept.popleft() if self.kept else self.conn.recv()

    def send(self, obj) -> None:
        self.conn.send(obj)
