"""KV-cache block bookkeeping on ints: which blocks each request holds.

A block may be held by several requests (the samples of one prompt share its full prompt blocks,
``share``); it returns to the free list when the last of them frees it.
"""
from __future__ import annotations


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._tables: dict[str, list[int]] = {}
        self._extra_holders: dict[int, int] = {}  # shared block -> holders beyond the first
        # request id -> its table as last handed out: a decode step grows a table by a block only
        # every block_size tokens, so most steps hand out the same tuple again instead of copying
        # a long context's hundreds of ids (tables only grow until freed: equal length, same table)
        self._handed: dict[str, tuple[int, ...]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int) -> tuple[int, ...]:
        """Grow the request's table to cover ``num_tokens`` positions; returns the whole table."""
        table = self.grow(request_id, num_tokens)
        handed = self._handed.get(request_id)
        if handed is None or len(handed) != len(table):
            handed = self._handed[request_id] = tuple(table)
        return handed

    def grow(self, request_id: str, num_tokens: int) -> list[int]:
        """``allocate`` without the copy: the request's own table (not to be kept or changed)."""
        table = self._tables.setdefault(request_id, [])
        need = -(-num_tokens // self.block_size) - len(table)  # NOTE: blocks_for, inlined: every request, every step
        if need <= 0:  # most calls: a decode step within the last block
            return table
        if need > len(self._free):
            raise OutOfBlocks(f"request {request_id} needs {need} more KV blocks, {len(self._free)} free")
        # the last ``need`` free ids, last first: what ``need`` pops would hand out
        table.extend(reversed(self._free[-need:]))
        del self._free[-need:]
        return table

    def num_held(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ()))

    def table(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._tables.get(request_id, ()))

    def share(self, src: str, dst: str, num_blocks: int) -> tuple[int, ...]:
        """``dst`` (holding nothing yet) starts with the first ``num_blocks`` blocks of ``src``."""
        if self._tables.get(dst):
            raise ValueError(f"request {dst} already holds KV blocks")
        blocks = self._tables[src][:num_blocks]
        for b in blocks:
            self._extra_holders[b] = self._extra_holders.get(b, 0) + 1
        self._tables[dst] = list(blocks)
        self._handed.pop(dst, None)
        return tuple(blocks)

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, [])
        self._handed.pop(request_id, None)
        if not self._extra_holders:  # nothing shared anywhere: every block goes back, in this order
            self._free.extend(reversed(table))
            return
        for b in reversed(table):
            n = self._extra_holders.pop(b, 0)
            if n > 1:
                self._extra_holders[b] = n - 1
            elif n == 0:
                self._free.append(b)
