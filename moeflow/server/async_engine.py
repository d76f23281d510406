"""AsyncEngine: one background thread owns the Engine and runs its step loop for the HTTP server.

The thread is the only one that touches the Engine: it builds it, steps it, aborts into it and shuts
it down. Handlers reach it through one FIFO inbox (add, abort, call, stop) and read each request's
progress from that request's asyncio queue, which the thread fills through ``call_soon_threadsafe``.
Admission is bounded: past ``max_pending`` unfinished requests ``submit`` refuses at once (the caller
answers 429), so a flood costs one refusal per request, not queue memory.

Invariant: every request ``submit`` accepted gets exactly one answer from the thread — a refusal
(``RequestStream.accepted`` raises) or deltas ending in one with a ``finish_reason`` (completion,
engine error, or shutdown) — unless its handler aborted it first. No handler waits forever.

A failed deployment is rebuilt, a degraded one healed in place, and the server gives up when the
restart policy says so (``health.Supervisor``); the thread checks its workers after every iteration,
busy or idle, and the engine's stall watchdog fails work nobody answers.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future
from typing import Callable

from moeflow.core import EngineBusy, Request, RequestError
from moeflow.engine.base import StepResult, clock
from moeflow.server.health import EngineUnavailable, Overloaded, Snapshot, Stopping, Supervisor
from moeflow.server.metrics import ServerMetrics
from moeflow.server.stream import Delta, RequestStream, Tracked, step_delta

logger = logging.getLogger("moeflow.server")

_IDLE_POLL_S = 0.25  # an idle thread wakes this often to notice a dead worker


class AsyncEngine:
    def __init__(self, make_llm: Callable[[], object], max_pending: int, metrics: ServerMetrics,
                 on_give_up: Callable[[str], None] | None = None):
        """``on_give_up(reason)``: called (on the engine thread) when the deployment stays failed for
        good; None: the server goes on answering 503."""
        self._make_llm = make_llm
        self.max_pending = max_pending
        self.metrics = metrics
        self.llm = None  # moeflow.LLM, built by the thread; handlers use only its tokenizer and make_request
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _num_pending, _closed and the order of inbox puts
        self._num_pending = 0
        self._closed = False
        self._failure: str | None = None
        self._restarting = False  # the engine thread is rebuilding the deployment
        self._gave_up = False  # the restart policy's attempts were spent: failed for good
        self._stopping = threading.Event()  # cuts a restart's back-off short at shutdown
        self.supervisor = Supervisor(metrics, self._stopping, on_give_up)
        self._tracked: dict[str, Tracked] = {}  # engine thread only
        self._snap = Snapshot(False, "starting", 0)
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="moeflow-engine", daemon=True)
        self.autoscaler = None  # engine/autoscaler.py (--autoscale), set before start

    # -- any thread ---------------------------------------------------------------------------

    def start(self) -> None:
        """Build the deployment on the engine thread; raises what building it raised."""
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error

    @property
    def max_model_len(self) -> int:
        return self.llm.engine.max_model_len  # fixed at construction: safe to read from any thread

    def oldest_work_age_s(self) -> float:
        """Any thread: how long the deployment's oldest unanswered work item has been out (a stall
        shows here before the watchdog fires, even while a step blocks the engine thread)."""
        llm = self.llm
        return 0.0 if llm is None else llm.engine.oldest_work_age_s()[0]

    def submit(self, request: Request) -> RequestStream:
        """Queue a request for the engine thread; raises Overloaded or EngineUnavailable at once."""
        stream = RequestStream(request, asyncio.get_running_loop())
        with self._lock:
            if self._closed or self._failure is not None:
                raise self._unavailable()
            if self._num_pending >= self.max_pending:
                raise Overloaded(f"{self._num_pending} requests are unfinished (limit {self.max_pending})")
            self._num_pending += 1
            self._inbox.put(("add", stream))  # NOTE: under the lock: never after shutdown's "stop"
        return stream

    def abort(self, request_id: str) -> None:
        """The handler stopped listening (client gone): cancel the request and free its KV blocks."""
        self._inbox.put(("abort", request_id))

    def release_kv(self, handle) -> Future:
        """A refused handoff (``kv_handle.KvHandle``): its prefill server may free the KV now. The
        future gets what the engine made of it (a prefill server's ``kv_server.RELEASED``, ...)."""
        return self.call(lambda: self.llm.engine.release_kv(handle))

    def call(self, fn) -> Future:
        """``fn()`` run on the engine's thread between steps (a scale request, its status); the future
        gets its result or its exception."""
        done: Future = Future()
        self._inbox.put(("call", (fn, done)))
        return done

    def snapshot(self) -> Snapshot:
        return self._snap

    def shutdown(self) -> None:
        """Finish every request (with an error if unfinished), stop the thread, release the deployment."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._inbox.put(("stop", None))
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()

    # -- engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.llm = self._make_llm()
        except BaseException as e:  # a bad model path or layout: start() re-raises it
            self._start_error = e
            self._ready.set()
            return
        self._update_snapshot()
        self._ready.set()
        try:
            self._serve()
        except BaseException as e:  # a bug in this loop: answer everyone rather than hang them
            logger.exception("engine thread crashed")
            self._fail(f"the engine thread crashed: {type(e).__name__}: {e}")
        finally:
            self._end_all("abort", "the server is shutting down")
            self._drain_refusing()
            self.llm.shutdown()

    def _serve(self) -> None:
        while True:
            engine = self.llm.engine  # a new one after each restart
            busy = self._failure is None and engine.has_unfinished()
            try:
                cmd = self._inbox.get_nowait() if busy else self._inbox.get(timeout=_IDLE_POLL_S)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd[0] == "stop":
                    return
                self._handle(*cmd)
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._failure is None:
                try:
                    result = engine.step() if engine.has_unfinished() else StepResult({}, [])
                    checked = engine.check_workers()  # busy or idle: a worker may die while others work
                    result.finished += checked.finished
                except Exception as e:
                    logger.exception("engine step failed")
                    self._fail(f"an engine step raised {type(e).__name__}: {e}")
                else:
                    self._deliver(result)
                    if self.autoscaler is not None:  # --autoscale: a window of the load, maybe a change
                        self.autoscaler.turn(engine, result, clock())
                    self.supervisor.count_stalls(engine)
                    if engine.failed is not None:
                        self._fail(engine.failed)
                    elif (rebuild := self.supervisor.mend(engine, self.llm.restart_policy.enabled)) is not None:
                        engine.failed = rebuild  # the restart below shuts it down and builds it anew
                        self._fail(rebuild)
            if self._failure is not None and not self._gave_up:
                try:
                    self._restart()
                except Stopping:
                    return
            self._update_snapshot()

    def _restart(self) -> None:
        """Rebuild the failed deployment (its requests already ended with errors); meanwhile new
        requests get 503 with Retry-After. When the policy gives up (or has no restarts) it stays
        failed, and the supervisor is told."""
        reason = self._failure
        if self.llm.restart_policy.enabled:
            with self._lock:
                self._restarting = True
            self._update_snapshot()
            reason = self.supervisor.restart(self.llm, reason)
        with self._lock:
            self._restarting = False
            self._gave_up = reason is not None
            self._failure = reason
        if reason is not None:
            self._update_snapshot()
            self.supervisor.give_up(reason)

    def _unavailable(self) -> EngineUnavailable:
        """The refusal for a request arriving now (caller holds the lock)."""
        if self._restarting:
            return EngineUnavailable(f"restarting after a failure ({self._failure})",
                                     retry_after_s=self.llm.restart_policy.backoff_s + 5.0)
        return EngineUnavailable(self._failure or "the server is shutting down")

    def _handle(self, kind: str, arg) -> None:
        if kind == "add":
            self._add(arg)
        elif kind == "call":
            fn, done = arg
            try:
                done.set_result(fn())
            except Exception as e:  # noqa: BLE001  (the route answers it; the engine goes on)
                done.set_exception(e)
        elif kind == "abort" and self._tracked.pop(arg, None) is not None:
            self.llm.engine.abort(arg)
            self.metrics.finished.labels("abort").inc()
            self._release()

    def _add(self, stream: RequestStream) -> None:
        r = stream.request
        if self._failure is not None:
            with self._lock:
                error = self._unavailable()
            return self._refuse(stream, error)
        if r.request_id in self._tracked:  # a client's request_id, sent again before its answer ended
            return self._refuse(stream, RequestError(f"request_id: {r.request_id!r} is the id of an unfinished request"))
        try:
            self.llm.engine.add_request(r)
        except RequestError as e:
            return self._refuse(stream, e)
        except EngineBusy as e:  # a bounded queue inside the deployment (pd's handoffs) is full
            return self._refuse(stream, EngineUnavailable(str(e), retry_after_s=1.0))
        except Exception as e:  # the deployment failed under us (WorkerDied)
            return self._refuse(stream, EngineUnavailable(f"{type(e).__name__}: {e}"))
        self._tracked[r.request_id] = Tracked(stream)
        self.metrics.prompt_tokens.inc(r.num_prompt_tokens)
        stream.accept()

    def _refuse(self, stream: RequestStream, error: BaseException) -> None:
        stream.accept(error)
        self._release()

    def _deliver(self, result: StepResult) -> None:
        now = clock()
        self.metrics.observe_busy(result.busy_s)
        self.metrics.observe_handoffs(result.kv_transfers, result.prealloc_waits_s)
        outs = {rid: out for rid, out in result.outputs.items() if rid in self._tracked}
        for rid, out in outs.items():
            if out.token_id is not None:  # a prefill chunk has none (it may carry prompt logprobs)
                self.metrics.observe_token(*self._tracked[rid].token_at(now))
        finished = {r.request_id: r for r in result.finished if r.request_id in self._tracked}
        for rid, out in outs.items():
            if rid not in finished and (d := step_delta(self._tracked[rid].stream.request, out, False)) is not None:
                self._tracked[rid].stream.push(d)
        for rid, r in finished.items():
            t = self._tracked.pop(rid)
            t.stream.push(step_delta(r, outs.get(rid), True))
            self.metrics.observe_finished(r.finish_reason, now - r.arrival_s)
            self._release()

    def _fail(self, reason: str) -> None:
        """Stop serving: /health turns unhealthy, and every tracked request ends with this error."""
        with self._lock:
            self._failure = reason
        self._update_snapshot()  # before the requests end: a client that saw its error sees /health fail too
        self._end_all("error", reason)

    def _end_all(self, finish_reason: str, error: str) -> None:
        for rid, t in list(self._tracked.items()):
            if self._failure is None:
                self.llm.engine.abort(rid)
            t.stream.push(Delta((), finish_reason, error))
            self.metrics.finished.labels(finish_reason).inc()
            self._release()
        self._tracked.clear()

    def _drain_refusing(self) -> None:
        """Answer what is still in the inbox (nothing can arrive after "stop")."""
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                with self._lock:
                    error = self._unavailable()
                self._refuse(arg, error)

    def _release(self) -> None:
        with self._lock:
            self._num_pending -= 1

    def _update_snapshot(self) -> None:
        with self._lock:
            pending, failure, restarting = self._num_pending, self._failure, self._restarting
        if failure is not None:
            self._snap = Snapshot(False, failure, pending, restarting=restarting)
            return
        load = self.llm.engine.load()  # EngineLoad's fields are the snapshot's
        self._snap = Snapshot(True, None, pending, **{**vars(load), "degraded": self.supervisor.degraded})
