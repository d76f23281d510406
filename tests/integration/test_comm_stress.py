"""Multi-process stress: every transport delivers exactly what the in-process reference delivers.

Random payload sizes (0 rows included), random pauses on both sides, two batches in flight per
attention rank (both slots in use), crc32 of every payload: nothing lost, duplicated, torn or
reordered within a lane. Together these tests move > 10,000 checksummed messages.
"""
from __future__ import annotations

import pytest
import torch.distributed as dist
from comm_deploy import SHM_STRESS, check_against_reference, free_port, run_deployment, stress_config
from comm_harness import Plan

from moeflow.comm import list_segments


def test_shm_stress_matches_reference(tmp_path):
    config = stress_config("shm", **SHM_STRESS)
    plan = Plan(seed=1, num_batches=400, inflight=2)
    results = run_deployment(config, plan, tmp_path)
    n = check_against_reference(config, plan, results)
    stats = [r["stats"] for r in results.values()]
    print(f"shm stress: {n} messages, backpressure {sum(s['num_backpressure'] for s in stats)}, "
          f"overlapped {sum(s['num_overlapped'] for s in stats)}, "
          f"rows streamed before completion {sum(s.get('streamed_rows', 0) for s in stats)}")
    assert n >= 5000
    assert sum(s["num_overlapped"] for s in stats) > 0, "the second slot was never used while the first was full"
    assert list_segments(config.deployment_id) == []


def test_deferred_arena_stress_matches_reference(tmp_path):
    """The payload-arena seam with copies that land only at release (the CUDA arena's CPU fake):
    every checksum still matches, so every flag store waits for the copies before it."""
    config = stress_config("shm", arena="deferred", **SHM_STRESS)
    plan = Plan(seed=5, num_batches=80, inflight=2)
    results = run_deployment(config, plan, tmp_path)
    n = check_against_reference(config, plan, results)
    deferred = sum(r["stats"]["deferred_copies"] for r in results.values())
    print(f"deferred-arena stress: {n} messages, {deferred} copies deferred to a release")
    assert n >= 800 and deferred >= n
    assert list_segments(config.deployment_id) == []


@pytest.mark.parametrize("transport,layout,plan,min_messages", [
    ("dist", dict(num_regions=2, lanes_per_region=1, num_expert_ranks=2, num_experts=4, top_k=2, max_batch_tokens=16),
     Plan(seed=2, num_batches=400, inflight=2, max_delay_s=1e-3), 2000),
    # Per link: world ranks 0-3 write the lanes of regions 0 (host 0) and 1 (host 1), expert ranks 4
    # (host 0) and 5 (host 1): every receiver completes regions and segments from shm and gloo lanes.
    pytest.param("links", dict(num_regions=2, lanes_per_region=2, num_expert_ranks=2, num_experts=4, top_k=2,
                               max_batch_tokens=16, rank_nodes=(0, 0, 1, 1, 0, 1)),
                 Plan(seed=4, num_batches=150, inflight=2, max_delay_s=1e-3), 1000,
                 marks=pytest.mark.slow),  # make test runs links in test_multihost.py
    # Blocking p2p: one batch in flight, one DP group (see p2p.py on deadlock freedom).
    pytest.param("p2p", dict(num_regions=1, lanes_per_region=2, num_expert_ranks=2, num_experts=2, top_k=1,
                             max_batch_tokens=32),
                 Plan(seed=3, num_batches=250, inflight=1, max_delay_s=1e-3), 1000, marks=pytest.mark.slow),
])
def test_dist_transports_match_reference(tmp_path, transport, layout, plan, min_messages):
    config = stress_config(transport, hidden_size=64, **layout)
    results = run_deployment(config, plan, tmp_path)
    n = check_against_reference(config, plan, results)
    print(f"{transport} stress: {n} messages")
    assert n >= min_messages


def test_pair_links_match_reference(tmp_path):
    """``pairs``, the links of an elastic deployment across hosts: the layout of the ``links`` case
    above, every cross-host lane over a gloo group of its two processes met in a store (no world)."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True)  # the cluster's rendezvous, as node 0 hosts it
    config = stress_config("pairs", hidden_size=64, num_regions=2, lanes_per_region=2, num_expert_ranks=2,
                           num_experts=4, top_k=2, max_batch_tokens=16, rank_nodes=(0, 0, 1, 1, 0, 1),
                           store=("127.0.0.1", port))
    plan = Plan(seed=6, num_batches=150, inflight=2, max_delay_s=1e-3)
    results = run_deployment(config, plan, tmp_path)
    del store
    n = check_against_reference(config, plan, results)
    print(f"pairs stress: {n} messages")
    assert n >= 1000
