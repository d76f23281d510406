"""The machine report behind ``moeflow env`` and every result file's provenance.

``machine_facts()`` is cheap (no measurement beyond the cached start-up probe) and goes into
provenance; ``measure()`` adds the longer measurements ``moeflow env`` prints.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import platform
import statistics
import time
from dataclasses import asdict
from multiprocessing import shared_memory

import numpy as np
import torch

from moeflow.hardware.capability import detect
from moeflow.hardware.dtype import decide_dtype
from moeflow.hardware.probe import PROBE_DTYPES, PROBE_SHAPE, gemm_gflops, probe_rates

ENV_SHAPE = (2048, 1024, 1024)  # M, K, N of the reported GEMM rate (a 2k-token prefill projection)
_SLOW_CALL_S = 0.3  # a dtype too slow for ENV_SHAPE in this time is measured on fewer rows


def machine_facts(device: str = "cpu") -> dict:
    """What names the machine a number was measured on: CPU, ISA, cores, builds, probe rates."""
    cap = detect(device)
    rates = probe_rates(cap)
    return {"cpu_model": cap.model, "isa": cap.isa, "isa_flags": list(cap.flags), "cores": cap.num_cores,
            "native_dtypes": list(cap.native), "torch": torch.__version__, "python": platform.python_version(),
            "probe_gemm_gflops": {d: round(g, 2) for d, g in rates.gflops.items()},
            "auto_dtype": decide_dtype("auto", "bfloat16", cap, rates).dtype}


def gemm_rate(dtype: str) -> tuple[float, tuple[int, int, int]]:
    """One-thread GFLOP/s at ENV_SHAPE, or on fewer rows when the dtype is emulated (slow)."""
    dt = getattr(torch, dtype)
    pilot = gemm_gflops(dt, PROBE_SHAPE, budget_s=0.02)
    m, k, n = ENV_SHAPE
    if 2 * m * k * n / (pilot * 1e9) > _SLOW_CALL_S:
        m = max(64, int(pilot * 1e9 * _SLOW_CALL_S / (2 * k * n)) // 64 * 64)
    return gemm_gflops(dt, (m, k, n), budget_s=1.0), (m, k, n)


def memcpy_s(x: torch.Tensor, repeats: int = 11) -> float:
    """Median time of one single-threaded copy of ``x`` into another private buffer."""
    dst = torch.empty_like(x)
    dst.copy_(x)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memcpy_gbps(num_bytes: int = 256 << 20) -> float:
    """One-thread copy bandwidth between two large buffers (bytes read + written counted once)."""
    return num_bytes / memcpy_s(torch.ones(num_bytes // 4, dtype=torch.float32), repeats=7) / 1e9


def _echo(name: str, rounds: int) -> None:
    shm = shared_memory.SharedMemory(name=name)
    flags = np.ndarray((16,), dtype=np.int64, buffer=shm.buf)  # [0]: ping, [8]: pong (other cache line)
    for seq in range(1, rounds + 1):
        spins = 0
        while flags[0] != seq:
            spins += 1
            if spins > 200:  # NOTE: yield, never pure spin: on 2 cores the peer needs this one
                os.sched_yield()
        flags[8] = seq
    del flags
    shm.close()


def flag_round_trip_us(rounds: int = 2000) -> float:
    """Median round trip of a sequence flag through shared memory between two processes."""
    shm = shared_memory.SharedMemory(create=True, size=128)
    try:
        flags = np.ndarray((16,), dtype=np.int64, buffer=shm.buf)
        flags[:] = 0
        child = mp.get_context("fork").Process(target=_echo, args=(shm.name, rounds), daemon=True)
        child.start()
        times = []
        for seq in range(1, rounds + 1):
            t0 = time.perf_counter()
            flags[0] = seq
            spins = 0
            while flags[8] != seq:
                spins += 1
                if spins > 200:
                    os.sched_yield()
            times.append(time.perf_counter() - t0)
        child.join(5.0)
        del flags
        return statistics.median(times[rounds // 10:]) * 1e6
    finally:
        shm.close()
        shm.unlink()


def measure(device: str = "cpu") -> dict:
    """Everything ``moeflow env`` reports (a few seconds; one torch thread, as the workers run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cap = detect(device)
        rates = probe_rates(cap, refresh=True)
        gemm = {}
        for d in PROBE_DTYPES:
            g, shape = gemm_rate(d)
            gemm[d] = {"gflops": round(g, 2), "shape": list(shape), "native": d in cap.native}
        facts = machine_facts(device)
        return {**facts, "capability": asdict(cap), "gemm": gemm, "memcpy_gbps": round(memcpy_gbps(), 2),
                "shm_flag_round_trip_us": round(flag_round_trip_us(), 2),
                "auto_dtype_reason": decide_dtype("auto", "bfloat16", cap, rates).reason}
    finally:
        torch.set_num_threads(threads)
