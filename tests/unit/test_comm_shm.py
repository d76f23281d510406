"""The shared-memory transport in one process, against the in-process reference (the oracle)."""
from __future__ import annotations

import os
import random
import stat
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch

from moeflow.comm import CommConfig, CommSpec, ProtocolError, cleanup, list_segments, make_transport
from moeflow.comm.shm import dispatch_path

SPEC = CommSpec(num_regions=2, lanes_per_region=2, num_expert_ranks=2, num_experts=4, top_k=2, hidden_size=16,
                max_batch_tokens=6)


@pytest.fixture
def dep():
    name = f"u{uuid.uuid4().hex[:12]}"
    yield name
    cleanup(name)


def _endpoints(config):
    tr = make_transport(config)
    s = config.spec
    d_rx = [tr.dispatch_receiver(e) for e in range(s.num_expert_ranks)]  # receivers first: they own buffers
    c_rx = {(i, j): tr.combine_receiver(i, j) for i in range(s.num_regions) for j in range(s.lanes_per_region)}
    d_tx = {(i, j): tr.dispatch_sender(i, j) for i in range(s.num_regions) for j in range(s.lanes_per_region)}
    c_tx = [tr.combine_sender(e) for e in range(s.num_expert_ranks)]
    return d_tx, d_rx, c_tx, c_rx


def _close(*groups):
    for g in groups:
        for ep in (g.values() if isinstance(g, dict) else g):
            ep.close()


def _summary(msg):
    if msg is None:
        return None
    if hasattr(msg, "rows"):
        return (msg.region, msg.seq, [(r.lane, r.layer_id, r.batch_id, r.tokens_per_expert, r.payload.clone())
                                     for r in msg.rows])
    return {e: (s.seq, s.layer_id, s.batch_id, s.payload.clone()) for e, s in msg.segments.items()}


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("chunk_bytes", [0, 64])  # one copy; streamed in 2-row chunks
def test_shm_matches_reference_on_random_traffic(dep, chunk_bytes):
    shm = _endpoints(CommConfig(SPEC, deployment_id=dep, stream_chunk_bytes=chunk_bytes))
    ref = _endpoints(CommConfig(SPEC, transport="reference"))
    rng = random.Random(0)
    unread = {}  # (receiver kind, receiver, lane) -> messages in flight: a full lane would block
    sent = {}  # (expert rank, region, lane) -> dispatch rows sent
    try:
        for step in range(3000):
            op = rng.random()
            if op < 0.45:  # a dispatch row from a random lane to a random expert rank
                i, j, e = rng.randrange(2), rng.randrange(2), rng.randrange(2)
                if unread.get(("d", e, i, j), 0) == SPEC.num_slots:
                    continue
                n = rng.choice([0, rng.randint(1, SPEC.dispatch_rows)])
                cut = rng.randint(0, n)
                x = torch.randn(n, 16).bfloat16()
                k = sent.get((e, i, j), 0)  # the k-th row of this lane: region k shares (layer, batch)
                for d_tx, *_ in (shm, ref):
                    d_tx[i, j].send(e, x, (k + i) % 5, k, [cut, n - cut])
                sent[(e, i, j)] = k + 1
                unread[("d", e, i, j)] = unread.get(("d", e, i, j), 0) + 1
            elif op < 0.7:  # an expert rank polls
                e = rng.randrange(2)
                got = [_summary(d_rx[e].poll()) for _, d_rx, _, _ in (shm, ref)]
                assert _same(got[0], got[1]), f"step {step}: dispatch poll differs"
                if got[0] is not None:
                    for j in range(2):
                        unread[("d", e, got[0][0], j)] -= 1
            elif op < 0.85:  # a combine segment
                e, i, j = rng.randrange(2), rng.randrange(2), rng.randrange(2)
                if unread.get(("c", i, j, e), 0) == SPEC.num_slots:
                    continue
                x = torch.randn(rng.randint(0, SPEC.segment_rows), 16).bfloat16()
                for *_, c_tx, _ in (shm, ref):
                    c_tx[e].send(i, j, x, 1, step)
                unread[("c", i, j, e)] = unread.get(("c", i, j, e), 0) + 1
            else:  # a lane writer polls a random subset of expert ranks
                i, j = rng.randrange(2), rng.randrange(2)
                ranks = rng.choice([[0], [1], [0, 1]])
                got = [_summary(c_rx[i, j].poll(ranks)) for *_, c_rx in (shm, ref)]
                assert _same(got[0], got[1]), f"step {step}: combine poll differs"
                if got[0] is not None:
                    for e in ranks:
                        unread[("c", i, j, e)] -= 1
    finally:
        _close(*shm)
    assert list_segments(dep) == []


