"""moeflow against transformers on random checkpoints: prompt logprobs and greedy decoding.

The core correctness requirement: in float32, moeflow computes the same distribution as the
Hugging Face reference implementation of each supported family, for ragged batches and for
prompts chunked across steps.
"""
from __future__ import annotations

import pytest
import torch

from moeflow import SamplingParams
from conftest import VARIANTS

LOGPROB_ATOL = 1e-3  # float32, same math, different kernels/order: differences are ~1e-6
TIE_ATOL = 1e-4  # a greedy divergence is only accepted at a genuine tie of HF's top-2 logits
NUM_NEW_TOKENS = 32
KV_BLOCKS = 128  # 2048 cache slots: plenty for these prompts, small to allocate


def _prompts(seed: int, vocab_size: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def _hf_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[n, V] float32 log-softmax of HF's logits at every prompt position (row i predicts i+1)."""
    return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_prompt_logprobs_match(out, prompt: list[int], hf_lp: torch.Tensor, k: int, tokenizer) -> None:
    """vLLM semantics: [None, {token: Logprob}, ...] with the actual token plus HF's top-k."""
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt)
    assert plp[0] is None
    for i in range(1, len(prompt)):
        d, row, tok = plp[i], hf_lp[i - 1], prompt[i]
        assert tok in d, f"position {i}: actual token {tok} missing from {sorted(d)}"
        for t, lp in d.items():
            assert abs(lp.logprob - row[t].item()) < LOGPROB_ATOL, \
                f"position {i} token {t}: moeflow {lp.logprob} vs HF {row[t].item()}"
            assert lp.decoded_token == tokenizer.decode([t])
        # rank of the actual token: 1 + tokens strictly more likely (within the tolerance band)
        lo = 1 + int((row > row[tok] + LOGPROB_ATOL).sum())
        hi = 1 + int((row > row[tok] - LOGPROB_ATOL).sum())
        assert lo <= d[tok].rank <= hi, f"position {i}: rank {d[tok].rank} not in [{lo}, {hi}]"
        top = sorted((t for t in d if t != tok or d[tok].rank <= k), key=lambda t: d[t].rank)
        assert len(top) == k and len(d) in (k, k + 1)
        assert [d[t].rank for t in top] == list(range(1, k + 1))
        assert all(d[a].logprob >= d[b].logprob for a, b in zip(top, top[1:]))
        if k:
            hf_top = set(row.topk(k).indices.tolist())
            kth = row.topk(k).values[-1].item()
            for t in set(top) ^ hf_top:  # only a near tie at the k-th place may swap membership
                assert abs(row[t].item() - kth) < LOGPROB_ATOL, f"position {i}: top-{k} {top} vs HF {hf_top}"


@torch.no_grad()
def assert_greedy_matches(model, prompt: list[int], ours: list[int], ref: list[int]) -> None:
    assert len(ours) == len(ref) == NUM_NEW_TOKENS
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            logits = model(torch.tensor([prompt + ref[:i]])).logits[0, -1].float()
            top = logits.topk(2)
            gap = (top.values[0] - top.values[1]).item()
            assert gap < TIE_ATOL and {a, b} == set(top.indices.tolist()), (
                f"greedy diverges at new token {i} (moeflow {a}, HF {b}) without a tie: "
                f"HF top-2 {top.indices.tolist()} differ by {gap:.3g}")
            return  # after a genuine tie the continuations legitimately differ


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_prompt_logprobs_match_hf(checkpoints, llm_cache, name, k):
    ck = checkpoints(name)
    llm = llm_cache(ck.path, dtype="float32", num_kv_blocks=KV_BLOCKS)
    prompts = _prompts(k, ck.model.config.vocab_size, (19, 7, 1, 30))  # ragged, one batch
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=k))
    for out, prompt in zip(outs, prompts):
        assert out.prompt_token_ids == prompt
        assert_prompt_logprobs_match(out, prompt, _hf_logprobs(ck.model, prompt), k, llm.get_tokenizer())


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_matches_hf(checkpoints, llm_cache, name):
    ck = checkpoints(name)
    llm = llm_cache(ck.path, dtype="float32", num_kv_blocks=KV_BLOCKS)
    prompts = _prompts(100, ck.model.config.vocab_size, (12, 1, 25, 5))  # ragged, incl. a 1-token prompt
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for out, prompt in zip(outs, prompts):
        c = out.outputs[0]
        assert c.finish_reason == "length"
        assert_greedy_matches(ck.model, prompt, c.token_ids, _hf_greedy(ck.model, prompt, NUM_NEW_TOKENS))


