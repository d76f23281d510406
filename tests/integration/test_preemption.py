"""Preemption by recompute is exact: with a KV cache too small for its requests at once, every mode
preempts (the counters say so) and still gives colocated's greedy output and prompt logprobs, each
prompt logprob sent once although the prompt ran twice. So are n > 1 samples, whose later samples
compute only the prompt's last partial block on top of the first one's shared blocks."""
from __future__ import annotations

import dataclasses

import pytest

from moeflow import LLM, SamplingParams
from parity import assert_same

PROMPTS = [list(range(3, 23)), list(range(40, 58)), list(range(100, 121)), list(range(7, 26))]
PARAMS = SamplingParams(max_tokens=24, temperature=0, prompt_logprobs=1, ignore_eos=True)
SMALL = dict(num_kv_blocks=6, kv_block_size=8)  # a group holds ~48 tokens: two requests' prompts, not their lives

MODES = {
    "colocated": {},
    "dep": dict(mode="dep", dp=2),
    "asap": dict(mode="asap", attn_dp=1, moe_workers=1, min_batch_tokens=8, max_batch_wait_s=0.005),
    "dwdp": dict(mode="dwdp", dp=2),
    "afd": dict(mode="afd", attn_workers=1, ffn_workers=1, micro_batches=2),
    # a recompute (prompt and tokens so far: up to 44) longer than a batch, no chunked prefill: it comes back
    # in max_batch_tokens pieces (else it would wait forever)
    "dep_short_batches": dict(mode="dep", dp=2, max_batch_tokens=24),
    "afd_short_batches": dict(mode="afd", attn_workers=1, ffn_workers=1, micro_batches=2, max_batch_tokens=24),
}


@pytest.fixture(scope="module")
def reference(checkpoints):
    with LLM(checkpoints("qwen3").path, dtype="float32") as llm:
        return llm.generate(PROMPTS, PARAMS)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_outputs_after_preemption_equal_colocated(checkpoints, reference, mode):
    with LLM(checkpoints("qwen3").path, dtype="float32", **SMALL, **MODES[mode]) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        preemptions = llm.engine.scheduler.pool.num_preemptions
        samples = llm.generate(PROMPTS[0], dataclasses.replace(PARAMS, n=3))[0]
        free = [g.allocator.num_free for g in llm.engine.scheduler.pool.groups]
    print(f"{mode}: {preemptions} preemptions")
    assert preemptions > 0
    assert_same(outs, reference)
    assert [c.token_ids for c in samples.outputs] == [reference[0].outputs[0].token_ids] * 3
    assert_same([samples], reference[:1])
    assert free == [SMALL["num_kv_blocks"]] * len(free)  # nothing stranded
