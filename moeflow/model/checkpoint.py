"""Key -> tensor over a Hugging Face safetensors checkpoint (one file or sharded), with precise errors."""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    """The checkpoint directory is incomplete or inconsistent with its config.json."""


class CheckpointReader:
    def __init__(self, path: str, dtype: torch.dtype):
        self.path, self.dtype = path, dtype
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self.key_file = {k: os.path.join(path, v) for k, v in weight_map.items()}
        elif os.path.isfile(single):
            with safe_open(single, framework="pt") as f:
                self.key_file = {k: single for k in f.keys()}
        else:
            raise CheckpointError(f"{path}: neither model.safetensors nor model.safetensors.index.json found")
        self._open: dict[str, object] = {}

    def has(self, key: str) -> bool:
        return key in self.key_file

    def get(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        file = self.key_file.get(key)
        if file is None:
            raise CheckpointError(f"{self.path}: tensor {key!r} is missing from the checkpoint")
        if file not in self._open:
            if not os.path.isfile(file):
                raise CheckpointError(f"{self.path}: shard {os.path.basename(file)} (holding {key!r}) not found")
            self._open[file] = safe_open(file, framework="pt")
        t = self._open[file].get_tensor(key)
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{self.path}: tensor {key!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        return t.to(self.dtype)

    def maybe(self, key: str, shape: tuple[int, ...], wanted: bool) -> torch.Tensor | None:
        return self.get(key, shape) if wanted else None
