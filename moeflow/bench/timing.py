"""Wall-clock timing shared by the micro-benchmarks: the median of repeated calls."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_s(fn: Callable[[], object], repeats: int, warmup: bool = True) -> float:
    """Median seconds of ``repeats`` calls of ``fn``, after one untimed call unless ``warmup`` is
    False (first calls allocate; a call that is itself a whole run needs none)."""
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
