"""The engine interface every mode implements (the table of modes is ``modes.py``)."""
from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field

from moeflow.config import ConfigError, EngineConfig, ModelConfig
from moeflow.core import Request, RequestError
from moeflow.scheduler.load_window import oldest_unanswered
from moeflow.scheduler.handoff.port import KvPort


def clock() -> float:
    """The engine's monotonic clock (seconds); request metrics use it."""
    return time.monotonic()


@dataclass
class StepResult:
    outputs: dict  # request id -> workers.runner.SeqOutput produced this step
    finished: list[Request]  # requests that finished (or failed) in this step
    # worker name -> seconds of compute its work items reported in this step (a server's busy fraction)
    busy_s: dict[str, float] = field(default_factory=dict)
    wait_s: dict[str, float] = field(default_factory=dict)  # seconds it was blocked on the expert side
    # pd: the KV handoffs completed in this step and the pre-allocation waits
    kv_transfers: list["KvTransfer"] = field(default_factory=list)
    prealloc_waits_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class KvTransfer:
    """One KV handoff's copy, as /metrics counts it."""

    seconds: float
    nbytes: int
    # "shm": into the decode side's blocks through one host's shared memory; "gloo": pulled from
    # another host, then copied in; "stage": a prefill server's copy out into its staging arena
    path: str


@dataclass(frozen=True)
class EngineLoad:
    """What the deployment holds right now (a server exports it as gauges)."""

    num_waiting: int  # accepted, not yet admitted to a group
    num_running: int  # admitted (their KV blocks reserved), not finished
    num_free_kv_blocks: int  # summed over attention groups
    num_kv_blocks: int
    running_per_group: tuple[int, ...] = ()  # resident requests of each attention group (an afd instance, a rank)
    preemptions_per_group: tuple[int, ...] = ()  # requests preempted by recompute so far, per group
    running_per_role: tuple[tuple[str, int], ...] = ()  # pd: (prefill | decode, requests on that side)
    num_handoffs: int = 0  # pd: requests between their prefill and decode instances
    # pd: handoff outcomes so far, (name, count): failures, lease_expiries, recomputes
    handoff_counts: tuple[tuple[str, int], ...] = ()
    # the modes that spread experts: slots per MoE layer, each layer's (model layer id, balancedness)
    # over the load window, and its hottest experts (layer, expert, share of the layer's tokens)
    eplb_physical_experts: int = 0
    eplb_balancedness: tuple[tuple[int, float], ...] = ()
    eplb_hottest: tuple[tuple[int, int, float], ...] = ()
    # why the deployment serves with less than it was built with (dwdp: a rank died and the others go
    # on; pd: an instance failed), None when whole. A degraded deployment is still serving, not failed.
    degraded: str | None = None
    # an elastic deployment: its members by role now, and its scale events so far, (kind, outcome, count)
    members: tuple[tuple[str, int], ...] = ()
    scale_events: tuple[tuple[str, str, int], ...] = ()


