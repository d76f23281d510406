"""Decode steps replayed from CUDA graphs: what vLLM and SGLang do so that a decode step is a few
launches instead of thousands, each one waiting on the host.

A graph holds the kernels of one forward over fixed tensors, so a step's inputs are copied into
static buffers and its batch is padded up to a captured size: batch buckets (1, 2, 4, 8, 16, ...,
``max_batch``) times block-table widths (powers of two up to ``max_model_len``: the batched decode
attention gathers a table's whole width, so one width for every context would gather the longest
context for every request). A bucket is captured the first time a batch needs it, once per
deployment, into one memory pool. Padding rows repeat the batch's first request (its token,
position, slot and table): they compute what it computes and write the same KV to the same slot,
so no cache slot has to be set aside for them, and their outputs are dropped.

Only pure decode batches take this path (one new token over cached context per request); a batch
with a prompt or a chunk runs eagerly. Sampling stays outside (its one read-back ends the step).
``capture=False`` runs the same static buffers, padding and buckets eagerly: the CPU rehearsal of
the logic (a CPU has no graphs), and the oracle a GPU test compares the replay with.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from moeflow.errors import ConfigError
from moeflow.logs import get_logger
from moeflow.model.kv_cache import AttentionMetadata, KVCache
from moeflow.model.moe import grouped_on_device
from moeflow.model.paged_attention import DecodeBatch
from moeflow.settings import decode_graphs_mode

log = get_logger("moeflow.model.decode_graphs")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class GraphUnavailable(ConfigError):
    """CUDA graphs cannot run here (not a CUDA device, or an attention kind that decodes request by
    request), or a bucket's capture failed (an op of the forward reads back to the host)."""


def for_engine(cuda_graph: bool | None, model, kv_cache: KVCache, max_batch: int,
               max_model_len: int) -> DecodeGraphs | None:
    """An engine's graphs (``EngineConfig.cuda_graph``): None (auto) captures on CUDA where the
    attention kind allows and runs eagerly elsewhere; True requires them (refused, with the reason,
    where they cannot run); False never. ``$MOEFLOW_DECODE_GRAPHS=eager``: the static-buffer path
    without capture, on any device (the rehearsal)."""
    if cuda_graph is False:
        return None
    rehearse = decode_graphs_mode() == "eager"
    device = kv_cache.device
    if device.type != "cuda":
        if cuda_graph:
            raise GraphUnavailable(f"CUDA graphs need a CUDA device; this engine runs on {device.type} "
                                   f"(leave --cuda-graph unset there, or give --enforce-eager)")
        if not rehearse:
            return None
    try:
        graphs = DecodeGraphs(model, kv_cache, max_batch, max_model_len, capture=device.type == "cuda" and not rehearse)
    except GraphUnavailable as e:
        if cuda_graph:
            raise
        log.info("decode runs eagerly: %s", e)
        return None
    log.info("decode %s: batches padded to %s, tables to %s blocks", "from CUDA graphs" if graphs.capture
             else "through the graphs' static buffers, eagerly", graphs.batch_sizes, graphs.widths)
    return graphs


def buckets(limit: int) -> tuple[int, ...]:
    """The captured sizes up to ``limit``, ``limit`` itself the last."""
    return tuple(b for b in BATCH_BUCKETS if b < limit) + (limit,)


def bucket_of(n: int, sizes: Sequence[int]) -> int:
    return next(b for b in sizes if b >= n)


