"""What /proc/cpuinfo says about this CPU (torch-free: result provenance reads it too)."""
from __future__ import annotations

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
