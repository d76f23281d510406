"""CommSpec sizes against ASAP Table 2, the mailbox layout, and config validation."""
from __future__ import annotations

import math

import pytest

from moeflow.comm import CommConfig, CommSpec, WaitPolicy
from moeflow.comm.shm import combine_layout, dispatch_layout
from moeflow.config import ConfigError

# ASAP Table 1's representative deployment.
ASAP = dict(num_regions=4, lanes_per_region=4, num_expert_ranks=16, num_experts=256, top_k=8, hidden_size=7168,
            max_batch_tokens=32 * 1024)


def test_table2_example_sizes():
    t2 = CommSpec(**ASAP).table2_bytes()
    assert t2["attention_expert_ids"] == 64 * 1024  # "64KB"
    assert t2["attention_expert_results"] == 0.875 * 2**30  # "0.9GB"
    assert t2["attention_bitmap"] < 1024 and t2["moe_token_metadata"] < 1024 and t2["moe_bitmaps"] < 1024
    assert t2["moe_tokens"] == 14 * 2**30  # "14GB"


def test_dispatch_buffer_is_table2_per_slot():
    spec = CommSpec(**ASAP)
    layout = dispatch_layout(spec)
    assert layout.num_lanes == 16 and spec.dispatch_rows == 8 * 32 * 1024 // 4  # K x S / T per row
    payload_per_slot = layout.num_lanes * layout.slot_bytes
    assert payload_per_slot == spec.table2_bytes()["moe_tokens"]
    assert layout.size_bytes == layout.payload_offset + spec.num_slots * payload_per_slot
    assert spec.dispatch_header_words == 3 + 16  # layer, batch, rows, E_total / E counts


def test_combine_segments_are_sized_for_their_worst_case():
    spec = CommSpec(**ASAP)
    assert spec.segment_rows == spec.dispatch_rows  # min(K, Epr) x S / W: independent segments
    assert CommSpec(**{**ASAP, "combine_rows": 1000}).segment_rows == 1000
    layout = combine_layout(spec)
    assert layout.num_lanes == 16 and layout.header_words == 3


def test_layout_alignment():
    spec = CommSpec(num_regions=3, lanes_per_region=2, num_expert_ranks=2, num_experts=4, top_k=2, hidden_size=100,
                    max_batch_tokens=7, dtype="float32", num_slots=3)
    layout = dispatch_layout(spec)
    assert layout.flags_offset % 64 == 0 and layout.headers_offset % 64 == 0
    assert layout.header_stride % 64 == 0 and layout.header_stride >= 8 * layout.header_words
    assert layout.payload_offset % 4096 == 0 and layout.slot_bytes % 4096 == 0
    assert layout.slot_bytes >= spec.dispatch_rows * 100 * 4
    assert spec.tokens_per_lane == math.ceil(7 / 2) and spec.dispatch_rows == 2 * 4
    assert layout.key != dispatch_layout(CommSpec(**{**spec.__dict__, "hidden_size": 101})).key


def test_ranks():
    spec = CommSpec(num_regions=2, lanes_per_region=3, num_expert_ranks=2, num_experts=2, top_k=1, hidden_size=8,
                    max_batch_tokens=8)
    assert [spec.lane_id(1, j) for j in range(3)] == [3, 4, 5]
    assert spec.expert_world_rank(0) == 6 and spec.world_size == 8
    with pytest.raises(ConfigError):
        spec.lane_id(2, 0)


@pytest.mark.parametrize("bad", [
    dict(num_regions=0), dict(lanes_per_region=-1), dict(hidden_size=1.5), dict(dtype="int8"), dict(num_slots=1),
    dict(num_slots=9), dict(num_experts=250), dict(top_k=300), dict(combine_rows=-1), dict(num_regions=True),
])
def test_spec_validation(bad):
    with pytest.raises(ConfigError):
        CommSpec(**{**ASAP, **bad})


def test_config_validation():
    spec = CommSpec(**ASAP)
    assert CommConfig(spec).transport == "shm"
    for bad in (dict(transport="carrier-pigeon"), dict(deployment_id="a.b"), dict(deployment_id=""),
                dict(deployment_id="x/y"), dict(attach_timeout_s=0)):
        with pytest.raises(ConfigError):
            CommConfig(spec, **bad)
    for bad in (dict(spin_s=-1), dict(block_timeout_s=0), dict(block_timeout_s=math.inf), dict(nap_s=math.nan)):
        with pytest.raises(ConfigError):
            WaitPolicy(**bad)


def test_every_transport_builds_its_endpoint_kinds_by_name():
    from moeflow.comm import TRANSPORTS
    from moeflow.comm.transport import DispatchSender

    kinds = ("dispatch_sender", "dispatch_receiver", "combine_sender", "combine_receiver")
    for name, cls in TRANSPORTS.items():
        assert all(isinstance(getattr(cls, f"{k}_cls", None), type) for k in kinds), name
    spec = CommSpec(**{**ASAP, "hidden_size": 8, "max_batch_tokens": 8})
    ref = TRANSPORTS["reference"](CommConfig(spec, transport="reference"))
    tx = ref.dispatch_sender(1, 2)
    assert isinstance(tx, DispatchSender) and (tx.region, tx.lane, tx.lane_id) == (1, 2, 6)
    with pytest.raises(NotImplementedError, match="weight_puller"):  # a kind this transport does not name
        ref.endpoint("weight_puller", 0)
