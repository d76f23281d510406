"""Decode attention that reads the paged KV cache where it lies, one call per layer for a batch.

The requests of a batch that decode (one new token over cached context) go through one call:
the C++ kernel (``paged_attention.cpp``, built on first use by ``extension.py``) follows each
request's block table into the layer's cache views and copies nothing; ``batched_decode_attention``
gathers the whole batch's contexts through their block tables in one indexing op and runs one
SDPA over them (a fixed handful of ops whatever the batch, nothing read back to the host: what a
GPU runs, and what a CUDA graph can capture); the slow path and oracle,
``gathered_decode_attention``, gathers each request's context (index_select) and runs SDPA
request by request, as attention did before the kernel.

Which runs is ``$MOEFLOW_PAGED_ATTENTION`` (read in ``settings``): ``auto`` (default) takes the
kernel on CPU where it builds and the batched path elsewhere (one warning naming why, when it does
not build); ``batched`` forces the batched path on any device (the path a GPU takes, run on the
CPU in tests and benchmarks); ``gather`` forces the per-request path (the "before" of before/after
runs); ``kernel`` requires the kernel and raises where it cannot run. Only the choice knows about
CPUs: the caller passes tensors on any device. flash-attn's paged decode needs KV blocks of a
multiple of 256 tokens and FlashInfer is not a dependency, so neither is wired in; the choice per
device kind is logged once (``path_for``), so a run says which path its decode took.

Legend: B decode requests, Hq / Hkv query / kv heads, Dk / Dv key / value dims, N cache slots.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeflow.logs import get_logger
from moeflow.model.extension import ExtensionError, load_extension
from moeflow.settings import paged_attention_mode

log = get_logger("moeflow.model.paged_attention")

MODES = ("auto", "gather", "kernel", "batched")
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paged_attention.cpp")


@dataclass(frozen=True)
class DecodeBatch:
    """The decode requests of one batch in the kernel's terms; built once per batch, read by every layer."""

    rows: torch.Tensor  # [B] int64: their (single) token rows in the batch
    block_tables: torch.Tensor  # [B, max_blocks] int32: each request's blocks, padded with block 0
    context_lens: torch.Tensor  # [B] int32: keys per request, the new token's included (written first)
    block_size: int

    @staticmethod
    def takes(query_len: int, context_len: int) -> bool:
        """Whether a request decodes: one new token over a cached context (prefill and chunks do not)."""
        return query_len == 1 and context_len > 0

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables: list[tuple[int, ...]],
              block_size: int, device: torch.device | str = "cpu") -> DecodeBatch | None:
        """None when no request decodes."""
        rows, tables, lens = [], [], []
        start = 0
        for q, c, table in zip(query_lens, context_lens, block_tables):
            if cls.takes(q, c):
                rows.append(start)
                tables.append(table)
                lens.append(c + 1)
            start += q
        if not rows:
            return None
        width = max(len(t) for t in tables)
        padded = [list(t) + [0] * (width - len(t)) for t in tables]  # [B, max_blocks]
        return cls(torch.as_tensor(rows, dtype=torch.int64, device=device),
                   torch.as_tensor(padded, dtype=torch.int32, device=device),
                   torch.as_tensor(lens, dtype=torch.int32, device=device), block_size)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: DecodeBatch,
                     scale: float | None = None) -> torch.Tensor:
    """q: [B, Hq, Dk] one query per decode request; k: [N, Hkv, Dk], v: [N, Hkv, Dv] one layer's cache
    (strided views, last dim contiguous); scale: None = Dk^-0.5. -> [B, Hq, Dv] in q's dtype."""
    op = {"kernel": paged_decode_attention, "batched": batched_decode_attention,
          "gather": gathered_decode_attention}[path_for(q.device)]
    return op(q, k, v, batch.block_tables, batch.context_lens, batch.block_size, scale)


