"""A model of any shape with random weights, made directly on the device: no checkpoint is read or
written (a 61 GB model need not fit the disk to be measured).

The tensors are those a checkpoint of that config would hold, assembled by ``weights.assemble_weights``
under the family's key names; each is drawn from its own generator seeded by (seed, key), so a tensor
does not depend on which others were drawn before it. Matrices are N(0, 1/fan_in) (activations keep
their scale through the layers), norm weights ones, biases zeros (the gate's selection bias too).
"""
from __future__ import annotations

import zlib

import torch

from moeflow.config import ModelConfig
from moeflow.model.family import family_for, load_families
from moeflow.model.weights import LoadSpec, ModelWeights, assemble_weights


class RandomReader:
    """``WeightReader`` over random values: every key the assembly asks for exists, in the shape asked."""

    def __init__(self, dtype: torch.dtype, device: torch.device | str = "cpu", seed: int = 0):
        self.dtype, self.device, self.seed = dtype, torch.device(device), seed

    def has(self, key: str) -> bool:
        # NOTE: only asked for an optional tensor (a tied model's lm_head): a random model holds none
        return False

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        if self.device.type == "meta":  # shapes only: what a model would take, before making it
            return torch.empty(shape, dtype=dtype, device=self.device)
        if len(shape) == 1:
            fill = 1.0 if key.endswith("norm.weight") else 0.0
            return torch.full(shape, fill, dtype=dtype, device=self.device)
        g = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(key.encode()))
        w = torch.randn(shape, generator=g, dtype=dtype, device=self.device)
        return w.mul_(shape[-1] ** -0.5)

    def maybe(self, key: str, shape: tuple[int, ...], wanted: bool) -> torch.Tensor | None:
        return self.get(key, shape) if wanted else None


def random_weights(hf: dict, dtype: torch.dtype, device: torch.device | str = "cpu", seed: int = 0,
                   router_skew: float = 0.0) -> tuple[ModelConfig, ModelWeights]:
    """The whole model ``hf`` (a Hugging Face config dict) describes, random, in ``dtype`` on ``device``."""
    load_families()
    family = family_for(hf)
    cfg = family.to_model_config(hf)
    return cfg, assemble_weights(RandomReader(dtype, device, seed), cfg, family, LoadSpec(), router_skew)
