"""``moeflow bench decode-ops``: what one decode step asks of the device, per attention path and batch.

A colocated deployment (in this process) prefills ``batch`` requests, decodes one step, then the
next step is counted (``model/op_count.py``): its aten ops, the host syncs among them and where
each sync comes from. The paths are ``MOEFLOW_PAGED_ATTENTION``'s: ``kernel`` (the CPU's C++ op),
``batched`` (what a GPU runs) and ``gather`` (the per-request oracle), and ``graphs``: the batched
path through the CUDA graphs' static buffers and padded buckets, run eagerly
(``MOEFLOW_DECODE_GRAPHS=eager``). The worker-process modes step in other processes; what their
steps add to a layer is counted on the pieces, in this process, on the same model's shapes: the
attention side's dispatch (asap attention workers, dep ranks, afd attention instances), an FFN
daemon's experts over rows whose counts came in the headers, and a daemon that routes its own rows.
"""
from __future__ import annotations

import argparse
import os

_PATHS = ("kernel", "batched", "gather", "graphs")


def add_parser(sub) -> None:
    p = sub.add_parser("decode-ops", help="aten ops and host syncs of one colocated decode step, per path and batch")
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--paths", default=",".join(_PATHS), help=f"of {', '.join(_PATHS)}")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--sampling", default="greedy", choices=("greedy", "seeded"),
                   help="seeded: temperature 0.8, top_p 0.9, a seed, a presence penalty and 3 logprobs per request")
    p.add_argument("--json", default=None, metavar="FILE.json")
    p.add_argument("--md", default=None, metavar="FILE.md")
    p.set_defaults(func=run)


def count(model: str, dtype: str, path: str, batches: list[int], prompt_len: int, sampling: str) -> list[dict]:
    import torch

    from moeflow import LLM, SamplingParams
    from moeflow.core import Request
    from moeflow.model.op_count import OpCount

    os.environ["MOEFLOW_PAGED_ATTENTION"] = "batched" if path == "graphs" else path
    if path == "graphs":
        os.environ["MOEFLOW_DECODE_GRAPHS"] = "eager"
    else:
        os.environ.pop("MOEFLOW_DECODE_GRAPHS", None)
    torch.set_num_threads(1)
    rows = []
    blocks = sum(batches) * (-(-(prompt_len + 8) // 16) + 1)
    with LLM(model, dtype=dtype, num_kv_blocks=blocks, max_num_seqs=max(batches)) as llm:
        eng = llm.engine
        layers = eng.model_config.num_layers
        for b in batches:
            for i in range(b):
                p = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0) if sampling == "greedy" else \
                    SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.8, top_p=0.9, seed=i,
                                   presence_penalty=0.5, logprobs=3)
                eng.add_request(Request(f"{b}-{i}", list(range(1, prompt_len + 1)), p, 0.0))
            for _ in range(2):  # the prefill, then a first decode step
                eng.step()
            with OpCount() as c:
                res = eng.step()
            if len(res.outputs) != b:
                raise RuntimeError(f"path {path}, batch {b}: {len(res.outputs)} requests decoded in the counted step")
            rows.append({"path": path, "batch": b, "layers": layers, "ops": c.ops, "ops_per_layer": c.ops / layers,
                         "syncs": c.syncs, "sync_sites": dict(c.sync_sites)})
            while eng.has_unfinished():
                eng.step()
    return rows


