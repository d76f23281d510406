"""What this machine computes natively and how fast: capability detection, a cached GEMM probe,
and the ``dtype="auto"`` decision every deployment makes once at start.

Imports torch but nothing of the runtime; the engine and the benchmarks read it.
"""
from moeflow.hardware.capability import Capability, detect
from moeflow.hardware.dtype import DtypeChoice, EmulatedDtypeWarning, decide_dtype, resolve_dtype
from moeflow.hardware.probe import GemmRates, gemm_gflops, probe_rates

__all__ = ["Capability", "detect", "DtypeChoice", "EmulatedDtypeWarning", "decide_dtype", "resolve_dtype",
           "GemmRates", "gemm_gflops", "probe_rates"]
