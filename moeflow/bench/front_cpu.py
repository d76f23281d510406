"""``moeflow bench front-cpu``: how much CPU the engine's front process (the one that runs LLM, the
scheduler and the step loop) takes while dep 2 and afd M1 N1 m2 decode: its process time over the
wall time of one generate call. Session 8's probe (docs/results/afd.md); run it with
OMP_NUM_THREADS=1, as the serving workers run.
"""
from __future__ import annotations

import argparse
import time

from moeflow.measure.provenance import write_json

MODES = (("dep", {"dp": 2}), ("afd", {"micro_batches": 2}))  # (mode, LLM keyword arguments)


def add_parser(sub) -> None:
    p = sub.add_parser("front-cpu", help="the front process's CPU time while dep 2 and afd M1 N1 m2 decode")
    p.add_argument("--model", default="tiny", help="tiny or a model path")
    p.add_argument("--shapes", default="1x512,8x512,8x2048", help="REQUESTSxPROMPT_TOKENS, comma-separated")
    p.add_argument("--max-tokens", type=int, default=33, help="tokens each request decodes (the first from prefill)")
    p.add_argument("--json", default=None, metavar="OUT.json")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from moeflow import LLM, SamplingParams

    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if args.max_tokens < 2:
        raise ValueError("--max-tokens: at least 2 (one decode step after the first token)")
    rng = np.random.default_rng(0)
    rows = []
    for mode, kw in MODES:
        with LLM(model=args.model, mode=mode, **kw) as llm:
            vocab = llm.engine.model_config.vocab_size
            for batch, prompt_len in shapes:
                prompts = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(batch)]
                llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
                params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
                c0, w0 = time.process_time(), time.perf_counter()
                outs = llm.generate(prompts, params)
                cpu_s, wall_s = time.process_time() - c0, time.perf_counter() - w0
                t = outs[0].metrics.token_times_s
                step_s = (t[-1] - t[0]) / (len(t) - 1)
                rows.append({"mode": mode, "requests": batch, "prompt_len": prompt_len, "front_cpu_s": cpu_s,
                             "wall_s": wall_s, "decode_step_s": step_s})
                print(f"{mode} B={batch} ctx={prompt_len}: front CPU {cpu_s:.3f} s over {wall_s:.2f} s wall "
                      f"({cpu_s / wall_s:.0%}), decode {step_s * 1e3:.1f} ms/step", flush=True)
    if args.json:
        write_json(args.json, {"model": args.model, "max_tokens": args.max_tokens, "rows": rows})
    return 0
