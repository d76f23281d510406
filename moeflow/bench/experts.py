"""``moeflow bench experts``: one MoE layer's expert time against batch tokens, and its inflection.

ASAP §2.2.2 (Fig. 3b): expert time stays flat while the layer is memory-bound (weights are read
once whatever the token count), then grows linearly once compute-bound. The inflection — where
the linear regime extrapolated back meets the plateau — is the default ``min_batch_tokens`` of
length-aware batching. Tokens are routed uniformly at random (top-k of E), as under balanced load.
"""
from __future__ import annotations

import argparse

from moeflow.bench.timing import median_s
from moeflow.config import DTYPES
from moeflow.measure.provenance import write_json

TOKENS = [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


def add_parser(sub) -> None:
    p = sub.add_parser("experts", help="expert-layer time vs tokens, and the MoE inflection point")
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default="auto", choices=list(DTYPES), help="auto: what this machine computes natively")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)


KNEE_FACTOR = 1.5  # "compute-bound" = per-token time within 1.5x of the largest batch's


def crossover_tokens(points: list[tuple[int, float]]) -> float:
    """Roofline knee: where the compute-bound line (fit through the two largest points) meets
    the plateau (the smallest point's time)."""
    (t1, s1), (t2, s2) = points[-2], points[-1]
    slope = (s2 - s1) / (t2 - t1)
    intercept = s2 - slope * t2
    return max(points[0][0], (points[0][1] - intercept) / slope)


def inflection_tokens(points: list[tuple[int, float]]) -> int:
    """Smallest measured batch whose per-token time is within KNEE_FACTOR of the compute-bound
    per-token time: from there on, time grows linearly with tokens (ASAP Fig. 3b)."""
    n_max, s_max = points[-1]
    floor = s_max / n_max
    return next(n for n, s in points if s / n <= KNEE_FACTOR * floor)


def run(args: argparse.Namespace) -> int:
    import torch

    from moeflow.engine.llm import resolve_model
    from moeflow.hardware import resolve_dtype
    from moeflow.model.moe import experts_grouped, plan_pairs
    from moeflow.model.weights import LoadSpec, load_config, load_weights

    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    args.dtype = resolve_dtype(args.dtype, load_config(path)[0].checkpoint_dtype).dtype
    dtype = getattr(torch, args.dtype)
    cfg, w = load_weights(path, dtype, LoadSpec(attention=False))
    layer = w.experts.layer_ids[0]
    g = torch.Generator().manual_seed(0)
    points = []
    for n in TOKENS:
        x = torch.randn(n, cfg.hidden_size, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.num_experts_per_tok] for _ in range(n)])
        plan = plan_pairs(ids, w.experts)
        xs = x[plan.token_index]
        points.append((n, median_s(lambda: experts_grouped(w.experts, layer, xs, plan.counts), args.repeats)))
    knee, cross = inflection_tokens(points), crossover_tokens(points)
    print(f"{args.model}: one MoE layer, {cfg.num_experts} experts top-{cfg.num_experts_per_tok}, "
          f"{args.dtype}, {args.threads} thread(s)")
    print(f"{'tokens':>7} {'ms':>8} {'us/token':>9}")
    for n, s in points:
        print(f"{n:>7} {s * 1e3:>8.2f} {s / n * 1e6:>9.1f}")
    print(f"roofline crossover (plateau meets the compute-bound line): ~{cross:.0f} tokens")
    print(f"inflection (per-token time within {KNEE_FACTOR}x of compute-bound): {knee} tokens")
    if args.json:
        write_json(args.json, {"model": args.model, "dtype": args.dtype, "threads": args.threads,
                               "points": [{"tokens": n, "seconds": s} for n, s in points],
                               "inflection_tokens": knee, "crossover_tokens": cross})
    return 0
