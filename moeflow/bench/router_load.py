"""Expert load under a model's own router, on a workload's prompts: the measured side of the
simulator's expert-skew model (``sim/expert_load.py``).

    moeflow bench router-load --model tiny --length-scale 0.1 --num-requests 40 --devices 2,4 --json out.json

One process, colocated forward (the model's own attention, router and experts), each prompt a
batch of its own. Per MoE layer it counts the (token, expert) pairs of every expert and reports:
the coefficient of variation of the per-expert load over the whole workload (what
``SimOptions.expert_load_cv`` models), the hottest expert / mean, and, for N expert devices with
the contiguous placement, the most loaded device / mean per prompt (averaged over prompts) next to
what the simulator's model predicts for the same pair counts at the measured CV.

NOTE: the embedded models have random weights; their routing says little about a trained model's.
"""
from __future__ import annotations

import argparse

import numpy as np


def measure(model: str, prompts: list[list[int]], dtype: str = "float32",
            router_skew: float = 0.0) -> tuple[int, list[np.ndarray]]:
    """(number of experts, per prompt an [L_moe, E] array of pairs per expert)."""
    import torch

    from moeflow.engine.llm import resolve_model
    from moeflow.model.kv_cache import AttentionMetadata
    from moeflow.model.transformer import MoETransformer
    from moeflow.model.weights import load_weights

    cfg, w = load_weights(resolve_model(model), getattr(torch, dtype), router_skew=router_skew)
    net = MoETransformer(cfg, w)
    moe_layers = [lid for lid in range(cfg.num_layers) if cfg.sparse_layers[lid]]
    out = []
    with torch.inference_mode():
        for ids in prompts:
            counts = np.zeros((len(moe_layers), cfg.num_experts), dtype=np.int64)
            meta = AttentionMetadata.build([len(ids)], [0], None, 16)
            h = net.embed(torch.tensor(ids, dtype=torch.int64))
            for lid in range(cfg.num_layers):
                if not cfg.sparse_layers[lid]:
                    h = net.layer(lid, h, meta, None)
                    continue
                attn = net.attention(lid, h, meta, None)
                topk, wts = net.route(lid, attn.moe_input)
                counts[moe_layers.index(lid)] = np.bincount(topk.flatten().numpy(), minlength=cfg.num_experts)
                h = net.combine(lid, attn, net.experts(lid, attn.moe_input, topk, wts))
            out.append(counts)
    return cfg.num_experts, out


def summarize(num_experts: int, per_prompt: list[np.ndarray], devices: list[int], seed: int = 0) -> dict:
    from moeflow.sim.expert_load import ExpertLoads

    total = np.sum(per_prompt, axis=0)  # [L, E]
    share = total / total.sum(axis=1, keepdims=True)
    cv = share.std(axis=1) / share.mean(axis=1)  # per layer, across experts
    out = {"num_prompts": len(per_prompt), "pairs": int(total.sum()), "num_experts": num_experts,
           "expert_cv_per_layer": cv.tolist(), "expert_cv_mean": float(cv.mean()),
           "hottest_expert_over_mean_per_layer": (share.max(axis=1) * num_experts).tolist(), "devices": {}}
    for n in devices:
        owner = np.arange(num_experts) * n // num_experts
        measured = []
        for c in per_prompt:
            dev = np.stack([np.bincount(owner, weights=row, minlength=n) for row in c])  # [L, N]
            measured.append(dev.max(axis=1) / dev.mean(axis=1))
        model = ExpertLoads(num_experts, total.shape[0], n, float(cv.mean()), seed=seed)
        for c in per_prompt:
            model.draw(int(c[0].sum()))
        out["devices"][str(n)] = {"measured_max_over_mean": float(np.mean(measured)),
                                  "measured_per_layer": np.mean(measured, axis=0).tolist(),
                                  "model_max_over_mean": model.mean_imbalance}
    return out


def add_parser(sub) -> None:
    p = sub.add_parser("router-load", help="expert load under the model's own router on a workload's prompts")
    p.add_argument("--model", default="tiny")
    p.add_argument("--workload", default="production")
    p.add_argument("--length-scale", type=float, default=0.1)
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--devices", default="2,4", help="expert devices to report, comma-separated")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--router-skew", type=float, default=0.0,
                   help="the benchmarks' Zipf tilt of the routers (0: the model's own)")
    p.add_argument("--json", default=None)
    p.add_argument("--save-location", default=None, metavar="FILE.json",
                   help="write the load as a file --init-expert-location starts a deployment from")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moeflow.bench.http_client import token_prompts
    from moeflow.measure.workload import WorkloadConfig, generate_requests

    reqs = generate_requests(WorkloadConfig(kind=args.workload, rate_rps=1.0, num_requests=args.num_requests,
                                            length_scale=args.length_scale, seed=args.seed))
    num_experts, per_prompt = measure(args.model, token_prompts(reqs, args.seed), args.dtype, args.router_skew)
    res = summarize(num_experts, per_prompt, [int(x) for x in args.devices.split(",")], args.seed)
    res.update(model=args.model, workload=args.workload, length_scale=args.length_scale, seed=args.seed,
               router_skew=args.router_skew)
    print(f"{args.model}: {res['num_prompts']} prompts, {res['pairs']:,} (token, expert) pairs, "
          f"{num_experts} experts; per-expert load CV per layer: "
          + " ".join(f"{x:.2f}" for x in res["expert_cv_per_layer"]) + f" (mean {res['expert_cv_mean']:.2f})")
    print("hottest expert / mean per layer: " + " ".join(f"{x:.2f}" for x in res["hottest_expert_over_mean_per_layer"]))
    for n, d in res["devices"].items():
        print(f"{n} devices, per prompt, most loaded / mean: measured {d['measured_max_over_mean']:.3f}, "
              f"the simulator's model at CV {res['expert_cv_mean']:.2f}: {d['model_max_over_mean']:.3f}")
    if args.json:
        from moeflow.measure.provenance import write_json

        write_json(args.json, res)
    if args.save_location:
        save_location(args.save_location, args.model, per_prompt)
    return 0


def save_location(path: str, model: str, per_prompt: list[np.ndarray]) -> None:
    """The measured load in ``scheduler/expert_location``'s format (what /expert_distribution writes)."""
    from moeflow.engine.llm import resolve_model
    from moeflow.measure.provenance import write_json
    from moeflow.model.weights import load_config

    cfg, _ = load_config(resolve_model(model))
    total = np.sum(per_prompt, axis=0)
    write_json(path, {"logical_count": total.tolist(), "num_experts": cfg.num_experts, "work_items": len(per_prompt),
                      "moe_layers": [lid for lid in range(cfg.num_layers) if cfg.sparse_layers[lid]]})
    print(f"the load of {len(per_prompt)} prompts: {path} (--init-expert-location {path})")

