"""``moeflow bench decode-attention``: one layer's decode attention over the paged KV cache, the
in-place kernel against the gather path, each as a fraction of the memory-bandwidth bound.

Decode attention reads every cached key and value of the batch once and does little arithmetic
per byte, so its floor is the time to stream those bytes: bound = KV bytes read / copy bandwidth,
the copy bandwidth measured in the same run (median ``dst.copy_(src)`` over a buffer 4x the
last-level cache; bytes = the size of src). The gather path copies every request's context out
of the cache first (index_select) and then runs SDPA on the copy. Block tables are shuffled, as a
cache that has served a while holds them. MLA's latent rows are read once: keys are the whole
row, values a view of its first kv_lora_rank columns (DSA decode keeps the gather path).
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

from moeflow.bench.timing import median_s
from moeflow.config import DTYPES
from moeflow.measure.provenance import write_json


@dataclass(frozen=True)
class Shape:
    """What one layer's decode attention reads per token and head."""

    heads: int  # query heads
    kv_heads: int  # heads of the cache (MLA: 1, the latent)
    head_dim_k: int
    head_dim_v: int
    latent: bool  # MLA: values are the first head_dim_v columns of the key rows


def add_parser(sub) -> None:
    p = sub.add_parser("decode-attention", help="decode attention over the paged KV cache vs the bandwidth bound")
    p.add_argument("--model", default=None, help="tiny, tiny-mla or a model path: one layer's attention shape "
                   "(default tiny unless --heads/--kv-heads/--head-dim are given)")
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--context", type=int, nargs="+", default=[2048, 8192], help="tokens per request")
    p.add_argument("--batch", type=int, default=16, help="decode requests")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="auto", choices=list(DTYPES), help="auto: what this machine computes natively")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the serving workers run one)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)


def _shape(args: argparse.Namespace) -> tuple[str, Shape, str | None]:
    """(label, shape, checkpoint dtype) from --model or the explicit dims."""
    explicit = (args.heads, args.kv_heads, args.head_dim)
    if any(x is not None for x in explicit):
        if args.model is not None or None in explicit:
            raise ValueError("give --model, or all of --heads, --kv-heads and --head-dim")
        h, kv, d = explicit
        if h % kv:
            raise ValueError(f"--heads ({h}) must be a multiple of --kv-heads ({kv})")
        return f"Hq {h} Hkv {kv} D {d}", Shape(h, kv, d, d, False), "bfloat16"  # auto: as for a bf16 checkpoint
    from moeflow.engine.llm import resolve_model
    from moeflow.model.family import family_for, load_families
    from moeflow.model.tiny_config import EMBEDDED
    from moeflow.model.weights import load_config

    model = args.model or "tiny"
    if model in EMBEDDED:  # the config alone: no need to write the checkpoint
        load_families()
        hf = EMBEDDED[model][0]
        cfg = family_for(hf).to_model_config(hf)
    else:
        cfg = load_config(resolve_model(model))[0]
    if cfg.kv_lora_rank:
        shape = Shape(cfg.num_heads, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank, True)
    else:
        shape = Shape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim, False)
    return model, shape, cfg.checkpoint_dtype


