"""The control loop's heap trimming: glibc's malloc_trim at most every interval, a clock read
otherwise (the dep ranks' anon memory grew without it; see workers/heap.py)."""
from __future__ import annotations

import sys
import time

import pytest

from moeflow.workers.heap import HeapTrimmer


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_trims_once_per_interval():
    h = HeapTrimmer(interval_s=0.2)
    assert h._trim is not None, "glibc's malloc_trim was not found on Linux"
    h.maybe()
    assert h.num_trims == 0, "trimmed before the interval passed"
    time.sleep(0.25)
    h.maybe()
    h.maybe()
    assert h.num_trims == 1