class DecodeGraphs:
    def __init__(self, model, kv_cache: KVCache, max_batch: int, max_model_len: int, capture: bool):
        """``model``: an ``MoETransformer`` (its ``forward(tokens, meta, cache)``); ``max_batch``: the
        most requests of one step; ``capture``: record CUDA graphs (True) or run the buffers eagerly."""
        device = kv_cache.device
        if capture and device.type != "cuda":
            raise GraphUnavailable(f"CUDA graphs need a CUDA device; this engine runs on {device.type}")
        if not getattr(model.attn_kind, "decode_in_place", True):
            raise GraphUnavailable(f"{type(model.attn_kind).__name__} decodes request by request (its selection "
                                   f"reads each request's length on the host): nothing to capture")
        experts = model.w.experts
        if capture and experts is not None and not grouped_on_device(experts):
            raise GraphUnavailable(f"the experts run one matmul per expert in {experts.w13.dtype} here "
                                   f"(F.grouped_mm needs bfloat16 on compute capability 9.0 or newer): each reads "
                                   f"its row count back to the host, which a graph cannot hold")
        self.model, self.kv_cache, self.capture = model, kv_cache, capture
        bs = kv_cache.block_size
        self.max_model_len, self.block_size = max_model_len, bs
        self.batch_sizes = buckets(max_batch)
        most = -(-max_model_len // bs)
        self.widths = tuple(w for w in (1 << k for k in range(most.bit_length() + 1)) if w < most) + (most,)
        b, w = self.batch_sizes[-1], self.widths[-1]
        self.tokens = torch.zeros(b, dtype=torch.int64, device=device)  # [Bmax]
        self.positions = torch.zeros(b, dtype=torch.int64, device=device)  # [Bmax]
        self.slots = torch.zeros(b, dtype=torch.int64, device=device)  # [Bmax]
        self.tables = torch.zeros(b, w, dtype=torch.int32, device=device)  # [Bmax, Wmax]
        self.lens = torch.ones(b, dtype=torch.int32, device=device)  # [Bmax]
        self.rows = torch.arange(b, dtype=torch.int64, device=device)  # [Bmax]
        self._graphs: dict[tuple[int, int], tuple[object, torch.Tensor]] = {}  # (B, W) -> (graph, hidden out)
        self._pool = None
        self.replays = 0  # steps served from a graph (or, capture=False, from the static buffers)

    @staticmethod
    def takes(query_lens: Sequence[int], context_lens: Sequence[int]) -> bool:
        """Whether a batch is pure decode (every request one new token over a cached context)."""
        return bool(query_lens) and all(DecodeBatch.takes(q, c) for q, c in zip(query_lens, context_lens))

    def fits(self, num_seqs: int, longest_table: int) -> bool:
        return num_seqs <= self.batch_sizes[-1] and longest_table <= self.widths[-1]

    def run(self, tokens: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """Hidden states [n, H] of n decode requests: request i's new token ``tokens[i]`` at position
        ``positions[i]`` (its cached context), its KV blocks ``tables[i]``."""
        n, bs = len(tokens), self.block_size
        b = bucket_of(n, self.batch_sizes)
        w = bucket_of(max(len(t) for t in tables), self.widths)
        pad = b - n
        pos = list(positions) + [positions[0]] * pad
        rows = [list(t) + [0] * (w - len(t)) for t in tables]
        rows += [rows[0]] * pad
        slots = [r[p // bs] * bs + p % bs for r, p in zip(rows, pos)]
        # NOTE: one host tensor per buffer, copied in; the graph reads the static views
        host = torch.tensor([list(tokens) + [tokens[0]] * pad, pos, slots], dtype=torch.int64, device="cpu")  # [3, b]
        dev = self.tokens.device
        self.tokens[:b].copy_(host[0], non_blocking=True)
        self.positions[:b].copy_(host[1], non_blocking=True)
        self.slots[:b].copy_(host[2], non_blocking=True)
        self.lens[:b].copy_(host[1].to(torch.int32) + 1, non_blocking=True)
        self.tables[:b, :w].copy_(torch.tensor(rows, dtype=torch.int32, device="cpu"), non_blocking=dev.type == "cuda")
        self.replays += 1
        if not self.capture:
            return self._forward(b, w)[:n]
        key = (b, w)
        if key not in self._graphs:
            try:
                self._graphs[key] = self._record(b, w)
            except RuntimeError as e:  # NOTE: e.g. an op that syncs: capture forbids it
                raise GraphUnavailable(f"capturing decode of batch {b}, tables of {w} blocks failed: "
                                       f"{type(e).__name__}: {e}") from e
        graph, out = self._graphs[key]
        graph.replay()
        return out[:n]

    def _meta(self, b: int, w: int) -> AttentionMetadata:
        """The static buffers' first b rows as a batch of b decode requests over tables w blocks wide."""
        meta = AttentionMetadata(self.positions[:b], [1] * b, [1] * b, self.slots[:b], [], self.block_size,
                                 self.tokens.device, self.max_model_len)
        meta.decode = DecodeBatch(self.rows[:b], self.tables[:b, :w], self.lens[:b], self.block_size)
        return meta

    def _forward(self, b: int, w: int) -> torch.Tensor:
        return self.model.forward(self.tokens[:b], self._meta(b, w), self.kv_cache)  # [b, H]

    def _record(self, b: int, w: int):
        """Warm the bucket up on a side stream (lazy tables, kernels' first-call work), then capture it."""
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self._forward(b, w)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(b, w)
        self._pool = graph.pool()
        return graph, out

    @property
    def captured(self) -> list[tuple[int, int]]:
        """The (batch, width) buckets recorded so far."""
        return sorted(self._graphs)
