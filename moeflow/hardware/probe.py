"""Measured GEMM rates per dtype on one thread, cached per machine.

The ``auto`` dtype decision confirms capability detection with a short probe (a few ms per
dtype, once per machine: cached under ``<cache_dir>/hardware/<machine key>.json``, where the key
covers the CPU model, its ISA flags and the torch build). ``moeflow env`` measures again, longer.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from moeflow.hardware.capability import Capability, detect
from moeflow.settings import cache_dir

PROBE_SHAPE = (256, 256, 256)  # M, K, N of the start-up probe: ~0.3 ms in fp32, ~50 ms emulated bf16
PROBE_DTYPES = ("float32", "bfloat16", "float16")
_CACHE_VERSION = 1


@dataclass(frozen=True)
class GemmRates:
    """GFLOP/s of one-thread GEMMs per dtype on one machine."""

    key: str  # Capability.key of the machine measured
    gflops: dict  # dtype name -> GFLOP/s
    shape: tuple  # (M, K, N) measured

    def slowdown(self, dtype: str) -> float:
        """How many times slower ``dtype`` multiplies than float32 here."""
        return self.gflops["float32"] / self.gflops[dtype]


def gemm_gflops(dtype: torch.dtype, shape: tuple[int, int, int] = PROBE_SHAPE, budget_s: float = 0.05,
                device: str = "cpu") -> float:
    """Median GFLOP/s of ``[M, K] @ [K, N]`` over calls filling about ``budget_s`` (at least one)."""
    m, k, n = shape
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)  # [M, K]
    b = torch.randn(k, n, generator=g).to(device=device, dtype=dtype)  # [K, N]

    def timed() -> float:
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    times = [timed()]  # warm-up, kept only if it is all the budget allows
    if times[0] < budget_s:
        times = []
        start = time.perf_counter()
        while not times or (time.perf_counter() - start < budget_s and len(times) < 200):
            times.append(timed())
    return 2 * m * k * n / statistics.median(times) / 1e9


def _measure(cap: Capability) -> GemmRates:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' setting: rates per core
    try:
        rates = {d: gemm_gflops(getattr(torch, d), device=cap.device) for d in PROBE_DTYPES}
    finally:
        torch.set_num_threads(threads)
    return GemmRates(cap.key, rates, PROBE_SHAPE)


def _cache_path(cap: Capability) -> str:
    return os.path.join(cache_dir(), "hardware", f"gemm-{cap.key}.json")


def probe_rates(cap: Capability | None = None, refresh: bool = False) -> GemmRates:
    """This machine's probe rates: from the cache, or measured now and cached (atomically)."""
    cap = cap or detect()
    path = _cache_path(cap)
    if not refresh and os.path.isfile(path):
        try:
            with open(path) as f:
                d = json.load(f)
            if d.get("version") == _CACHE_VERSION and d.get("key") == cap.key:
                return GemmRates(d["key"], d["gemm_gflops"], tuple(d["shape"]))
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache is measured again
    rates = _measure(cap)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".gemm-")
    with os.fdopen(fd, "w") as f:
        json.dump({"version": _CACHE_VERSION, "key": rates.key, "capability": asdict(cap),
                   "gemm_gflops": rates.gflops, "shape": list(rates.shape),
                   "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, f, indent=2)
    os.replace(tmp, path)
    return rates
