"""What a device can do, measured on it now, and what its datasheet says: the two ceilings a roofline
divides by, and the facts that name the device.

CUDA: a GEMM of 8192^3 in the run's dtype after warm-up, and a 4 GiB device-to-device copy. CPU: the
probes ``moeflow env`` reports (``hardware/report.py``: a [2048, 1024] x [1024, 1024] GEMM, a 256 MiB
copy), run at the benchmark's thread count. A copy rate counts the bytes copied (the source's size),
as ``moeflow env`` does: a kernel that only reads can exceed it (a copy also writes each byte).
"""
from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

CUDA_GEMM_N = 8192
CUDA_COPY_BYTES = 4 << 30


@dataclass(frozen=True)
class Datasheet:
    """A device's published peaks (dense, without sparsity)."""

    name: str
    flop_per_s: dict  # dtype -> peak FLOP/s
    bytes_per_s: float  # memory bandwidth
    source: str


# NVIDIA's H100 / H200 Tensor Core GPU datasheets, SXM parts: bf16/fp16 tensor 1,979 TFLOPS quoted
# with sparsity (989.5 dense), FP32 67 TFLOPS; HBM3 3.35 TB/s (H100), HBM3e 4.8 TB/s (H200). torch names
# them "NVIDIA H200" and "NVIDIA H100 80GB HBM3"; the PCIe and NVL parts have other peaks: not listed.
_HOPPER_FLOPS = {"bfloat16": 989.5e12, "float16": 989.5e12, "float32": 67e12}
DATASHEETS = (
    (lambda name: "H200" in name and "NVL" not in name,
     Datasheet("NVIDIA H200 SXM", _HOPPER_FLOPS, 4.8e12, "NVIDIA H200 Tensor Core GPU datasheet")),
    (lambda name: "H100" in name and ("HBM3" in name or "SXM" in name),
     Datasheet("NVIDIA H100 SXM", _HOPPER_FLOPS, 3.35e12, "NVIDIA H100 Tensor Core GPU datasheet")),
)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_s(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones, the device drained
    before and after each (a CUDA call returns when its kernels are queued, not done)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def device_facts(device: torch.device, threads: int) -> dict:
    """Names the device a result was measured on: model, driver, builds, memory, threads."""
    facts = {"kind": device.type, "torch": torch.__version__, "threads": threads}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update(name=torch.cuda.get_device_name(device), capability=f"{props.major}.{props.minor}",
                     memory_bytes=props.total_memory, cuda=torch.version.cuda, driver=_nvidia_driver())
    else:
        from moeflow.hardware.capability import detect

        cap = detect("cpu")
        facts.update(name=cap.model, isa=cap.isa, isa_flags=list(cap.flags), cores=cap.num_cores)
    return facts


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def datasheet_for(device: torch.device) -> Datasheet | None:
    return datasheet_named(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def datasheet_named(name: str) -> Datasheet | None:
    """The datasheet of the GPU torch calls ``name``; None for a part not listed."""
    return next((sheet for matches, sheet in DATASHEETS if matches(name)), None)


def measure_ceilings(device: torch.device, dtype: torch.dtype) -> dict:
    """{"gemm": {flop_per_s, shape, how}, "copy": {bytes_per_s, bytes, how}, "datasheet": ... | None}."""
    if device.type == "cuda":
        gemm, copy = _cuda_gemm(device, dtype), _cuda_copy(device)
    else:
        from moeflow.hardware.report import gemm_rate, memcpy_gbps

        gflops, shape = gemm_rate(str(dtype).removeprefix("torch."))
        gemm = {"flop_per_s": gflops * 1e9, "shape": list(shape),
                "how": "moeflow env's GEMM probe (hardware/report.py gemm_rate), median over ~1 s"}
        copy_bytes = 256 << 20
        copy = {"bytes_per_s": memcpy_gbps(copy_bytes) * 1e9, "bytes": copy_bytes,
                "how": "moeflow env's memcpy (hardware/report.py memcpy_gbps), median of 7"}
    sheet = datasheet_for(device)
    return {"gemm": gemm, "copy": copy, "datasheet": asdict(sheet) if sheet else None}


def _cuda_gemm(device: torch.device, dtype: torch.dtype) -> dict:
    n = CUDA_GEMM_N
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=device, dtype=dtype)  # [N, N]
    b = torch.randn(n, n, generator=g, device=device, dtype=dtype)  # [N, N]
    calls = 10  # one timing spans several calls: a sync per call would add its latency to each

    def batch():
        for _ in range(calls):
            a @ b

    s = statistics.median(timed_s(batch, device, repeats=5, warmup=1)) / calls
    del a, b
    return {"flop_per_s": 2 * n ** 3 / s, "shape": [n, n, n],
            "how": f"torch.matmul {n}^3, median of 5 timings of {calls} calls, after warm-up"}


def _cuda_copy(device: torch.device) -> dict:
    src = torch.empty(CUDA_COPY_BYTES, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    s = statistics.median(timed_s(lambda: dst.copy_(src), device, repeats=5, warmup=2))
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes_per_s": CUDA_COPY_BYTES / s, "bytes": CUDA_COPY_BYTES,
            "how": "dst.copy_(src) of 4 GiB on the device, median of 5 after warm-up; bytes = the source's"}
