"""``dtype="auto"``: the checkpoint's dtype where this device computes it natively and fast,
otherwise float32; an explicit dtype the device only emulates runs, with one warning.

A dtype is *fast* when capability detection says it is native **and** the GEMM probe confirms it
(at least half the float32 rate): the flags decide, the probe catches a flag that lies (a
hypervisor that hides AMX, a torch build without the kernel).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

from moeflow.hardware.capability import Capability, detect
from moeflow.hardware.probe import GemmRates, probe_rates
from moeflow.logs import get_logger

log = get_logger("moeflow.hardware")

DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
_CONFIRM = 0.5  # a native dtype must reach this fraction of the float32 GEMM rate in the probe
_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


class EmulatedDtypeWarning(UserWarning):
    """An explicitly requested dtype runs emulated on this device (much slower than float32)."""


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # what the deployment computes in
    reason: str  # one sentence, logged at start
    emulated: bool = False  # the dtype is not fast here (only ever True when asked for explicitly)
    slowdown: float | None = None  # measured GEMM time ratio vs float32, when probed


def checkpoint_dtype_name(raw) -> str | None:
    """Normalize config.json's ``torch_dtype``/``dtype`` ("bfloat16", "torch.float16", "bf16")."""
    if raw is None:
        return None
    name = str(raw).removeprefix("torch.").lower()
    return _ALIASES.get(name, name)


def _fast(dtype: str, cap: Capability, rates: GemmRates | None) -> bool:
    if dtype == "float32":
        return True
    if dtype not in cap.native:
        return False
    return rates is None or rates.gflops[dtype] >= _CONFIRM * rates.gflops["float32"]


def _probe_note(dtype: str, rates: GemmRates | None) -> str:
    if rates is None or dtype == "float32":
        return ""
    g = rates.gflops
    return (f" (probe: {dtype} GEMM {g[dtype]:.1f} GFLOP/s vs float32 {g['float32']:.1f}, "
            f"{rates.slowdown(dtype):.1f}x the time)")


def decide_dtype(requested: str, checkpoint_dtype: str | None, cap: Capability,
                 rates: GemmRates | None) -> DtypeChoice:
    """The decision itself, on given capabilities and probe rates (tests fake both)."""
    requested = _ALIASES.get(requested, requested)
    if requested not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {requested!r}")
    if requested != "auto":
        fast = _fast(requested, cap, rates)
        slow = None if rates is None or requested == "float32" else rates.slowdown(requested)
        why = cap.why(requested) if requested not in cap.native else "the probe measured it slow"
        if fast:
            return DtypeChoice(requested, f"dtype {requested} as requested", False, slow)
        return DtypeChoice(requested, f"dtype {requested} as requested, but this {cap.device.upper()} only emulates it: "
                           f"{why}{_probe_note(requested, rates)}; dtype='auto' would pick float32", True, slow)
    ckpt = checkpoint_dtype_name(checkpoint_dtype) or "float32"
    if ckpt not in ("bfloat16", "float16", "float32"):
        return DtypeChoice("float32", f"auto: the checkpoint stores {ckpt}, computed in float32")
    if ckpt == "float32":
        return DtypeChoice("float32", "auto: the checkpoint is float32")
    if _fast(ckpt, cap, rates):
        return DtypeChoice(ckpt, f"auto: the checkpoint's {ckpt}, native here: {cap.why(ckpt)}"
                           f"{_probe_note(ckpt, rates)}")
    if ckpt == "float16" and _fast("bfloat16", cap, rates):
        return DtypeChoice("bfloat16", f"auto: the checkpoint is float16, emulated here ({cap.why('float16')}); "
                           f"bfloat16 is native: {cap.why('bfloat16')}")
    why = cap.why(ckpt) if ckpt not in cap.native else "the probe measured it slow"
    return DtypeChoice("float32", f"auto: float32, not the checkpoint's {ckpt}: {why}{_probe_note(ckpt, rates)}")


_warned: set[tuple[str, str]] = set()


def resolve_dtype(requested: str, checkpoint_dtype: str | None, device: str = "cpu") -> DtypeChoice:
    """Decide for this machine, log the choice, and warn once per process for an emulated dtype."""
    cap = detect(device)
    rates = None
    if _ALIASES.get(requested, requested) != "float32":  # float32 is fast everywhere: nothing to probe
        try:
            rates = probe_rates(cap)
        except (RuntimeError, OSError) as e:  # no probe: capability alone decides
            log.warning("GEMM probe failed (%s); deciding the dtype from CPU flags alone", e)
    choice = decide_dtype(requested, checkpoint_dtype, cap, rates)
    if choice.emulated:
        if (cap.key, choice.dtype) not in _warned:
            _warned.add((cap.key, choice.dtype))
            warnings.warn(choice.reason, EmulatedDtypeWarning, stacklevel=3)
            log.warning("%s", choice.reason)
    else:
        log.info("%s", choice.reason)
    return choice
