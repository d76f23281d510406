"""``moeflow bench contention``: does a streaming neighbour slow the decode attention block?

One layer's decode block (attention, MoE gate, the weighted sum of the experts' rows: the part
``moeflow profile`` times for the attention side) on one core, timed alone, then while a second
process loops the experts op of the same model on the other core, then alone again. Session 7's
probe for issue 17 (``docs/results/afd/contention_probe.json``; float32, one torch thread each).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import time

from moeflow.bench.timing import median_s
from moeflow.measure.provenance import write_json

ROWS_PER_EXPERT = 15  # the neighbour's batch: 15 rows for every expert of the layer


def add_parser(sub) -> None:
    p = sub.add_parser("contention", help="decode attention alone and beside a process running the experts op")
    p.add_argument("--model", default="tiny", help="tiny or a model path")
    p.add_argument("--shapes", default="5x2048,30x2048,8x8192", help="BATCHxCONTEXT, comma-separated")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--settle-s", type=float, default=6.0,
                   help="wait after starting the neighbour (its weights loaded and looping) before timing")
    p.add_argument("--json", default=None, metavar="OUT.json")
    p.set_defaults(func=run)


def _experts_loop(path: str, stop) -> None:
    import torch

    from moeflow.model.moe import experts_grouped
    from moeflow.model.weights import LoadSpec, load_weights

    torch.set_num_threads(1)
    cfg, w = load_weights(path, torch.float32, LoadSpec(attention=False))
    layer = next(i for i, s in enumerate(cfg.sparse_layers) if s)
    x = torch.randn(ROWS_PER_EXPERT * cfg.num_experts, cfg.hidden_size)  # [T, H]
    counts = torch.full((cfg.num_experts,), ROWS_PER_EXPERT, dtype=torch.int64)  # [E]
    while not stop.is_set():
        experts_grouped(w.experts, layer, x, counts)


def run(args: argparse.Namespace) -> int:
    import torch

    from moeflow.engine.llm import resolve_model
    from moeflow.model.kv_cache import AttentionMetadata, KVCache
    from moeflow.model.moe import plan_pairs, weighted_sum
    from moeflow.model.transformer import MoETransformer
    from moeflow.model.weights import load_weights

    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    torch.set_num_threads(1)
    path = resolve_model(args.model)
    cfg, w = load_weights(path, torch.float32)
    model = MoETransformer(cfg, w)
    layer = next(i for i, s in enumerate(cfg.sparse_layers) if s)
    ctx = mp.get_context("spawn")
    out = {}
    for b, c in shapes:
        block = 16
        per = -(-(c + 1) // block)  # blocks per request: its context and the decoded token
        cache = KVCache.for_model(cfg, b * per + 8, block, torch.float32)
        tables = [tuple(range(i * per, (i + 1) * per)) for i in range(b)]
        meta = AttentionMetadata.build([1] * b, [c] * b, tables, block)
        hidden = torch.randn(b, cfg.hidden_size)  # [B, H]

        def decode_block():
            a = model.attention(layer, hidden, meta, cache)
            ids, wts = model.route(layer, a.moe_input)
            plan = plan_pairs(ids, w.experts)
            model.combine(layer, a, weighted_sum(b, plan, a.moe_input[plan.token_index], wts))

        alone = median_s(decode_block, args.repeats)
        stop = ctx.Event()
        neighbour = ctx.Process(target=_experts_loop, args=(path, stop))
        neighbour.start()
        try:
            time.sleep(args.settle_s)
            beside = median_s(decode_block, args.repeats)
        finally:
            stop.set()
            neighbour.join()
        again = median_s(decode_block, args.repeats)
        out[f"{b}x{c}"] = {"alone_ms": alone * 1e3, "beside_experts_ms": beside * 1e3, "alone_again_ms": again * 1e3}
        print(f"{b} x {c}: alone {alone * 1e3:.2f} ms, beside experts {beside * 1e3:.2f} ms ({beside / alone:.2f}x), "
              f"alone again {again * 1e3:.2f} ms", flush=True)
    if args.json:
        write_json(args.json, {"what": __doc__, "model": args.model, "repeats": args.repeats, "results": out})
    return 0
