"""ExpertRoutes with replicas: every pair goes to exactly one copy, the copies share a hot expert's
rows, and without replicas the plan is plan_pairs' (the oracle)."""
import torch

from moeflow.layout import make_layout
from moeflow.layout.expert_map import ExpertMap
from moeflow.model.moe import ExpertWeights, plan_pairs
from moeflow.workers.dispatch import ExpertRoutes


def _ids(n: int, e: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])  # [n, K] distinct per row


def test_every_pair_goes_to_one_copy_and_copies_share_the_rows():
    placement = make_layout("dep", dp=3, num_redundant_experts=4).experts_held(8)  # experts 0-3 twice
    routes = ExpertRoutes(placement, 8)
    ids = _ids(300, 8, 2)
    plans = [routes.local_plan(ids, w) for w in range(3)]
    covered = torch.sort(torch.cat([p.pair_index[p.held] for p in plans])).values
    assert torch.equal(covered, torch.arange(ids.numel()))  # each (token, expert) pair exactly once
    for e in range(4):  # a replicated expert: its rows split evenly between its two holders
        holders = [w for w in range(3) if e in placement[w]]
        got = [int(plans[w].counts[placement[w].index(e)]) for w in holders]
        assert len(holders) == 2 and abs(got[0] - got[1]) <= 1
    for w, p in enumerate(plans):  # every pair sits in the slot that holds its expert
        experts = ids.reshape(-1)[p.pair_index[p.held]]
        slot = torch.repeat_interleave(torch.arange(len(placement[w])), p.counts)
        assert [placement[w][s] for s in slot.tolist()] == experts.tolist()


def test_without_replicas_the_plan_is_plan_pairs():
    placement = make_layout("dep", dp=3).experts_held(8)
    routes = ExpertRoutes(placement, 8)
    ids = _ids(50, 8, 2, seed=1)
    for w, held in enumerate(placement):
        w13 = torch.zeros(1, len(held), 2, 2)
        oracle = plan_pairs(ids, ExpertWeights(w13, w13, (0,), held))
        mine = routes.local_plan(ids, w)
        # both keep a row for every pair, those computed elsewhere last (masked)
        assert torch.equal(mine.pair_index, oracle.pair_index) and torch.equal(mine.counts, oracle.counts)
        assert torch.equal(mine.held, oracle.held) and not oracle.held[int(oracle.counts.sum()):].any()


def test_a_members_share_chooses_as_the_whole_batch_does():
    placement = make_layout("asap", moe_workers=2, num_redundant_experts=3).experts_held(8)
    routes = ExpertRoutes(placement, 8)
    ids = _ids(40, 8, 2, seed=2)
    whole = routes.split(ids, [0, 1])
    parts = [routes.split(ids, [0, 1], (0, 17)), routes.split(ids, [0, 1], (17, 40))]
    for w in range(2):  # the members' shares add up to the whole batch's, row for row
        joined = torch.cat([parts[0][w].pair_index, parts[1][w].pair_index + 17 * 2])
        assert sorted(joined.tolist()) == sorted(whole[w].pair_index.tolist())
        assert [a + b for a, b in zip(parts[0][w].counts, parts[1][w].counts)] == whole[w].counts
    assert set(routes.workers_for(ids)) == {0, 1}


def test_the_simulator_prices_the_engines_placement_and_replica_routing():
    """sim/expert_load.py places with scheduler/eplb.py, and its even split over copies is what
    ExpertRoutes does to within one pair per copy in every batch."""
    import numpy as np

    from moeflow.scheduler.eplb import rebalance
    from moeflow.sim.expert_load import place

    g = torch.Generator().manual_seed(3)
    pop = np.random.default_rng(3).dirichlet(np.full(8, 0.5), size=2)  # [L, E]
    m = rebalance(pop.tolist(), 3, 4)
    assert np.allclose(place(pop, 3, "eplb", 4), m.device_load(pop.tolist()))
    ids = torch.multinomial(torch.tensor(pop[0]), 2 * 500, replacement=True, generator=g).view(500, 2)
    ids = ids[ids[:, 0] != ids[:, 1]]  # a token's experts are distinct
    routes = ExpertRoutes(m.layers[0], 8)
    got = [int(routes.local_plan(ids, d).held.sum()) for d in range(3)]
    counts = torch.bincount(ids.flatten(), minlength=8).tolist()
    want = ExpertMap((m.layers[0],), 8).device_load([counts])[0]
    copies = sum(len(r) for r in m.replicas(0))
    assert all(abs(a - b) <= copies for a, b in zip(got, want)) and sum(got) == ids.numel()
