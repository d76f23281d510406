"""Which floating-point types a device computes natively (in hardware, not emulated).

CPU: bfloat16 needs AVX512_BF16 or AMX-BF16 (without them torch converts every element and runs
the fp32 kernels at ~1 GFLOP/s, ~100x below fp32); float16 needs AVX512_FP16 or AMX-FP16. CUDA:
bfloat16 where the device supports it (Ampere and newer), float16 everywhere.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch

from moeflow.hardware.cpuinfo import cpu_flags, cpu_model

# /proc/cpuinfo flags that make a dtype native on x86 (Linux spells AVX512_BF16 "avx512_bf16")
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
_FP16_FLAGS = frozenset({"avx512_fp16", "amx_fp16"})
# flags worth naming in a report (what decides the GEMM kernels torch picks)
_REPORTED_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
                   "amx_bf16", "amx_fp16", "amx_int8", "asimd", "sve", "bf16")


@dataclass(frozen=True)
class Capability:
    device: str  # "cpu" or "cuda"
    model: str  # CPU model name (or CUDA device name)
    isa: str  # torch's own verdict: torch.backends.cpu.get_cpu_capability() ("AVX2", "AVX512", ...)
    flags: tuple[str, ...]  # the reported ISA flags present
    num_cores: int  # CPUs this process may run on
    torch_version: str
    native: tuple[str, ...]  # dtypes computed natively, fastest-first preference is the caller's

    @property
    def key(self) -> str:
        """Names this machine for the probe cache: the CPU, its flags and the torch build."""
        raw = "|".join([self.device, self.model, self.isa, ",".join(self.flags), self.torch_version])
        return hashlib.sha1(raw.encode()).hexdigest()[:16]

    def why(self, dtype: str) -> str:
        """One phrase saying why ``dtype`` is or is not native here."""
        if self.device == "cuda":
            return f"{self.model} {'supports' if dtype in self.native else 'lacks'} {dtype}"
        need = {"bfloat16": "AVX512_BF16 or AMX-BF16", "float16": "AVX512_FP16 or AMX-FP16"}.get(dtype)
        if need is None:
            return f"{dtype} is native on every CPU"
        has = sorted((_BF16_FLAGS if dtype == "bfloat16" else _FP16_FLAGS) & set(self.flags))
        if has:
            return f"the CPU has {', '.join(f.upper() for f in has)}"
        return f"the CPU ({self.isa}) has no {need}"


def detect(device: str = "cpu") -> Capability:
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device!r} requested but torch sees no CUDA device")
        native = ("float32", "float16") + (("bfloat16",) if torch.cuda.is_bf16_supported() else ())
        return Capability("cuda", torch.cuda.get_device_name(), "cuda", (), torch.cuda.device_count(),
                          torch.__version__, native)
    if device != "cpu":
        raise ValueError(f"unknown device {device!r}; moeflow runs on 'cpu' or 'cuda'")
    flags = cpu_flags()
    native = ["float32"]
    if flags & _BF16_FLAGS:
        native.append("bfloat16")
    if flags & _FP16_FLAGS:
        native.append("float16")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return Capability("cpu", cpu_model(), torch.backends.cpu.get_cpu_capability(),
                      tuple(f for f in _REPORTED_FLAGS if f in flags), cores, torch.__version__, tuple(native))
