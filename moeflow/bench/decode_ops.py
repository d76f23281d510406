"""``moeflow bench decode-ops``: what one decode step asks of the device, per attention path and batch.

A colocated deployment (in this process) prefills ``batch`` requests, decodes one step, then the
next step is counted (``model/op_count.py``): its aten ops, the host syncs among them and where
each sync comes from. The paths are ``MOEFLOW_PAGED_ATTENTION``'s: ``kernel`` (the CPU's C++ op),
``batched`` (what a GPU runs) and ``gather`` (the per-request oracle). Worker-process modes (dep,
asap, afd, dwdp) step in other processes and are not counted here.
"""
from __future__ import annotations

import argparse
import os

_PATHS = ("kernel", "batched", "gather")


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

    os.environ["MOEFLOW_PAGED_ATTENTION"] = path
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
    result = {"provenance": provenance(), "model": args.model, "dtype": args.dtype, "sampling": args.sampling,
              "rows": rows}
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
    return "\n".join(lines) + "\n"
