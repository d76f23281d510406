"""The safetensors loader: sharded checkpoints, subset loading, and its error messages."""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeflow.config import ConfigError
from moeflow.model.weights import CheckpointError, LoadSpec, ModelWeights, load_weights

F32 = torch.float32


def _flat(w: ModelWeights) -> dict[str, torch.Tensor]:
    """Every tensor of a ModelWeights under a readable name (None entries left out)."""
    out = {}
    for name in ("embed", "final_norm", "lm_head"):
        if getattr(w, name) is not None:
            out[name] = getattr(w, name)
    for lid, a in w.attention.items():
        out.update({f"attn{lid}.{k}": v for k, v in vars(a).items() if v is not None})
    out.update({f"gate{lid}": v.weight for lid, v in w.gates.items()})
    for kind in ("dense", "shared"):
        for lid, m in getattr(w, kind).items():
            out.update({f"{kind}{lid}.{k}": v for k, v in vars(m).items() if v is not None})
    if w.experts is not None:
        out["w13"], out["w2"] = w.experts.w13, w.experts.w2
    return out


def _copy(ck, tmp_path) -> str:
    dst = os.path.join(tmp_path, ck.name)
    shutil.copytree(ck.path, dst)
    return dst


@pytest.mark.parametrize("name", ["qwen3", "qwen2_moe"])
def test_sharded_checkpoint_matches_single_file(checkpoints, tmp_path, name):
    ck = checkpoints(name)
    sharded = str(tmp_path / "sharded")
    ck.model.save_pretrained(sharded, max_shard_size="40KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    shards = [f for f in os.listdir(sharded) if f.endswith(".safetensors")]
    assert len(shards) > 2 and "model.safetensors" not in shards
    cfg_a, wa = load_weights(ck.path, F32)
    cfg_b, wb = load_weights(sharded, F32)
    assert cfg_a == cfg_b
    fa, fb = _flat(wa), _flat(wb)
    assert fa.keys() == fb.keys()
    for k in fa:
        assert torch.equal(fa[k], fb[k]), k


def test_loaded_tensors_are_the_checkpoint_tensors(checkpoints):
    """Spot-check the fused layouts against the HF module's own parameters."""
    ck = checkpoints("qwen3_bias_nonorm")
    cfg, w = load_weights(ck.path, F32)
    sd = ck.model.state_dict()
    attn = ck.model.model.layers[1].self_attn
    torch.testing.assert_close(w.attention[1].qkv, torch.cat([attn.q_proj.weight, attn.k_proj.weight,
                                                              attn.v_proj.weight]), rtol=0, atol=0)
    torch.testing.assert_close(w.attention[1].qkv_bias, torch.cat([attn.q_proj.bias, attn.k_proj.bias,
                                                                   attn.v_proj.bias]), rtol=0, atol=0)
    assert torch.equal(w.attention[1].o_bias, attn.o_proj.bias)
    assert torch.equal(w.attention[0].q_norm, sd["model.layers.0.self_attn.q_norm.weight"])
    # HF v5 keeps experts fused as gate_up_proj [E, 2F, H] / down_proj [E, H, F]: the same layout
    experts = ck.model.model.layers[1].mlp.experts
    assert torch.equal(w.experts.w13[1], experts.gate_up_proj)
    assert torch.equal(w.experts.w2[1], experts.down_proj)
    assert w.lm_head is not w.embed


def test_tied_embeddings_share_the_tensor(checkpoints):
    ck = checkpoints("qwen3_tied")
    from safetensors import safe_open

    with safe_open(os.path.join(ck.path, "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    cfg, w = load_weights(ck.path, F32)
    assert cfg.tie_word_embeddings and w.lm_head is w.embed


def test_subset_layers_and_experts(checkpoints):
    ck = checkpoints("qwen3_sparse_step2")  # 4 layers, MoE at 1 and 3
    cfg, full = load_weights(ck.path, F32)
    assert cfg.sparse_layers == (False, True, False, True)
    assert full.experts.layer_ids == (1, 3)

    _, w = load_weights(ck.path, F32, LoadSpec(layers=(2, 3), experts=(5, 0, 6)))
    assert sorted(w.attention) == [2, 3] and sorted(w.dense) == [2] and sorted(w.gates) == [3]
    assert w.experts.layer_ids == (3,) and w.experts.expert_ids == (5, 0, 6)
    assert torch.equal(w.experts.w13[0], full.experts.w13[1, [5, 0, 6]])
    assert torch.equal(w.experts.w2[0], full.experts.w2[1, [5, 0, 6]])
    assert w.experts.local_ids(torch.tensor([0, 5, 6, 3])).tolist() == [1, 0, 2, -1]
    assert torch.equal(w.attention[3].qkv, full.attention[3].qkv)


def test_attention_only_and_experts_only(checkpoints):
    ck = checkpoints("qwen2_moe")
    _, attn = load_weights(ck.path, F32, LoadSpec(routed_experts=False))
    assert attn.experts is None
    assert attn.embed is not None and attn.lm_head is not None and attn.final_norm is not None
    assert sorted(attn.attention) == [0, 1, 2] and sorted(attn.gates) == [0, 2]
    assert sorted(attn.shared) == [0, 2] and attn.shared[0].gate.shape == (1, 64)  # shared expert + gate
    assert sorted(attn.dense) == [1]

    _, experts = load_weights(ck.path, F32, LoadSpec(attention=False, layers=(2,), experts=(7,)))
    assert experts.embed is None and experts.lm_head is None and experts.final_norm is None
    assert not experts.attention and not experts.gates and not experts.shared and not experts.dense
    assert experts.experts.layer_ids == (2,) and experts.experts.expert_ids == (7,)
    assert experts.experts.w13.shape == (1, 1, 64, 64) and experts.experts.w2.shape == (1, 1, 64, 32)


@pytest.mark.parametrize("spec, msg", [
    (LoadSpec(layers=(0, 2)), "layer 2 out of range: the model has 2 layers"),
    (LoadSpec(layers=(-1,)), "layer -1 out of range"),
    (LoadSpec(experts=(0, 8)), "expert 8 out of range: the model has 8 routed experts"),
])
def test_out_of_range_load_spec(checkpoints, spec, msg):
    with pytest.raises(ConfigError, match=re.escape(msg)):
        load_weights(checkpoints("qwen3").path, F32, spec)


def _rewrite(path: str, edit) -> None:
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def test_missing_tensor_is_named(checkpoints, tmp_path):
    path = _copy(checkpoints("qwen3"), tmp_path)
    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    _rewrite(path, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=re.escape(f"tensor {key!r} is missing")):
        load_weights(path, F32)
    # a process that does not hold that expert never asks for it
    load_weights(path, F32, LoadSpec(experts=(0, 1, 2)))


def test_misshaped_tensor_names_key_and_both_shapes(checkpoints, tmp_path):
    path = _copy(checkpoints("qwen3"), tmp_path)
    key = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(path, lambda t: t.__setitem__(key, torch.zeros(40, 64)))
    with pytest.raises(CheckpointError) as e:
        load_weights(path, F32)
    assert key in str(e.value) and "(40, 64)" in str(e.value) and "(48, 64)" in str(e.value)


def test_missing_config_json(checkpoints, tmp_path):
    path = _copy(checkpoints("qwen3"), tmp_path)
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_weights(path, F32)
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_weights(str(tmp_path / "does-not-exist"), F32)


def test_missing_weights_file(checkpoints, tmp_path):
    path = _copy(checkpoints("qwen3"), tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_weights(path, F32)


def test_missing_shard_names_file_and_key(checkpoints, tmp_path):
    ck = checkpoints("qwen3")
    path = str(tmp_path / "sharded")
    ck.model.save_pretrained(path, max_shard_size="40KB")
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    shard = weight_map["model.norm.weight"]
    os.remove(os.path.join(path, shard))
    with pytest.raises(CheckpointError, match=re.escape(f"shard {shard}")):
        load_weights(path, F32)


def _edit_config(path: str, **changes) -> None:
    f = os.path.join(path, "config.json")
    with open(f) as fh:
        cfg = json.load(fh)
    cfg.update(changes)
    with open(f, "w") as fh:
        json.dump(cfg, fh)


def test_unsupported_architecture(checkpoints, tmp_path):
    path = _copy(checkpoints("qwen3"), tmp_path)
    _edit_config(path, architectures=["LlamaForCausalLM"])
    with pytest.raises(ConfigError) as e:
        load_weights(path, F32)
    msg = str(e.value)
    assert "LlamaForCausalLM" in msg
    for arch in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        assert arch in msg


def test_unsupported_rope_scaling(checkpoints, tmp_path):
    path = _copy(checkpoints("qwen3"), tmp_path)
    _edit_config(path, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ConfigError, match="yarn"):
        load_weights(path, F32)
