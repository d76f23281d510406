"""The rehearsal's environment: decode attention on the gather path a GPU takes (the CPU would take
its in-place kernel), for the tests' own process and every worker they start."""
from __future__ import annotations

import pytest

from cuda_support import REHEARSAL


@pytest.fixture(autouse=True)
def _gather_path_in_rehearsal(monkeypatch):
    if REHEARSAL:
        monkeypatch.setenv("MOEFLOW_PAGED_ATTENTION", "gather")
