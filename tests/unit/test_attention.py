"""Ragged, paged attention (``attention_core``) against the explicit-softmax oracle."""
from __future__ import annotations

import pytest
import torch

from moeflow.model.kv_cache import AttentionMetadata, KVCache, slots_for
from moeflow.model.layers import attention_core, attention_reference

torch.set_num_threads(1)

HQ, HKV, D = 4, 2, 8  # grouped-query attention: 2 query heads per kv head
BLOCK = 4
LAYOUT = {"k": (HKV, D), "v": (HKV, D)}  # what GQA caches per token and layer
ATOL = 1e-5


def _qkv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, HQ, D, generator=g), torch.randn(n, HKV, D, generator=g),
            torch.randn(n, HKV, D, generator=g))


def test_reference_is_causal():
    q, k, v = _qkv(3, 0)
    out = attention_reference(q, k, v, ctx_len=0)
    # the first query sees only the first key: its output is that value (per kv head group)
    torch.testing.assert_close(out[0], v[0].repeat_interleave(HQ // HKV, dim=0))


def test_ragged_prefill_without_cache():
    lens = [5, 1, 12, 3]
    q, k, v = _qkv(sum(lens), 1)
    meta = AttentionMetadata.no_cache(lens)
    assert meta.slot_mapping is None
    assert meta.positions.tolist() == [p for n in lens for p in range(n)]
    out = attention_core(q, k, v, meta, None, layer=0)
    start = 0
    for n in lens:
        s = slice(start, start + n)
        torch.testing.assert_close(out[s], attention_reference(q[s], k[s], v[s], 0), atol=ATOL, rtol=ATOL)
        start += n


class _Seq:
    """One request's full k/v history, kept outside the cache for the oracle."""

    def __init__(self, blocks: tuple[int, ...]):
        self.blocks = blocks
        self.k = torch.empty(0, HKV, D)
        self.v = torch.empty(0, HKV, D)


def _step(cache: KVCache, layer: int, seqs: list[_Seq], q_lens: list[int], seed: int) -> None:
    """Run one ragged batch (each seq adds q_lens[i] tokens after its history) and check it."""
    ctx = [s.k.shape[0] for s in seqs]
    q, k, v = _qkv(sum(q_lens), seed)
    meta = AttentionMetadata.build(q_lens, ctx, [s.blocks for s in seqs], BLOCK)
    assert meta.positions.tolist() == [c + j for c, n in zip(ctx, q_lens) for j in range(n)]
    out = attention_core(q, k, v, meta, cache, layer)
    start = 0
    for s, n, c in zip(seqs, q_lens, ctx):
        sl = slice(start, start + n)
        s.k, s.v = torch.cat([s.k, k[sl]]), torch.cat([s.v, v[sl]])
        ref = attention_reference(q[sl], s.k, s.v, c)
        torch.testing.assert_close(out[sl], ref, atol=ATOL, rtol=ATOL)
        # the cache now holds the whole history at the request's (scattered) slots
        kc, vc = cache.gather(layer, slots_for(s.blocks, 0, c + n, BLOCK))
        assert torch.equal(kc, s.k) and torch.equal(vc, s.v)
        start += n


@pytest.mark.parametrize("layer", [0, 1])
def test_prefill_then_decode_through_paged_cache(layer):
    cache = KVCache(LAYOUT, num_layers=2, num_blocks=16, block_size=BLOCK, dtype=torch.float32)
    blocks = torch.randperm(16, generator=torch.Generator().manual_seed(2)).tolist()
    seqs = [_Seq(tuple(blocks[0:4])), _Seq(tuple(blocks[4:7])), _Seq(tuple(blocks[7:9]))]  # shuffled ids
    _step(cache, layer, seqs, [7, 5, 1], seed=10)  # prefill, ragged
    for i in range(6):  # decode steps; crosses block boundaries
        _step(cache, layer, seqs, [1, 1, 1], seed=20 + i)
    other = 1 - layer  # writes went to the requested layer only
    assert not cache.entries["k"][other].any() and not cache.entries["v"][other].any()


def test_chunks_with_context_mixed_with_decode_and_prefill():
    cache = KVCache(LAYOUT, num_layers=1, num_blocks=12, block_size=BLOCK, dtype=torch.float32)
    long, short, fresh = _Seq((11, 3, 8, 0)), _Seq((5, 9)), _Seq((1, 7, 2))
    _step(cache, 0, [long, short], [6, 3], seed=30)
    # long continues its prompt (q_len 5 over ctx 6), short decodes, fresh starts a prefill
    _step(cache, 0, [long, short, fresh], [5, 1, 4], seed=31)
    _step(cache, 0, [fresh, long], [6, 2], seed=32)  # order within a batch is free
    assert long.k.shape[0] == 13 and fresh.k.shape[0] == 10


def test_bf16_cache_close_to_reference():
    cache = KVCache(LAYOUT, 1, 8, BLOCK, torch.bfloat16)
    q, k, v = (t.bfloat16() for t in _qkv(9, 40))
    meta = AttentionMetadata.build([6], [0], [(4, 1)], BLOCK)
    attention_core(q[:6], k[:6], v[:6], meta, cache, 0)
    meta = AttentionMetadata.build([3], [6], [(4, 1, 6)], BLOCK)
    out = attention_core(q[6:], k[6:], v[6:], meta, cache, 0)
    ref = attention_reference(q[6:].float(), k.float(), v.float(), 6)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
