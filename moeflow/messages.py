"""Control-plane messages between the engine and its worker processes (one dataclass per kind).

Tensors never travel here: hidden states go through ``moeflow.comm``. These are small and pickled
over pipes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moeflow.core import Batch, SamplingParams

# token id -> (logprob, rank)
RawLogprobs = dict[int, tuple[float, int]]


@dataclass
class SeqOutput:
    """What one step produced for one request."""

    token_id: int | None = None  # sampled token (only when the batch reached the end of its tokens)
    logprobs: RawLogprobs | None = None
    prompt_logprobs: list[RawLogprobs] = field(default_factory=list)  # positions start+1 .. of this chunk
    timing: "BatchTiming | None" = None  # the engine attaches its batch's timing


@dataclass
class NewRequest:
    """A request joining an attention group: its prompt and how to sample it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


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
    compute_s: float  # attention, router, combine and sampling of this batch
    wait_s: float  # blocked in combine-recv for this batch's experts (other stages)


@dataclass
class WorkDone:
    """Group leader -> engine: the results of one work item."""

    group: int
    work_id: int
    outputs: dict[int, dict[str, SeqOutput]]  # batch id -> request id -> output
    timings: list[BatchTiming]


@dataclass
class WorkerReady:
    role: str  # "attention" | "moe" | "dep"
    index: int
    pid: int


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


@dataclass
class WorkerSetup:
    """Everything a worker process needs to start (pickled once at spawn)."""

    role: str  # "attention" | "moe"
    index: int  # attention: global attention rank g*T + m; moe: worker index
    model_path: str
    engine: object  # config.EngineConfig
    parallel: object  # config.ParallelConfig
    comm: object  # comm.CommConfig
    placement: tuple[tuple[int, ...], ...]  # experts held by each MoE worker
    dist_port: int  # TCP port of the torch.distributed rendezvous on 127.0.0.1 (0: no world)
    recv_thread: bool = True  # MoE worker: receive/migrate on its own thread
    send_thread: bool = True  # MoE worker: combine-send on its own thread
    trace: bool = False
    cpu: int | None = None  # pin the process to this CPU
