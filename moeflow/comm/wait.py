"""WaitPolicy: how a receiver (or a sender under backpressure) waits on 2 shared cores.

Measured on the development machine: a pure spin stalls 7-8 ms whenever another process wants
the core (the scheduler lets the spinner run out its slice), ``time.sleep(0)`` costs ~70 us, and
``os.sched_yield()`` ~0.6 us. So a waiter polls in three phases:

1. spin ``spin_s``: a message already on its way lands within microseconds;
2. poll with ``os.sched_yield()`` between checks until ``yield_s`` has passed: cheap, and it hands
   the core to a runnable sender at once;
3. block on the doorbell, re-checking at least every ``block_timeout_s`` (a safety net: a lost
   ring costs at most that long); a ring starts phases 1-2 over. Each block that ends without a
   ring doubles the next one, up to ``idle_block_s``: an idle receiver wakes a few times a second
   instead of 200 (idle deployments beside a measured one must not steal its cores).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from moeflow.comm.doorbell import Doorbell
from moeflow.config import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class WaitPolicy:
    spin_s: float = 20e-6  # phase 1 length
    yield_s: float = 300e-6  # phase 2 ends this long after the wait began (inf: never block)
    block_timeout_s: float = 5e-3  # phase 3: longest single block before re-checking
    nap_s: float = 100e-6  # phase 3 without a doorbell (sender backpressure): longest sleep
    idle_block_s: float = 0.1  # phase 3 blocks grow to this while no ring comes

    def __post_init__(self) -> None:
        for name in ("spin_s", "yield_s", "block_timeout_s", "nap_s", "idle_block_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
                raise ConfigError(f"WaitPolicy.{name} must be a number >= 0, got {v!r}")
        if self.block_timeout_s == 0 or math.isinf(self.block_timeout_s):
            raise ConfigError(f"WaitPolicy.block_timeout_s must be finite and > 0, got {self.block_timeout_s}")


# The benchmark reports each; "adaptive" is the default.
POLICIES = {
    "adaptive": WaitPolicy(),
    "yield": WaitPolicy(yield_s=math.inf),  # never blocks: lowest latency, burns its core
    "block": WaitPolicy(spin_s=0.0, yield_s=0.0),  # blocks at once: frees the core, pays a wake-up
}


def wait_for(poll: Callable[[], T | None], bell: Doorbell, policy: WaitPolicy,
             timeout_s: float | None = None) -> T | None:
    """Call ``poll`` until it returns something other than None; return that, or None once
    ``timeout_s`` (None: forever) has passed."""
    got = poll()
    if got is not None:
        return got
    now = time.perf_counter
    t0 = now()
    deadline = math.inf if timeout_s is None else t0 + timeout_s
    spin_end, yield_end = t0 + policy.spin_s, t0 + policy.yield_s
    block_s = policy.block_timeout_s
    while True:
        t = now()
        if t >= deadline:
            return poll()
        if t >= yield_end:
            # Drain first, then re-check, then block: a ring after the drain wakes the block.
            bell.drain()
            got = poll()
            if got is not None:
                return got
            if bell.wait(min(block_s, deadline - t)):
                # Rung: poll briskly again (a streaming writer rings after every chunk).
                spin_end, yield_end = now() + policy.spin_s, now() + policy.yield_s
                block_s = policy.block_timeout_s
            else:
                block_s = min(2 * block_s, max(policy.idle_block_s, policy.block_timeout_s))
        elif t >= spin_end:
            os.sched_yield()
        got = poll()
        if got is not None:
            return got
