"""KV-cache block bookkeeping on ints: which blocks each request owns."""
from __future__ import annotations


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int) -> tuple[int, ...]:
        """Grow the request's table to cover ``num_tokens`` positions; returns the whole table."""
        table = self._tables.setdefault(request_id, [])
        need = self.blocks_for(num_tokens) - len(table)
        if need > len(self._free):
            raise OutOfBlocks(f"request {request_id} needs {need} more KV blocks, {len(self._free)} free")
        if need > 0:  # the last ``need`` free ids, last first: what ``need`` pops would hand out
            table.extend(reversed(self._free[-need:]))
            del self._free[-need:]
        return tuple(table)

    def table(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._tables.get(request_id, ()))

    def free(self, request_id: str) -> None:
        self._free.extend(reversed(self._tables.pop(request_id, [])))
