"""``bench decode``'s reservation per request: enough that no request finishes inside the timed
window, counting what the first-prefilled requests decode while the rest of their group prefills
(a dep rank of 17 requests with 2048-token chunks had decoded 34 tokens before the window began)."""
from __future__ import annotations

from moeflow.config import EngineConfig
from moeflow.experiment.decode import decode_tokens, step_tokens
from moeflow.experiment.system import SystemSpec
from moeflow.layout import make_layout


def test_the_reservation_covers_the_window_and_the_decodes_during_the_group_prefill():
    assert decode_tokens(2, 16) == 2 + 32 + 6  # no group to prefill beside
    # 17 requests of 2048 tokens, steps of 2048 tokens of which 17 go to decodes: 2 steps per prompt
    assert decode_tokens(2, 16, context=2048, per_group=17, step_limit=2048) == 40 + 17 * 2 + 17
    assert decode_tokens(2, 16, context=8192, per_group=4, step_limit=2048) == 40 + 4 * 5 + 4


def test_the_step_limit_is_the_smallest_batch_limit_of_the_system():
    def spec(mode, **kw):
        s = SystemSpec(mode, make_layout(mode, **kw), EngineConfig(model="tiny", max_num_batched_tokens=8192))
        return s.layout, s.engine
    assert step_tokens(*spec("dep", dp=2, max_batch_tokens=4096, chunked_prefill_size=1024)) == 1024
    assert step_tokens(*spec("afd", max_batch_tokens=2048)) == 2048
    assert step_tokens(*spec("asap", max_batch_tokens=4096)) == 4096  # the scheduler's limit
    assert step_tokens(*spec("colocated")) == 8192  # the engine's
