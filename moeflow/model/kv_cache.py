"""Paged KV cache (block pool tensors) and the per-batch metadata attention reads.

Block allocation is bookkeeping on ints and lives in ``moeflow.scheduler.block_allocator``; this
module only owns the tensors. What a token stores is the attention kind's ``KVLayout`` (GQA: k and
v of [Hkv, D]). Shape legend: L layers, N slots (= blocks * block_size), T new tokens in the batch,
``*e`` the per-token shape of an entry.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from moeflow.config import ModelConfig
from moeflow.model.attention import KVLayout, attention_for
from moeflow.model.paged_attention import DecodeBatch


_ALIGN = 64  # bytes: each entry of a cache carved from one buffer starts on a cache line


def storage_bytes(layout: KVLayout, num_layers: int, num_slots: int, dtype: torch.dtype) -> int:
    """Bytes of one buffer that ``carve`` lays a cache's entries out in."""
    return sum(-(-num_layers * num_slots * math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
               for shape in dict(layout).values())


def carve(storage: torch.Tensor, layout: KVLayout, num_layers: int, num_slots: int,
          dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One [L, N, *e] view per entry of a uint8 ``storage`` (no copy), entry after entry in layout
    order: the layout a process that maps another's cache (the KV handoff) rebuilds from the same
    numbers."""
    need = storage_bytes(layout, num_layers, num_slots, dtype)
    if need > storage.numel():
        raise ValueError(f"a KV cache of {need} bytes does not fit a {storage.numel()}-byte buffer")
    out, off = {}, 0
    for name, shape in dict(layout).items():
        count = num_layers * num_slots * math.prod(shape)
        out[name] = storage[off:off + count * dtype.itemsize].view(dtype).view(num_layers, num_slots, *shape)
        off += -(-count * dtype.itemsize // _ALIGN) * _ALIGN
    return out


class KVCache:
    def __init__(self, layout: KVLayout, num_layers: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", storage: torch.Tensor | None = None):
        """``storage``: a uint8 buffer the entries are carved from (memory another process maps, for
        the KV handoff; ``storage_bytes`` says how big); None: the cache's own tensors."""
        self.layout = dict(layout)
        self.num_layers, self.block_size, self.num_blocks, self.dtype = num_layers, block_size, num_blocks, dtype
        self.device = torch.device(device if storage is None else storage.device)
        if storage is not None:
            self.entries = carve(storage, self.layout, num_layers, num_blocks * block_size, dtype)
            for t in self.entries.values():
                t.zero_()
            return
        self.entries = {name: torch.zeros((num_layers, num_blocks * block_size, *shape), dtype=dtype,
                                          device=self.device)  # [L, N, *e]
                        for name, shape in self.layout.items()}

    @classmethod
    def for_model(cls, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                  device: torch.device | str = "cpu", storage: torch.Tensor | None = None) -> "KVCache":
        """The cache of ``cfg``'s attention kind (a TP member passes its own, sharded config)."""
        return cls(attention_for(cfg).kv_layout(), cfg.num_layers, num_blocks, block_size, dtype, device, storage)

    @property
    def bytes_per_token(self) -> int:
        """What one cached token costs over all layers and entries."""
        return self.num_layers * self.dtype.itemsize * sum(math.prod(shape) for shape in self.layout.values())

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.entries.values())

    def write(self, layer: int, slots: torch.Tensor, *values: torch.Tensor) -> None:
        """slots: [T] int64; values: one [T, *e] per entry, in layout order (GQA: k, v)."""
        for cache, x in zip(self.entries.values(), values, strict=True):
            cache[layer].index_copy_(0, slots, x.to(cache.dtype))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """slots: [S] int64 -> one [S, *e] per entry, in layout order (GQA: k, v). A copy."""
        return tuple(cache[layer].index_select(0, slots) for cache in self.entries.values())

    def layer_entries(self, layer: int) -> tuple[torch.Tensor, ...]:
        """One layer's whole cache, one [N, *e] view per entry (no copy), for decode attention to read in place."""
        return tuple(cache[layer] for cache in self.entries.values())


def slots_for(block_ids: tuple[int, ...] | list[int], start: int, stop: int, block_size: int,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """Cache slots of positions [start, stop) of a request whose blocks are ``block_ids``."""
    pos = torch.arange(start, stop, dtype=torch.int64, device=device)  # [stop - start]
    table = torch.as_tensor(block_ids, dtype=torch.int64, device=device)
    return table[pos // block_size] * block_size + pos % block_size


def _token_positions(query_lens: list[int], context_lens: list[int], block_tables: list[tuple[int, ...]] | None,
                     block_size: int, cpu: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[T] positions and (with tables) [T] cache slots of the new tokens, on ``cpu`` (the step's
    device: the host's lists go over once each; every op's shape is known on the host)."""
    total = sum(query_lens)
    q = torch.as_tensor(query_lens, dtype=torch.int64, device=cpu)
    c = torch.as_tensor(context_lens, dtype=torch.int64, device=cpu)
    seq = torch.repeat_interleave(torch.arange(len(query_lens), device=cpu), q, output_size=total)  # [T]
    first = torch.cumsum(q, 0) - q  # each request's first row
    positions = c[seq] + torch.arange(total, dtype=torch.int64, device=cpu) - first[seq]
    if block_tables is None:
        return positions, None
    width = max((len(t) for t in block_tables), default=0)
    table = torch.as_tensor([list(t) + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64,
                            device=cpu).view(len(block_tables), width)
    return positions, table[seq, positions // block_size] * block_size + positions % block_size


@dataclass
class AttentionMetadata:
    """Where each request's new tokens sit in the batch and in the cache."""

    positions: torch.Tensor  # [T] int64, absolute position of each new token
    query_lens: list[int]  # per request: new tokens this step
    context_lens: list[int]  # per request: tokens already in the cache before this step
    slot_mapping: torch.Tensor | None  # [T] int64 cache slot of each new token; None: no cache
    block_tables: list[tuple[int, ...]]  # per request: its blocks, in position order
    block_size: int
    device: torch.device = torch.device("cpu")  # where the batch's tensors (and the cache) are
    max_position: int = 0  # one past the largest position of the batch (known on the host)

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables: list[tuple[int, ...]] | None,
              block_size: int, device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Positions and slots of every new token, in a fixed number of ops whatever the batch: what
        a step launches does not grow with its requests, and nothing is read back."""
        device = torch.device(device)
        positions, slot_mapping = _token_positions(query_lens, context_lens, block_tables, block_size, device)
        return cls(positions, list(query_lens), list(context_lens), slot_mapping, list(block_tables or []),
                   block_size, device, max((c + q for q, c in zip(query_lens, context_lens)), default=0))

    @classmethod
    def no_cache(cls, query_lens: list[int], device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Prefill from scratch without keeping KV (e.g. scoring prompts)."""
        return cls.build(query_lens, [0] * len(query_lens), None, 1, device)

    def iter_seqs(self):
        """Yield (first row in the batch, new tokens, cached tokens) per request."""
        start = 0
        for q, c in zip(self.query_lens, self.context_lens):
            yield start, q, c
            start += q

    @cached_property
    def decode(self) -> DecodeBatch | None:
        """The decode requests' block tables and lengths, built on the first layer's call and kept for the
        others (None: no request decodes, or no cache)."""
        if self.slot_mapping is None:
            return None
        return DecodeBatch.build(self.query_lens, self.context_lens, self.block_tables, self.block_size, self.device)

    def context_slots(self, i: int) -> torch.Tensor:
        """Slots of all positions a request's queries attend to (cached + new)."""
        return slots_for(self.block_tables[i], 0, self.context_lens[i] + self.query_lens[i], self.block_size,
                         self.device)
