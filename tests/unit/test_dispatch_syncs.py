"""What the split modes' own steps ask of the host, per MoE layer (``model/op_count.py``), beside the
colocated step's count (``test_decode_ops.py``): the attention side's dispatch (asap attention
workers, dep ranks, afd attention instances) reads back once per layer, the sizes the transport
writes with, whatever the batch and however many workers; an FFN daemon's expert compute reads
nothing back (its counts arrive in the headers), nor does a daemon that routes its own rows."""
from __future__ import annotations

import torch

from moeflow.model.moe import ExpertWeights
from moeflow.model.op_count import OpCount
from moeflow.workers.afd_connector import AfdControl, FfnInput
from moeflow.workers.dispatch import ExpertRoutes
from moeflow.workers.ffn import ffn_pairs

E, W, K, H, F = 16, 4, 2, 32, 16  # experts, workers, top-k, hidden, expert width


def _ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])  # [n, K]


def _placement(replicas: bool):
    slots = [list(range(w * E // W, (w + 1) * E // W)) for w in range(W)]
    if replicas:  # expert 0 also on the last worker: its pairs alternate between the copies
        slots[-1].append(0)
    return tuple(tuple(s) for s in slots)


def test_the_dispatch_reads_back_once_per_layer_at_any_batch():
    for replicas in (False, True):
        routes = ExpertRoutes(_placement(replicas), E)
        ops = {}
        for n in (1, 8, 64):
            ids = _ids(n, n)
            with OpCount() as c:
                workers, shares = routes.route(ids, (0, n), list(range(W)))
            assert c.syncs == 1, dict(c.sync_sites)
            ops[n] = c.ops
            # the same shares as the per-worker oracle below
            worker, local = routes.assign(ids)
            for sh in shares:
                mine = [(t * K + k) for t in range(n) for k in range(K) if worker[t, k] == sh.worker]
                assert sorted(sh.pair_index.tolist()) == mine
                assert sh.counts == [int(((worker == sh.worker) & (local == s)).sum()) for s in
                                     range(routes.num_local[sh.worker])]
        assert max(ops.values()) == min(ops.values()), ops  # one op sequence for every batch


def test_the_workers_a_batch_activates_come_with_the_same_read_back():
    routes = ExpertRoutes(_placement(False), E)
    ids = torch.tensor([[0, 1], [2, 5]])  # experts 0-3 on worker 0, 4-7 on worker 1
    with OpCount() as c:
        workers, shares = routes.route(ids)
    assert workers == [0, 1] == routes.workers_for(ids) and c.syncs == 1
    assert [s.counts for s in shares] == [[1, 1, 1, 0], [0, 1, 0, 0]]


def _experts(el: int) -> ExpertWeights:
    g = torch.Generator().manual_seed(1)
    return ExpertWeights(torch.randn(1, el, 2 * F, H, generator=g) / 4, torch.randn(1, el, H, F, generator=g) / 4,
                         (0,), tuple(range(el)))


def test_an_ffn_daemon_computes_its_rows_without_reading_back():
    el = 4
    experts = _experts(el)
    ops = {}
    for n in (1, 8, 64):
        g = torch.Generator().manual_seed(n)
        per = {i: torch.multinomial(torch.ones(el), n, replacement=True, generator=g).bincount(minlength=el).tolist()
               for i in (0, 1)}  # instance -> its rows per local expert
        payloads = {i: torch.randn(n, H, generator=g) for i in (0, 1)}
        inp = FfnInput(AfdControl(0, {0: 0, 1: 0}, {0: n, 1: n}, per), payloads)
        with OpCount() as c:
            out = ffn_pairs(experts, 0, inp, (0, 1))
        assert c.syncs == 0, dict(c.sync_sites)
        ops[n] = c.ops
        for i in (0, 1):  # each instance's rows through its own experts, one matmul per row: the oracle
            expert = torch.repeat_interleave(torch.arange(el), torch.tensor(per[i]))
            for r in range(n):
                w13, w2 = experts.w13[0, expert[r]], experts.w2[0, expert[r]]
                gu = payloads[i][r] @ w13.T
                ref = (torch.nn.functional.silu(gu[:F]) * gu[F:]) @ w2.T
                torch.testing.assert_close(out[i][r], ref, atol=1e-5, rtol=1e-5)
    assert max(ops.values()) == min(ops.values()), ops


def test_a_daemon_that_routes_its_own_rows_plans_them_without_reading_back():
    routes = ExpertRoutes(_placement(True), E)
    ops = {}
    for n in (1, 8, 64):
        ids = _ids(n, n)
        with OpCount() as c:
            routes.local_plan(ids, W - 1)
        assert c.syncs == 0, dict(c.sync_sites)
        ops[n] = c.ops
    assert max(ops.values()) == min(ops.values()), ops
