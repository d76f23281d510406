"""The model's seams: attention kinds and gate kinds chosen by name, the KV cache laid out by the
attention kind, TP sharding through the kind, and checkpoint keys named by the family."""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeflow.config import ConfigError, ModelConfig
from moeflow.model.attention import attention_for
from moeflow.model.family import FAMILIES
from moeflow.model.kv_cache import AttentionMetadata, KVCache
from moeflow.model.gate import GATE_KINDS, GateKind, GateWeights, gate_for
from moeflow.model.sharding import check_tp, shard_attention
from moeflow.model.transformer import MoETransformer
from moeflow.model.weights import ModelWeights, load_weights

F32 = torch.float32
CFG = ModelConfig(architecture="test", vocab_size=16, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=8, rope_theta=1e4, rms_norm_eps=1e-6, max_position_embeddings=64, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                  sparse_layers=(True,) * 3)


@pytest.mark.parametrize("field, name, lookup, msg", [
    ("attention_kind", "linear", attention_for, "unknown attention kind 'linear'; known: ['dsa', 'gqa', 'mla']"),
    ("gate_kind", "hash", gate_for, "unknown gate kind 'hash'; known: ['sigmoid_group', 'softmax_topk']"),
])
def test_unknown_kind_names_the_known_ones(field, name, lookup, msg):
    cfg = dataclasses.replace(CFG, **{field: name})
    for build in (lookup, lambda c: MoETransformer(c, ModelWeights())):
        with pytest.raises(ConfigError, match=re.escape(msg)):
            build(cfg)


def test_route_calls_the_gate_kind_the_config_names(monkeypatch):
    class Constant(GateKind):  # every token to experts (K-1, ..., 0), equal weights
        name = "constant"

        def __call__(self, x, gate_w):
            k = self.cfg.num_experts_per_tok
            ids = torch.arange(k - 1, -1, -1).expand(x.shape[0], k)  # [T, K]
            return ids, torch.full((x.shape[0], k), 1.0 / k)

    monkeypatch.setitem(GATE_KINDS, Constant.name, Constant)
    cfg = dataclasses.replace(CFG, gate_kind="constant")
    model = MoETransformer(cfg, ModelWeights(gates={1: GateWeights(torch.randn(4, 32))}))
    ids, wts = model.route(1, torch.randn(5, 32))
    assert ids.tolist() == [[1, 0]] * 5 and wts.tolist() == [[0.5, 0.5]] * 5


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
def test_kv_cache_for_model_allocates_the_layout(dtype):
    num_blocks, block_size = 5, 4
    cache = KVCache.for_model(CFG, num_blocks, block_size, dtype)
    slots, item = num_blocks * block_size, dtype.itemsize
    hkv, d, layers = CFG.num_kv_heads, CFG.head_dim, CFG.num_layers
    assert list(cache.entries) == ["k", "v"]
    assert all(t.shape == (layers, slots, hkv, d) and t.dtype == dtype for t in cache.entries.values())
    assert cache.nbytes == 2 * hkv * d * layers * slots * item
    assert cache.bytes_per_token == 2 * hkv * d * layers * item
    # a TP member caches only its own kv heads
    member = KVCache.for_model(attention_for(CFG).member_config(2), num_blocks, block_size, dtype)
    assert member.nbytes == cache.nbytes // 2 and member.bytes_per_token == cache.bytes_per_token // 2


def test_tp_size_must_divide_the_heads():
    check_tp(CFG, 2)
    with pytest.raises(ConfigError, match=re.escape("attention TP size 3 must divide num_heads (4)")):
        check_tp(CFG, 3)


def _logits(model: MoETransformer, cfg: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    """Three steps through a paged cache: ragged prefill, chunks over cached context mixed with a
    decode, then decodes. -> [all new tokens, V] logits."""
    g = torch.Generator().manual_seed(1)
    cache = KVCache.for_model(cfg, 32, 4, dtype)
    tables = [tuple(range(0, 10)), tuple(range(10, 20)), tuple(range(20, 30))]
    out = []
    for q_lens, ctx_lens in [([7, 3, 1], [0, 0, 0]), ([5, 1, 6], [7, 3, 1]), ([1, 1, 1], [12, 4, 7])]:
        ids = torch.randint(0, cfg.vocab_size, (sum(q_lens),), generator=g)
        meta = AttentionMetadata.build(q_lens, ctx_lens, tables, 4)
        out.append(model.logits(model.forward(ids, meta, cache)))
    return torch.cat(out)


def _tp_logits(cfg: ModelConfig, w: ModelWeights, size: int) -> list[torch.Tensor]:
    """Every member of a TP group in its own thread; the all-reduce sums the partials in rank order."""
    partials, done = [None] * size, threading.Barrier(size)
    results: list = [None] * size

    def member(rank: int) -> None:
        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            partials[rank] = x
            done.wait()
            total = sum(partials[1:], partials[0])
            done.wait()  # nobody overwrites a partial before all have summed
            return total

        mcfg, mw = shard_attention(cfg, w, rank, size)
        results[rank] = _logits(MoETransformer(mcfg, mw, attn_reduce=all_reduce), mcfg, F32)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("name", ["qwen3_bias_nonorm", "qwen2_moe"])
def test_tp_sharded_attention_matches_unsharded(checkpoints, name):
    cfg, w = load_weights(checkpoints(name).path, F32)
    ref = _logits(MoETransformer(cfg, w), cfg, F32)
    members = _tp_logits(cfg, w, 2)
    assert torch.equal(members[0], members[1])
    torch.testing.assert_close(members[0], ref, atol=1e-4, rtol=1e-4)


def test_family_names_the_attention_module(checkpoints, tmp_path, monkeypatch):
    """A family that puts attention under another module name loads the same weights."""
    ck = checkpoints("qwen3")
    path = str(tmp_path / "renamed")
    shutil.copytree(ck.path, path)
    f = os.path.join(path, "model.safetensors")
    save_file({k.replace(".self_attn.", ".attn."): v for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    _, ref = load_weights(ck.path, F32)
    arch = "Qwen3MoeForCausalLM"
    monkeypatch.setitem(FAMILIES, arch, dataclasses.replace(FAMILIES[arch], attention_module="attn"))
    _, got = load_weights(path, F32)
    assert sorted(got.attention) == sorted(ref.attention)
    for lid, a in ref.attention.items():
        for field in dataclasses.fields(a):
            x, y = getattr(a, field.name), getattr(got.attention[lid], field.name)
            assert (x is None and y is None) or torch.equal(x, y), (lid, field.name)
