"""The attention side's model stages for one batch in flight: embed, attention + MoE gate +
dispatch-send, combine-recv + weighted sum, sample. How a worker walks the layers with them is a
``LayerSchedule`` (``workers/schedule.py``); these stages do not know which.

Legend: n tokens of a batch, s = this TP member's share of them, K experts per token, H hidden.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from moeflow.core import Batch
from moeflow.messages import SeqOutput, WorkerSetup
from moeflow.model.kv_cache import AttentionMetadata, KVCache
from moeflow.model.sharding import shard_attention
from moeflow.model.transformer import AttentionOut, MoETransformer
from moeflow.model.weights import TORCH_DTYPES, LoadSpec, load_weights
from moeflow.workers.dispatch import ExpertRoutes, LayeredRoutes, WorkerShare, tag_layer
from moeflow.workers.expert_load import ExpertLoadRecorder
from moeflow.workers.kv_transfer import own_cache_path, shared_cache
from moeflow.workers.runner import ModelRunner
from moeflow.workers.tracer import Tracer
from moeflow.workers.world import TPGroup

logger = logging.getLogger("moeflow.worker")


def _nbytes(obj) -> int:
    """Bytes of every distinct tensor reachable through dataclasses, dicts and lists."""
    seen, total, todo = set(), 0, [obj]
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            if x.data_ptr() not in seen:
                seen.add(x.data_ptr())
                total += x.nbytes
        elif isinstance(x, dict):
            todo += list(x.values())
        elif isinstance(x, (list, tuple)):
            todo += list(x)
        elif hasattr(x, "__dataclass_fields__"):
            todo += [getattr(x, f) for f in x.__dataclass_fields__]
    return total


@dataclass
class InFlight:
    """One batch moving through the layers."""

    batch: Batch
    meta: AttentionMetadata
    hidden: torch.Tensor  # [n, H] input of the current layer
    lo: int  # this member's share: rows [lo, hi)
    hi: int
    attn: AttentionOut | None = None
    topk_w: torch.Tensor | None = None  # [s, K] of the share
    shares: list[WorkerShare] = field(default_factory=list)
    workers: list[int] = field(default_factory=list)
    start_s: float = 0.0
    compute_s: float = 0.0
    wait_s: float = 0.0
    # why this batch failed (its first exception); a failed batch still walks every layer on zeros,
    # sending and receiving what its peers expect, so that only its own requests fail
    error: str | None = None


def guarded(f: InFlight, what: str, compute, fallback):
    """``compute()``, unless the batch already failed or this raises: then ``fallback()`` (zeros of
    the right shape) and the batch is marked failed. Failure isolation: the batch keeps its place
    in the protocol (peers wait for its dispatches and combines), only its requests fail."""
    if f.error is None:
        try:
            return compute()
        except Exception as e:  # noqa: BLE001  (any error of one batch's compute is that batch's)
            f.error = f"{what} failed: {type(e).__name__}: {e}"
            logger.warning("batch %d: %s", f.batch.batch_id, f.error)
    return fallback()


class AttentionStages:
    """One attention-side process's model, KV cache, request state and dispatch/combine endpoints.

    ``group``/``member``: this process's DP group and TP member (a dep rank is group r, member 0).
    ``send_to``: the expert-side workers this process dispatches to at every MoE layer, rows or
    not (dep: all of them, the synchronous baseline's collective; afd: its FFN daemons); None: only
    those holding the batch's experts (asap).
    """

    def __init__(self, setup: WorkerSetup, transport, tp: TPGroup | None, group: int, member: int, tp_size: int,
                 load_spec: LoadSpec, send_to: tuple[int, ...] | None = None, dispatch: bool = True):
        """``dispatch``: build dispatch/combine endpoints (False: this process runs its experts itself)."""
        self.setup, self.tp, self.group, self.member, self.tp_size = setup, tp, group, member, tp_size
        dtype = TORCH_DTYPES[setup.engine.dtype]
        self.device = torch.device(setup.device)
        cfg, weights = load_weights(setup.model_path, dtype, load_spec, self.device, setup.engine.router_skew)
        self.cfg, self.weights = cfg, weights
        mcfg, mweights = shard_attention(cfg, weights, member, tp_size)
        self.model = MoETransformer(mcfg, mweights, attn_reduce=tp.all_reduce if tp else None)
        e = setup.engine
        self.kv_region = self._kv_memory = None  # the cache shared for the KV handoff (share_kv_cache)
        if e.share_kv_cache:
            kv, self.kv_region, self._kv_memory = shared_cache(
                mcfg, e.num_kv_blocks, e.kv_block_size, dtype, self.device,
                own_cache_path(setup.comm.deployment_id, f"kv-cache-{setup.role}{setup.index}"), member)
        else:
            kv = KVCache.for_model(mcfg, e.num_kv_blocks, e.kv_block_size, dtype, self.device)
        self.runner = ModelRunner(self.model, kv, seed=e.seed)
        self.tracer = Tracer(setup.role, setup.index, setup.engine.trace)
        # the group's leader counts what its batches route (every member routes the same)
        self.expert_load = (ExpertLoadRecorder(cfg.sparse_layers, cfg.num_experts, self.device)
                            if cfg.num_moe_layers and member == 0 else None)
        self.receiver = self.sender = None
        self.expert_devices = len(setup.experts_held)  # the expert holders routed to now
        if dispatch:
            self.routes = (ExpertRoutes(setup.experts_held, cfg.num_experts, group, self.device)
                           if cfg.num_moe_layers else None)
            self.layered: LayeredRoutes | None = None  # after a rebalance: per-layer routes
            self.expert_epoch = 0  # the placement this process routes by (a dispatch carries its parity)
            if setup.expert_layers is not None and cfg.num_moe_layers:  # a starting placement by layer
                self.use_experts(0, setup.expert_layers)
            self.epw = setup.comm.spec.experts_per_rank
            self.send_to = None if send_to is None else list(send_to)
            # NOTE: receivers own their buffers; build ours before attaching to the expert side's.
            # Our group is a region of every expert-side buffer, our member a lane of it.
            self.receiver = transport.combine_receiver(region=group, lane=member)
            self.sender = transport.dispatch_sender(region=group, lane=member)

    def use_experts(self, epoch: int, layers: tuple) -> None:
        """Route by placement ``epoch`` (``ExpertMap.layers``) from the next batch on; an expert holder
        that left is let go (the switch comes between work items), one that joined is attached lazily."""
        moe = [lid for lid in range(self.cfg.num_layers) if self.cfg.sparse_layers[lid]]
        self.layered = LayeredRoutes(layers, moe, self.cfg.num_experts, self.group, self.device)
        self.expert_epoch = epoch
        n, before = len(layers[0]), self.expert_devices
        if self.sender is not None:  # None: the starting placement, set while building
            for j in range(n, before):
                self.sender.detach(j)
                self.receiver.forget(j)
        self.expert_devices = n

    def routes_for(self, layer: int) -> ExpertRoutes:
        return self.routes if self.layered is None else self.layered.for_layer(layer)

    def memory(self) -> dict[str, int]:
        """Bytes this process holds, by kind (workers report them at start)."""
        w = self.weights
        experts = 0 if w.experts is None else w.experts.w13.nbytes + w.experts.w2.nbytes
        return {"kv_cache": self.runner.kv_cache.nbytes, "routed_experts": experts,
                "other_weights": _nbytes(w) - experts}

    def close_sender(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None

    def close(self) -> None:
        self.close_sender()
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        if self._kv_memory is not None:
            self._kv_memory.close()
            self._kv_memory = None

    def begin(self, batches: tuple[Batch, ...], t0: float) -> list[InFlight]:
        flights = []
        for b in batches:
            tokens, meta = self.runner.prepare(b)
            n, t = tokens.shape[0], self.tp_size
            f = InFlight(b, meta, None, self.member * n // t, (self.member + 1) * n // t, start_s=t0)
            f.hidden = guarded(f, "embedding", lambda: self.model.embed(tokens), lambda: self.zeros(n))
            flights.append(f)
        return flights

    def zeros(self, n: int) -> torch.Tensor:
        """[n, H] of zeros: what a failed batch's stages hand on, so its peers are never left waiting."""
        return torch.zeros(n, self.cfg.hidden_size, dtype=TORCH_DTYPES[self.setup.engine.dtype], device=self.device)

    def route(self, layer: int, f: InFlight, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MoE gate's top-k ids and weights [n, K]; a failed batch sends every pair to expert 0."""
        k = self.cfg.num_experts_per_tok
        ids, wts = guarded(f, f"MoE gate of layer {layer}", lambda: self.model.route(layer, x),
                           lambda: (torch.zeros(x.shape[0], k, dtype=torch.int64, device=x.device),
                                    torch.zeros(x.shape[0], k, device=x.device)))
        if self.expert_load is not None and f.error is None:
            self.expert_load.add(layer, ids)
        return ids, wts

    between_layers = None  # the worker's: called before each layer's attention (takes KV copies early)

    def attend(self, layer: int, f: InFlight) -> bool:
        """The layer's attention, and its dense MLP where it has no routed experts (then the layer is
        done); guarded and timed. True: the experts come next, on ``f.attn.moe_input``."""
        if self.between_layers is not None:
            self.between_layers()
        c0 = time.monotonic()
        m = self.model
        n = f.hidden.shape[0]
        f.attn = guarded(f, f"attention of layer {layer}",
                         lambda: m.attention(layer, f.hidden, f.meta, self.runner.kv_cache),
                         lambda: AttentionOut(self.zeros(n), self.zeros(n)))
        c1 = time.monotonic()
        self.tracer.add("attention", c0, c1, layer=layer, batch=f.batch.batch_id)
        if not self.cfg.sparse_layers[layer]:
            f.hidden = guarded(f, f"dense MLP of layer {layer}", lambda: m.dense_mlp(layer, f.attn),
                               lambda: self.zeros(n))
            f.compute_s += time.monotonic() - c0
            return False
        f.compute_s += c1 - c0
        return True

    def attention_and_dispatch(self, layer: int, f: InFlight) -> None:
        if not self.attend(layer, f):
            return
        c1 = time.monotonic()
        c2 = self._dispatch(layer, f)
        c3 = time.monotonic()
        self.tracer.add("router", c1, c2, layer=layer, batch=f.batch.batch_id)
        self.tracer.add("dispatch", c2, c3, layer=layer, batch=f.batch.batch_id, workers=len(f.workers))
        f.compute_s += c3 - c1

    def _dispatch(self, layer: int, f: InFlight) -> float:
        """Route the batch and send this member's pairs; returns when routing ended (the rest is sending)."""
        ids, wts = self.route(layer, f, f.attn.moe_input)  # [n, K] each, identical on every TP member
        # the whole batch's set: every member sends to it
        # replicas chosen over the whole batch, and the workers it activates: every member sends to them
        f.workers, f.shares = self.routes_for(layer).route(ids, (f.lo, f.hi), self.send_to)
        ids, f.topk_w = ids[f.lo:f.hi], wts[f.lo:f.hi]
        x = f.attn.moe_input[f.lo:f.hi]  # [s, H]
        c2 = time.monotonic()
        k = ids.shape[1]
        for sh in f.shares:
            tpe = sh.counts + [0] * (self.epw - len(sh.counts))
            word = tag_layer(layer, self.expert_epoch)
            self.sender.send(sh.worker, x[sh.pair_index // k], word, f.batch.batch_id, tpe)
        return c2

    def _receive(self, f: InFlight) -> dict[int, torch.Tensor]:
        """Each expert-side worker's results for this batch [m, H], valid until the next receive."""
        msg = self.receiver.recv(f.workers)
        return {w: msg.segments[w].payload for w in f.workers}

    def _routed(self, f: InFlight, payloads: dict[int, torch.Tensor]) -> torch.Tensor:
        """This member's routed-expert output [s, H] from the expert side's results."""
        k = f.topk_w.shape[1]
        flat_w = f.topk_w.reshape(-1)
        routed = torch.zeros(f.hi - f.lo, self.cfg.hidden_size, dtype=f.hidden.dtype, device=f.hidden.device)  # [s, H]
        for sh in f.shares:
            y = payloads[sh.worker]  # [m, H], valid until the next recv: used at once
            routed.index_add_(0, sh.pair_index // k, y * flat_w[sh.pair_index].to(y.dtype).unsqueeze(1))
        return routed

    def combine(self, layer: int, f: InFlight) -> None:
        if not self.cfg.sparse_layers[layer]:
            return
        w0 = time.monotonic()
        payloads = self._receive(f)
        c0 = time.monotonic()
        self.tracer.add("wait-combine", w0, c0, layer=layer, batch=f.batch.batch_id)
        a = f.attn
        share = guarded(f, f"combine of layer {layer}", lambda: self.model.combine(
            layer, AttentionOut(a.residual[f.lo:f.hi], a.moe_input[f.lo:f.hi]), self._routed(f, payloads)),
            lambda: self.zeros(f.hi - f.lo))
        if self.tp is not None:
            n, t = f.hidden.shape[0], self.tp.size
            share = self.tp.all_gather_rows(share, [(i + 1) * n // t - i * n // t for i in range(t)])
        f.hidden = share
        c1 = time.monotonic()
        self.tracer.add("combine", c0, c1, layer=layer, batch=f.batch.batch_id)
        f.wait_s += c0 - w0
        f.compute_s += c1 - c0

    def sample(self, f: InFlight) -> dict[str, SeqOutput]:
        """The batch's outputs; none for a failed batch (its requests end with ``f.error``)."""
        def run():
            return self.runner.sample(f.batch, f.hidden)

        def skip():
            # NOTE: a placeholder token keeps the failed requests' positions where the scheduler
            # put them: a work item already sent (afd's next step) may hold them; the engine
            # drops what comes back for them
            rs = self.runner.requests
            self.runner.append_tokens({s.request_id: 0 for s in f.batch.seqs if s.is_last_chunk
                                       and len(rs[s.request_id].token_ids) == s.start + s.num_tokens})
            return {}
        if self.tp is None:
            return guarded(f, "sampling", run, skip)
        # NOTE: member 0 samples and broadcasts, so seeded and unseeded sampling stay identical
        # across members without relying on bitwise-equal logits.
        last = [s for s in f.batch.seqs if s.is_last_chunk]
        out = guarded(f, "sampling", run, skip) if self.member == 0 else {}
        tokens = torch.tensor([out[s.request_id].token_id if out else 0 for s in last], dtype=torch.int64,
                              device="cpu")  # the TP group is gloo: a host tensor
        self.tp.broadcast(tokens)
        if self.member != 0:
            self.runner.append_tokens({s.request_id: int(t) for s, t in zip(last, tokens)})
        return out
