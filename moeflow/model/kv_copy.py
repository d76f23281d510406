"""The KV handoff's copy of runs of cache slots, every layer at once (``comm/kv_pull.py`` decides
which runs and heads): on the CPU the C++ op ``copy_kv_runs`` (``kv_copy.cpp``, built on first
use: one call per entry, streaming stores); where ``op_runs`` says it does not (another device, no
compiler, ``MOEFLOW_KV_COPY=torch``) the caller copies run by run in torch
(``comm.kv_pull.copy_by_slices``, also the oracle).
"""
from __future__ import annotations

import functools
import os

import torch

from moeflow.logs import get_logger
from moeflow.model.extension import ExtensionError, load_extension
from moeflow.settings import kv_copy_mode

log = get_logger("moeflow.model.kv_copy")

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kv_copy.cpp")


@functools.cache
def _kernel() -> bool:
    """Build or load the op once per process; a failure is logged once and torch copies are used."""
    try:
        load_extension("moeflow_kv_copy", _SOURCE)
    except ExtensionError as e:
        log.warning("the KV copy op is unavailable, the KV handoff copies run by run in torch: %s", e)
        return False
    return True


def op_runs(device: torch.device) -> bool:
    """Whether ``copy_runs`` runs for caches on ``device``."""
    return device.type == "cpu" and kv_copy_mode() == "auto" and _kernel()


def copy_runs(src: torch.Tensor, dst: torch.Tensor, runs: list[tuple[int, int, int]]) -> None:
    """The op: ``dst[:, to:to + n] = src[:, at:at + n]`` for every run (first source slot, first
    destination slot, slots), every layer; [L, N, *e] CPU views whose slots are contiguous inside."""
    if not _kernel():
        raise RuntimeError("the KV copy op could not be built here (the warning says why); copy by slices")
    torch.ops.moeflow.copy_kv_runs(src, dst, torch.tensor(runs, dtype=torch.int64, device="cpu").view(-1, 3))
