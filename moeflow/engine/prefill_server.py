"""The prefill server's side of the handoff (``moeflow serve --role prefill``): a request that asks for a remote
decode (``Request.kv_handoff``, the router's ``do_remote_decode``) runs with ``max_tokens=1``; when
its first token is sampled its blocks stay leased and the request finishes with a ``KvHandle``,
which the KV link (``comm/kv_server.py``) offers to decode servers until one releases it or the
lease runs out. In place (``KvTransferConfig.in_place``, the default): the handle names the leased
blocks themselves, a decode server on this host copies them out of the shared caches and one
elsewhere pulls what the link gathers (``kv_regions.py``); the blocks are freed when the offer
ends. Staged: the members first copy them into the staging arena, the blocks are freed, and the
handle names that range. A first token that ends the request (EOS, a stop token) needs no
decode: no handle.

Per handoff request: prefilling (the inner engine's) -> staging (blocks leased; waiting for a flag
row, or arena room and the copy out) -> offered (the answer went out; the KV waits for a decode
server).
"""
from __future__ import annotations

import dataclasses
import functools
import random
import time
import uuid
from dataclasses import dataclass

from moeflow.comm.kv_arena import WRITE
from moeflow.comm.kv_link import host_id, new_token
from moeflow.comm.kv_server import KvServer, Offers
from moeflow.config import KvTransferConfig
from moeflow.core import Request, RequestError
from moeflow.engine.base import Engine, KvTransfer, StepResult, clock
from moeflow.engine.kv_copier import EngineCopier
from moeflow.engine.kv_handoff import DONE, FAILED
from moeflow.engine.kv_regions import Gatherer, RegionTable
from moeflow.engine.server_side import ServerSide
from moeflow.kv_handle import UNKNOWN, KvHandle
from moeflow.messages import KvStage
from moeflow.scheduler.handoff.sides import Lease, PrefillSide
from moeflow.settings import pd_fail_prob

_IDLE_WAIT_S = 1e-3


@dataclass
class Staging:
    request: Request
    lease: Lease  # the inner engine's group and blocks it holds
    since_s: float  # first token sampled (the lease started)
    stage: KvStage | None = None  # arena room found, copy out sent
    stage_s: float = 0.0  # ... when (the copy out has one lease from then)


