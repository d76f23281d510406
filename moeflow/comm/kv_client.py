"""The decode side of the KV link (``kv_link.py``): one pair per prefill server, a thread per pair
that runs its jobs in order, and the answers on one queue the engine thread reads without waiting.

A job names a remote range (``RemoteRange``) and what to do with it: claim it (this host's
processes will read the shared memory), pull it into a local tensor (another host), or release
it. The engine thread never blocks on the network: connecting, claiming and pulling happen on the
pair's thread. A pair that breaks (its prefill server died) fails the job it was running and every
job queued behind it; the next job to that server opens a new pair.

NOTE: a pull writes into its target until its answer comes back: whoever gave the target keeps it
until then, even when it has given up on the handoff.
"""
from __future__ import annotations

import datetime
import queue
import threading
from dataclasses import dataclass

import torch

from moeflow.comm.kv_arena import gloo_buffer
from moeflow.comm.kv_link import BYE, CLAIM, DATA_TAG, HEADER_TAG, OK, PULL, RELEASE, STATUS_TAG, connect, header

# the decode side waits this long for an answer (a prefill server that hangs fails the job)
ANSWER_TIMEOUT = datetime.timedelta(seconds=60)


@dataclass(frozen=True)
class RemoteRange:
    """A range a prefill server offers: where its KV link listens and which bytes."""

    server_id: str  # the offering server's link (a restarted server has a new one: a new pair)
    host: str
    port: int
    transfer_id: int
    slot: int
    offset_bytes: int
    nbytes: int
    token: int  # the range's token (``kv_link.new_token``): without it the prefill server refuses


@dataclass(frozen=True)
class Answer:
    cookie: object  # what the caller gave with the job
    ok: bool
    error: str | None = None  # why not, when not ok


class _Pair:
    def __init__(self, host: str, port: int, answers: queue.SimpleQueue, secret: str | None):
        self.host, self.port, self.answers, self.secret = host, port, answers, secret
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.broken = False
        self._thread = threading.Thread(target=self._run, name=f"kv-link-{host}:{port}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        job = None
        try:
            pg = connect(self.host, self.port, self.secret)
            status = torch.empty(1, dtype=torch.int64, device="cpu")  # gloo: host tensors
            while (job := self.jobs.get()) is not None:
                op, r, into, cookie = job
                hdr = header(op, r.transfer_id, r.slot, r.offset_bytes, r.nbytes, r.token)
                pg.send([hdr], 0, HEADER_TAG).wait(ANSWER_TIMEOUT)
                if op == RELEASE:
                    continue
                pg.recv([status], 0, STATUS_TAG).wait(ANSWER_TIMEOUT)
                ok = int(status[0]) == OK
                if ok and op == PULL:
                    data = gloo_buffer(into)
                    pg.recv([data], 0, DATA_TAG).wait(ANSWER_TIMEOUT)
                    if data is not into:  # a device heap: through pinned host memory
                        into.copy_(data)
                self.answers.put(Answer(cookie, ok, None if ok else
                                        f"the prefill server no longer offers transfer {r.transfer_id} under "
                                        f"that token (its lease ran out, it restarted, or the handle is not its)"))
                job = None
            pg.send([header(BYE)], 0, HEADER_TAG).wait(ANSWER_TIMEOUT)
        except Exception as e:  # noqa: BLE001  (the prefill server is gone or unreachable)
            self.broken = True
            why = f"the KV link to {self.host}:{self.port} failed: {type(e).__name__}: {e}"
            for j in [job, *_drain(self.jobs)]:
                if j is not None and j[0] != RELEASE:
                    self.answers.put(Answer(j[3], False, why))

    def close(self) -> None:
        self.jobs.put(None)


class KvClient:
    def __init__(self, secret: str | None = None):
        """``secret``: the deployment's KV secret, which a prefill server's KV port may ask for."""
        self.secret = secret
        self.answers: queue.SimpleQueue[Answer] = queue.SimpleQueue()
        self._pairs: dict[tuple[str, int, str], _Pair] = {}

    def _pair(self, r: RemoteRange) -> _Pair:
        key = (r.host, r.port, r.server_id)
        p = self._pairs.get(key)
        if p is None or p.broken:
            for old in [k for k in self._pairs if k[:2] == key[:2] and k != key]:
                self._pairs.pop(old).close()  # that server restarted: its old pair says goodbye
            p = self._pairs[key] = _Pair(r.host, r.port, self.answers, self.secret)
        return p

    def claim(self, r: RemoteRange, cookie) -> None:
        """Pin ``r`` for this host's processes to read; answered on ``answers``."""
        self._pair(r).jobs.put((CLAIM, r, None, cookie))

    def pull(self, r: RemoteRange, into: torch.Tensor, cookie) -> None:
        """Claim ``r`` and copy its bytes into ``into`` (uint8 [r.nbytes]); answered on ``answers``."""
        if into.dtype != torch.uint8 or into.numel() != r.nbytes:
            raise ValueError(f"a pull of {r.nbytes} bytes needs a uint8 target of that size, got "
                             f"{into.dtype} [{into.numel()}]")
        self._pair(r).jobs.put((PULL, r, into, cookie))

    def release(self, r: RemoteRange) -> None:
        """The prefill server may free ``r`` (read, or given up); no answer."""
        self._pair(r).jobs.put((RELEASE, r, None, None))

    def poll(self, wait_s: float = 0.0) -> list[Answer]:
        """The answers so far; with ``wait_s``, wait that long for the first one."""
        if wait_s > 0:
            try:
                return [self.answers.get(timeout=wait_s), *_drain(self.answers)]
            except queue.Empty:
                return []
        return _drain(self.answers)

    def shutdown(self) -> None:
        for p in self._pairs.values():
            p.close()
        self._pairs.clear()


def _drain(q: queue.SimpleQueue) -> list:
    """What ``q`` holds now, without waiting."""
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out
