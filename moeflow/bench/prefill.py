"""``moeflow bench prefill``: prefill throughput of moeflow vs transformers, and MFU.

Both run on the same checkpoint, in bf16 with the same thread count, side by side in one run
(alternating, median of ``--repeats``). The GEMM ceiling is measured in the same run, so MFU is
relative to what this machine delivered at that moment.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

SINGLE_LEN = 2048
RAGGED_LENS = [128, 402, 676, 951, 1225, 1499, 1774, 2048]  # 8 prompts evenly spread over 128..2048


def add_parser(sub) -> None:
    p = sub.add_parser("prefill", help="prefill tokens/s vs transformers, and model-FLOPs utilization")
    p.add_argument("--model", default="tiny")
    p.add_argument("--mode", default="colocated", help="moeflow deployment mode")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=run)


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def gemm_gflops(threads: int, repeats: int = 5) -> float:
    """bf16 GEMM rate of this machine now: [2048, 1024] x [1024, 4096], median of ``repeats``."""
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(2048, 1024, dtype=torch.bfloat16)
    b = torch.randn(4096, 1024, dtype=torch.bfloat16)
    torch.nn.functional.linear(a, b)
    t = _median_time(lambda: torch.nn.functional.linear(a, b), repeats)
    return 2 * 2048 * 1024 * 4096 / t / 1e9


def _prompts(lens: list[int], seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]


def _hf_prefill(model, prompts: list[list[int]]) -> None:
    """One forward over the padded batch, logits for the last position only (what generate's prefill does)."""
    import torch

    n = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), n, dtype=torch.int64)
    mask = torch.zeros(len(prompts), n, dtype=torch.int64)
    for i, p in enumerate(prompts):  # left padding, as for generation
        ids[i, n - len(p):] = torch.tensor(p)
        mask[i, n - len(p):] = 1
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, logits_to_keep=1, use_cache=False)


def run(args: argparse.Namespace) -> int:
    import torch

    from moeflow import LLM, SamplingParams
    from moeflow.bench.flops import prefill_flops

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, mode=args.mode, dtype="bfloat16", num_threads=args.threads,
              max_num_batched_tokens=16384)
    cfg = llm.engine.model_config
    hf = None
    if not args.no_transformers:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(llm.model_path, dtype=torch.bfloat16).eval()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    cases = {"single_2048": [SINGLE_LEN], "ragged_8": RAGGED_LENS}
    gemm = gemm_gflops(args.threads)
    rows = []
    for name, lens in cases.items():
        prompts = _prompts(lens, seed=len(lens))
        tokens = sum(lens)
        flops = prefill_flops(cfg, lens)
        llm.generate(prompts, params)  # warm-up
        if hf is not None:
            _hf_prefill(hf, prompts)
        ours, theirs = [], []
        for _ in range(args.repeats):  # alternate so both see the same machine conditions
            ours.append(_median_time(lambda: llm.generate(prompts, params), 1))
            if hf is not None:
                theirs.append(_median_time(lambda: _hf_prefill(hf, prompts), 1))
        t_ours = statistics.median(ours)
        row = {"case": name, "prompt_lens": lens, "tokens": tokens, "model_gflop": flops / 1e9,
               "moeflow_s": t_ours, "moeflow_tok_s": tokens / t_ours,
               "moeflow_mfu": flops / t_ours / 1e9 / gemm}
        if hf is not None:
            t_hf = statistics.median(theirs)
            row.update({"transformers_s": t_hf, "transformers_tok_s": tokens / t_hf,
                        "transformers_mfu": flops / t_hf / 1e9 / gemm, "speedup": t_hf / t_ours})
        rows.append(row)
    gemm_after = gemm_gflops(args.threads)
    llm.shutdown()
    result = {"model": args.model, "mode": args.mode, "dtype": "bfloat16", "threads": args.threads,
              "repeats": args.repeats, "gemm_gflops": gemm, "gemm_gflops_after": gemm_after,
              "cpu": platform.processor() or platform.machine(), "torch": torch.__version__, "rows": rows}
    _print(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _print(r: dict) -> None:
    print(f"model={r['model']} mode={r['mode']} bf16 threads={r['threads']} "
          f"GEMM {r['gemm_gflops']:.0f} GFLOP/s (after: {r['gemm_gflops_after']:.0f})")
    print(f"{'case':<12} {'tokens':>6} {'moeflow tok/s':>14} {'MFU':>6} {'transformers tok/s':>19} {'MFU':>6} {'speedup':>8}")
    for row in r["rows"]:
        hf_tok = f"{row['transformers_tok_s']:.0f}" if "transformers_tok_s" in row else "-"
        hf_mfu = f"{row['transformers_mfu']:.0%}" if "transformers_mfu" in row else "-"
        sp = f"{row['speedup']:.2f}x" if "speedup" in row else "-"
        print(f"{row['case']:<12} {row['tokens']:>6} {row['moeflow_tok_s']:>14.0f} {row['moeflow_mfu']:>6.0%} "
              f"{hf_tok:>19} {hf_mfu:>6} {sp:>8}")
