"""The KV handoff's one copy on a host: a decode member copies a request's positions straight out
of the prefill members' caches (mapped by handle, ``ipc_memory.py``) into its own reserved blocks;
nothing is staged in between.

Like ``kv_arena.py`` it knows caches as tensors ``[L, N, *e]`` per entry and positions as slots.
Each side may split an entry's heads over its members (GQA's K/V on dim 0) or hold it whole
(MLA's latent, DSA's indexer keys); a decode member takes, from every prefill member, the heads
both hold, and a whole entry from one of them. The copy itself goes by runs of positions
consecutive on both sides, every layer at once (``Copy``: the worker passes the model's
``kv_copy.copy_runs``, a C++ op on the CPU; the default is one torch copy per run).
"""
from __future__ import annotations

from typing import Callable

import torch

from moeflow.comm.kv_arena import Entries, head_range

Run = tuple[int, int, int]  # (first source slot, first destination slot, positions)
Copy = Callable[[torch.Tensor, torch.Tensor, list[Run]], None]  # (src, dst, runs): every layer of each run


def paired_runs(src_blocks: tuple[int, ...], src_block_size: int, dst_blocks: tuple[int, ...],
                dst_block_size: int, num_tokens: int) -> list[Run]:
    """Positions [0, num_tokens) as runs consecutive in both caches' slots."""
    runs: list[list[int]] = []
    pos = 0
    while pos < num_tokens:
        s_off, d_off = pos % src_block_size, pos % dst_block_size
        n = min(src_block_size - s_off, dst_block_size - d_off, num_tokens - pos)
        s = src_blocks[pos // src_block_size] * src_block_size + s_off
        d = dst_blocks[pos // dst_block_size] * dst_block_size + d_off
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += n
        else:
            runs.append([s, d, n])
        pos += n
    return [tuple(r) for r in runs]


def copy_by_slices(src: torch.Tensor, dst: torch.Tensor, runs: list[Run]) -> None:
    """``dst[:, to:to + n] = src[:, at:at + n]`` for every run: one strided torch copy each."""
    for at, to, n in runs:
        dst[:, to:to + n].copy_(src[:, at:at + n])


def _heads(whole: tuple[int, ...], mine: tuple[int, ...], member: int) -> tuple[int, int]:
    r = head_range(whole, mine, member)
    return (0, whole[0]) if r is None else r


def pull(sources: list[tuple[Entries, int]], whole: dict[str, tuple[int, ...]], dst: Entries, member: int,
         runs: list[Run], copy: Copy = copy_by_slices) -> None:
    """Copy ``runs`` of every layer from ``sources`` (each prefill member's entries and its member
    index) into ``dst``, this decode ``member``'s entries (its own heads)."""
    s_len, d_len = next(iter(sources[0][0].values())).shape[1], next(iter(dst.values())).shape[1]
    for at, to, n in runs:  # the blocks come from a handle: none may reach outside either cache
        if min(at, to, n) < 0 or at + n > s_len or to + n > d_len:
            raise ValueError(f"run ({at}, {to}, {n}) is outside the caches' {s_len} / {d_len} slots")
    for name, d in dst.items():
        shape = tuple(whole[name])
        d_lo, d_hi = _heads(shape, tuple(d.shape[2:]), member)
        for src, s_member in sources:
            s = src[name]
            s_lo, s_hi = _heads(shape, tuple(s.shape[2:]), s_member)
            lo, hi = max(s_lo, d_lo), min(s_hi, d_hi)
            if lo < hi:  # the heads both hold (whole: the same view)
                copy(s[:, :, lo - s_lo:hi - s_lo], d[:, :, lo - d_lo:hi - d_lo], runs)
            if tuple(s.shape[2:]) == shape:  # it held every head: the other members add nothing
                break


def pull_reference(sources: list[tuple[Entries, int]], whole: dict[str, tuple[int, ...]], dst: Entries,
                   member: int, src_slots: list[int], dst_slots: list[int]) -> None:
    """The slow oracle of ``pull``: position by position, layer by layer, head by head."""
    for name, d in dst.items():
        shape = tuple(whole[name])
        d_lo, d_hi = _heads(shape, tuple(d.shape[2:]), member)
        for head in range(d_lo, d_hi):
            src, s_member = next((s, m) for s, m in sources
                                 if _heads(shape, tuple(s[name].shape[2:]), m)[0] <= head
                                 < _heads(shape, tuple(s[name].shape[2:]), m)[1])
            s_lo = _heads(shape, tuple(src[name].shape[2:]), s_member)[0]
            for layer in range(d.shape[0]):
                for a, b in zip(src_slots, dst_slots):
                    d[layer, b, head - d_lo] = src[name][layer, a, head - s_lo]