def test_regions_are_served_round_robin(dep):
    spec = CommSpec(num_regions=3, lanes_per_region=1, num_expert_ranks=1, num_experts=1, top_k=1, hidden_size=8,
                    max_batch_tokens=4)
    d_tx, d_rx, c_tx, c_rx = _endpoints(CommConfig(spec, deployment_id=dep))
    try:
        order = []
        for _ in range(4):
            for i in range(3):  # every region always has two messages waiting
                while d_rx[0].mailbox.occupied(i) < 2:
                    d_tx[i, 0].send(0, torch.zeros(1, 8).bfloat16(), 0, 0)
            order += [d_rx[0].poll().region for _ in range(3)]
        assert order == [0, 1, 2] * 4
    finally:
        _close(d_tx, d_rx, c_tx, c_rx)


def test_full_slot_blocks_the_sender_and_is_not_overwritten(dep):
    spec = CommSpec(num_regions=1, lanes_per_region=1, num_expert_ranks=1, num_experts=1, top_k=1, hidden_size=8,
                    max_batch_tokens=4)
    d_tx, d_rx, c_tx, c_rx = _endpoints(CommConfig(spec, deployment_id=dep))
    tx, rx = d_tx[0, 0], d_rx[0]
    try:
        xs = [torch.full((2, 8), float(k)).bfloat16() for k in range(3)]
        tx.send(0, xs[0], 0, 0)
        tx.send(0, xs[1], 0, 1)
        assert tx.stats.num_overlapped == 1 and rx.mailbox.occupied(0) == 2
        third = threading.Thread(target=tx.send, args=(0, xs[2], 0, 2))
        third.start()
        time.sleep(0.1)
        assert third.is_alive() and tx.stats.num_backpressure == 1  # blocked, counted
        first = rx.poll()
        assert first.rows[0].batch_id == 0 and torch.equal(first.rows[0].payload, xs[0])
        third.join(5)
        assert not third.is_alive() and tx.stats.backpressure_s >= 0.05
        for k in (1, 2):
            msg = rx.recv(timeout_s=1)
            assert msg.seq == k + 1 and torch.equal(msg.rows[0].payload, xs[k])
    finally:
        _close(d_tx, d_rx, c_tx, c_rx)


def test_segments_are_owner_only_even_with_umask_0(dep):
    old = os.umask(0)
    try:
        rx = make_transport(CommConfig(SPEC, deployment_id=dep)).dispatch_receiver(0)
    finally:
        os.umask(old)
    try:
        paths = list_segments(dep)
        assert len(paths) == 1  # the buffer (its doorbell is a word inside)
        for p in paths:
            assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, p
    finally:
        rx.close()
    assert list_segments(dep) == []


def test_stale_segment_is_refused_then_replaced(dep):
    config = CommConfig(SPEC, deployment_id=dep, attach_timeout_s=0.3)
    tr = make_transport(config)
    rx1 = tr.dispatch_receiver(1)
    stale = tr.dispatch_receiver(0)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale.mailbox._words[3] = int(dead.stdout)  # as if its owner had been SIGKILLed ...
    stale.mailbox.segment.is_owner = False  # ... and so never unlinked anything
    stale.close()
    assert dispatch_path(dep, 0) in list_segments(dep)
    refused = tr.dispatch_sender(0, 0)
    with pytest.raises(TimeoutError):  # expert rank 0's buffer is there, but its owner is dead
        refused.send(0, torch.ones(1, 16).bfloat16(), 0, 0, [1, 0])
    refused.close()
    rx0 = tr.dispatch_receiver(0)  # a restart with the same id replaces it
    tx0, tx1 = tr.dispatch_sender(0, 0), tr.dispatch_sender(0, 1)
    try:
        tx0.send(0, torch.ones(1, 16).bfloat16(), 0, 0, [1, 0])
        assert rx0.recv(timeout_s=0.05) is None  # the region needs lane (0, 1) too
        tx1.send(0, torch.ones(0, 16).bfloat16(), 0, 0, [0, 0])
        assert rx0.recv(timeout_s=1).seq == 1
    finally:
        for ep in (tx0, tx1, rx0, rx1):
            ep.close()
    assert list_segments(dep) == []


def test_sender_refuses_a_buffer_of_another_layout(dep):
    rx = make_transport(CommConfig(SPEC, deployment_id=dep)).dispatch_receiver(0)
    other = CommSpec(**{**SPEC.__dict__, "hidden_size": 32, "num_expert_ranks": 1, "num_experts": 2})
    tx = make_transport(CommConfig(other, deployment_id=dep, attach_timeout_s=0.2)).dispatch_sender(0, 0)
    try:  # attached at the first send (expert ranks of an elastic deployment may join later)
        with pytest.raises(TimeoutError):
            tx.send(0, torch.zeros(1, 32).bfloat16(), 0, 0, [1, 0])
    finally:
        tx.close()
        rx.close()


