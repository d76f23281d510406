"""A production deployment nobody here built, simulated as published: DeepSeek-V3/R1's online service
on H800 nodes (DeepSeek's open-infra-index, day 6, "DeepSeek-V3/R1 Inference System Overview").
No constant is changed to meet it: the table says how far off the simulator is.

``python docs/results/sim/anchors.py OUT.md`` (about a minute). What the note states and what is
read from it:

- prefill: EP32 / DP32 over 4 nodes, 32 redundant experts; 73.7k input tokens/s per node including
  cache hits, 56.3% of input tokens hit the cache, so 32.2k computed tokens/s per node (4.0k per GPU);
- decode: EP144 / DP144 over 18 nodes, 32 redundant experts; 14.8k output tokens/s per node at an
  average 20-22 tokens/s per user (TPOT about 45-50 ms).

The second anchor, SGLang's 96 x H100 deployment ("Deploying DeepSeek with PD Disaggregation and
Large-scale Expert Parallelism on 96 H100 GPUs", LMSYS blog, 2025-05-05), read from its evaluation:

- prefill on 4 nodes, EP32: 57,674, 54,543 and 50,302 input tokens/s per node for prompts of 1K, 2K
  and 4K (16,384 tokens per device in its profile run);
- decode on 9 nodes, EP72: 22,282 output tokens/s per node at 256 requests per device with 2,000
  tokens of KV each;
- EPLB "with a distribution matching the input/output data" over 288 expert slots (32 redundant);
  the nodes are joined by InfiniBand, whose rate per GPU the blog does not state (the ``h100``
  preset's 50 GB/s, DeepSeek's, is used).

What the DeepSeek note does not state, bracketed instead: the prompt and context lengths (2K, 4K and 8K tokens),
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

HW, H100 = hardware_preset("h800"), hardware_preset("h100")
BUDGET_GIB = 0.9 * HW.hbm_bytes / 2 ** 30  # vLLM's and SGLang's default share of device memory
CONTEXTS = (2048, 4096, 8192)
TPOT_S = 1 / 20
PREFILL_PER_NODE, DECODE_PER_NODE, CACHE_HIT = 73.7e3, 14.8e3, 0.563
EPLB = {"num_redundant_experts": 32, "sim": {"expert_placement": "eplb"}}


SGLANG_PREFILL = {1024: 57674, 2048: 54543, 4096: 50302}  # input tokens/s per node, EP32
SGLANG_DECODE, SGLANG_BATCH, SGLANG_KV = 22282, 256, 2000  # output tokens/s per node, EP72


def _spec(name: str, system: dict, isl: int, hardware: str = "h800"):
    base = {"model": "deepseek-r1-fp8", "hardware": hardware, "slo_ttft_s": 5,
            "workload": {"kind": "fixed", "fixed_len": isl, "output_len": 1, "num_requests": 2000, "seed": 0}}
    cfg = parse_experiment({**base, "rps": [1.0], "systems": {name: system}})
    return cfg, cfg.systems[name], build_cost(cfg)


def prefill_rows() -> list[str]:
    """Computed prompt tokens/s per node of dep32 saturated with prompts of each length."""
    rows = []
    for isl in CONTEXTS:
        system = {"mode": "dep", "dp": 32, "max_batch_tokens": 16384, **EPLB,
                  "engine": {"memory_budget_gib": BUDGET_GIB, "max_num_seqs": 1024}}
        per_node, res = _prefill_per_node(system, isl, "h800", 32)
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


def _prefill_per_node(system: dict, isl: int, hardware: str, ranks: int) -> tuple[float, object]:
    cfg, spec, cost = _spec(f"dep{ranks}", system, isl, hardware)
    _, res = run_point(spec, cost, cfg, 400.0, num_requests=2000)
    return steady_tok_s(res.records) / ranks * 8, res


def sglang_rows() -> list[str]:
    """SGLang's prefill (dep32) saturated at each of its prompt lengths, and its decode (dep72) at its batch."""
    rows = []
    for isl, published in SGLANG_PREFILL.items():
        system = {"mode": "dep", "dp": 32, "max_batch_tokens": 16384, **EPLB,
                  "engine": {"memory_budget_gib": 0.9 * H100.hbm_bytes / 2 ** 30, "max_num_seqs": 1024}}
        per_node, res = _prefill_per_node(system, isl, "h100", 32)
        rows.append(f"| SGLang prefill, dep32 on H100 (EP32 over 4 nodes), prompts of {isl // 1024}K | "
                    f"{published / 1e3:.1f}k | {per_node / 1e3:.1f}k | {per_node / published:.2f}x | "
                    f"busy {res.busy.get('rank', 0):.0%}; {', '.join(f'{k} {v:.0%}' for k, v in res.split.items())} |")
    system = {"mode": "dep", "dp": 72, "max_batch_tokens": 16384, **EPLB,
              "engine": {"memory_budget_gib": 0.9 * H100.hbm_bytes / 2 ** 30, "kv_block_size": 64, "max_num_seqs": 1024}}
    _, spec, cost = _spec("dep72", system, SGLANG_KV, "h100")
    # NOTE: at 0.9 of an H100's memory (the blog does not give its share) the bf16 KV cache may hold
    # fewer than the blog's 256 requests: then the most it holds runs, and the row says so
    b = min(SGLANG_BATCH, simulate_decode(spec, cost, SGLANG_KV, 1, 1, H100.hbm_bytes)["capacity_per_group"])
    r = simulate_decode(spec, cost, SGLANG_KV, 4, 1, H100.hbm_bytes, batch=b * 72)
    per_node = r["tok_s_per_device"] * 8
    rows.append(f"| SGLang decode, dep72 on H100 (EP72 over 9 nodes), {b} per GPU (blog: {SGLANG_BATCH}) at KV {SGLANG_KV} | "
                f"{SGLANG_DECODE / 1e3:.1f}k | {per_node / 1e3:.1f}k | {per_node / SGLANG_DECODE:.2f}x | TPOT "
                f"{r['tpot_s'] * 1e3:.1f} ms; a step: {', '.join(f'{k} {v:.0%}' for k, v in r['split'].items())} |")
    return rows


def main(out: str) -> None:
    from moeflow.measure.provenance import provenance

    prov = provenance()
    text = ["# Production anchors: DeepSeek-V3/R1's service on H800 nodes, SGLang's 96 x H100", "",
            f"Written by `docs/results/sim/anchors.py` (commit {prov['commit'][:7]}"
            f"{', dirty' if prov.get('dirty') else ''}); the note's figures and what is assumed: the script's "
            "docstring. Per node = 8 GPUs. Nothing here was tuned to these numbers.", "",
            "| deployment | published per node | simulated per node | simulated / published | at |",
            "|---|---|---|---|---|", *prefill_rows(), *decode_rows(), *sglang_rows(), ""]
    with open(out, "w") as f:
        f.write("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main(sys.argv[1])
