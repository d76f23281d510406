"""Control-plane messages between the engine and its worker processes (one dataclass per kind).

Tensors never travel here: hidden states go through ``moeflow.comm``. These are small and pickled
over pipes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from typing import TYPE_CHECKING, Any

from moeflow.config import EngineConfig
from moeflow.core import Batch, SamplingParams
from moeflow.layout import Layout

if TYPE_CHECKING:  # comm imports torch; messages stay importable without it
    from moeflow.comm import CommConfig
    from moeflow.membership_messages import JoinExperts

# token id -> (logprob, rank)
RawLogprobs = dict[int, tuple[float, int]]


@dataclass
class SeqOutput:
    """What one step produced for one request."""

    token_id: int | None = None  # sampled token (only when the batch reached the end of its tokens)
    logprobs: RawLogprobs | None = None
    prompt_logprobs: list[RawLogprobs] = field(default_factory=list)  # positions start+1 .. of this chunk
    timing: "BatchTiming | None" = None  # the engine attaches its batch's timing
    handoff_s: float | None = None  # pd: on a request's first decode-side output, its KV handoff's seconds

    def followed_by(self, later: "SeqOutput") -> "SeqOutput":
        """One request's output over two consecutive chunks of one work item (the halves of a lone
        batch the asap scheduler cut in two, ``scheduler/asap.py``): ``later``'s token, both chunks'
        prompt logprobs in position order, one timing spanning both."""
        a, z = self.timing, later.timing
        timing = None if a is None or z is None else BatchTiming(
            z.batch_id, min(a.start_s, z.start_s), max(a.end_s, z.end_s), a.compute_s + z.compute_s, a.wait_s + z.wait_s)
        return SeqOutput(later.token_id, later.logprobs, self.prompt_logprobs + later.prompt_logprobs, timing)


@dataclass
class NewRequest:
    """A request joining an attention group: its prompt and how to sample it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()  # kept out of the output before params.min_tokens
    # tokens already generated elsewhere (a decode instance's request: the prefill side's first token)
    generated: tuple[int, ...] = ()


@dataclass(frozen=True)
class KvRegion:
    """One KV-holding member's whole cache, in memory other processes map by ``handle``
    (``comm/ipc_memory.py``: a /dev/shm file on a host, CUDA IPC on a device), carved as
    ``model.kv_cache.carve`` lays it out. A worker reports it at start when its engine hands KV over."""

    handle: bytes
    num_layers: int
    num_slots: int
    block_size: int
    dtype: str  # torch dtype name without "torch."
    entries: tuple[tuple[str, tuple[int, ...]], ...]  # this member's own per-token shapes (its heads)
    member: int  # its TP member index (which heads of a split entry it holds)


@dataclass(frozen=True)
class KvSource:
    """Where a stage's KV is when it was not staged: in the prefill group's own caches (``regions``,
    one per member), at ``blocks``; the decode members copy it from there, the one copy on a host."""

    regions: tuple[KvRegion, ...]
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class KvStage:
    """Where one request's prompt KV is staged for a handoff: ``num_tokens`` positions of every
    layer and entry, whole (unsplit) heads, at ``offset_bytes`` of the staging arena."""

    arena: str  # the arena's shared-memory path (comm/kv_arena.py)
    slot: int  # its row of the arena's flag table
    transfer_id: int  # > 0; what a member stores in its flag when done (minus it: failed)
    offset_bytes: int  # -1: none (a row of flags for KV read in place)
    num_tokens: int
    num_layers: int
    dtype: str  # torch dtype name without "torch."
    entries: tuple[tuple[str, tuple[int, ...]], ...]  # KV layout: name -> whole per-token shape
    fail: bool = False  # injected failure (MOEFLOW_PD_FAIL_PROB): the member reports failure, copies nothing
    # None: the KV is in the arena's heap at ``offset_bytes`` (staged); else where it is in place
    source: KvSource | None = None


@dataclass(frozen=True)
class KvSend:
    """Engine -> every KV-holding member of a prefill group: copy this request's blocks into the stage."""

    stage: KvStage
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class KvRecv:
    """Engine -> every KV-holding member of a decode group, before any work item that names the
    request: copy the stage into these (pre-allocated) blocks: its arena range, or, with a
    ``source``, straight out of the prefill members' caches."""

    stage: KvStage
    block_ids: tuple[int, ...]


@dataclass
class RunWork:
    """Engine -> every member of one attention group: run these batches (2 = interleaved)."""

    work_id: int
    batches: tuple[Batch, ...]
    new_requests: list[NewRequest]  # requests first seen by this group in this work item
    freed: list[str]  # finished or aborted requests whose state the group can drop


@dataclass
class BatchTiming:
    """Where one batch's wall time went on its attention group (seconds)."""

    batch_id: int
    start_s: float  # shared monotonic clock (CLOCK_MONOTONIC is system-wide on Linux)
    end_s: float
    compute_s: float  # attention, MoE gate, combine and sampling of this batch
    wait_s: float  # blocked in combine-recv for this batch's experts (other stages)


@dataclass
class WorkDone:
    """Group leader -> engine: the results of one work item."""

    group: int
    work_id: int
    outputs: dict[int, dict[str, SeqOutput]]  # batch id -> request id -> output
    timings: list[BatchTiming]
    errors: dict[int, str] = field(default_factory=dict)  # batch id -> why it failed (no outputs then)
    expert_load: Any = None  # numpy [Lm, E] int32: tokens per (MoE layer, expert) its batches routed; None: none


