"""DWDP's parts on their own: the copy plan against a brute-force reference, one-sided weight
pulls out of shared memory against the in-process oracle, the list experts op against its
oracle, the prefetcher's double buffer, and the layout's expert placement."""
from __future__ import annotations

import random
import uuid

import pytest
import torch

from moeflow.comm import CommConfig, make_transport
from moeflow.config import ConfigError
from moeflow.layout import make_layout
from moeflow.model.moe import ExpertWeights, experts_list, experts_loop, experts_merged
from moeflow.scheduler.copy_plan import Slice, copy_plan, source_order, sources
from moeflow.workers.prefetch import ExpertPrefetcher
from moeflow.workers.tracer import Tracer


def _brute_force_sliced(placement, dst, num_experts, unit_bytes, s):
    """The sliced order, spelled out: every source's byte stream cut in slices; sources visited
    in rotation starting after dst; one slice per visit, skipping exhausted sources."""
    queues = []
    for src, experts in sources(placement, dst, num_experts).items():
        q = []
        for unit, size in unit_bytes.items():
            for e in experts:
                off = 0
                while off < size:
                    q.append(Slice(src, unit, e, off, min(s, size - off)))
                    off += s
        queues.append(q)
    order = sorted(range(len(queues)), key=lambda i: (queues[i][0].src <= dst, queues[i][0].src))
    out = []
    while any(queues[i] for i in order):
        for i in order:
            if queues[i]:
                out.append(queues[i].pop(0))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_copy_plan_matches_a_brute_force_reference(seed):
    rng = random.Random(seed)
    n, e = rng.randint(2, 5), rng.randint(4, 12)
    per = rng.randint(-(-e // n), e)
    placement = make_layout("dwdp", dp=n, experts_per_rank=per).experts_held(e)
    units = {"w13": rng.randint(1, 5000), "w2": rng.randint(1, 3000)}
    s = rng.randint(64, 2048)
    for dst in range(n):
        plan = copy_plan(placement, dst, e, units, "sliced", s)
        assert plan == _brute_force_sliced(placement, dst, e, units, s)
        naive = copy_plan(placement, dst, e, units, "naive")
        assert sorted((x.src, x.unit, x.expert) for x in naive) == sorted(
            {(x.src, x.unit, x.expert) for x in plan})  # the same pulls, whole
        lacking = set(range(e)) - set(placement[dst])
        assert {x.expert for x in plan} == lacking and all(x.expert in placement[x.src] for x in plan)
        assert sum(x.nbytes for x in plan) == len(lacking) * sum(units.values())
    plans = {d: copy_plan(placement, d, e, units, "sliced", s) for d in range(n)}
    for src in range(n):  # a source serves every destination's slices round-robin
        served = source_order(plans, src)
        assert sorted(served, key=str) == sorted(((d, x) for d, p in plans.items() for x in p if x.src == src), key=str)
        firsts = [d for d, _ in served[:len({d for d, _ in served})]]
        assert firsts == sorted(set(firsts))


def test_weight_pulls_read_a_peers_shared_memory_one_sidedly():
    g = torch.Generator().manual_seed(0)
    tensors = {"w13": torch.randn(3, 4, 6, 5, generator=g), "w2": torch.randn(3, 4, 5, 3, generator=g)}
    for transport in ("shm", "reference"):
        t = make_transport(CommConfig(None, transport, f"w{uuid.uuid4().hex[:8]}"))
        owner = t.weight_store()
        owner.publish(1, tensors)
        peer = (t if transport == "reference" else make_transport(t.config)).weight_store().peer(1)
        got = torch.empty(6 * 5 * 4, dtype=torch.uint8)
        for off in range(0, got.numel(), 7):  # any slicing rebuilds the unit exactly
            piece = got[off:off + 7]
            peer.read("w13", (2, 1), off, piece)
        assert torch.equal(got.view(torch.float32).view(6, 5), tensors["w13"][2, 1])
        owner.close()


def test_a_weight_server_answers_and_greets_the_publishers_on_other_hosts_alone():
    """Ranks 0-2 on host 0, 3-5 on host 1; under EPLB only the expert ranks (1, 4, 5) publish: each
    says goodbye to, and its server waits for, the publishers on the other host; all ranks is dwdp's."""
    from moeflow.comm.remote_weights import LinksWeightStore

    config = CommConfig(None, "links", f"w{uuid.uuid4().hex[:8]}", rank_nodes=(0, 0, 0, 1, 1, 1))
    experts = LinksWeightStore(config, publishers=(1, 4, 5))
    assert [experts._remote(r) for r in (1, 4, 5)] == [[4, 5], [1], [1]]
    assert LinksWeightStore(config)._remote(0) == [3, 4, 5]


def test_the_list_experts_op_matches_its_oracle_without_merging():
    g = torch.Generator().manual_seed(1)
    w13, w2 = torch.randn(1, 7, 16, 8, generator=g), torch.randn(1, 7, 8, 8, generator=g)
    x = torch.randn(20, 8, generator=g)
    counts = torch.tensor([3, 0, 5, 2, 4, 6, 0])
    ref = experts_loop(ExpertWeights(w13, w2, (0,), tuple(range(7))), 0, x, counts)
    parts = [(w13[0, :3], w2[0, :3]), (w13[0, 3:], w2[0, 3:])]  # resident 3, pulled 4
    from moeflow.model.op_count import OpCount

    with OpCount() as c:
        got = experts_list(parts, x, counts)
    torch.testing.assert_close(got, ref)
    assert c.syncs == 1, dict(c.sync_sites)  # where each stack's rows end, read once per layer
    torch.testing.assert_close(experts_merged(parts, x, counts), ref)
    # a stack without experts, and one whose experts got no rows
    parts = [(w13[0, :0], w2[0, :0]), (w13[0, :2], w2[0, :2]), (w13[0, 2:], w2[0, 2:])]
    counts = torch.tensor([0, 0, 5, 2, 4, 6, 3])
    ref = experts_loop(ExpertWeights(w13, w2, (0,), tuple(range(7))), 0, x, counts)
    torch.testing.assert_close(experts_list(parts, x, counts), ref)


def test_the_prefetcher_pulls_each_layer_into_the_free_slot():
    placement = ((0, 1, 2), (2, 3, 4), (5, 6, 7))
    g = torch.Generator().manual_seed(2)
    full13, full2 = torch.randn(4, 8, 6, 4, generator=g), torch.randn(4, 8, 4, 3, generator=g)  # [Lm, E, ...]
    t = make_transport(CommConfig(None, "reference"))
    store = t.weight_store()
    for r, ids in enumerate(placement):
        store.publish(r, {"w13": full13[:, list(ids)].contiguous(), "w2": full2[:, list(ids)].contiguous()})
    peers = {r: store.peer(r) for r in (1, 2)}
    layers = [1, 3, 4, 6]  # MoE layer ids
    pre = ExpertPrefetcher(0, placement, layers, (store.hub[0]["w13"], store.hub[0]["w2"]), peers, "sliced", 40,
                           Tracer("dwdp", 0, True))
    try:
        for _ in range(3):  # three forward passes: the cycle wraps around
            for i, layer in enumerate(layers):
                (r13, r2), (p13, p2) = pre.acquire(layer)
                assert torch.equal(r13, full13[i, :3]) and torch.equal(p13, full13[i, 3:])
                assert torch.equal(p2, full2[i, 3:])
                pre.release(layer)
        pre.acquire(layers[2])  # out of step (a pass stopped half-way): it resyncs rather than hang
        pre.release(layers[2])
    finally:
        pre.close()
    assert pre.buffer_bytes == 2 * 5 * (6 * 4 + 4 * 3) * 4


def test_dwdp_placement_holds_every_expert_and_allows_redundancy():
    assert make_layout("dwdp", dp=3).experts_held(8) == ((0, 1, 2), (2, 3, 4), (5, 6, 7))
    assert make_layout("dwdp", dp=2, experts_per_rank=6).experts_held(8) == ((0, 1, 2, 3, 4, 5), (4, 5, 6, 7, 0, 1))
    with pytest.raises(ConfigError, match="cannot hold all 8 experts"):
        make_layout("dwdp", dp=2, experts_per_rank=3).experts_held(8)
    with pytest.raises(ConfigError, match="copy_plan must be one of"):
        make_layout("dwdp", copy_plan="fastest")
