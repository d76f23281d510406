"""A lane's writer leaves an elastic deployment and another joins at its index: the receiver, told to
forget the leaver, must not read the newcomer through the leaver's words in its buffer."""
from __future__ import annotations

import uuid

import pytest
import torch

from moeflow.comm import CommConfig, CommSpec, cleanup, make_transport


@pytest.fixture
def dep():
    name = f"u{uuid.uuid4().hex[:12]}"
    yield name
    cleanup(name)


@pytest.mark.parametrize("forget", ["dispatch", "combine"])
def test_a_writer_that_joins_at_a_leavers_index_is_not_read_through_the_leavers_progress(dep, forget):
    """A leaver whose first message (seq 1) was streamed leaves its progress word at seq 1 in that
    slot (later messages there were small: no progress written). Once the receiver forgets the
    lane, a writer joining at the same index writes seq 1 again: the receiver, polling before it
    has written, must not copy the leaver's rows as the new message's."""
    spec = CommSpec(num_regions=1, lanes_per_region=1, num_expert_ranks=1, num_experts=1, top_k=1, hidden_size=8,
                    max_batch_tokens=8)
    tr = make_transport(CommConfig(spec, deployment_id=dep, stream_chunk_bytes=32))  # 2 rows a chunk
    big, small = torch.full((8, 8), 7.0).bfloat16(), torch.arange(16.0).view(2, 8).bfloat16()
    if forget == "dispatch":  # a region's writer (an attention group, a dep rank) leaves and joins
        rx = tr.dispatch_receiver(0)
        send = lambda tx, x, k: tx.send(0, x, 0, k)  # noqa: E731
        new_tx, take = (lambda: tr.dispatch_sender(0, 0)), (lambda: rx.recv(timeout_s=1).rows[0].payload)
        forget_it = lambda: rx.forget_region(0)  # noqa: E731
    else:  # an expert rank (an FFN daemon, a dep rank) leaves and joins: its segment of a combine buffer
        rx = tr.combine_receiver(0, 0)
        send = lambda tx, x, k: tx.send(0, 0, x, 0, k)  # noqa: E731
        new_tx, take = (lambda: tr.combine_sender(0)), (lambda: rx.recv([0], timeout_s=1).segments[0].payload)
        forget_it = lambda: rx.forget(0)  # noqa: E731
    old = new_tx()
    try:
        for k, x in enumerate([big, small, small]):  # seq 1 streamed into slot 1; seq 3 there is small
            send(old, x, k)
            assert torch.equal(take(), x)
        old.close()
        forget_it()
        new = new_tx()
        assert rx.poll() is None if forget == "dispatch" else rx.poll([0]) is None  # streams what it may
        send(new, small * 2, 0)
        assert torch.equal(take(), small * 2)  # not the leaver's rows 0-1 of its seq 1
        new.close()
    finally:
        rx.close()
