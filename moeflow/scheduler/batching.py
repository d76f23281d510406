"""Prefill batch formation policies (pure Python, clock passed in by the caller).

A policy looks at the FIFO head of the waiting queue and proposes batches without removing
anything; the caller (a DP-group scheduler) decides how many proposals to take.
"""
from __future__ import annotations

import abc
from collections import deque
from dataclasses import dataclass
from typing import Callable

from moeflow.core import Request


@dataclass(frozen=True)
class Proposal:
    requests: tuple[Request, ...]
    num_tokens: int
    is_due: bool  # its oldest request has waited max_batch_wait_s: it may go without a partner
    is_long: bool  # holds a prompt above long_prompt_tokens: it must run alone


class BatchFormer(abc.ABC):
    @abc.abstractmethod
    def propose(self, waiting: deque[Request], now: float, limit: int,
                fits: Callable[[list[Request]], bool]) -> list[Proposal]:
        """Up to ``limit`` consecutive batches from the queue head; ``fits`` caps what a group can hold."""

    def next_due_s(self, waiting: deque[Request]) -> float | None:
        """When a partial batch becomes due (for the caller's timer); None: nothing pending."""
        return None


class _Former(BatchFormer):
    def __init__(self, max_batch_tokens: int, long_prompt_tokens: int):
        self.max_batch_tokens = max_batch_tokens
        self.long_prompt_tokens = long_prompt_tokens

    def _full(self, tokens: int) -> bool:
        raise NotImplementedError

    def _due(self, oldest_arrival_s: float, now: float) -> bool:
        raise NotImplementedError

    def propose(self, waiting, now, limit, fits):
        out: list[Proposal] = []
        taken: list[Request] = []
        cur: list[Request] = []
        tokens = 0

        def close() -> None:
            nonlocal cur, tokens
            is_long = any(r.num_prompt_tokens > self.long_prompt_tokens for r in cur)
            is_due = self._due(min(r.arrival_s for r in cur), now)
            out.append(Proposal(tuple(cur), tokens, is_due, is_long))
            taken.extend(cur)
            cur, tokens = [], 0

        for r in waiting:
            if len(out) == limit:
                break
            n = r.num_tokens - r.num_computed_tokens  # a preempted request recomputes its outputs too
            if cur and (tokens + n > self.max_batch_tokens or n > self.long_prompt_tokens):
                close()  # the next request does not fit: this batch is as full as it gets
                if len(out) == limit:
                    break
            if not fits(taken + cur + [r]):
                break  # the group has no room; FIFO: nobody overtakes the head
            cur.append(r)
            tokens += n
            if self._full(tokens) or n > self.long_prompt_tokens:
                close()
        if cur and len(out) < limit and self._due(min(r.arrival_s for r in cur), now):
            close()  # a partial batch goes only once due
        return out


class LengthAwareBatching(_Former):
    """ASAP §3.3.1: a batch forms once it reaches ``min_batch_tokens`` (the MoE inflection point),
    or once its oldest request has waited ``max_batch_wait_s``; never above ``max_batch_tokens``."""

    def __init__(self, min_batch_tokens: int, max_batch_tokens: int, max_batch_wait_s: float,
                 long_prompt_tokens: int):
        super().__init__(max_batch_tokens, long_prompt_tokens)
        self.min_batch_tokens = min_batch_tokens
        self.max_batch_wait_s = max_batch_wait_s

    def _full(self, tokens: int) -> bool:
        return tokens >= self.min_batch_tokens

    def _due(self, oldest_arrival_s: float, now: float) -> bool:
        # NOTE: the same sum as next_due_s, so a timer set for that instant finds the batch due
        # (now - arrival can round below max_batch_wait_s)
        return now >= oldest_arrival_s + self.max_batch_wait_s

    def next_due_s(self, waiting):
        return waiting[0].arrival_s + self.max_batch_wait_s if waiting else None


class ImmediateBatching(_Former):
    """Ablation of length-aware batching: whatever is waiting (up to S) goes at once."""

    def _full(self, tokens: int) -> bool:
        return False

    def _due(self, oldest_arrival_s: float, now: float) -> bool:
        return True
