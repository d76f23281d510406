"""``moeflow predict afd``: the three factors and the speed-up for an M:N, m and context, from a
baseline's ``bench decode`` result and a stage profile; with ``--measured``, side by side with
what ``bench decode`` of afd measured."""
from __future__ import annotations

import argparse
import dataclasses
import json

from moeflow.measure.provenance import write_json
from moeflow.predict.afd import ATTENTION_MODELS, Baseline, predict
from moeflow.scheduler.pool import resident_capacity


def add_parser(sub) -> None:
    p = sub.add_parser("predict", help="analytic predictions from measured profiles")
    psub = p.add_subparsers(dest="predict", required=True)
    a = psub.add_parser("afd", help="FastAFD's speed-up of afd over a baseline (B ratio x T ratio x M/(M+N))")
    a.add_argument("--baseline", required=True, metavar="DECODE.json", help="bench decode result of the baseline")
    a.add_argument("--system", required=True, help="the baseline's system name in it")
    a.add_argument("--profile", required=True, metavar="PROFILE.json", help="moeflow profile of the model here")
    a.add_argument("--context", type=int, nargs="+", required=True)
    a.add_argument("--attn-workers", type=int, default=1)
    a.add_argument("--ffn-workers", type=int, default=1)
    a.add_argument("--micro-batches", type=int, nargs="+", default=[2])
    a.add_argument("--topology", default="block", choices=["block", "all"])
    a.add_argument("--max-batch-tokens", type=int, default=None,
                   help="the afd layout's (default: the baseline's, which sizes the same buffers and reserve)")
    a.add_argument("--chunked-prefill-size", type=int, default=None,
                   help="the afd layout's (default: the baseline's; with the batch limit it sets how long a "
                        "group's prefill takes, hence each request's KV reservation)")
    a.add_argument("--no-overlap-scheduling", action="store_true")
    a.add_argument("--attention", default="linear", choices=ATTENTION_MODELS,
                   help="how the attention side grows from the baseline's batch to afd's: linear per request "
                        "(FastAFD), or the baseline's plus the profile's decode fit from B_base to B_AFD")
    a.add_argument("--batch", type=int, default=None,
                   help="resident requests of afd in all, as bench decode's --batch (default: what the memory plan "
                        "holds under the baseline's budget)")
    a.add_argument("--measured", default=None, metavar="DECODE.json", help="bench decode result of afd to compare with")
    a.add_argument("--json", default=None)
    a.set_defaults(func=run_afd)


def _afd_resident(result: dict, system: str, layout, context: int) -> int:
    """Requests per attention instance the afd layout's memory plan holds under the baseline's budget."""
    from moeflow.experiment.decode import DecodeExperiment, resident, step_tokens
    from moeflow.config import EngineConfig
    from moeflow.engine.llm import resolve_model
    from moeflow.engine.modes import plan_for

    sysd = result["systems"][system]
    engine = {k: v for k, v in sysd["engine"].items() if k in {f.name for f in dataclasses.fields(EngineConfig)}}
    run = result["results"][system][str(context)]["runs"][0]
    config = EngineConfig(**{**engine, "model": result["model"], "dtype": run["dtype"]})
    if config.memory_budget_gib is None:
        raise ValueError(f"baseline {system} ran without --memory-budget-gib: nothing to compare the KV gain under")
    plan = plan_for(layout, resolve_model(result["model"]), config)

    def capacity_at(gen: int) -> int:
        return resident_capacity(plan.num_kv_blocks, config.kv_block_size, context + gen, config.max_num_seqs)
    # as bench decode sizes afd's own run: its reservation covers what its first requests decode
    # while the rest of the instance's group prefill, which grows with the group
    warmup = result.get("warmup_steps", DecodeExperiment.warmup_steps)  # files before it was recorded: the default
    return resident(capacity_at, context, warmup, result["steps"], step_tokens(layout, config))[0]


def _given_resident(batch: int | None, attn_workers: int) -> int | None:
    """Requests per attention instance when the afd run was given its batch (bench decode --batch)."""
    if batch is None:
        return None
    if batch < attn_workers:
        raise ValueError(f"--batch {batch}: fewer requests than the {attn_workers} attention instances")
    return batch // attn_workers