@dataclass
class MoveExperts:
    """Engine -> every expert-holding worker: fill the slots of placement ``epoch`` (its buffer
    ``epoch % 2``) with ``layers`` (``ExpertMap.layers`` of the whole deployment), pulling from the
    live buffers of placement ``epoch - 1``, while serving goes on."""

    epoch: int
    layers: tuple  # [moe layer][expert device] -> logical expert of each slot


@dataclass
class ExpertsMoved:
    """Expert-holding worker -> engine: the slots of placement ``epoch`` hold their experts."""

    role: str
    index: int
    epoch: int
    seconds: float  # the move's wall time on this worker
    nbytes: int  # weight bytes copied (from peers and locally)
    peer_bytes: int = 0  # of which read from peers (over gloo when they are on other hosts)


@dataclass
class UseExperts:
    """Engine -> every attention-side process: route by placement ``epoch`` from the next work item
    on (its dispatches carry the epoch, so an expert worker computes them with that buffer)."""

    epoch: int
    layers: tuple


@dataclass
class WorkerReady:
    role: str  # a key of workers.roles.ROLES
    index: int
    pid: int
    memory: dict = field(default_factory=dict)  # bytes the worker holds, by kind (KV cache, experts, buffers)
    kv_region: KvRegion | None = None  # its KV cache, shared for the handoff (None: private, or none)


@dataclass
class WorkerFailed:
    role: str
    index: int
    error: str  # the traceback, for the engine's error message


@dataclass
class Span:
    """One interval of a worker's timeline, for the Chrome/Perfetto trace."""

    name: str  # attention, router, dispatch, wait-combine, experts, combine, idle, ...
    track: str  # "<role><index>/<thread>"
    start_s: float
    end_s: float
    args: dict = field(default_factory=dict)


@dataclass
class DumpSpans:
    """Engine -> worker: send your spans recorded so far (and forget them)."""


@dataclass
class Spans:
    role: str
    index: int
    spans: list[Span]


@dataclass
class Shutdown:
    """Engine -> worker: exit after releasing what you own."""


@dataclass(frozen=True)
class World:
    """The torch.distributed world of a deployment, when something needs one (tensor-parallel
    attention, a torch.distributed transport); the engine computes it from the layout."""

    size: int
    port: int  # TCP port of the rendezvous on ``addr``
    tp_groups: tuple[tuple[int, ...], ...] = ()  # global ranks of each tensor-parallel group, in order
    addr: str = "127.0.0.1"  # the rendezvous's host: node 0's address when the world spans hosts
    # None: the first rank hosts its own rendezvous (one host); else the keys' prefix in the
    # cluster's store, which node 0's engine hosts on addr:port (several hosts)
    store_prefix: str | None = None


@dataclass(frozen=True)
class WorkerSetup:
    """Everything a worker process needs to start (pickled once at spawn)."""

    role: str  # a key of workers.roles.ROLES: "attention" | "moe" | "dep"
    index: int  # attention: global attention rank g*T + m; moe: worker index; dep: rank
    model_path: str
    engine: EngineConfig  # dtype, limits, threads, trace, ...
    layout: Layout  # the deployment's shape (asap: D, T, E; dep: N)
    comm: CommConfig  # dispatch/combine buffers and transport
    experts_held: tuple[tuple[int, ...], ...]  # experts held by each expert-side worker (MoE worker, FFN daemon, rank)
    world: World | None = None  # None: this deployment has no torch.distributed world
    world_rank: int = 0  # this process's rank in ``world``
    device: str = "cpu"  # where this process computes: set by the process itself from engine.device and its rank
    cpu: int | None = None  # pin the process to this CPU
    node: int = 0  # the host that runs it (ClusterConfig.node_rank); 0: the engine's
    # the starting placement where it differs by layer (``ExpertMap.layers``: [moe layer][device] ->
    # experts; --init-expert-location); None: ``experts_held`` in every MoE layer
    expert_layers: tuple | None = None
    join: JoinExperts | None = None  # it joins while the deployment serves (an elastic expert holder)

    def held_by(self, device: int) -> tuple:
        """What expert device ``device`` loads: its experts, per MoE layer where they differ by layer."""
        return self.experts_held[device] if self.expert_layers is None else tuple(l[device] for l in self.expert_layers)

    def placement(self, moe_index: int) -> tuple[tuple[int, ...], ...]:
        """Every expert device's experts in the ``moe_index``-th MoE layer, before any rebalance."""
        return self.experts_held if self.expert_layers is None else self.expert_layers[moe_index]


@dataclass
class StartWorkers:
    """Engine -> a worker node, over the rendezvous: start these workers of deployment ``deployment_id``
    (again for the running one: workers that join it while it serves, numbered after the others)."""

    deployment_id: str
    setups: list[WorkerSetup]  # in the order the engine numbers them on this node


@dataclass
class StopWorkers:
    """Engine -> a worker node: the deployment is over; shut its workers down (kill what lingers)."""

    kill: bool = False  # True: at once (the engine gave up on them), False: after a Shutdown grace


@dataclass
class KillWorker:
    """Engine -> a worker node, for one of its workers: kill it now (it did not stop when asked)."""


@dataclass
class WorkerExited:
    """Worker node -> engine: one of its workers is gone (a death the engine cannot see itself)."""

    exitcode: int | None
