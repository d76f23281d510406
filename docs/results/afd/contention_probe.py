"""Session 7 probe for issue 17 (run: `python docs/results/afd/contention_probe.py docs/results/afd/contention_probe.json`).
Decode attention block (the profile's) on one core, alone and while a second process runs the
experts op of the same model on the other core: does a streaming neighbour slow it?"""
import multiprocessing as mp
import sys
import time


def experts_loop(stop):
    import torch
    torch.set_num_threads(1)
    from moeflow.engine.llm import resolve_model
    from moeflow.model.moe import experts_grouped
    from moeflow.model.weights import LoadSpec, load_weights
    path = resolve_model("tiny")
    cfg, w = load_weights(path, torch.float32, LoadSpec(attention=False, experts=tuple(range(16))))
    layer = next(i for i, s in enumerate(cfg.sparse_layers) if s)
    x = torch.randn(240, cfg.hidden_size)
    counts = torch.full((16,), 15, dtype=torch.int64)
    while not stop.is_set():
        experts_grouped(w.experts, layer, x, counts)


def main():
    import torch
    torch.set_num_threads(1)
    from moeflow.bench.profile import _median_s
    from moeflow.engine.llm import resolve_model
    from moeflow.model.kv_cache import AttentionMetadata, KVCache
    from moeflow.model.moe import plan_pairs, weighted_sum
    from moeflow.model.transformer import MoETransformer
    from moeflow.model.weights import load_weights
    cfg, w = load_weights(resolve_model("tiny"), torch.float32)
    model = MoETransformer(cfg, w)
    layer = next(i for i, s in enumerate(cfg.sparse_layers) if s)
    out = {}
    for b, c in ((5, 2048), (30, 2048), (8, 8192)):
        block = 16
        per = -(-(c + 1) // block)
        cache = KVCache.for_model(cfg, b * per + 8, block, torch.float32)
        tables = [tuple(range(i * per, (i + 1) * per)) for i in range(b)]
        meta = AttentionMetadata.build([1] * b, [c] * b, tables, block)
        hidden = torch.randn(b, cfg.hidden_size)

        def fn():
            a = model.attention(layer, hidden, meta, cache)
            ids, wts = model.route(layer, a.moe_input)
            plan = plan_pairs(ids, w.experts)
            model.combine(layer, a, weighted_sum(b, plan, a.moe_input[plan.token_index], wts))
        alone = _median_s(fn, 15)
        stop = mp.get_context("spawn").Event()
        p = mp.get_context("spawn").Process(target=experts_loop, args=(stop,))
        p.start()
        time.sleep(6)  # its weights loaded and looping
        beside = _median_s(fn, 15)
        stop.set(); p.join()
        again = _median_s(fn, 15)
        out[f"{b}x{c}"] = {"alone_ms": alone * 1e3, "beside_experts_ms": beside * 1e3, "alone_again_ms": again * 1e3}
        print(b, c, f"alone {alone*1e3:.2f} ms, beside experts {beside*1e3:.2f} ms ({beside/alone:.2f}x), alone again {again*1e3:.2f}", flush=True)
    from moeflow.measure.provenance import write_json
    write_json(sys.argv[1], {"what": __doc__, "results": out})


if __name__ == "__main__":
    main()
