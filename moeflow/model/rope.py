"""Rotary position embedding as transformers 5.x computes it: default or YaRN frequencies, the
YaRN attention factor folded into cos/sin, rotate-half or interleaved application.

Legend: T tokens, D the rotated dims (head_dim, or qk_rope_head_dim for MLA).
"""
from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "yarn")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(head_dim: int, scaling: dict) -> float:
    """1/sqrt(head_dim), times mscale_all_dim's correction under YaRN (DeepSeek's MLA)."""
    scale = head_dim ** -0.5
    if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


def inv_freq_and_scaling(dim: int, theta: float, scaling: dict, max_position: int,
                         device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """-> (inverse frequencies [D/2] float32 on ``device``, the factor cos and sin are multiplied by)."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)  # [D/2]
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return 1.0 / pos_freqs, 1.0
    if kind != "yarn":
        raise ValueError(f"rope type {kind!r} is not supported; supported: {ROPE_TYPES}")
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                            else yarn_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # the share of each frequency kept as trained
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention_factor)


class Rotary:
    """RoPE over the last D dims of [T, heads, D], with a cos/sin table of every position up to the
    model's ``max_position`` (made on first use, on the positions' device), or further where a
    batch's metadata says it reaches further (``cover``).

    NOTE: sized from the configured maximum and the host's own numbers, never from the positions
    tensor: reading its largest value back would be a sync in every layer of every step (and what a
    CUDA graph cannot hold). The table costs max_position x D x 8 bytes once per model
    (DeepSeek-R1's 163840 x 64: 84 MB).

    ``interleave``: DeepSeek lays rotated pairs out as (x0, x1), (x2, x3), ...; the result is
    de-interleaved (even dims' rotations first), as transformers computes it: queries and keys
    get the same permutation, so their dot products are those of the interleaved rotation.
    """

    def __init__(self, dim: int, theta: float, scaling: dict | None = None, max_position: int = 4096,
                 interleave: bool = False):
        self.dim, self.interleave = dim, interleave
        self._freq_args = (dim, theta, scaling or {}, max_position)
        self.inv_freq, self.attention_scaling = inv_freq_and_scaling(*self._freq_args)
        self._cos: torch.Tensor | None = None  # [max_position, D], on the positions' device
        self._sin: torch.Tensor | None = None
        self._covers = 0  # positions a batch said it reaches (AttentionMetadata.max_position)

    def cover(self, n: int) -> None:
        """Positions [0, n) will be asked for (a host number: the batch's metadata)."""
        if n > self._covers:
            self._covers = n
            if self._cos is not None and n > self._cos.shape[0]:
                self._cos = self._sin = None  # remade, larger, at the next call

    def _make(self, device: torch.device) -> None:
        n = max(self._freq_args[3], self._covers, 256)
        inv = inv_freq_and_scaling(*self._freq_args, device=device)[0]  # made there, not copied there
        freqs = torch.outer(torch.arange(n, dtype=torch.float32, device=device), inv)  # [n, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [n, D]
        self._cos, self._sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D]; positions: [T] int64 below ``max_position`` -> rotated x, same dtype."""
        if self._cos is None or self._cos.device != positions.device:
            self._make(positions.device)
        cos = self._cos[positions].unsqueeze(1).to(x.dtype)  # [T, 1, D]
        sin = self._sin[positions].unsqueeze(1).to(x.dtype)
        half = self.dim // 2
        if self.interleave:
            c, s = cos[..., :half], sin[..., :half]
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
