"""What this machine computes natively and how fast: capability detection, a cached GEMM probe,
and the ``dtype="auto"`` decision every deployment makes once at start.

Imports torch but nothing of the runtime; the engine and the benchmarks read it. The names below
load on first use, so ``moeflow.hardware.cpuinfo`` stays importable without torch.
"""
import importlib

_EXPORTS = {"Capability": "capability", "detect": "capability", "DtypeChoice": "dtype",
            "EmulatedDtypeWarning": "dtype", "decide_dtype": "dtype", "resolve_dtype": "dtype",
            "GemmRates": "probe", "gemm_gflops": "probe", "probe_rates": "probe",
            "resolve_device": "device", "worker_device": "device"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"moeflow.hardware.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'moeflow.hardware' has no attribute {name!r}")
