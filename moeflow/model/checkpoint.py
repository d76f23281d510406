"""Key -> tensor over a Hugging Face safetensors checkpoint (one file or sharded), with precise errors."""
from __future__ import annotations

import glob
import hashlib
import json
import os
import struct

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    """The checkpoint directory is incomplete or inconsistent with its config.json."""


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantize_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """A block-quantized weight [R, C] times its per-block scales [ceil(R/b0), ceil(C/b1)], in float32
    (DeepSeek-V3's fp8 checkpoints: ``quantization_config.weight_block_size`` = 128 x 128)."""
    rows, cols = w.shape
    if scale_inv.shape != (-(-rows // block[0]), -(-cols // block[1])):
        raise CheckpointError(f"scales of shape {tuple(scale_inv.shape)} do not tile a {rows} x {cols} weight "
                              f"in {block[0]} x {block[1]} blocks")
    s = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]  # [R, C]
    return w.float() * s


class CheckpointReader:
    def __init__(self, path: str, dtype: torch.dtype, device: torch.device | str = "cpu"):
        """Tensors come back in ``dtype`` on ``device`` (a CUDA device is read straight into; meta
        gives shapes only: read on the CPU, dropped)."""
        self.path, self.dtype, self.device = path, dtype, torch.device(device)
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
        self.block = (128, 128)  # fp8 blocks: config.json's quantization_config, DeepSeek's default
        cfg = os.path.join(path, "config.json")
        if os.path.isfile(cfg):
            with open(cfg) as f:
                q = json.load(f).get("quantization_config") or {}
            self.block = tuple(q.get("weight_block_size") or self.block)

    def has(self, key: str) -> bool:
        return key in self.key_file

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor ``key`` in ``dtype`` (default: the reader's), checked against ``shape``.
        Block-quantized float8 weights (DeepSeek's ``<key>_scale_inv``) are dequantized first."""
        file = self.key_file.get(key)
        if file is None:
            raise CheckpointError(f"{self.path}: tensor {key!r} is missing from the checkpoint")
        if file not in self._open:
            if not os.path.isfile(file):
                raise CheckpointError(f"{self.path}: shard {os.path.basename(file)} (holding {key!r}) not found")
            self._open[file] = self._safe_open(file)
        t = self._open[file].get_tensor(key)
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{self.path}: tensor {key!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if t.dtype in _FP8 and self.has(key + "_scale_inv"):
            t = dequantize_blocks(t, self._raw(key + "_scale_inv"), self.block)
        return t.to(device=self.device, dtype=dtype or self.dtype)

    def _safe_open(self, file: str):
        return safe_open(file, framework="pt", device=str(self.device) if self.device.type == "cuda" else "cpu")

    def _raw(self, key: str) -> torch.Tensor:
        file = self.key_file[key]
        if file not in self._open:
            self._open[file] = self._safe_open(file)
        return self._open[file].get_tensor(key)

    def maybe(self, key: str, shape: tuple[int, ...], wanted: bool) -> torch.Tensor | None:
        return self.get(key, shape) if wanted else None


def weights_fingerprint(path: str, samples_per_file: int = 64, sample_bytes: int = 64) -> str:
    """What tells two servers they hold the same model: a hash over config.json, every safetensors
    file's tensor names, dtypes and shapes, and ``samples_per_file`` pieces of each file's data
    spread evenly over it (16 hex digits).

    Other architectures, shapes or settings always differ here, and so do other trained weights
    (every tensor differs, so every sample does); a checkpoint that differs in a few tensors only
    may not. Reads headers and a few KiB per file: cheap at any size, cold cache included."""
    h = hashlib.sha256()
    cfg = os.path.join(path, "config.json")
    if os.path.isfile(cfg):
        with open(cfg) as f:
            h.update(json.dumps(json.load(f), sort_keys=True).encode())
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors file to fingerprint")
    for file in files:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            h.update(json.dumps({k: [v["dtype"], v["shape"]] for k, v in sorted(header.items())}).encode())
            start, size = 8 + n, os.fstat(f.fileno()).st_size - 8 - n
            for i in range(samples_per_file):
                f.seek(start + size * i // samples_per_file)
                h.update(f.read(sample_bytes))
    return h.hexdigest()[:16]
