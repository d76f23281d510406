"""The model's own steps on the device, timed: a prefill of fresh prompts and decode steps of one token
per request over a paged KV cache filled with random values (no real prefill needed to decode at
context C: attention reads C cached entries whatever they hold).

The model is driven as the colocated engine drives it (``MoETransformer.forward`` then ``logits`` for
each request's last token), without the scheduler: block tables and metadata are built once per batch
and the same step is timed again and again (it decodes at the same position each time, writing the
same slot). Legend: B requests, C context tokens per request, T tokens in a step, V vocab.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from moeflow.bench.ceilings import synchronize, timed_s
from moeflow.bench.flops import prefill_flops
from moeflow.bench.step_bytes import decode_step_bytes
from moeflow.model.kv_cache import AttentionMetadata, KVCache
from moeflow.model.transformer import MoETransformer


@dataclass
class DecodeCache:
    """A KV cache holding B_max requests of C tokens each (room for the token being decoded)."""

    cache: KVCache
    tables: list[tuple[int, ...]]  # per request: its blocks, shuffled over the pool
    context: int  # C


def step(model: MoETransformer, ids: torch.Tensor, meta: AttentionMetadata, cache: KVCache | None,
         last_rows: torch.Tensor) -> torch.Tensor:
    """One engine step: every layer over the batch, then logits of each request's last token. -> [B, V]"""
    h = model.forward(ids, meta, cache)
    return model.logits(h[last_rows])


def time_prefill(model: MoETransformer, seq_lens: list[int], block_size: int, repeats: int,
                 seed: int) -> dict:
    """Prefill of ``seq_lens`` fresh prompts through a paged cache (their KV written, as the engine does)."""
    cfg, device = model.cfg, model.w.embed.device
    per = [-(-n // block_size) for n in seq_lens]
    cache = KVCache.for_model(cfg, sum(per), block_size, model.w.embed.dtype, device)
    tables, first = [], 0
    for n in per:
        tables.append(tuple(range(first, first + n)))
        first += n
    meta = AttentionMetadata.build(seq_lens, [0] * len(seq_lens), tables, block_size, device)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (sum(seq_lens),), generator=g).to(device)  # [T]
    last_rows = torch.tensor(seq_lens, device=device).cumsum(0) - 1  # [B]
    times = timed_s(lambda: step(model, ids, meta, cache, last_rows), device, repeats)
    del cache
    seconds = statistics.median(times)
    flops = prefill_flops(cfg, seq_lens)
    return {"seq_lens": seq_lens, "tokens": sum(seq_lens), "repeats": repeats, "seconds": seconds,
            "seconds_all": times, "flops": flops, "flop_per_s": flops / seconds,
            "tokens_per_s": sum(seq_lens) / seconds}


def decode_cache(model: MoETransformer, max_batch: int, context: int, block_size: int, seed: int) -> DecodeCache:
    """A cache for ``max_batch`` requests of ``context`` tokens, every entry N(0, 1), blocks shuffled."""
    cfg, device, dtype = model.cfg, model.w.embed.device, model.w.embed.dtype
    per = -(-(context + 1) // block_size)
    cache = KVCache.for_model(cfg, max_batch * per, block_size, dtype, device)
    g = torch.Generator(device=device).manual_seed(seed)
    for t in cache.entries.values():
        t.normal_(generator=g)
    order = torch.randperm(max_batch * per, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = [tuple(order[i * per:(i + 1) * per]) for i in range(max_batch)]
    return DecodeCache(cache, tables, context)


def decode_batch(model: MoETransformer, kv: DecodeCache, batch: int, seed: int):
    """(ids [B], metadata, last rows [B]) of one decode step of ``batch`` requests at context C."""
    device = model.w.embed.device
    meta = AttentionMetadata.build([1] * batch, [kv.context] * batch, kv.tables[:batch], kv.cache.block_size, device)
    g = torch.Generator().manual_seed(seed + batch)
    ids = torch.randint(0, model.cfg.vocab_size, (batch,), generator=g).to(device)  # [B]
    return ids, meta, torch.arange(batch, device=device)


def experts_touched(model: MoETransformer, ids: torch.Tensor, meta: AttentionMetadata, kv: DecodeCache,
                    last_rows: torch.Tensor) -> dict[int, int]:
    """MoE layer -> distinct experts the step's routing selects (the step, run once untimed)."""
    seen: dict[int, int] = {}
    route = model.route

    def recording(layer: int, x: torch.Tensor):
        topk_ids, topk_weights = route(layer, x)
        seen[layer] = int(topk_ids.unique().numel())
        return topk_ids, topk_weights

    model.route = recording  # NOTE: an instance attribute: layer() looks route up through self
    try:
        step(model, ids, meta, kv.cache, last_rows)
    finally:
        del model.route
    return seen


def time_decode(model: MoETransformer, kv: DecodeCache, batch: int, repeats: int, seed: int) -> dict:
    """TPOT of ``batch`` requests at context C, and the bytes the step reads."""
    ids, meta, last_rows = decode_batch(model, kv, batch, seed)
    touched = experts_touched(model, ids, meta, kv, last_rows)
    kv_read = batch * (kv.context + 1) * kv.cache.bytes_per_token
    read = decode_step_bytes(model.w, touched, batch, kv_read)
    times = timed_s(lambda: step(model, ids, meta, kv.cache, last_rows), model.w.embed.device, repeats)
    seconds = statistics.median(times)
    return {"batch": batch, "context": kv.context, "repeats": repeats, "seconds": seconds, "seconds_all": times,
            "tokens_per_s": batch / seconds, "bytes": read, "bytes_per_s": read["total"] / seconds,
            "experts_touched": [touched[lid] for lid in sorted(touched)]}


def profile_decode(model: MoETransformer, kv: DecodeCache, batch: int, seed: int, top: int = 10) -> dict:
    """One decode step under torch.profiler (after a warm-up step): how many device operations it
    issues (CUDA: kernels launched; CPU: top-level ops), how much of the step the device is busy, and
    the operations that take the most time."""
    from torch.profiler import ProfilerActivity, profile

    from moeflow.bench.step_profile import summarize

    device = model.w.embed.device
    ids, meta, last_rows = decode_batch(model, kv, batch, seed)
    step(model, ids, meta, kv.cache, last_rows)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        step(model, ids, meta, kv.cache, last_rows)
        synchronize(device)
    return {"batch": batch, "context": kv.context, **summarize(prof.events(), device.type, top)}
