"""The pd handoff's state machine (``scheduler/handoff/``) on real request pools, with copies that
are recorded and answered by the test: the engine polls its members' flags and the simulator
its clock, and both drive this same machine."""
from __future__ import annotations

from moeflow.core import Request, SamplingParams
from moeflow.scheduler.block_allocator import BlockAllocator
from moeflow.scheduler.handoff.deployment import PdHandoffs
from moeflow.scheduler.handoff.port import KvPort
from moeflow.scheduler.handoff.sides import READ, WRITE, DecodeSide, PrefillSide
from moeflow.scheduler.pool import RequestPool


class Copies:
    def __init__(self, in_place: bool = False):
        self.sent, self.abandoned, self.in_place = [], [], in_place

    def copy_out(self, group, stage, blocks):
        if self.in_place:  # nothing is sent: the copy in reads the leased blocks
            return stage, True
        self.sent.append(("out", stage, blocks))
        return stage, False

    def copy_in(self, group, stage, blocks):
        self.sent.append(("in", stage, blocks))

    def abandon(self, stage, side, group):
        self.abandoned.append((stage, side))


class Stages:
    def __init__(self, room: int = 8):
        self.room, self.open_now = room, set()

    def open(self, request):
        if len(self.open_now) >= self.room:
            return None
        self.open_now.add(request.request_id)
        return request.request_id

    def close(self, stage):
        self.open_now.discard(stage)


def _leased(pool: RequestPool, rid: str, n: int) -> None:
    """A finished prefill whose blocks stay leased, as the pool leaves it."""
    r = Request(rid, list(range(n)), SamplingParams(max_tokens=1), kv_handoff=True)
    pool.enqueue(r)
    pool.admit(0, r)
    pool.update(0, type("B", (), {"seqs": (pool.seq(r, n),)})(), {rid: 7})


def _machine(decode_blocks=(10, 10), room=8, policy="recompute", in_place=False):
    prefill_pool = RequestPool([BlockAllocator(40, 4)], 1000, 8)
    decode_pools = [RequestPool([BlockAllocator(b, 4)], 1000, 8) for b in decode_blocks]
    arrived = []
    p_copies, d_copies = Copies(in_place), Copies()
    m = PdHandoffs([PrefillSide(KvPort(prefill_pool), p_copies)],
                   [DecodeSide(KvPort(p, on_arrive=arrived.append), d_copies) for p in decode_pools],
                   Stages(room), lease_s=1.0, policy=policy)
    return m, prefill_pool, decode_pools, p_copies, d_copies, arrived


def _prefilled(m, pool, rid, n=9, now=0.0):
    _leased(pool, rid, n)
    client = Request(rid, list(range(n)), SamplingParams(max_tokens=5), output_token_ids=[7])
    decode = Request(rid, list(range(n)), SamplingParams(max_tokens=5), output_token_ids=[7])
    return m.prefilled(0, client, decode, now)


def test_a_handoff_walks_its_states_and_returns_every_block():
    m, pp, dps, pc, dc, arrived = _machine(decode_blocks=(10, 12))
    h = _prefilled(m, pp, "a")
    assert h.state == "pending" and pp.leases == {"a": 0}
    assert m.start(h, 0.5) and h.state == "writing" and h.decode == 1  # the most free blocks
    assert pc.sent == [("out", "a", h.lease.blocks)] and dps[1].groups[0].allocator.num_free == 9
    assert m.copied_out(h, True, 0.6) is None and h.state == "reading" and not pp.leases
    assert pp.groups[0].allocator.num_free == 40 and dc.sent[0][:2] == ("in", "a")
    assert m.copied_in(h, True, 0.9, nbytes=100) is None
    assert arrived == [h.decode_request] and dps[1].groups[0].requests == [h.decode_request]
    assert not m.handoffs and m.stats.transfers == 1 and m.stats.seconds == [0.9 - 0.5]
    assert m.stages.open_now == set()


