"""``moeflow bench prefill``: prefill throughput of moeflow vs transformers, and MFU.

Both run on the same checkpoint, in the same dtype (``--dtype``, default ``auto``: what this machine
computes natively) and thread count, side by side in one run (alternating, median of
``--repeats``). The GEMM ceiling is measured in the same run and the same dtype, so MFU is
relative to what this machine delivered at that moment for the dtype actually run.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

from moeflow.bench.timing import median_s
from moeflow.engine.args import add_engine_args, engine_kwargs
from moeflow.measure.provenance import provenance, write_json

SINGLE_LEN = 2048
RAGGED_LENS = [128, 402, 676, 951, 1225, 1499, 1774, 2048]  # 8 prompts evenly spread over 128..2048


def add_parser(sub) -> None:
    p = sub.add_parser("prefill", help="prefill tokens/s vs transformers (colocated) or vs colocated (asap)")
    add_engine_args(p)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stream", type=int, default=16, help="asap: prompts of 2048 tokens in the stream")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=run)


def gemm_gflops(threads: int, dtype: str, repeats: int = 5) -> float:
    """GEMM rate of this machine now in ``dtype``: [2048, 1024] x [1024, 4096], median of ``repeats``."""
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(2048, 1024).to(getattr(torch, dtype))
    b = torch.randn(4096, 1024).to(getattr(torch, dtype))
    t = median_s(lambda: torch.nn.functional.linear(a, b), repeats)
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
    if args.mode != "colocated":
        return run_stream(args)
    return run_vs_transformers(args)


def run_vs_transformers(args: argparse.Namespace) -> int:
    import torch

    from moeflow import LLM, SamplingParams
    from moeflow.bench.flops import prefill_flops

    torch.set_num_threads(args.threads)
    llm = LLM(**engine_kwargs(args), max_num_batched_tokens=16384)
    cfg, dtype = llm.engine.model_config, llm.config.dtype  # "auto" resolved
    hf = None
    if not args.no_transformers:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(llm.model_path, dtype=getattr(torch, dtype)).eval()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    cases = {"single_2048": [SINGLE_LEN], "ragged_8": RAGGED_LENS}
    gemm = gemm_gflops(args.threads, dtype)
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
            ours.append(median_s(lambda: llm.generate(prompts, params), 1, warmup=False))
            if hf is not None:
                theirs.append(median_s(lambda: _hf_prefill(hf, prompts), 1, warmup=False))
        t_ours = statistics.median(ours)
        row = {"case": name, "prompt_lens": lens, "tokens": tokens, "model_gflop": flops / 1e9,
               "moeflow_s": t_ours, "moeflow_tok_s": tokens / t_ours,
               "moeflow_mfu": flops / t_ours / 1e9 / gemm}
        if hf is not None:
            t_hf = statistics.median(theirs)
            row.update({"transformers_s": t_hf, "transformers_tok_s": tokens / t_hf,
                        "transformers_mfu": flops / t_hf / 1e9 / gemm, "speedup": t_hf / t_ours})
        rows.append(row)
    gemm_after = gemm_gflops(args.threads, dtype)
    llm.shutdown()
    result = {"model": args.model, "mode": args.mode, "dtype": dtype, "threads": args.threads,
              "repeats": args.repeats, "gemm_gflops": gemm, "gemm_gflops_after": gemm_after,
              "cpu": platform.processor() or platform.machine(), "torch": torch.__version__, "rows": rows}
    _print(result)
    if args.json:
        write_json(args.json, result)
    return 0


def _print(r: dict) -> None:
    print(f"model={r['model']} mode={r['mode']} {r['dtype']} threads={r['threads']} "
          f"GEMM {r['gemm_gflops']:.0f} GFLOP/s (after: {r['gemm_gflops_after']:.0f})")
    print(f"{'case':<12} {'tokens':>6} {'moeflow tok/s':>14} {'MFU':>6} {'transformers tok/s':>19} {'MFU':>6} {'speedup':>8}")
    for row in r["rows"]:
        hf_tok = f"{row['transformers_tok_s']:.0f}" if "transformers_tok_s" in row else "-"
        hf_mfu = f"{row['transformers_mfu']:.0%}" if "transformers_mfu" in row else "-"
        sp = f"{row['speedup']:.2f}x" if "speedup" in row else "-"
        print(f"{row['case']:<12} {row['tokens']:>6} {row['moeflow_tok_s']:>14.0f} {row['moeflow_mfu']:>6.0%} "
              f"{hf_tok:>19} {hf_mfu:>6} {sp:>8}")


def run_stream(args: argparse.Namespace) -> int:
    """A stream of 2048-token prompts through ``--mode`` and through colocated, alternating runs."""
    from moeflow import LLM, SamplingParams
    from moeflow.engine.trace import busy_fractions, write_chrome_trace

    prompts = _prompts([SINGLE_LEN] * args.stream, seed=7)
    tokens = SINGLE_LEN * args.stream
    params = SamplingParams(max_tokens=1, temperature=0.0)
    kw = engine_kwargs(args)
    kw.setdefault("min_batch_tokens", SINGLE_LEN)  # one prompt per batch: pairs of 2k-token batches
    kw.setdefault("max_batch_tokens", SINGLE_LEN)
    kw.setdefault("max_batch_wait_s", 0.0)
    ours = LLM(**kw)
    base = LLM(args.model, dtype=ours.config.dtype, num_threads=args.threads, max_num_batched_tokens=SINGLE_LEN)
    try:
        base.generate(prompts[:1], params)
        ours.generate(prompts[:2], params)
        if args.trace:
            ours.engine.collect_spans()  # drop the warm-up's spans
        t_base, t_ours = [], []
        for i in range(args.repeats):
            t_base.append(median_s(lambda: base.generate(prompts, params), 1, warmup=False))
            t0 = time.monotonic()
            t_ours.append(median_s(lambda: ours.generate(prompts, params), 1, warmup=False))
            window = (t0, time.monotonic())
        busy = {}
        if args.trace:
            spans = ours.engine.collect_spans()
            write_chrome_trace([sp for sp in spans if sp.end_s >= window[0]], args.trace, {"provenance": provenance()})
            # steady state: the middle 80% of the last run (ramp-up and drain left out)
            lo, hi = window
            busy = busy_fractions(spans, lo + 0.1 * (hi - lo), hi - 0.1 * (hi - lo))
    finally:
        base.shutdown()
        ours.shutdown()
    tb, to = statistics.median(t_base), statistics.median(t_ours)
    result = {"model": args.model, "mode": args.mode, "config": {k: v for k, v in kw.items() if k != "model"},
              "dtype": ours.config.dtype, "threads": args.threads, "repeats": args.repeats, "prompts": args.stream,
              "prompt_len": SINGLE_LEN, "colocated_tok_s": tokens / tb, "mode_tok_s": tokens / to,
              "speedup": tb / to, "busy_fraction_steady": busy, "trace": args.trace}
    print(f"stream of {args.stream} x {SINGLE_LEN}-token prompts, {result['dtype']}, {args.threads} thread(s) per process")
    print(f"{'colocated':<34} {tokens / tb:>8.0f} tok/s")
    print(f"{args.mode + ' ' + _layout(kw):<34} {tokens / to:>8.0f} tok/s   speedup {tb / to:.2f}x")
    for proc, frac in sorted(busy.items()):
        print(f"  steady-state busy {proc:<16} {frac:6.1%}")
    if args.json:
        write_json(args.json, result)
    return 0


def _layout(kw: dict) -> str:
    return f"D={kw.get('attn_dp', 1)} T={kw.get('attn_tp', 1)} E={kw.get('moe_workers', 1)}"