def pieces(model: str, batches: list[int], workers: int = 2) -> list[dict]:
    """The split modes' per-layer pieces on ``model``'s expert shapes, experts spread over ``workers``
    (``tests/unit/test_dispatch_syncs.py`` asserts what these count)."""
    import torch

    from moeflow.model.moe import ExpertWeights
    from moeflow.model.op_count import OpCount
    from moeflow.model.weights import load_weights
    from moeflow.engine.llm import resolve_model
    from moeflow.workers.afd_connector import AfdControl, FfnInput
    from moeflow.workers.dispatch import ExpertRoutes
    from moeflow.workers.ffn import ffn_pairs

    cfg, w = load_weights(resolve_model(model, None), torch.float32)
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    placement = tuple(tuple(range(i * e // workers, (i + 1) * e // workers)) for i in range(workers))
    routes = ExpertRoutes(placement, e)
    el = len(placement[0])
    layer = w.experts.layer_ids[0]
    mine = ExpertWeights(w.experts.w13[:1, :el], w.experts.w2[:1, :el], (layer,), tuple(range(el)))
    g = torch.Generator().manual_seed(0)
    rows = []
    for b in batches:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(b)])  # [b, K]
        worker, local = routes.assign(ids)
        per = [[int(((worker == 0) & (local == s)).sum()) for s in range(el)]]
        inp = FfnInput(AfdControl(layer, {0: 0}, {0: sum(per[0])}, {0: per[0]}),
                       {0: torch.randn(sum(per[0]), cfg.hidden_size, generator=g)})
        for name, fn in (("dispatch (attention side)", lambda: routes.route(ids, (0, b), list(range(workers)))),
                         ("FFN daemon, rows routed by attention", lambda: ffn_pairs(mine, layer, inp, (0,))),
                         ("FFN daemon routing its own rows", lambda: routes.local_plan(ids, 0))):
            with OpCount() as c:
                fn()
            rows.append({"piece": name, "batch": b, "ops": c.ops, "syncs": c.syncs, "sync_sites": dict(c.sync_sites)})
    return rows


def run(args: argparse.Namespace) -> int:
    from moeflow.measure.provenance import provenance, write_result

    paths = [p for p in args.paths.split(",") if p]
    bad = [p for p in paths if p not in _PATHS]
    if bad:
        raise ValueError(f"--paths: {bad} not of {_PATHS}")
    batches = [int(b) for b in args.batches.split(",") if b]
    rows = []
    for path in paths:
        rows += count(args.model, args.dtype, path, batches, args.prompt_len, args.sampling)
    for r in rows:
        print(f"{r['path']:8} batch {r['batch']:4}: {r['ops']:6} ops ({r['ops_per_layer']:.0f}/layer), "
              f"{r['syncs']} syncs {r['sync_sites']}")
    parts = pieces(args.model, batches)
    for r in parts:
        print(f"{r['piece']:38} batch {r['batch']:4}: {r['ops']:4} ops, {r['syncs']} syncs {r['sync_sites']}")
    result = {"provenance": provenance(), "model": args.model, "dtype": args.dtype, "sampling": args.sampling,
              "rows": rows, "pieces": parts}
    write_result(result, args.json, args.md, markdown)
    return 0


def markdown(result: dict) -> str:
    prov = result["provenance"]
    lines = ["# Ops and host syncs of one decode step", "",
             f"Command: `{prov['command']}`  ", f"Commit {prov['commit']}{' (dirty)' if prov.get('dirty') else ''}, "
             f"{prov['date']}, {prov['cpu_model']} ({prov.get('isa', '?')}), {prov['cores']} cores, torch "
             f"{prov['torch']}; model {result['model']} in {result['dtype']}, colocated, {result['sampling']} "
             "sampling. Counted with `moeflow.model.op_count.OpCount` over one engine step (scheduling, the "
             "forward, sampling).", "",
             "| attention path | batch | aten ops | per layer | host syncs | where |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        where = "; ".join(f"{k} ×{v}" for k, v in r["sync_sites"].items())
        lines.append(f"| {r['path']} | {r['batch']} | {r['ops']} | {r['ops_per_layer']:.0f} | {r['syncs']} | {where} |")
    lines += ["", "What the worker-process modes add per MoE layer, counted on the pieces in one process (the "
              "same model's expert shapes, its experts over 2 workers). The dispatch's read-back is the sizes a "
              "host-driven transport writes each worker's rows with: one per MoE layer, where a device-initiated "
              "transport (DeepEP's, NVSHMEM's) would write them from the device.", "",
              "| piece | batch | aten ops | host syncs | where |", "|---|---|---|---|---|"]
    for r in result.get("pieces", []):
        where = "; ".join(f"{k} ×{v}" for k, v in r["sync_sites"].items())
        lines.append(f"| {r['piece']} | {r['batch']} | {r['ops']} | {r['syncs']} | {where} |")
    return "\n".join(lines) + "\n"
