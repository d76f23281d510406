"""A production deployment nobody here built, simulated as published: DeepSeek-V3/R1's online service
on H800 nodes (DeepSeek's open-infra-index, day 6, "DeepSeek-V3/R1 Inference System Overview").
No constant is changed to meet it: the table says how far off the simulator is.

``python docs/results/sim/anchors.py OUT.md`` (about a minute). What the note states and what is
read from it:

- prefill: EP32 / DP32 over 4 nodes, 32 redundant experts; 73.7k input tokens/s per node including
  cache hits, 56.3% of input tokens hit the cache, so 32.2k computed tokens/s per node (4.0k per GPU);
- decode: EP144 / DP144 over 18 nodes, 32 redundant experts; 14.8k output tokens/s per node at an
  average 20-22 tokens/s per user (TPOT about 45-50 ms).

What it does not state, bracketed instead: the prompt and context lengths (2K, 4K and 8K tokens),
and the decode batch (the largest whose mean TPOT is within 1/20 s, the note's slower users).
Every system uses the simulator's defaults for ``deepseek-r1-fp8`` (sim/model_spec.py: FP8 weights
and dispatch as DeepSeek serves them, bf16 KV) on the ``h800`` preset (sim/hardware.py: the H100's
compute and HBM, 50 GB/s of InfiniBand per GPU for the all-to-all).
"""
from __future__ import annotations

import sys

from moeflow.experiment.serve import parse_experiment
from moeflow.sim.decode import simulate_decode, simulate_handed_decode
from moeflow.sim.hardware import hardware_preset
from moeflow.sim.run import build_cost, run_point
from moeflow.sim.sweep import steady_tok_s

HW = hardware_preset("h800")
BUDGET_GIB = 0.9 * HW.hbm_bytes / 2 ** 30  # vLLM's and SGLang's default share of device memory
CONTEXTS = (2048, 4096, 8192)
TPOT_S = 1 / 20
PREFILL_PER_NODE, DECODE_PER_NODE, CACHE_HIT = 73.7e3, 14.8e3, 0.563
EPLB = {"num_redundant_experts": 32, "sim": {"expert_placement": "eplb"}}


def _spec(name: str, system: dict, isl: int):
    base = {"model": "deepseek-r1-fp8", "hardware": "h800", "slo_ttft_s": 5,
            "workload": {"kind": "fixed", "fixed_len": isl, "output_len": 1, "num_requests": 2000, "seed": 0}}
    cfg = parse_experiment({**base, "rps": [1.0], "systems": {name: system}})
    return cfg, cfg.systems[name], build_cost(cfg)


def prefill_rows() -> list[str]:
    """Computed prompt tokens/s per node of dep32 saturated with prompts of each length."""
    rows = []
    for isl in CONTEXTS:
        system = {"mode": "dep", "dp": 32, "max_batch_tokens": 16384, **EPLB,
                  "engine": {"memory_budget_gib": BUDGET_GIB, "max_num_seqs": 1024}}
        cfg, spec, cost = _spec("dep32", system, isl)
        _, res = run_point(spec, cost, cfg, 400.0, num_requests=2000)
        per_node = steady_tok_s(res.records) / 32 * 8
        rows.append(f"| prefill, dep32 (EP32 over 4 nodes), prompts of {isl // 1024}K | "
                    f"{PREFILL_PER_NODE * (1 - CACHE_HIT) / 1e3:.1f}k | {per_node / 1e3:.1f}k | "
                    f"{per_node / (PREFILL_PER_NODE * (1 - CACHE_HIT)):.2f}x | "
                    f"busy {res.busy.get('rank', 0):.0%}; {', '.join(f'{k} {v:.0%}' for k, v in res.split.items())} |")
    return rows


def decode_rows() -> list[str]:
    rows = []
    for ctx in CONTEXTS:
        system = {"mode": "dep", "dp": 144, "max_batch_tokens": 16384, **EPLB,
                  "engine": {"memory_budget_gib": BUDGET_GIB, "kv_block_size": 64, "max_num_seqs": 1024}}
        _, spec, cost = _spec("dep144", system, ctx)
        tpot, best = {}, None
        b = 1
        while True:
            try:
                r = simulate_handed_decode(spec, cost, ctx, 4, HW.hbm_bytes, batch=b * 144)
            except ValueError:
                break
            tpot[b] = r
            if r["tpot_s"] > TPOT_S:
                break
            best = b
            b = b * 2 if b < 16 else b + 8
        if best is None:
            rows.append(f"| decode, dep144, context {ctx // 1024}K | {DECODE_PER_NODE / 1e3:.1f}k | none | - | "
                        f"TPOT {tpot[1]['tpot_s'] * 1e3:.0f} ms at one request per GPU |")
            continue
        r = tpot[best]
        per_node = r["tok_s_per_device"] * 8
        split = simulate_decode(spec, cost, ctx, 4, 1, HW.hbm_bytes, batch=best * 144)["split"]
        rows.append(f"| decode, dep144 (EP144 over 18 nodes), context {ctx // 1024}K | {DECODE_PER_NODE / 1e3:.1f}k | "
                    f"{per_node / 1e3:.1f}k | {per_node / DECODE_PER_NODE:.2f}x | {best} per GPU at TPOT "
                    f"{r['tpot_s'] * 1e3:.1f} ms (KV holds {r['capacity_per_group']}); a step: "
                    f"{', '.join(f'{k} {v:.0%}' for k, v in split.items())} |")
    return rows


def main(out: str) -> None:
    from moeflow.measure.provenance import provenance

    prov = provenance()
    text = ["# A production anchor: DeepSeek-V3/R1's service on H800 nodes", "",
            f"Written by `docs/results/sim/anchors.py` (commit {prov['commit'][:7]}"
            f"{', dirty' if prov.get('dirty') else ''}); the note's figures and what is assumed: the script's "
            "docstring. Per node = 8 GPUs. Nothing here was tuned to these numbers.", "",
            "| deployment | published per node | simulated per node | simulated / published | at |",
            "|---|---|---|---|---|", *prefill_rows(), *decode_rows(), ""]
    with open(out, "w") as f:
        f.write("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main(sys.argv[1])