def _point(shape: Shape, context: int, args: argparse.Namespace, dtype, kernel_ok: bool) -> dict:
    import torch

    from moeflow.hardware.cpuinfo import last_level_cache_bytes
    from moeflow.hardware.report import memcpy_s
    from moeflow.model.paged_attention import gathered_decode_attention, paged_decode_attention

    g = torch.Generator().manual_seed(args.seed + context)
    b, bs = args.batch, args.block_size
    per = -(-context // bs)  # blocks per request
    n_slots = b * per * bs
    if shape.latent:
        latents = torch.randn(n_slots, shape.head_dim_k, generator=g).to(dtype)  # [N, Rkv + dr]
        k, v = latents.unsqueeze(1), latents[:, None, :shape.head_dim_v]  # [N, 1, Dk], [N, 1, Dv] views
        kv_bytes = b * context * shape.head_dim_k * dtype.itemsize
    else:
        k = torch.randn(n_slots, shape.kv_heads, shape.head_dim_k, generator=g).to(dtype)  # [N, Hkv, Dk]
        v = torch.randn(n_slots, shape.kv_heads, shape.head_dim_v, generator=g).to(dtype)  # [N, Hkv, Dv]
        kv_bytes = b * context * shape.kv_heads * (shape.head_dim_k + shape.head_dim_v) * dtype.itemsize
    tables = torch.randperm(b * per, generator=g).view(b, per).to(torch.int32)  # [B, blocks], shuffled
    lens = torch.full((b,), context, dtype=torch.int32)
    q = torch.randn(b, shape.heads, shape.head_dim_k, generator=g).to(dtype)  # [B, Hq, Dk]

    src = torch.ones(4 * last_level_cache_bytes() // 4, dtype=torch.float32)
    copy_gbps = src.nbytes / memcpy_s(src, repeats=args.repeats) / 1e9
    del src
    bound_s = kv_bytes / (copy_gbps * 1e9)

    def timing(fn) -> dict:
        s = median_s(lambda: fn(q, k, v, tables, lens, bs), args.repeats)
        return {"seconds": s, "gbps": kv_bytes / s / 1e9, "fraction_of_bound": bound_s / s}

    gather = timing(gathered_decode_attention)
    point = {"context": context, "kv_bytes": kv_bytes, "copy_gbps": copy_gbps, "bound_s": bound_s,
             "gather": gather, "kernel": None, "speedup": None, "max_abs_diff": None}
    if kernel_ok:
        point["kernel"] = timing(paged_decode_attention)
        point["speedup"] = gather["seconds"] / point["kernel"]["seconds"]
        diff = paged_decode_attention(q, k, v, tables, lens, bs).float() - \
            gathered_decode_attention(q, k, v, tables, lens, bs).float()
        point["max_abs_diff"] = diff.abs().max().item()
    return point


def run(args: argparse.Namespace) -> int:
    import torch

    from moeflow.hardware import resolve_dtype
    from moeflow.model.paged_attention import kernel_status

    label, shape, ckpt_dtype = _shape(args)
    torch.set_num_threads(args.threads)
    args.dtype = resolve_dtype(args.dtype, ckpt_dtype).dtype
    dtype = getattr(torch, args.dtype)
    status = kernel_status()
    kind = "MLA latent" if shape.latent else "GQA"
    print(f"{label}: {kind} decode attention, Hq {shape.heads}, Hkv {shape.kv_heads}, Dk {shape.head_dim_k}, "
          f"Dv {shape.head_dim_v}, {args.dtype}, batch {args.batch}, block {args.block_size}, "
          f"{args.threads} thread(s)")
    if status.available:
        print(f"kernel: {'built' if status.built else 'loaded'} in {status.load_s:.1f} s ({status.reason})")
    else:
        print(f"kernel unavailable, gather path only: {status.reason}")
    points = [_point(shape, c, args, dtype, status.available) for c in args.context]
    print(f"{'context':>7} {'KV MB':>8} {'copy GB/s':>9} {'bound ms':>8} | {'kernel ms':>9} {'GB/s':>6} {'of bound':>8} "
          f"| {'gather ms':>9} {'GB/s':>6} {'of bound':>8} | {'speed-up':>8}")
    for p in points:
        kn, ga = p["kernel"], p["gather"]
        kcols = (f"{kn['seconds'] * 1e3:>9.2f} {kn['gbps']:>6.1f} {kn['fraction_of_bound']:>8.0%}" if kn
                 else f"{'-':>9} {'-':>6} {'-':>8}")
        print(f"{p['context']:>7} {p['kv_bytes'] / 1e6:>8.1f} {p['copy_gbps']:>9.1f} {p['bound_s'] * 1e3:>8.2f} | "
              f"{kcols} | {ga['seconds'] * 1e3:>9.2f} {ga['gbps']:>6.1f} {ga['fraction_of_bound']:>8.0%} | "
              + (f"{p['speedup']:>7.1f}x" if p["speedup"] else f"{'-':>8}"))
    if args.json:
        write_json(args.json, {"model": label, "shape": asdict(shape), "dtype": args.dtype, "threads": args.threads,
                               "batch": args.batch, "block_size": args.block_size, "repeats": args.repeats,
                               "kernel": {"available": status.available, "reason": status.reason,
                                          "load_s": status.load_s, "built": status.built},
                               "points": points})
    return 0