def batched_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor,
                             context_lens: torch.Tensor, block_size: int, scale: float | None = None) -> torch.Tensor:
    """The whole batch in a fixed handful of ops on any device, with nothing read back to the host:
    every request's context gathered through its block table into [B, L, Hkv, D] (L: the table's
    width in slots; padding slots point at block 0 and are masked), then one SDPA."""
    width = block_tables.shape[1] * block_size
    pos = torch.arange(width, device=k.device)  # [L]
    table = block_tables.to(device=k.device, dtype=torch.int64)
    slots = table[:, pos // block_size] * block_size + pos % block_size  # [B, L]
    keys, values = k[slots].transpose(1, 2), v[slots].transpose(1, 2)  # [B, Hkv, L, D]
    mask = pos.unsqueeze(0) < context_lens.to(device=k.device).unsqueeze(1)  # [B, L]: a request's own keys
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask[:, None, None, :],
                                         scale=scale, enable_gqa=True)
    return out[:, :, 0]  # [B, Hq, Dv]


def uses_kernel(device: torch.device) -> bool:
    """Whether decode attention on ``device`` runs the in-place kernel (see the module docstring)."""
    return path_for(device) == "kernel"


def path_for(device: torch.device) -> str:
    """Which decode attention runs on ``device``: "kernel", "batched" or "gather" (the module docstring)."""
    path = _path_for(device)
    _log_choice(device.type, path)
    return path


@functools.cache
def _log_choice(device_type: str, path: str) -> None:
    if device_type != "meta":
        log.info("decode attention on %s: %s", device_type, {
            "kernel": "the in-place paged kernel", "batched": "SDPA over the batch's gathered KV, no host sync",
            "gather": "SDPA over each request's gathered KV"}[path])


def _path_for(device: torch.device) -> str:
    mode = paged_attention_mode()
    if mode not in MODES:
        raise ValueError(f"MOEFLOW_PAGED_ATTENTION={mode!r}: must be one of {MODES}")
    if mode in ("gather", "batched"):
        return mode
    if device.type != "cpu":
        if mode == "kernel":
            raise RuntimeError(f"MOEFLOW_PAGED_ATTENTION=kernel: the paged attention kernel is CPU-only, "
                               f"the tensors are on {device}")
        return "batched"
    status = kernel_status()
    if not status.available and mode == "kernel":
        raise RuntimeError(f"MOEFLOW_PAGED_ATTENTION=kernel, but the kernel is unavailable: {status.reason}")
    return "kernel" if status.available else "batched"


@dataclass(frozen=True)
class KernelStatus:
    available: bool
    reason: str  # why not, or where the library is
    load_s: float | None = None  # build (first use on this CPU) or load time
    built: bool = False  # this process compiled it


@functools.cache
def kernel_status() -> KernelStatus:
    """Build or load the kernel once per process; a failure is logged once and the gather path is used."""
    try:
        ext = load_extension("moeflow_paged_attention", _SOURCE)
    except ExtensionError as e:
        log.warning("paged attention kernel unavailable, decode attention gathers the KV cache instead: %s", e)
        return KernelStatus(False, str(e))
    return KernelStatus(True, ext.library, ext.load_s, ext.built)


def paged_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, block_size: int, scale: float | None = None) -> torch.Tensor:
    """The kernel (arguments as ``decode_attention``'s, its batch unpacked); raises where it cannot run."""
    status = kernel_status()
    if not status.available:
        raise RuntimeError(f"the paged attention kernel is unavailable: {status.reason}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.moeflow.paged_decode_attention(q, k, v, block_tables, context_lens, block_size, scale)


def gathered_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor,
                              context_lens: torch.Tensor, block_size: int,
                              scale: float | None = None) -> torch.Tensor:
    """The slow path and oracle: per request, copy its keys and values out of the cache, then SDPA."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])  # [B, Hq, Dv]
    for i, n in enumerate(context_lens.tolist()):
        pos = torch.arange(n, device=k.device)
        slots = block_tables[i].to(k.device, torch.int64)[pos // block_size] * block_size + pos % block_size
        ki = k.index_select(0, slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, Dk]
        vi = v.index_select(0, slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, Dv]
        qi = q[i].unsqueeze(0).unsqueeze(2)  # [1, Hq, 1, Dk]
        out[i] = F.scaled_dot_product_attention(qi, ki, vi, scale=scale, enable_gqa=True)[0, :, 0]
    return out