@pytest.mark.parametrize("name", ["qwen3", "mixtral", "qwen2_moe"])
def test_chunked_prefill_matches_hf(checkpoints, llm_cache, name):
    """A 16-token budget splits the long prompts across several steps, mixed with decodes; the
    270-token prompt also runs past the rotary table's first 256 positions."""
    ck = checkpoints(name)
    llm = llm_cache(ck.path, dtype="float32", num_kv_blocks=KV_BLOCKS, max_num_batched_tokens=16)
    prompts = _prompts(200, ck.model.config.vocab_size, (40, 23, 7, 270))
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(prompts, params)
    for out, prompt in zip(outs, prompts):
        assert_prompt_logprobs_match(out, prompt, _hf_logprobs(ck.model, prompt), 2, llm.get_tokenizer())
        assert_greedy_matches(ck.model, prompt, out.outputs[0].token_ids,
                              _hf_greedy(ck.model, prompt, NUM_NEW_TOKENS))


def test_requests_wait_for_cache_blocks_and_seq_slots(checkpoints, llm_cache):
    """Whole-life reservation (kv_admission reserve): a cache of 64 slots holds one request's whole
    life at a time, and at most 2 run at once: the rest queue (FIFO), reuse freed blocks, and still
    decode exactly like HF."""
    ck = checkpoints("qwen3")
    llm = llm_cache(ck.path, dtype="float32", num_kv_blocks=8, kv_block_size=8, max_num_seqs=2, kv_admission="reserve")
    prompts = _prompts(400, ck.model.config.vocab_size, (20, 9, 25, 3, 3))
    outs = llm.generate(prompts, SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0, ignore_eos=True))
    for out, prompt in zip(outs, prompts):
        assert_greedy_matches(ck.model, prompt, out.outputs[0].token_ids,
                              _hf_greedy(ck.model, prompt, NUM_NEW_TOKENS))
    # 7, 6, 8, 5 and 5 blocks: no two fit together, so each request starts after the previous ended
    for a, b in zip(outs, outs[1:]):
        assert a.metrics.token_times_s[-1] < b.metrics.first_scheduled_s


# bfloat16 vs float32 (both moeflow), measured on these checkpoints and prompts:
#   qwen3 mean 0.072 / p95 0.24 / max 1.53; mixtral 0.073 / 0.41 / 0.81; qwen2_moe 0.050 / 0.16 / 0.55
# (|delta logprob| over all prompt positions; typical |logprob| is ~6-7). transformers' own bf16 run
# deviates from its fp32 run just as much, max outliers included, so this is bf16 arithmetic, not
# a moeflow bug. The outliers come from discrete routing flips (a router near-tie picks another
# expert in bf16), amplified by initializer_range=0.2; so the mean and 95th percentile get bounds
# of ~2x the measurement (a real bf16 bug, e.g. attention or the KV cache in the wrong precision,
# moves the bulk of positions) and the max only a loose one.
BF16_MEAN_ATOL = 0.15
BF16_P95_ATOL = 0.8
BF16_MAX_ATOL = 4.0


@pytest.mark.filterwarnings("ignore::moeflow.hardware.EmulatedDtypeWarning")  # bf16 is emulated on some CPUs: expected here
@pytest.mark.parametrize("name", ["qwen3", "mixtral", "qwen2_moe"])
def test_bf16_prompt_logprobs_close_to_fp32(checkpoints, llm_cache, name):
    ck = checkpoints(name)
    prompts = _prompts(300, ck.model.config.vocab_size, (40, 13, 25, 33, 50))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    ref = llm_cache(ck.path, dtype="float32", num_kv_blocks=KV_BLOCKS).generate(prompts, params)
    got = llm_cache(ck.path, dtype="bfloat16", num_kv_blocks=KV_BLOCKS).generate(prompts, params)
    deltas = torch.tensor([abs(a.prompt_logprobs[i][p[i]].logprob - b.prompt_logprobs[i][p[i]].logprob)
                           for a, b, p in zip(ref, got, prompts) for i in range(1, len(p))])
    stats = f"mean {deltas.mean():.4f} p95 {deltas.quantile(0.95):.4f} max {deltas.max():.4f}"
    assert deltas.mean() < BF16_MEAN_ATOL, stats
    assert deltas.quantile(0.95) < BF16_P95_ATOL, stats
    assert deltas.max() < BF16_MAX_ATOL, stats