class Engine(abc.ABC):
    """One deployment: schedule -> execute -> update, one ``step`` at a time. A mode's engine names
    itself (``mode_name``) and says whether its workers may run on several hosts (``multinode``);
    what each of its processes holds (the memory plan) is its layout's, ``layout/memory.py``."""

    mode_name: str
    multinode: bool = False

    config: EngineConfig
    max_model_len: int
    failed: str | None = None  # why the deployment stopped serving (a worker died); None while healthy
    stalls: int = 0  # work items that went unanswered past the stall timeout (each failed the deployment)
    memory_plan = None  # engine.memory.MemoryPlan when the config sets a memory budget

    @abc.abstractmethod
    def add_request(self, request: Request) -> None:
        """Validate and queue; raises ``RequestError`` without side effects on bad input."""

    @abc.abstractmethod
    def step(self) -> StepResult: ...

    @abc.abstractmethod
    def has_unfinished(self) -> bool: ...

    @abc.abstractmethod
    def abort(self, request_id: str) -> None: ...

    def drain(self, timeout_s: float = 120.0) -> None:
        """Return once no work is in flight on any worker (results of aborted requests are
        dropped). Modes whose ``step`` returns with nothing in flight have nothing to do."""

    def shutdown(self) -> None:
        """Release processes and shared memory (nothing to do for in-process engines)."""

    def check_workers(self) -> StepResult:
        """Notice a dead worker between steps (an idle deployment runs no step that would);
        its requests end with errors as in ``step``. In-process modes have nothing to check."""
        return StepResult({}, [])

    def heal(self) -> bool:
        """Replace what a degraded deployment lost (``load().degraded``) while it goes on serving (it
        is whole again some steps later); False when that cannot be done in place (the caller
        rebuilds it)."""
        return False

    def oldest_work_age_s(self) -> tuple[float, int | None]:
        """(seconds, group) of the oldest work item its workers have not answered; (0, None): none."""
        return 0.0, None

    def load(self) -> EngineLoad:
        pool = self.scheduler.pool
        waiting = len(pool.waiting) + sum(map(len, pool.held.values()))  # held: later samples of a prompt
        return EngineLoad(waiting, sum(len(g.requests) for g in pool.groups),
                          sum(g.allocator.num_free for g in pool.groups),
                          sum(g.allocator.num_blocks for g in pool.groups), tuple(len(g.requests) for g in pool.groups),
                          tuple(g.preemptions for g in pool.groups))

    def _requests_decoding(self) -> int:
        """The requests past their first token (resident, or preempted and waiting to come back): for the
        autoscaler of ranks, which asks every turn."""
        return sum(1 for r in self.scheduler.pool.requests.values() if r.output_token_ids)

    def _oldest_unanswered_s(self) -> float | None:
        """The arrival (engine clock) of the oldest request still without a first token: queued, or on
        a group that has not reached its prompt; None: there is none. For the autoscaler, which asks
        once a window: a scan of every request, kept out of ``load`` (the server reads that every turn)."""
        return oldest_unanswered(self.scheduler.pool)

    # -- a KV handoff's side on this deployment (scheduler/handoff/) -----------------------------

    max_wait_s: float = 0.05  # longest a step blocks for an answer when nothing else is due

    def handoff_port(self) -> KvPort:
        """What a KV handoff's side may do to this deployment: its pool's leases and reservations,
        and its KV-holding members (``scheduler/handoff/port.py``)."""
        if getattr(self, "_kv_port", None) is None:
            self._kv_port = KvPort(self.scheduler.pool, self._kv_members, self._send_kv, self._kv_arrived,
                                   self._kv_regions)
        return self._kv_port

    def _kv_members(self, group: int) -> int:
        """How many processes hold a share of group ``group``'s KV cache (TP members)."""
        return 1

    def _send_kv(self, group: int, message) -> None:
        """Hand a ``KvSend``/``KvRecv`` to every process holding group ``group``'s KV cache; each
        stores its flag in the staging arena when its copy is done."""
        raise ConfigError(f"mode {self.mode_name!r} cannot hand KV blocks over")

    _kv_arrived = None  # (request) -> None: what else a request decoding from handed-over KV needs

    def _kv_regions(self, group: int) -> tuple | None:
        """Group ``group``'s caches as others map them, one ``KvRegion`` per member (None: private;
        ``EngineConfig.share_kv_cache`` shares them)."""
        return None

    def collect_spans(self) -> list:
        """Trace spans recorded by the deployment's workers (modes with worker processes)."""
        raise ConfigError(f"mode {self.mode_name!r} records no trace spans; use a mode with worker processes")


def context_len(config: EngineConfig, model: ModelConfig) -> int:
    """The deployment's max_model_len: the config's, capped by the model's positions."""
    return min(config.max_model_len or model.max_position_embeddings, model.max_position_embeddings)


def validate_request(request: Request, model: ModelConfig) -> None:
    """Checks every mode makes before accepting a request (the scheduler checks lengths)."""
    vocab = model.vocab_size
    bad = next((t for t in request.prompt_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"request {request.request_id}: token id {bad} is outside the vocabulary [0, {vocab})")
    # NOTE: checked here, not later: top-n over V < n fails inside a step, after the request is
    # scheduled, and would leave it stuck in the running set.
    bad = next((t for t, _ in request.params.logit_bias if t >= vocab), None)
    if bad is not None:
        raise RequestError(f"request {request.request_id}: SamplingParams: logit_bias names token id {bad}, "
                           f"outside the vocabulary [0, {vocab})")
    for name in ("logprobs", "prompt_logprobs"):
        n = getattr(request.params, name)
        if n is not None and n > vocab:
            raise RequestError(f"request {request.request_id}: {name}={n} exceeds the vocabulary size {vocab}")
