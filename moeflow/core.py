"""The shared nouns: SamplingParams, Request, RequestOutput (vLLM-shaped), Logprob.

Pure Python (no torch): the scheduler and the simulator import this module.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestError(ValueError):
    """A request (prompt or sampling parameters) is invalid; the message names the field."""


class EngineBusy(RuntimeError):
    """The engine cannot take a request now (a bounded queue is full); the client may retry."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, with vLLM's names and meanings (the sampler applies them in
    vLLM's order: min_tokens, logit_bias, penalties, temperature, min_p, top_k, top_p)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below 1e-5) means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) means all tokens
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    seed: int | None = None  # a seed makes this request's sampling reproducible on its own
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # strings that end the output (not included in its text)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop tokens/strings cannot end the output before this many tokens
    presence_penalty: float = 0.0  # OpenAI's: minus this from every token already in the output
    frequency_penalty: float = 0.0  # OpenAI's: minus this per time a token is already in the output
    repetition_penalty: float = 1.0  # CTRL's (transformers'): tokens of the prompt or output, divided / multiplied
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), OpenAI's
    n: int = 1  # samples of the same prompt (the server's choices), sharing its prefill
    logprobs: int | None = None  # top-n logprobs per generated token (plus the sampled one)
    prompt_logprobs: int | None = None  # top-n logprobs per prompt token (plus the actual one)

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise RequestError(f"SamplingParams: {msg}")

        def number(name: str, lo: float, hi: float) -> None:
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi):
                bad(f"{name} must be a number in [{lo:g}, {hi:g}], got {v!r}")

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not (0.0 <= self.temperature < float("inf")):
            bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be -1, 0 (all tokens) or a positive int, got {self.top_k!r}")
        # NOTE: the range torch.Generator.manual_seed accepts; a seed outside it would fail inside
        # a worker, after the request was accepted.
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**64):
            bad(f"seed must be None or an int in [-2**63, 2**64), got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0):
                bad(f"{name} must be None or an int >= 0, got {v!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        number("min_p", 0.0, 1.0)
        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        # NOTE: bounded, where vLLM takes any positive number: dividing a logit by 5e-324 (what a
        # fuzzer sent) overflows to inf and the softmax to NaN, inside a worker after acceptance
        number("repetition_penalty", 0.01, 100.0)
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or \
                not 0 <= self.min_tokens <= self.max_tokens:
            bad(f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            bad(f"n must be an int >= 1, got {self.n!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(x, str) and x for x in stop):
            bad(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        bias = tuple(sorted((dict(self.logit_bias).items() if isinstance(self.logit_bias, dict)
                             else self.logit_bias)))
        for t, b in bias:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0 or not isinstance(b, (int, float)) \
                    or not -100 <= b <= 100:
                bad(f"logit_bias maps token ids >= 0 to numbers in [-100, 100], got {t!r}: {b!r}")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


@dataclass(frozen=True)
class Logprob:
    """One entry of a logprobs dict (vLLM's ``Logprob``)."""

    logprob: float
    rank: int  # 1 = most likely token
    decoded_token: str | None = None


# Position -> {token id: Logprob}; ``None`` for the first prompt token (no context to predict it).
LogprobsDict = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[LogprobsDict] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, if any


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[LogprobsDict | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: "RequestMetrics | None" = None
    error: str | None = None


@dataclass
class RequestMetrics:
    """Wall-clock marks of one request (seconds on the engine's monotonic clock)."""

    arrival_s: float
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    # where the first token's wait went (ASAP Fig. 15): queueing until its batch started, this
    # batch's own compute, and the rest (waiting on other stages / the interleaved partner)
    prefill_start_s: float | None = None
    prefill_compute_s: float | None = None
    prefill_wait_s: float | None = None
    kv_handoff_s: float | None = None  # pd: decode room found to KV in place (the second token waited for it)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One request as the scheduler and runners see it: token ids and counters only."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float = 0.0
    prompt: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    # engine.stop.StopStrings when params.stop is set (the front that tokenizes attaches it)
    stop_strings: object | None = None
    # n > 1: the first sample of the same prompt, whose full prompt KV blocks this one shares
    prefix_of: str | None = None
    # a prefill instance's copy of a disaggregated request: when it finishes, its KV blocks stay
    # held (a lease) until the decode instance has taken them (``RequestPool.end_lease``)
    kv_handoff: bool = False
    # a prefill server's request that finished with its KV staged for a decode server: where
    # (``kv_handle.KvHandle``; the answer's kv_transfer_params)
    kv_handle: object | None = None
    # a decode server's request whose prompt KV a prefill server holds (``kv_handle.KvHandle``)
    kv_source: object | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    def append_token(self, token_id: int) -> bool:
        """Record a sampled token; returns True when the request is now finished."""
        self.output_token_ids.append(token_id)
        p, n = self.params, len(self.output_token_ids)
        # NOTE: the sampler keeps EOS and stop tokens out before min_tokens; stop strings count
        # from min_tokens on (vLLM's rules)
        text_stop = self.stop_strings.add(token_id, n >= p.min_tokens) if self.stop_strings is not None else None
        if token_id in p.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token_id
        elif not p.ignore_eos and token_id in self.eos_token_ids:
            self.finish_reason = "stop"
        elif text_stop is not None:
            self.finish_reason, self.stop_reason = "stop", text_stop
        elif n >= p.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None:
            self.status = RequestStatus.FINISHED
            if self.stop_strings is not None:
                self.stop_strings.finish()
            return True
        return False


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's share of a batch: tokens [start, start + num_tokens) are computed."""

    request_id: str
    start: int  # first position computed this step (== tokens already in the KV cache)
    num_tokens: int
    block_ids: tuple[int, ...]  # KV-cache blocks of the request, in position order
    is_last_chunk: bool  # the batch reaches the end of the known tokens: sample a token


@dataclass(frozen=True)
class Batch:
    """What one forward step computes (ragged: no padding between requests)."""

    batch_id: int
    seqs: tuple[ScheduledSeq, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


@dataclass(frozen=True)
class Work:
    """One work item for one group (an attention DP group, a dep rank): one batch, or two that
    the group interleaves layer by layer. Every scheduler's ``schedule(now)`` returns a list of these."""

    group: int
    batches: tuple[Batch, ...]