def test_no_stage_room_keeps_it_pending_and_holds_nothing_on_the_decode_side():
    m, pp, dps, pc, dc, _ = _machine(room=0)
    h = _prefilled(m, pp, "a")
    assert not m.start(h, 0.1) and h.state == "pending" and not pc.sent
    assert all(p.groups[0].allocator.num_free == 10 for p in dps)


def test_a_lease_runs_out_on_the_prefill_side_only():
    m, pp, dps, pc, dc, _ = _machine()
    h = _prefilled(m, pp, "a")
    m.start(h, 0.1)
    g = m.expired(h, 1.5)  # the copy out never answered
    assert g is not None and "lease expired" in g.why and m.stats.lease_expiries == 1
    assert pc.abandoned == [("a", WRITE)] and not pp.leases
    assert all(p.groups[0].allocator.num_free == 10 for p in dps) and not m.handoffs
    h2 = _prefilled(m, pp, "b", now=2.0)
    m.start(h2, 2.1)
    m.copied_out(h2, True, 2.2)
    assert m.expired(h2, 9.0) is None  # reading: the prefill side has let go already


def test_a_failed_copy_frees_both_sides_then_the_policy_picks_the_decode_instance_with_most_room():
    m, pp, dps, pc, dc, _ = _machine(decode_blocks=(10, 12))
    a = _prefilled(m, pp, "a")
    m.start(a, 0.0)
    m.copied_out(a, True, 0.1)
    g = m.copied_in(a, False, 0.2)
    assert g.recompute_on == 1 and "into the decode instance failed" in g.why and m.stats.failures == 1
    assert dps[1].groups[0].allocator.num_free == 12 and m.stages.open_now == set() and not dc.abandoned
    fail, pp2, _, _, _, _ = _machine(policy="fail")
    b = _prefilled(fail, pp2, "b")
    fail.start(b, 0.0)
    assert fail.copied_out(b, False, 0.1).recompute_on is None and not pp2.leases


def test_dropping_mid_copy_in_drains_the_stage_first():
    m, pp, dps, pc, dc, _ = _machine()
    h = _prefilled(m, pp, "a")
    m.start(h, 0.0)
    m.copied_out(h, True, 0.1)
    m.drop(h)  # an abort: the decode members may still be copying
    assert dc.abandoned == [("a", READ)] and "a" in m.stages.open_now  # the owner closes it once drained
    assert all(p.groups[0].allocator.num_free == 10 for p in dps) and not m.handoffs


def test_in_place_the_lease_lasts_until_the_copy_in_is_done():
    m, pp, dps, pc, dc, arrived = _machine(in_place=True)
    h = _prefilled(m, pp, "a")
    assert m.start(h, 0.5) and h.in_place and pc.sent == []  # nothing copied out
    assert m.copied_out(h, True, 0.5) is None and h.state == "reading"
    assert pp.leases == {"a": 0} and pp.groups[0].allocator.num_free == 40 - 3  # the decode side reads them
    assert m.copied_in(h, True, 0.7, nbytes=100) is None
    assert not pp.leases and pp.groups[0].allocator.num_free == 40 and arrived == [h.decode_request]
    assert m.stages.open_now == set()


def test_in_place_a_copy_in_given_up_frees_the_lease_and_drains_the_stage():
    m, pp, dps, pc, dc, arrived = _machine(in_place=True)
    h = _prefilled(m, pp, "a")
    m.start(h, 0.5)
    m.copied_out(h, True, 0.5)
    g = m.give_up(h, "the decode instance failed", answered=False)
    assert g.recompute_on is not None and not pp.leases and pp.groups[0].allocator.num_free == 40
    assert dc.abandoned == [("a", READ)] and "a" in m.stages.open_now  # its owner closes it once drained
    assert all(d.groups[0].allocator.num_free == 10 for d in dps)
