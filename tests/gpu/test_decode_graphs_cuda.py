"""Decode replayed from CUDA graphs against the same engine eager (``--enforce-eager``), token for
token with logprobs, in bfloat16 on the GPU; the buckets it captured and the time per decode step
of each, recorded. In the rehearsal the graph side is the same static buffers run eagerly
(``MOEFLOW_DECODE_GRAPHS=eager``): the logic, not the capture."""
from __future__ import annotations

import os
import time

import torch

from cuda_support import DEVICE, GPU, REHEARSAL, prompts, record, synchronize
from moeflow import LLM, SamplingParams

pytestmark = GPU


def _run(graphs: bool) -> tuple[list, dict]:
    env = os.environ.pop("MOEFLOW_DECODE_GRAPHS", None)
    if graphs and REHEARSAL:
        os.environ["MOEFLOW_DECODE_GRAPHS"] = "eager"
    try:
        kw = {} if graphs else {"enforce_eager": True}
        ps = prompts(5, 250, [9, 40, 77, 130, 200, 31])
        params = SamplingParams(max_tokens=24 if REHEARSAL else 64, ignore_eos=True, logprobs=1)
        with LLM("tiny", device=DEVICE, dtype="bfloat16" if DEVICE == "cuda" else "float32", num_kv_blocks=512,
                 max_num_seqs=16, **kw) as llm:
            llm.generate(ps[:2], params)  # warm-up: the buckets of 1 and 2 captured before the clock
            synchronize()
            t0 = time.perf_counter()
            out = llm.generate(ps, params)
            synchronize()
            wall = time.perf_counter() - t0
            g = llm.engine.runner.graphs
            info = {"wall_s": wall, "replays": g.replays if g else 0, "captured": g.captured if g else []}
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in out], info
    finally:
        os.environ.pop("MOEFLOW_DECODE_GRAPHS", None)
        if env is not None:
            os.environ["MOEFLOW_DECODE_GRAPHS"] = env


def test_graph_replay_decodes_what_eager_decodes():
    eager, e = _run(False)
    graphed, g = _run(True)
    assert e["replays"] == 0 and g["replays"] > 20
    if DEVICE == "cuda":
        assert g["captured"], "no bucket was captured"
    same = sum(ta == tb for (ta, _), (tb, _) in zip(eager, graphed))
    record("decode_graphs", {"eager_s": e["wall_s"], "graphs_s": g["wall_s"], "captured": g["captured"],
                             "sequences_equal": same, "sequences": len(eager)})
    for (ta, la), (tb, lb) in zip(eager, graphed):
        # NOTE: bf16 on the GPU: a padded bucket may change a GEMM's tiling; tokens must agree until
        # the first near-tie, which shows as logprobs within bf16's resolution of each other
        for k, (a, b) in enumerate(zip(ta, tb)):
            if a != b:
                gap = abs(la[k][a].logprob - lb[k][b].logprob) if a in la[k] and b in lb[k] else float("inf")
                assert gap < 0.05, f"token {k}: {a} vs {b} (logprob gap {gap:.3g}): not a near-tie"
                break
            assert abs(la[k][a].logprob - lb[k][b].logprob) < (0.05 if DEVICE == "cuda" else 1e-4)
    torch.cuda.empty_cache() if DEVICE == "cuda" else None