def run_afd(args: argparse.Namespace) -> int:
    from moeflow.engine.llm import resolve_model
    from moeflow.layout import make_layout
    from moeflow.model.weights import load_config

    with open(args.baseline) as f:
        base_result = json.load(f)
    with open(args.profile) as f:
        profile = json.load(f)
    measured = None
    if args.measured:
        with open(args.measured) as f:
            measured = json.load(f)
    mc, _ = load_config(resolve_model(base_result["model"]))
    rows = []
    base_sys = base_result["systems"][args.system]
    limits = {k: v for k, v in (("max_batch_tokens", args.max_batch_tokens or base_sys.get("max_batch_tokens")),
                                ("chunked_prefill_size", args.chunked_prefill_size or base_sys.get("chunked_prefill_size")))
              if v}
    for c in args.context:
        base = Baseline.from_result(base_result, args.system, c)
        for m in args.micro_batches:
            layout = make_layout("afd", attn_workers=args.attn_workers, ffn_workers=args.ffn_workers, micro_batches=m,
                                 topology=args.topology, overlap_scheduling=not args.no_overlap_scheduling, **limits)
            b_afd = _given_resident(args.batch, args.attn_workers) or _afd_resident(base_result, args.system, layout, c)
            pred = predict(base, profile, m=m, attn_workers=args.attn_workers, ffn_workers=args.ffn_workers,
                           served=len(layout.served_by(0)), local_experts=len(layout.experts_held(mc.num_experts)[0]),
                           b_afd=b_afd, num_layers=mc.num_layers, num_moe_layers=mc.num_moe_layers,
                           top_k=mc.num_experts_per_tok, overlap_scheduling=layout.overlap_scheduling,
                           pair_share=1 / len(layout.ffns_of(0)), attention=args.attention, context=c)
            row = {"context": c, **pred.to_dict()}
            if measured is not None:
                row["measured"] = _measured(measured, layout, c, base)
            rows.append(row)
            _print(row)
    if args.json:
        write_json(args.json, {"baseline": args.baseline, "baseline_system": args.system, "profile": args.profile,
                               "attn_workers": args.attn_workers, "ffn_workers": args.ffn_workers,
                               "topology": args.topology, "attention_model": args.attention, "predictions": rows})
    return 0


def _measured(result: dict, layout, context: int, base: Baseline) -> dict | None:
    """The afd system of ``result`` with this layout's M, N, m and overlap setting, as factors."""
    for name, sysd in result["systems"].items():
        if sysd.get("mode") == "afd" and all(sysd.get(k) == getattr(layout, k) for k in
                                             ("attn_workers", "ffn_workers", "micro_batches", "topology",
                                              "overlap_scheduling")):
            r = result["results"][name].get(str(context))
            if r is None:
                return None
            t = r["tpot_s"]["mean"]
            node = layout.attn_workers / (layout.attn_workers + layout.ffn_workers)
            b_ratio, t_ratio = r["resident_per_group"] / base.resident, base.tpot_s / t
            return {"system": name, "b_afd": r["resident_per_group"], "t_afd_s": t, "b_ratio": b_ratio,
                    "t_ratio": t_ratio, "node_factor": node, "speedup": b_ratio * t_ratio * node,
                    "tpot_ci95": r["tpot_s"]["ci95"]}
    return None


def _print(row: dict) -> None:
    flag = "" if row["overlap_holds"] else "  (overlap fails: F > A, the FFN is not hidden)"
    line = (f"context {row['context']} m={row['m']}: B {row['b_afd']}/{row['b_base']:g} = {row['b_ratio']:.2f}, "
            f"T {row['t_base_s'] * 1e3:.1f}/{row['t_afd_s'] * 1e3:.1f} ms = {row['t_ratio']:.2f}, "
            f"M/(M+N) {row['node_factor']:.2f} -> predicted {row['speedup']:.2f}x{flag}")
    meas = row.get("measured")
    if meas:
        line += (f"\n    measured ({meas['system']}): B {meas['b_ratio']:.2f}, T {meas['t_ratio']:.2f}, "
                 f"speed-up {meas['speedup']:.2f}x; prediction error {row['speedup'] / meas['speedup'] - 1:+.1%}")
    print(line)