class PrefillServer(ServerSide):
    def __init__(self, inner: Engine, kv: KvTransferConfig, weights: str = ""):
        super().__init__(inner, kv, weights)
        self.offers = Offers(kv.lease_s, clock)
        try:
            self.server = KvServer(self.kv.arena, self.offers, kv.host, kv.port, kv.secret)
        except BaseException:
            super().shutdown()
            raise
        self.server_id, self.host_id, self.kv_port = uuid.uuid4().hex, host_id(), self.server.port
        self.staging: dict[str, Staging] = {}
        self.offered: dict[int, KvStage] = {}  # transfer id -> its stage, until reaped
        self._logprobs: dict[str, tuple] = {}  # handoff request -> (first token's, prompt's so far)
        self.port = port = inner.handoff_port()
        self.copier = EngineCopier(self.kv, port, pd_fail_prob(), random.Random(self.config.seed))
        self.side = PrefillSide(port, self.copier)
        self.in_place = kv.in_place and port.regions(0) is not None
        self.leased: dict[int, str] = {}  # transfer id -> the request whose blocks it offers in place
        self.region_table = RegionTable(self.kv.arena.segment.path) if self.in_place else None
        self.gatherer = Gatherer(self.kv.num_layers, self.kv.dtype, self.kv.entries) if self.in_place else None

    def add_request(self, request: Request) -> None:
        if request.kv_handoff and request.params.max_tokens != 1:
            raise RequestError(f"request {request.request_id}: a remote decode's prefill samples one token "
                               f"(max_tokens=1), got max_tokens={request.params.max_tokens}")
        self.inner.add_request(request)
        if request.kv_handoff:
            self._logprobs[request.request_id] = (None, [])

    def abort(self, request_id: str) -> None:
        s = self.staging.pop(request_id, None)
        self._logprobs.pop(request_id, None)
        if s is None:
            self.inner.abort(request_id)
        else:
            self._drop(s)

    def has_unfinished(self) -> bool:
        return self.inner.has_unfinished() or bool(self.staging)

    def release_kv(self, handle: KvHandle) -> str:
        """The router found no decode server to take it: ``kv_server.RELEASED``, ``REFUSED`` (a wrong
        token, or a decode server claimed it) or ``UNKNOWN`` (not offered here, or not any more)."""
        if handle.server_id != self.server_id:
            return UNKNOWN
        return self.offers.release(handle.transfer_id, handle.token)

    def step(self) -> StepResult:
        res = self.inner.step()
        for rid, o in res.outputs.items():
            if rid in self._logprobs:
                first, plp = self._logprobs[rid]
                self._logprobs[rid] = (o.logprobs if o.token_id is not None else first, plp + list(o.prompt_logprobs))
        out = StepResult(res.outputs, [], res.busy_s)
        for r in res.finished:
            lease = self.side.lease(r.request_id) if r.finish_reason == "length" else None
            if lease is not None:
                self.staging[r.request_id] = Staging(r, lease, clock())
            else:  # ended by its first token, or failed: nothing to hand over
                self.side.end(r.request_id)
                self._logprobs.pop(r.request_id, None)
                out.finished.append(r)
        for s in list(self.staging.values()):
            self._advance(s, out)
        self._reap()
        if self.staging and not res.outputs and not self.inner.has_unfinished():
            time.sleep(_IDLE_WAIT_S)  # only copies or arena room are awaited: nap, do not spin
        return out

    def check_workers(self) -> StepResult:
        self._reap()  # an idle server steps no more, but released ranges are freed
        return self.inner.check_workers()

    def _reap(self) -> None:
        for tid in self.offers.reap():
            self.kv.close(self.offered.pop(tid))
            rid = self.leased.pop(tid, None)
            if rid is not None:  # offered in place: nobody reads the blocks any more
                self.side.end(rid)
        self.kv.drain()

    def _advance(self, s: Staging, out: StepResult) -> None:
        r = s.request
        if s.stage is None and clock() - s.since_s > self.kv_config.lease_s:
            self.kv.stats.lease_expiries += 1
            return self._fail(s, out, f"its KV lease expired after {self.kv_config.lease_s:g} s: the staging "
                                      f"buffer had no room (kv_transfer_config.buffer_mib)")
        if s.stage is None and self.in_place:
            s.stage = self.kv.open(r.num_prompt_tokens, staged=False)
            if s.stage is not None:
                self._offer_in_place(s, out)
            return
        if s.stage is None:
            s.stage, s.stage_s = self.kv.open(r.num_prompt_tokens), clock()
            if s.stage is not None:
                self.side.copy_out(r.request_id, s.stage)
            return
        state = self.copier.status(s.stage, WRITE, s.lease.group)
        if state not in (DONE, FAILED) and clock() - s.stage_s > self.kv_config.lease_s:
            # NOTE: its members never answered (a member stalled): the stage drains (``_drop``) and
            # the blocks are freed; a member's late copy out still comes before any later work on them
            self.kv.stats.lease_expiries += 1
            return self._fail(s, out, f"its KV copy out took more than {self.kv_config.lease_s:g} s")
        if state == FAILED:
            self.kv.stats.failures += 1
            self.kv.close(s.stage)
            s.stage = None
            if self.kv_config.failure_policy == "fail":
                return self._fail(s, out, "its KV copy out of the prefill instance failed")
            self.kv.stats.recomputes += 1
            return self._hand_over(s, out)  # the decode server computes the prompt itself
        if state == DONE:
            st, nbytes = s.stage, self.kv.bytes_for(s.stage.num_tokens)
            token = new_token()
            self.offers.offer(st.transfer_id, st.slot, st.offset_bytes, nbytes, token)
            self.offered[st.transfer_id] = st
            self._hand_over(s, out, token)
            self.kv.stats.transfers += 1
            self.kv.stats.bytes_total += nbytes
            self.kv.stats.seconds.append(clock() - s.since_s)
            out.kv_transfers.append(KvTransfer(clock() - s.since_s, nbytes, "stage"))

    def _offer_in_place(self, s: Staging, out: StepResult) -> None:
        """The leased blocks offered as they are: the table of our caches published (decode servers
        on this host read it), a pull's gather ready (for one elsewhere); the blocks stay leased until
        the offer ends (``_reap``)."""
        r, st, lease = s.request, s.stage, s.lease
        n, nbytes, token = r.num_prompt_tokens, self.kv.bytes_for(r.num_prompt_tokens), new_token()
        regions = self.port.regions(lease.group)
        self.region_table.publish({g: self.port.regions(g) for g in range(len(self.port.pool.groups))})
        self.offers.offer(st.transfer_id, st.slot, st.offset_bytes, nbytes, token,
                          gather=functools.partial(self.gatherer.gather, regions, lease.blocks, n, nbytes))
        self.offered[st.transfer_id] = st
        self.leased[st.transfer_id] = r.request_id
        self._hand_over(s, out, token, in_place=True)
        self.kv.stats.transfers += 1
        self.kv.stats.bytes_total += nbytes
        self.kv.stats.seconds.append(clock() - s.since_s)
        out.kv_transfers.append(KvTransfer(clock() - s.since_s, nbytes, "in-place"))  # offered, nothing copied

    def _hand_over(self, s: Staging, out: StepResult, token: int | None = None, in_place: bool = False) -> None:
        """The request finishes here with its handle: the staged range under ``token`` (the blocks
        are free now), its blocks in place (freed when the offer ends), or none (None) when its
        copy failed."""
        r, st, staged = s.request, s.stage, token is not None
        del self.staging[r.request_id]
        if not in_place:
            self.side.copied(r.request_id)  # copied or not, the blocks go back
        first_lp, plp = self._logprobs.pop(r.request_id, (None, []))
        where = (st.arena, st.slot, st.transfer_id, st.offset_bytes, self.kv.bytes_for(st.num_tokens)) if staged \
            else ("", 0, 0, 0, 0)
        r.kv_handle = KvHandle(self.server_id, self.server.host, self.server.port, self.host_id, *where,
                               r.num_prompt_tokens, self.kv_layout, r.output_token_ids[0],
                               first_lp if r.params.logprobs is not None else None,
                               tuple(plp) if r.params.prompt_logprobs is not None else (), staged,
                               token or 0, self.weights, s.lease.blocks if in_place else (),
                               s.lease.group if in_place else 0)
        out.finished.append(r)

    def _fail(self, s: Staging, out: StepResult, why: str) -> None:
        del self.staging[s.request.request_id]
        self._drop(s)
        r = s.request
        r.finish_reason, r.error = "error", f"request {r.request_id}: {why}"
        out.finished.append(r)

    def _drop(self, s: Staging) -> None:
        self._logprobs.pop(s.request.request_id, None)
        self.side.drop(s.request.request_id, s.stage, answered=False)

    def load(self):
        x = self.inner.load()
        st = self.kv.stats
        return dataclasses.replace(x, running_per_role=(("prefill", x.num_running + len(self.staging)),),
                                   num_handoffs=len(self.staging) + len(self.offers),
                                   handoff_counts=(("failures", st.failures), ("recomputes", st.recomputes),
                                                   ("lease_expiries", st.lease_expiries + self.offers.expired)))

    def shutdown(self) -> None:
        self.server.shutdown()
        if self.in_place:
            self.gatherer.close()
            self.region_table.close()
        super().shutdown()
