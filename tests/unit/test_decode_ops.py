"""What one decode step asks of the device (``model/op_count.py``): on the colocated engine, the
aten ops of a step do not grow with the batch and the step syncs with the host once (its sampled
tokens leaving for the host), on the batched attention path a GPU takes and on the CPU kernel's;
the per-request gather path, the oracle, is what they replaced (it grows, and syncs every layer)."""
from __future__ import annotations

import pytest
import torch

from moeflow import LLM, SamplingParams
from moeflow.core import Request
from moeflow.model.op_count import OpCount


def _step_counts(monkeypatch, path: str) -> dict[int, OpCount]:
    monkeypatch.setenv("MOEFLOW_PAGED_ATTENTION", path)
    torch.set_num_threads(1)
    out = {}
    with LLM("tiny", dtype="float32", num_kv_blocks=1024) as llm:
        eng = llm.engine
        for b in (1, 8, 64):
            for i in range(b):
                eng.add_request(Request(f"{b}-{i}", list(range(1, 17)), SamplingParams(max_tokens=6, ignore_eos=True),
                                        0.0))
            for _ in range(2):  # the prefill, then a first decode step
                eng.step()
            with OpCount() as c:
                res = eng.step()
            assert len(res.outputs) == b  # every request decoded in the counted step
            out[b] = c
            while eng.has_unfinished():
                eng.step()
    return out


@pytest.mark.parametrize("path", ["batched", "auto"])
def test_a_decode_step_launches_the_same_ops_at_any_batch_and_syncs_once(monkeypatch, path):
    counts = _step_counts(monkeypatch, path)
    ops = [c.ops for c in counts.values()]
    assert max(ops) - min(ops) <= 2, ops
    for b, c in counts.items():
        assert c.syncs <= 1, (b, dict(c.sync_sites))


def test_the_per_request_oracle_is_what_grows(monkeypatch):
    counts = _step_counts(monkeypatch, "gather")
    assert counts[64].ops > 5 * counts[1].ops and counts[64].syncs > 1