def test_an_expert_rank_leaves_and_another_joins_at_its_index(dep):
    """Elastic FFN daemons: a sender attaches to a rank's buffer at its first send, lets it go when
    the rank leaves, and writes a new rank's new buffer at that index from seq 1; the combine
    receiver forgets the old rank's sequence."""
    spec = CommSpec(num_regions=1, lanes_per_region=1, num_expert_ranks=2, num_experts=2, top_k=1, hidden_size=8,
                    max_batch_tokens=4)
    tr = make_transport(CommConfig(spec, deployment_id=dep))
    c_rx = tr.combine_receiver(0, 0)
    d_rx0 = tr.dispatch_receiver(0)
    d_tx = tr.dispatch_sender(0, 0)  # rank 1 has not joined: nothing to attach yet
    c_tx0 = tr.combine_sender(0)
    x = torch.ones(2, 8).bfloat16()
    try:
        for k in range(3):
            d_tx.send(0, x * k, 0, k)
            assert d_rx0.recv(timeout_s=1).rows[0].batch_id == k
            c_tx0.send(0, 0, x * k, 0, k)
            assert c_rx.recv([0], timeout_s=1).segments[0].seq == k + 1
        for generation in range(2):  # rank 1 joins, serves, leaves; then joins again at index 1
            d_rx1, c_tx1 = tr.dispatch_receiver(1), tr.combine_sender(1)
            for k in range(2):
                d_tx.send(1, x * (k + 10 * generation), 0, k)
                msg = d_rx1.recv(timeout_s=1)
                assert msg.seq == k + 1 and torch.equal(msg.rows[0].payload, x * (k + 10 * generation))
                c_tx1.send(0, 0, x * k, 0, k)
                assert c_rx.recv([1], timeout_s=1).segments[1].seq == k + 1
            d_tx.detach(1)
            c_rx.forget(1)
            c_tx1.close()
            d_rx1.close()
    finally:
        _close([d_tx, d_rx0, c_tx0, c_rx])


def test_corrupt_flag_is_a_protocol_error(dep):
    d_tx, d_rx, c_tx, c_rx = _endpoints(CommConfig(SPEC, deployment_id=dep))
    try:
        d_rx[0].mailbox.set_flag(0, 1, 7)  # region 0 expects seq 1 in slot 1
        with pytest.raises(ProtocolError):
            d_rx[0].poll()
    finally:
        _close(d_tx, d_rx, c_tx, c_rx)


def test_send_validates_its_arguments(dep):
    d_tx, d_rx, c_tx, c_rx = _endpoints(CommConfig(SPEC, deployment_id=dep))
    tx = d_tx[0, 0]
    try:
        for bad in (dict(payload=torch.zeros(2, 16)),  # float32, spec is bfloat16
                    dict(payload=torch.zeros(2, 15).bfloat16()),
                    dict(payload=torch.zeros(SPEC.dispatch_rows + 1, 16).bfloat16(), tokens_per_expert=[7, 0]),
                    dict(tokens_per_expert=[1, 0]), dict(tokens_per_expert=[2]), dict(tokens_per_expert=None)):
            args = {"payload": torch.zeros(2, 16).bfloat16(), "tokens_per_expert": [1, 1], **bad}
            with pytest.raises(ValueError):
                tx.send(0, args["payload"], 0, 0, args["tokens_per_expert"])
        with pytest.raises(ValueError):
            c_tx[0].send(0, 0, torch.zeros(SPEC.segment_rows + 1, 16).bfloat16(), 0, 0)
        assert tx.stats.num_sends == 0 and d_rx[0].mailbox.occupied(0) == 0
    finally:
        _close(d_tx, d_rx, c_tx, c_rx)


def test_receiver_streams_published_rows_before_the_flag(dep):
    spec = CommSpec(num_regions=1, lanes_per_region=1, num_expert_ranks=1, num_experts=1, top_k=1, hidden_size=8,
                    max_batch_tokens=6, dtype="float32")
    d_tx, d_rx, c_tx, c_rx = _endpoints(CommConfig(spec, deployment_id=dep))
    rx, mb = d_rx[0], d_rx[0].mailbox
    x = torch.arange(6 * 8, dtype=torch.float32).view(6, 8)
    try:
        # A writer half-way through message 1 (slot 1): header, rows 0-3, progress 4, no flag yet.
        mb.write_header(0, 1, [2, 9, 6, 6])
        mb.payload(0, 1)[:4].copy_(x[:4])
        mb.set_progress(0, 1, 1, 4)
        assert rx.poll() is None and rx.reader.streamed[0] == 4  # copied early, not delivered
        mb.payload(0, 1)[:4].fill_(-1)  # (a real writer never does this) shows rows 0-3 are not re-read
        mb.payload(0, 1)[4:6].copy_(x[4:6])
        mb.set_progress(0, 1, 1, 6)
        mb.set_flag(0, 1, 1)
        msg = rx.poll()
        assert msg.rows[0].layer_id == 2 and msg.rows[0].batch_id == 9 and torch.equal(msg.rows[0].payload, x)
        assert mb.flag(0, 1) == 0 and rx.reader.streamed[0] == 0
        assert mb.progress(0, 1, 3) == 0  # a stale progress word never counts for a later message
    finally:
        _close(d_tx, d_rx, c_tx, c_rx)
