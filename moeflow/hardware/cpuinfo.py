"""What /proc/cpuinfo says about this CPU (torch-free: result provenance reads it too)."""
from __future__ import annotations

import glob
import platform


def _line(prefixes: tuple[str, ...]) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(prefixes):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return _line(("model name",)) or platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    flags = _line(("flags", "Features"))
    return set(flags.split()) if flags else set()


def last_level_cache_bytes(default: int = 32 << 20) -> int:
    """Size of the largest CPU cache (sysfs), ``default`` where the kernel does not say."""
    sizes = []
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(index) as f:
                text = f.read().strip().upper()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=default)
