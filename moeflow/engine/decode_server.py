"""The decode server's side of the handoff (``moeflow serve --role decode``): a request that carries a ``KvHandle``
(``Request.kv_source``, the prefill server's ``kv_transfer_params``) takes its prompt's KV from the
prefill server instead of computing it. Requests without one are served as usual.

Per handoff: waiting (for blocks: pre-allocated against this server's budget, in a queue of at
most ``max_pending``; beyond it new handoffs are refused) -> fetching (on the same host: the range
claimed, the members will read the prefill server's shared memory: its caches' blocks when the
handle is in place, else its staged range; elsewhere: pulled over the link into this server's own
arena) -> reading (the members copy it into the reserved blocks) ->
arrived: the first token (the prefill side's) goes out with its logprobs, and the request decodes.
A failed claim, pull or copy frees everything and applies ``failure_policy``: recompute the prompt
here (from the prompt and the first token), or fail the request. So does a handoff that stays in
one state longer than ``lease_s`` (the prefill server's lease is over by then anyway), so no
handoff holds blocks forever, whatever the prefill server or the link do.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from moeflow.comm.kv_arena import READ
from moeflow.comm.kv_client import KvClient, RemoteRange
from moeflow.comm.kv_link import host_id
from moeflow.config import KvTransferConfig
from moeflow.core import EngineBusy, Request, RequestError
from moeflow.engine.base import Engine, KvTransfer, StepResult, clock, validate_request
from moeflow.engine.handle_arenas import HandleArenas, remote_of, stage_of
from moeflow.engine.kv_copier import EngineCopier
from moeflow.engine.kv_handoff import BUSY, DONE, FAILED
from moeflow.engine.kv_regions import read_regions
from moeflow.engine.server_side import ServerSide
from moeflow.kv_handle import KvHandle
from moeflow.messages import KvSource, KvStage, SeqOutput
from moeflow.scheduler.handoff.sides import DecodeSide
from moeflow.settings import pd_fail_prob

_IDLE_WAIT_S = 2e-3  # longest a step waits for the KV link when nothing else runs


@dataclass
class Incoming:
    request: Request  # the client's
    handle: KvHandle
    remote: RemoteRange
    since_s: float  # accepted
    state: str = "waiting"  # waiting -> fetching -> reading
    state_s: float = 0.0  # entered its state (each state has one lease)
    group: int | None = None
    blocks: tuple[int, ...] = ()
    stage: KvStage | None = None  # what the members read: the prefill server's range, or the local copy
    local: KvStage | None = None  # this server's arena range a pull lands in (another host), or in place its flags
    source: KvSource | None = None  # in place on this host: the prefill server's caches the members copy from
    started_s: float | None = None  # blocks reserved


class DecodeServer(ServerSide):
    def __init__(self, inner: Engine, kv: KvTransferConfig, weights: str = ""):
        super().__init__(inner, kv, weights)
        self.client, self.host_id = KvClient(kv.secret), host_id()
        self.incoming: dict[str, Incoming] = {}
        self.first_out: set[str] = set()  # arrived, the first decode output not yet out: it carries handoff_s
        self._handoff_s: dict[str, float] = {}
        self.arenas = HandleArenas(self.kv.arena)
        self._orphans: dict[int, Incoming] = {}  # given up while a claim or pull was out: freed on its answer
        self._unread: list[Incoming] = []  # given up while the members copied: released once they answered
        self._later: list = []  # live handoffs' answers seen between steps, for the next step
        self.port = inner.handoff_port()
        self.copier = EngineCopier(self.kv, self.port, pd_fail_prob(), random.Random(self.config.seed),
                                   arena_of=self.arenas.of)
        self.side = DecodeSide(self.port, self.copier)

    # -- intake -------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        h = request.kv_source
        if h is None:
            return self.inner.add_request(request)
        rid = request.request_id
        if h.layout != self.kv_layout:
            raise RequestError(f"request {rid}: its KV was prefilled by {h.layout.describe()}, but this decode "
                               f"server runs {self.kv_layout.describe()}: a KV cache passes only between the "
                               f"same model and dtype")
        if h.weights != self.weights:
            raise RequestError(f"request {rid}: its KV was prefilled by weights {h.weights or '(unnamed)'}, but this "
                               f"decode server holds weights {self.weights}: a KV cache passes only between the "
                               f"same checkpoint")
        if h.num_tokens != request.num_prompt_tokens or (h.staged and h.nbytes != self.kv.bytes_for(h.num_tokens)):
            raise RequestError(f"request {rid}: its KV handle stages {h.num_tokens} positions ({h.nbytes} bytes) "
                               f"but the prompt has {request.num_prompt_tokens} tokens")
        validate_request(request, self.model_config)
        self.port.check(request)
        if rid in self.incoming:
            raise RequestError(f"request {rid}: a request with this id is running")
        if len(self.incoming) >= self.kv_config.max_pending:
            raise EngineBusy(f"{len(self.incoming)} requests wait for blocks or for their KV "
                             f"(kv_transfer_config.max_pending); retry later")
        now = clock()
        self.incoming[rid] = Incoming(request, h, remote_of(h), now, state_s=now)

    def abort(self, request_id: str) -> None:
        inc = self.incoming.pop(request_id, None)
        if inc is not None and not inc.handle.staged:
            return
        if inc is None:
            self.first_out.discard(request_id)
            self._handoff_s.pop(request_id, None)
            return self.inner.abort(request_id)
        self._let_go(inc)

    def has_unfinished(self) -> bool:
        return self.inner.has_unfinished() or bool(self.incoming)

    def release_kv(self, handle: KvHandle) -> None:
        self.client.release(remote_of(handle))

    # -- the loop -----------------------------------------------------------------------------

    def step(self) -> StepResult:
        res = self.inner.step()
        for rid, o in res.outputs.items():
            if rid in self.first_out and o.token_id is not None:
                self.first_out.discard(rid)
                o.handoff_s = self._handoff_s.pop(rid, None)
        out = StepResult(res.outputs, res.finished, res.busy_s)
        # NOTE: with nothing else to run, wait a little for the link rather than spin on it
        idle = self.incoming and not res.outputs and not self.inner.has_unfinished()
        self._answers(out, _IDLE_WAIT_S if idle else 0.0)
        for inc in list(self.incoming.values()):
            self._advance(inc, out)
        return out

    def check_workers(self) -> StepResult:
        """Also between steps (an idle server): what aborted handoffs held is freed; answers for live
        ones wait for the next step (the server keeps only the finished requests of this result)."""
        self._answers(None)
        return self.inner.check_workers()

    def _answers(self, out: StepResult | None, wait_s: float = 0.0) -> None:
        answers, self._later = self._later + self.client.poll(wait_s), []
        for a in answers:
            inc = self._orphans.pop(a.cookie, None)
            if inc is not None:  # given up meanwhile: free what the job held
                self._release(inc)
                continue
            inc = next((x for x in self.incoming.values() if id(x) == a.cookie), None)
            if inc is None:
                continue
            if out is None:
                self._later.append(a)
                continue
            if not a.ok:
                if inc.local is not None:
                    self.kv.close(inc.local)
                self._give_up(inc, a.error, out)
            elif inc.source is not None:  # claimed in place: the members copy out of the prefill caches
                self._read(inc, dataclasses.replace(inc.local, source=inc.source))
            elif inc.local is not None:  # pulled: the prefill server may free its range now
                self.client.release(inc.remote)
                self._read(inc, inc.local)
            else:
                self._read(inc, stage_of(inc.handle))
        self._unread = [x for x in self._unread if not self._read_over(x)]

    def _advance(self, inc: Incoming, out: StepResult) -> None:
        if clock() - inc.state_s > self.kv_config.lease_s:
            return self._expire(inc, out)
        if inc.state == "waiting" and not inc.handle.staged:
            self._give_up(inc, "the prefill server staged no KV (its copy out failed)", out)
        elif inc.state == "waiting":
            self._start(inc)
        elif inc.state == "reading":
            state = self.copier.status(inc.stage, READ, inc.group)
            if state == FAILED:
                self.kv.stats.failures += 1
                self._finish_read(inc)
                self._give_up(inc, "its KV copy into the decode instance failed", out)
            elif state == DONE:
                self._finish_read(inc)
                self._arrived(inc, out)

    def _start(self, inc: Incoming) -> None:
        """Blocks reserved in the group with the most free ones, then the claim or the pull."""
        h, same_host = inc.handle, inc.handle.host_id == self.host_id and self.arenas.by_path(inc.handle.arena) is not None
        regions = read_regions(h.arena, h.group) if same_host and h.in_place else None
        same_host = same_host and (regions is not None or not h.in_place)  # no table to read: pull it
        gid = self.side.room(inc.request)
        if gid is None:
            return
        if not same_host or h.in_place:  # a range to pull into, or in place a row of flags
            inc.local = self.kv.open(h.num_tokens, staged=not same_host)
            if inc.local is None:
                return
            inc.source = KvSource(regions, h.block_ids) if same_host else None
        inc.group, inc.state, inc.started_s = gid, "fetching", clock()
        inc.state_s = inc.started_s
        inc.blocks = self.side.reserve(inc.request, gid)
        self.kv.stats.prealloc_wait_s.append(inc.started_s - inc.since_s)
        if same_host:
            self.client.claim(inc.remote, id(inc))
        else:
            self.client.pull(inc.remote, self.kv.arena.heap_view(inc.local.offset_bytes, h.nbytes), id(inc))

    def _read(self, inc: Incoming, stage: KvStage) -> None:
        inc.stage, inc.state, inc.state_s = stage, "reading", clock()
        self.side.copy_in(inc.request.request_id, stage)

    def _arrived(self, inc: Incoming, out: StepResult) -> None:
        r, h = inc.request, inc.handle
        del self.incoming[r.request_id]
        secs = clock() - inc.started_s
        s = self.kv.stats
        s.transfers, s.bytes_total = s.transfers + 1, s.bytes_total + h.nbytes
        s.seconds.append(secs)
        out.kv_transfers.append(KvTransfer(secs, h.nbytes, "gloo" if inc.local is not None and inc.source is None
                                           else "shm"))
        out.prealloc_waits_s.append(inc.started_s - inc.since_s)
        out.outputs[r.request_id] = SeqOutput(h.first_token_id, h.first_logprobs, list(h.prompt_logprobs))
        if r.append_token(h.first_token_id):  # its first token ended it: nothing to decode
            self.side.drop(r.request_id)
            out.finished.append(r)
            return
        self.side.arrived(r.request_id)
        self.first_out.add(r.request_id)
        self._handoff_s[r.request_id] = secs

    # -- giving up ----------------------------------------------------------------------------

    def _expire(self, inc: Incoming, out: StepResult) -> None:
        """Over its state's lease: let go of what it holds (as an abort does), then the policy."""
        self.kv.stats.lease_expiries += 1
        what = {"waiting": "no decode blocks came free for it", "fetching": "its claim or pull went unanswered",
                "reading": "its copy in did not finish"}[inc.state]
        self._let_go(inc)
        self._give_up(inc, f"{what} within {self.kv_config.lease_s:g} s (kv_transfer_config.lease_s)", out)

    def _give_up(self, inc: Incoming, why: str, out: StepResult) -> None:
        """Blocks freed, then the policy: recompute the prompt here, or fail the request."""
        r = inc.request
        self.incoming.pop(r.request_id, None)
        self.side.drop(r.request_id)
        if self.kv_config.failure_policy == "recompute":
            out.outputs[r.request_id] = SeqOutput(inc.handle.first_token_id, inc.handle.first_logprobs,
                                                  list(inc.handle.prompt_logprobs))
            if r.append_token(inc.handle.first_token_id):
                out.finished.append(r)
                return
            try:
                self.inner.add_request(r)
                self.kv.stats.recomputes += 1
                return
            except Exception as e:  # noqa: BLE001  (then the request fails with both reasons)
                why += f"; recomputing it failed: {e}"
        r.finish_reason, r.error = "error", f"request {r.request_id}: {why}"
        out.finished.append(r)

    def _let_go(self, inc: Incoming) -> None:
        """An abort: free the blocks; what a claim, pull or copy still holds is freed when it answers."""
        self.side.drop(inc.request.request_id)
        if inc.state == "waiting":
            self.client.release(inc.remote)  # the prefill server need not wait for the lease
        elif inc.state == "fetching":
            self._orphans[id(inc)] = inc
        else:
            self._unread.append(inc)

    def _release(self, inc: Incoming) -> None:
        if inc.local is not None:
            self.kv.close(inc.local)
        self.client.release(inc.remote)

    def _read_over(self, inc: Incoming) -> bool:
        """Its members answered (or never will: a lease after it was given up, the range is gone anyway)."""
        arena = self.arenas.of(inc.stage)
        late = clock() - inc.state_s > 2 * self.kv_config.lease_s
        if not late and arena is not None and self.copier.status(inc.stage, READ, inc.group) == BUSY:
            return False
        self._finish_read(inc)
        return True

    def _finish_read(self, inc: Incoming) -> None:
        if inc.local is not None:
            self.kv.close(inc.local)
        if inc.local is None or inc.source is not None:  # read on this host: the prefill server may free it
            self.client.release(inc.remote)

    def load(self):
        x = self.inner.load()
        st = self.kv.stats
        return dataclasses.replace(x, running_per_role=(("decode", x.num_running),), num_handoffs=len(self.incoming),
                                   handoff_counts=(("failures", st.failures), ("recomputes", st.recomputes),
                                                   ("lease_expiries", st.lease_expiries)))

    def shutdown(self) -> None:
        self.client.shutdown()
        self.arenas.close()
        super().shutdown()

