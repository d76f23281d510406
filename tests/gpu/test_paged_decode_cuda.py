"""Decode attention over the paged KV cache on the GPU: ``decode_attention`` (the batched path there:
one gather and one SDPA for the batch, no host sync; the C++ kernel is CPU-only) against the float32 oracle, and a whole model decoding through its cache
against recomputing each sequence from scratch.
"""
from __future__ import annotations

import pytest
import torch

from cuda_support import DEVICE, GPU, prompts
from moeflow.model.kv_cache import AttentionMetadata, KVCache
from moeflow.model.layers import attention_reference
from moeflow.model.paged_attention import DecodeBatch, decode_attention, path_for
from moeflow.model.transformer import MoETransformer
from moeflow.model.weights import load_weights

pytestmark = GPU


def _paged(b: int, hkv: int, dk: int, dv: int, block_size: int, max_len: int, dtype, seed: int,
           latent: bool = False):
    """A cache on the GPU with shuffled blocks, ragged context lengths and a block 0 no request owns
    -> k, v views [N, Hkv, D*] and a DecodeBatch there too, as the engine builds them."""
    g = torch.Generator().manual_seed(seed)
    per = -(-max_len // block_size)
    num_blocks = b * per + 1
    n = num_blocks * block_size
    if latent:  # MLA: one kv head; values are the first dv columns of the key rows
        rows = torch.randn(n, dk, generator=g).to(DEVICE, dtype)  # [N, Dk]
        k, v = rows.unsqueeze(1), rows[:, None, :dv]
    else:
        k = torch.randn(n, hkv, dk, generator=g).to(DEVICE, dtype)  # [N, Hkv, Dk]
        v = torch.randn(n, hkv, dv, generator=g).to(DEVICE, dtype)  # [N, Hkv, Dv]
    lens = torch.randint(2, max_len + 1, (b,), generator=g).tolist()  # >= 2: one cached key and the new one
    lens[0] = max_len
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = []
    for n_keys in lens:
        used = -(-n_keys // block_size)
        tables.append(tuple(ids[:used]))
        ids = ids[used:]
    # DecodeBatch counts the new token among the keys: a request of context c decodes over c + 1
    return k, v, DecodeBatch.build([1] * b, [m - 1 for m in lens], tables, block_size, device=DEVICE)


def _reference(q, k, v, batch: DecodeBatch) -> torch.Tensor:
    """attention_reference per request on the CPU, float32, over the keys copied out of the cache."""
    out = []
    tables = batch.block_tables.cpu().long()
    for i, n in enumerate(batch.context_lens.tolist()):
        pos = torch.arange(n)
        slots = tables[i][pos // batch.block_size] * batch.block_size + pos % batch.block_size
        ki, vi = k.cpu()[slots].float(), v.cpu()[slots].float()
        out.append(attention_reference(q[i:i + 1].cpu().float(), ki, vi, n - 1)[0])
    return torch.stack(out)  # [B, Hq, Dv]


def test_the_gpu_takes_the_batched_path():
    assert path_for(torch.device(DEVICE)) == "batched"  # the rehearsal asks for it (MOEFLOW_PAGED_ATTENTION=batched)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("group,hkv,d", [(1, 2, 64), (4, 2, 64), (8, 1, 128)])
def test_decode_attention_matches_the_reference_fp32(group, hkv, d, block_size):
    k, v, batch = _paged(5, hkv, d, d, block_size, 45, torch.float32, seed=group * d + block_size)
    q = torch.randn(5, group * hkv, d, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out = decode_attention(q, k, v, batch)
    assert out.device.type == torch.device(DEVICE).type and out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), _reference(q, k, v, batch), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_decode_attention_close_to_the_reference_in_half_precision(dtype):
    k, v, batch = _paged(4, 2, 128, 128, 16, 300, dtype, seed=3)
    q = torch.randn(4, 8, 128, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    out = decode_attention(q, k, v, batch)
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu().float(), _reference(q, k, v, batch), atol=2e-2, rtol=2e-2)


def test_decode_attention_reads_mla_latents_through_a_view():
    # DeepSeek's shape: keys the whole [c_kv | k_pe] row (512 + 64), values a strided view of c_kv
    k, v, batch = _paged(3, 1, 576, 512, 16, 37, torch.bfloat16, seed=4, latent=True)
    assert v.data_ptr() == k.data_ptr() and not v.is_contiguous()
    q = torch.randn(3, 16, 576, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.bfloat16)
    out = decode_attention(q, k, v, batch, scale=0.07)
    ref = _reference(q * 0.07 * 576 ** 0.5, k, v, batch)  # the oracle scales by Dk^-0.5
    torch.testing.assert_close(out.cpu().float(), ref, atol=2e-2, rtol=2e-2)


# -- a model decoding through its cache -------------------------------------------------------

BLOCK = 4
STEPS = 6


@torch.no_grad()
def _recomputed_logits(model: MoETransformer, seq: list[int]) -> torch.Tensor:
    """[V] the last position's logits from a forward over the whole sequence without a cache."""
    h = model.forward(torch.tensor(seq, device=DEVICE), AttentionMetadata.no_cache([len(seq)], device=DEVICE), None)
    return model.logits(h[-1:])[0]


@pytest.mark.parametrize("name", ["qwen3", "mixtral", "deepseek_v3"])
@torch.no_grad()
def test_model_decode_through_the_cache_equals_recomputing(checkpoints, name):
    """Step 0: two prefills and the first chunk of a third prompt; step 1: two decodes beside the
    prompt's second chunk (a chunk over cached context); then decodes only. At every step each
    request's logits equal a cache-free forward over its whole sequence."""
    cfg, w = load_weights(checkpoints(name).path, torch.float32, device=DEVICE)
    model = MoETransformer(cfg, w)
    cache = KVCache.for_model(cfg, num_blocks=32, block_size=BLOCK, dtype=torch.float32, device=DEVICE)
    assert all(t.device.type == torch.device(DEVICE).type for t in cache.entries.values())
    seqs = prompts(5, cfg.vocab_size, (9, 14, 3))
    tables = [(7, 2, 11, 0, 20, 25), (5, 9, 1, 30, 13, 15, 17), (4, 6, 10, 19, 22)]
    done = [0, 0, 0]  # tokens of each sequence already in the cache
    plan = [[9, 8, 3], [1, 6, 1]] + [[1, 1, 1]] * STEPS  # new tokens per request per step
    for step, q_lens in enumerate(plan):
        ids = torch.tensor([t for s, c, q in zip(seqs, done, q_lens) for t in s[c:c + q]], device=DEVICE)
        h = model.forward(ids, AttentionMetadata.build(q_lens, done, tables, BLOCK, device=DEVICE), cache)
        last = torch.tensor(q_lens).cumsum(0) - 1
        logits = model.logits(h[last.to(DEVICE)])  # [3, V]
        for i, q in enumerate(q_lens):
            done[i] += q
            if done[i] < len(seqs[i]):
                continue  # mid-prompt: no token yet
            ref = _recomputed_logits(model, seqs[i])
            torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"{name} step {step} request {i}: {m}")
            seqs[i].append(int(logits[i].argmax()))
