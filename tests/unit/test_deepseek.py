"""The DeepSeek-V3 family against transformers (fp32): MLA with and without q LoRA, YaRN, grouped
sigmoid routing with its selection bias, leading dense layers, shared experts; DeepSeek-V3.2's
sparse attention past index_topk; the latent KV cache; absorbed decode against expanded; fp8
block-quantized checkpoints."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from moeflow.config import ConfigError
from moeflow.core import SamplingParams
from moeflow.model.attention import attention_for
from moeflow.model.kv_cache import AttentionMetadata, KVCache
from moeflow.model.weights import load_config, load_weights

PROMPT = list(range(3, 43))  # 40 tokens: past V3.2's index_topk of 12
PARAMS = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=1, ignore_eos=True)
DEEPSEEK = ["deepseek_v3", "deepseek_v3_noqlora", "deepseek_v3_yarn", "deepseek_v32"]


def _hf_logprobs(model, prompt):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)  # [n, V]


@pytest.mark.parametrize("name", DEEPSEEK)
def test_prompt_logprobs_and_greedy_match_transformers(checkpoints, llm_cache, name):
    ck = checkpoints(name)
    out = llm_cache(ck.path, dtype="float32", num_kv_blocks=64).generate([PROMPT], PARAMS)[0]
    ref = _hf_logprobs(ck.model, PROMPT)
    for i, (d, t) in enumerate(zip(out.prompt_logprobs[1:], PROMPT[1:])):
        assert abs(d[t].logprob - ref[i, t].item()) < 1e-3 * max(1.0, abs(ref[i, t].item()))
    greedy = ck.model.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False)[0, len(PROMPT):]
    assert out.outputs[0].token_ids == greedy.tolist()  # decode runs the absorbed path


def test_dsa_is_sparse_past_index_topk_and_dense_below(checkpoints, llm_cache):
    """transformers' V3.2 is itself dense until a sequence holds more than index_topk keys; past it
    the selection changes the result (so the parity above exercised the sparse path)."""
    ck = checkpoints("deepseek_v32")
    cfg, w = load_weights(ck.path, torch.float32)
    dense = dataclasses.replace(cfg, attention_kind="mla")  # the same weights without the indexer
    from moeflow.model.transformer import MoETransformer

    def logprobs(c, prompt):
        meta = AttentionMetadata.no_cache([len(prompt)])
        h = MoETransformer(c, w).forward(torch.tensor(prompt), meta, None)
        return torch.log_softmax(MoETransformer(c, w).logits(h), -1)

    short, long = PROMPT[:cfg.index_topk], PROMPT
    torch.testing.assert_close(logprobs(cfg, short), logprobs(dense, short))
    assert (logprobs(cfg, long) - logprobs(dense, long)).abs().max() > 1e-3
    torch.testing.assert_close(logprobs(cfg, long), _hf_logprobs(ck.model, long), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v32"])
def test_absorbed_decode_equals_expanded(checkpoints, name):
    cfg, w = load_weights(checkpoints(name).path, torch.float32)
    kind = attention_for(cfg)
    layer = 1
    cache = KVCache.for_model(cfg, num_blocks=8, block_size=8, dtype=torch.float32)
    x = torch.randn(len(PROMPT), cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    meta = AttentionMetadata.build([len(PROMPT)], [0], [tuple(range(8))], 8)
    kind.forward(w.attention[layer], x, meta, cache, layer, None)  # prefill: the cache holds the latents
    step = AttentionMetadata.build([1], [len(PROMPT)], [tuple(range(8))], 8)
    xd = torch.randn(1, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    absorbed = kind.forward(w.attention[layer], xd, step, cache, layer, None)  # one query: absorbed
    p = kind.project(w.attention[layer], xd, step.positions)
    kind.cache_entries(w.attention[layer], xd, p, step.positions)  # DSA: the indexer's queries
    cached = cache.gather(layer, step.context_slots(0))
    keep = kind.selection(p, slice(0, 1), cached, len(PROMPT))
    o = kind.expanded(w.attention[layer], p.q_nope, p.q_pe, cached[0], len(PROMPT), keep)  # [1, Hn, dv]
    expanded = torch.nn.functional.linear(o.reshape(1, -1), w.attention[layer].o)
    torch.testing.assert_close(absorbed, expanded, atol=1e-5, rtol=1e-5)


def test_the_kv_cache_holds_the_latent_per_token(checkpoints):
    cfg, _ = load_config(checkpoints("deepseek_v3").path)
    cache = KVCache.for_model(cfg, num_blocks=4, block_size=16, dtype=torch.bfloat16)
    per_token = cfg.kv_lora_rank + cfg.qk_rope_head_dim  # 16 + 8, not 2 x 4 heads x (16 + 8)
    assert cache.bytes_per_token == cfg.num_layers * per_token * 2
    assert cache.nbytes == 4 * 16 * cache.bytes_per_token
    v32, _ = load_config(checkpoints("deepseek_v32").path)
    assert KVCache.for_model(v32, 4, 16, torch.float32).bytes_per_token == v32.num_layers * (per_token + 16) * 4
    # DeepSeek-V3's own numbers: 512 + 64 = 576 values per token and layer instead of 128 x 384
    real = dataclasses.replace(cfg, num_layers=1, sparse_layers=(True,), kv_lora_rank=512, qk_rope_head_dim=64,
                               head_dim=64)
    assert KVCache.for_model(real, 1, 1, torch.float32).bytes_per_token == 576 * 4


def test_routing_matches_transformers_gate(checkpoints):
    ck = checkpoints("deepseek_v3")
    cfg, w = load_weights(ck.path, torch.float32)
    from moeflow.model.gate import gate_for

    x = torch.randn(50, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    ids, wts = gate_for(cfg)(x, w.gates[1])
    _, ref_w, ref_ids = ck.model.model.layers[1].mlp.gate(x)
    order, ref_order = ids.sort(-1), ref_ids.sort(-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(wts.gather(1, order.indices), ref_w.gather(1, ref_order.indices))
    assert w.gates[1].bias is not None and w.gates[1].bias.abs().sum() > 0  # the perturbed bias was read


def test_fp8_block_quantized_weights_are_dequantized(tmp_path):
    from safetensors.torch import save_file

    from moeflow.model.checkpoint import CheckpointReader, dequantize_blocks

    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 130, generator=g)
    scale = torch.rand(2, 2, generator=g) + 0.5  # 128 x 128 blocks, ragged at the edges
    full = scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :130]
    q = (w / full).to(torch.float8_e4m3fn)
    save_file({"m.weight": q, "m.weight_scale_inv": scale}, str(tmp_path / "model.safetensors"))
    got = CheckpointReader(str(tmp_path), torch.float32).get("m.weight", (200, 130))
    torch.testing.assert_close(got, q.float() * full)
    assert (got - w).abs().max() < 0.1 * w.abs().max()  # e4m3's precision, scaled back
    torch.testing.assert_close(dequantize_blocks(q, scale), got)


def test_mtp_layers_are_ignored_and_configs_validated(checkpoints, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    src = checkpoints("deepseek_v3").path
    dst = tmp_path / "with_mtp"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)  # a next-token-prediction layer
    save_file(tensors, str(dst / "model.safetensors"))
    cfg, w = load_weights(str(dst), torch.float32)
    assert cfg.num_layers == 3 and sorted(w.attention) == [0, 1, 2]
    assert cfg.sparse_layers == (False, True, True) and cfg.shared_expert_intermediate_size == 64
    hf = json.loads((dst / "config.json").read_text())
    for bad, msg in (({"scoring_func": "softmax"}, "scoring_func='softmax'"), ({"n_group": 3}, "n_group")):
        (dst / "config.json").write_text(json.dumps({**hf, **bad}))
        with pytest.raises(ConfigError, match=msg):
            load_config(str(dst))
    (dst / "config.json").write_text(json.dumps({**hf, "architectures": ["DeepseekV4ForCausalLM"]}))
    with pytest.raises(ConfigError, match=r"unsupported architecture.*DeepseekV4.*supports.*DeepseekV32ForCausalLM.*DeepseekV3ForCausalLM"):
        load_config(str(dst))
    assert os.path.isdir(src)


def _logits_by_schedule(model, tokens: list[int], chunks: list[int], block_size: int = 8) -> torch.Tensor:
    """Run ``tokens`` through the paged cache in pieces of ``chunks`` tokens (one piece: a full
    prefill; pieces of 1: decode) and return every position's logits [N, V]."""
    num_blocks = -(-len(tokens) // block_size)
    cache = KVCache.for_model(model.cfg, num_blocks, block_size, torch.float32)
    table, out, done = tuple(range(num_blocks)), [], 0
    for n in chunks:
        meta = AttentionMetadata.build([n], [done], [table], block_size)
        out.append(model.logits(model.forward(torch.tensor(tokens[done:done + n]), meta, cache)))
        done += n
    assert done == len(tokens)
    return torch.cat(out)


@pytest.mark.parametrize("forced_ties", [True, False])
def test_dsa_selects_the_same_keys_in_prefill_chunks_and_decode(checkpoints, forced_ties):
    """The keys a query attends to may not depend on how its position was computed. With the
    indexer's queries zeroed every key scores exactly 0 and the top-k is decided by its tie rule
    alone (torch.topk's depends on the row's length: a prefill row is masked, a decode row shorter)."""
    from moeflow.model.transformer import MoETransformer

    cfg, w = load_weights(checkpoints("deepseek_v32").path, torch.float32)
    if forced_ties:
        for a in w.attention.values():
            a.index_wq = torch.zeros_like(a.index_wq)
    model = MoETransformer(cfg, w)
    tokens = [(7 * i + 3) % cfg.vocab_size for i in range(3 * cfg.index_topk)]
    full = _logits_by_schedule(model, tokens, [len(tokens)])
    p = cfg.index_topk // 2  # decode starts below index_topk and crosses it
    decode = _logits_by_schedule(model, tokens, [p] + [1] * (len(tokens) - p))
    chunked = _logits_by_schedule(model, tokens, [5] * (len(tokens) // 5) + [len(tokens) % 5])
    torch.testing.assert_close(decode, full, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(chunked, full, atol=1e-4, rtol=1e-4)
