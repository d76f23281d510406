"""Colocated moeflow against transformers, both on the GPU: float32 prompt logprobs within 1e-3 and
greedy decoding, a bfloat16 smoke run, and where ``device`` puts weights and which dtype "auto" picks.

The CPU suite (tests/unit/test_hf_parity.py) holds every family to the same bounds; here a few
variants cover each attention kind (GQA with and without biases, MLA, DSA) and expert layout.
"""
from __future__ import annotations

import pytest
import torch

from cuda_support import DEVICE, GPU, assert_greedy_matches, gpu_only, hf_logprobs, hf_on_device, prompts
from moeflow import LLM, SamplingParams

pytestmark = GPU

LOGPROB_ATOL = 1e-3  # float32, same math, different kernels and order
TIE_ATOL = 1e-4
NUM_NEW_TOKENS = 32
KV_BLOCKS = 128
NAMES = ["qwen3", "qwen3_bias_nonorm", "mixtral", "qwen2_moe", "deepseek_v3", "deepseek_v32"]


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    """``hf_models(name)``: the transformers model of a test checkpoint, float32 on the GPU."""
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = hf_on_device(checkpoints(name).path, torch.float32)
        return cache[name]

    yield get
    cache.clear()


def _fp32(checkpoints, llm_cache, name: str):
    return llm_cache(checkpoints(name).path, device=DEVICE, dtype="float32", num_kv_blocks=KV_BLOCKS)


@pytest.mark.parametrize("name", NAMES)
def test_prompt_logprobs_match_hf_fp32(checkpoints, llm_cache, hf_models, name):
    llm = _fp32(checkpoints, llm_cache, name)
    batch = prompts(0, checkpoints(name).model.config.vocab_size, (19, 7, 1, 30))  # ragged, one batch
    outs = llm.generate(batch, SamplingParams(max_tokens=1, prompt_logprobs=3))
    for out, prompt in zip(outs, batch):
        ref = hf_logprobs(hf_models(name), prompt)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for i in range(1, len(prompt)):
            d = out.prompt_logprobs[i]
            assert prompt[i] in d and len(d) >= 3
            for t, lp in d.items():
                assert abs(lp.logprob - ref[i - 1, t].item()) < LOGPROB_ATOL, \
                    f"{name} position {i} token {t}: moeflow {lp.logprob} vs HF {ref[i - 1, t].item()}"


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_hf_fp32(checkpoints, llm_cache, hf_models, name):
    llm = _fp32(checkpoints, llm_cache, name)
    batch = prompts(100, checkpoints(name).model.config.vocab_size, (12, 1, 25, 5))
    outs = llm.generate(batch, SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0, ignore_eos=True))
    model = hf_models(name)
    for out, prompt in zip(outs, batch):
        c = out.outputs[0]
        assert c.finish_reason == "length"
        ids = torch.tensor([prompt], device=DEVICE)
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NUM_NEW_TOKENS)[0, len(prompt):].tolist()
        assert_greedy_matches(model, prompt, c.token_ids, ref, TIE_ATOL)


# the CPU suite's bf16-vs-fp32 bounds (tests/unit/test_hf_parity.py says how they were measured)
BF16_MEAN_ATOL, BF16_P95_ATOL, BF16_MAX_ATOL = 0.15, 0.8, 4.0


@pytest.mark.parametrize("name", ["qwen3", "mixtral", "deepseek_v3"])
def test_bf16_smoke(checkpoints, llm_cache, name):
    """bfloat16 on the GPU runs prefill and decode, and its prompt logprobs stay near float32's."""
    path = checkpoints(name).path
    batch = prompts(300, checkpoints(name).model.config.vocab_size, (40, 13, 25, 33))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    ref = _fp32(checkpoints, llm_cache, name).generate(batch, params)
    bf16 = llm_cache(path, device=DEVICE, dtype="bfloat16", num_kv_blocks=KV_BLOCKS)
    assert bf16.config.dtype == "bfloat16"
    got = bf16.generate(batch, params)
    for out in got:
        c = out.outputs[0]
        assert c.finish_reason == "length" and len(c.token_ids) == 16
        assert all(torch.isfinite(torch.tensor(d[t].logprob)) for t, d in zip(c.token_ids, c.logprobs))
    deltas = torch.tensor([abs(a.prompt_logprobs[i][p[i]].logprob - b.prompt_logprobs[i][p[i]].logprob)
                           for a, b, p in zip(ref, got, batch) for i in range(1, len(p))])
    stats = f"mean {deltas.mean():.4f} p95 {deltas.quantile(0.95):.4f} max {deltas.max():.4f}"
    print(f"{name} bf16 vs fp32 |delta logprob|: {stats}")
    assert deltas.mean() < BF16_MEAN_ATOL and deltas.quantile(0.95) < BF16_P95_ATOL, stats
    assert deltas.max() < BF16_MAX_ATOL, stats


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_weights_load_onto_the_device_and_auto_means_cuda(checkpoints):
    """``device="auto"`` on a machine with CUDA deploys there; the weights (and KV cache) take GPU memory."""
    gpu_only("where device='auto' deploys, and the device memory the weights take,")
    ck = checkpoints("qwen3")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with LLM(ck.path, device="auto", dtype="float32", num_kv_blocks=KV_BLOCKS) as llm:
        assert str(llm.config.device).startswith("cuda"), llm.config.device
        grown = torch.cuda.memory_allocated() - before
        assert grown >= _param_bytes(ck.model), (grown, _param_bytes(ck.model))
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4


def test_auto_dtype_is_the_checkpoints_bf16_on_the_gpu():
    """The embedded model is stored in bfloat16; a GPU with native bf16 computes in it."""
    gpu_only("which dtype auto picks")
    if not torch.cuda.is_bf16_supported():
        pytest.skip(f"{torch.cuda.get_device_name()} has no native bfloat16")
    with LLM("tiny", device=DEVICE, num_kv_blocks=64) as llm:
        assert llm.config.dtype == "bfloat16"
        out = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
