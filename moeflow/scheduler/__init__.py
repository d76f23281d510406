"""Batching policies and KV-block bookkeeping on ints (no torch), shared by the engine and the
simulator: ``make_scheduler`` builds any mode's scheduler from its layout, the same way for both.

The table below is the one place that imports the policies; they never import it."""
from __future__ import annotations

from typing import Callable

from moeflow.config import EngineConfig
from moeflow.layout import Layout
from moeflow.scheduler import afd, asap, continuous, dep, dwdp
from moeflow.scheduler.block_allocator import BlockAllocator
from moeflow.scheduler.pool import RequestPool, Scheduler

# mode -> (layout, pool, max_num_batched_tokens) -> its scheduler
BUILDERS: dict[str, Callable[[Layout, RequestPool, int], Scheduler]] = {
    "colocated": continuous.build, "dep": dep.build, "asap": asap.build, "dwdp": dwdp.build, "afd": afd.build}


def make_scheduler(layout: Layout, config: EngineConfig, max_model_len: int) -> Scheduler:
    """The scheduler of ``layout``'s mode over one KV allocator per group of the layout, with
    ``config``'s limits (KV blocks, sequences, batched tokens) and KV admission."""
    pool = RequestPool([BlockAllocator(config.num_kv_blocks, config.kv_block_size) for _ in range(layout.num_groups)],
                       max_model_len, config.max_num_seqs, config.kv_admission)
    return BUILDERS[layout.mode](layout, pool, config.max_num_batched_tokens)
