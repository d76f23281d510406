"""Which device a deployment computes on: ``"auto"`` (CUDA when torch sees one), ``"cpu"``, ``"cuda"``
or ``"cuda:N"``; resolved once per deployment (beside the dtype), and per worker process.

``"cuda"`` without an index spreads a deployment's workers over the visible GPUs by rank, as
torchrun's local rank does; ``"cuda:N"`` puts every process on GPU N.
"""
from __future__ import annotations

import re

import torch

DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def resolve_device(requested: str) -> str:
    """``requested`` made concrete for this machine; a CUDA device torch cannot see is refused."""
    if not isinstance(requested, str) or not DEVICE_PATTERN.match(requested):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {requested!r}")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {requested!r}: torch {torch.__version__} sees no CUDA device here "
                             f"(a CPU build, or no GPU visible); use --device cpu")
        index = int(requested.split(":")[1]) if ":" in requested else 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {requested!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return requested


def worker_device(resolved: str, rank: int) -> torch.device:
    """The device of the worker with world rank ``rank`` in a deployment on ``resolved``."""
    if resolved == "cuda":
        return torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    return torch.device(resolved)
