"""The model, its KV cache and the attention side's routes run where the weights are: built and run
on ``device="meta"``, no step may touch a tensor on the CPU (a spy sees every op's inputs and
outputs, so a CPU tensor made inside the model, even one that meta would accept as an index,
fails the test as it would fail on CUDA). Plus the device setting's validation and resolution."""
from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from moeflow.config import ConfigError, EngineConfig
from moeflow.core import Batch, SamplingParams, ScheduledSeq
from moeflow.hardware.device import resolve_device, worker_device
from moeflow.model.kv_cache import KVCache
from moeflow.model.transformer import MoETransformer
from moeflow.model.weights import load_weights
from moeflow.workers.dispatch import ExpertRoutes
from moeflow.workers.runner import ModelRunner

META = torch.device("meta")


class CpuSpy(TorchDispatchMode):
    """Records every op that reads or makes a CPU tensor (0-dim ones aside: devices accept those)."""

    def __init__(self):
        super().__init__()
        self.offenders: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = pytree.tree_leaves((args, kwargs or {}, out))
        if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0 for t in leaves):
            self.offenders.append(str(func))
        return out


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    if hasattr(obj, "__dict__"):
        return [t for v in vars(obj).values() for t in _tensors(v)]
    return []


@pytest.mark.parametrize("name", ["qwen3", "qwen2_moe", "deepseek_v3", "deepseek_v32"])
def test_the_model_and_its_cache_run_on_meta_without_a_cpu_tensor(checkpoints, name):
    cfg, w = load_weights(checkpoints(name).path, torch.float32, device=META)
    assert {t.device for t in _tensors(w)} == {META}, "a weight was loaded elsewhere"
    model = MoETransformer(cfg, w)
    kv = KVCache.for_model(cfg, num_blocks=8, block_size=8, dtype=torch.float32, device=META)
    runner = ModelRunner(model, kv)
    prompt = list(range(3, 43))  # 40 tokens: past DSA's index_topk, so its selection runs
    runner.add_request("r", prompt, SamplingParams(seed=1))
    spy = CpuSpy()
    with spy, torch.inference_mode():
        for start, n in ((0, 24), (24, 16)):  # a prefill, then a chunk over its cached context
            batch = Batch(0, (ScheduledSeq("r", start, n, (0, 1, 2, 3, 4), start + n >= len(prompt)),))
            tokens, meta = runner.prepare(batch)
            assert tokens.device == META and meta.positions.device == META and meta.slot_mapping.device == META
            h = model.embed(tokens)
            for layer in range(cfg.num_layers):
                a = model.attention(layer, h, meta, kv)
                if cfg.sparse_layers[layer]:
                    ids, wts = model.route(layer, a.moe_input)
                    assert ids.device == META and wts.device == META
                    h = model.combine(layer, a, torch.zeros_like(a.moe_input))  # the experts' output stands in
                else:
                    h = model.dense_mlp(layer, a)
            logits = model.logits(h[-1:])
            assert logits.device == META
        routes = ExpertRoutes(tuple((e,) for e in range(cfg.num_experts)), cfg.num_experts, 0, META) \
            if cfg.num_moe_layers else None
        if routes is not None:
            assert routes.worker_of.device == META and routes.local_of.device == META
    assert not spy.offenders, f"ops that read or made a CPU tensor: {sorted(set(spy.offenders))}"


def test_the_device_setting_is_validated_and_resolved():
    assert EngineConfig(device="cuda:1").device == "cuda:1" and EngineConfig().device == "auto"
    for bad in ("gpu", "cuda:x", "", 0):
        with pytest.raises(ConfigError, match="device must be auto, cpu, cuda or cuda:N"):
            EngineConfig(device=bad)
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA device here"):
            resolve_device("cuda")
    assert worker_device("cpu", 3) == torch.device("cpu")
