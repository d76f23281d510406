"""Which MoE worker gets which (token, expert) pair, in the row order the worker computes in.

Legend: n tokens of this member's share, K experts per token, P = n*K pairs, Epw experts held by
one worker, H hidden size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.model.moe import ExpertPlan


@dataclass
class WorkerShare:
    worker: int
    pair_index: torch.Tensor  # [m] int64 flat t*K + k, grouped by the worker's local expert
    counts: list[int]  # [Epw] rows per local expert (the header's tokens-per-expert)


class ExpertRoutes:
    """Placement lookups: which expert-side worker and local slot each (token, expert) pair goes to.

    An expert held by several workers (a replica) takes the batch's pairs of that expert in turn:
    the i-th pair of expert e (in row order) goes to copy i mod copies, so the copies split a hot
    expert's tokens to within one, and every process that sees the same batch chooses alike. A
    worker holding an expert in two slots uses the first.
    """

    def __init__(self, placement: tuple[tuple[int, ...], ...], num_experts: int, group: int = 0,
                 device: torch.device | str = "cpu"):
        copies: dict[int, list[tuple[int, int]]] = {}
        for w, ids in enumerate(placement):
            for slot, e in enumerate(ids):
                if all(cw != w for cw, _ in copies.setdefault(e, [])):
                    copies[e].append((w, slot))
        most = max(len(copies[e]) for e in range(num_experts))
        pad = [[copies[e][i % len(copies[e])] for i in range(most)] for e in range(num_experts)]
        self.num_copies = torch.tensor([len(copies[e]) for e in range(num_experts)], dtype=torch.int64, device=device)
        self.worker_of = torch.tensor([[w for w, _ in row] for row in pad], dtype=torch.int64, device=device)  # [E, C]
        self.local_of = torch.tensor([[s for _, s in row] for row in pad], dtype=torch.int64, device=device)  # [E, C]
        self.num_local = [len(ids) for ids in placement]
        self.max_local = max(self.num_local)

    def assign(self, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(worker [n, K], local slot [n, K]) of each pair of a whole batch."""
        flat = topk_ids.reshape(-1)  # [P]
        order = torch.argsort(flat, stable=True)
        # NOTE: not bincount: its output's size depends on the largest id, read back on a GPU
        per = torch.zeros(self.num_copies.numel(), dtype=torch.int64, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        first = torch.cumsum(per, 0) - per  # [E] where each expert's pairs start in sorted order
        occ = torch.empty_like(flat)
        occ[order] = torch.arange(flat.numel(), device=flat.device) - first[flat[order]]  # i: the expert's i-th pair
        copy = (occ % self.num_copies[flat]).view_as(topk_ids)  # [n, K]
        return self.worker_of[topk_ids, copy], self.local_of[topk_ids, copy]

    def workers_for(self, topk_ids: torch.Tensor) -> list[int]:
        """The workers a whole batch activates (sorted). topk_ids: [n, K] of the whole batch."""
        return self.route(topk_ids)[0]

    def split(self, topk_ids: torch.Tensor, workers: list[int],
              rows: tuple[int, int] | None = None) -> list[WorkerShare]:
        """One share per listed worker (possibly empty) of the batch's rows [lo, hi) (default all),
        pairs ordered by (worker, local slot); pair indices count from row lo. topk_ids: [n, K]."""
        return self.route(topk_ids, rows, workers)[1]

    def route(self, topk_ids: torch.Tensor, rows: tuple[int, int] | None = None,
              workers: list[int] | None = None) -> tuple[list[int], list[WorkerShare]]:
        """``workers`` (None: those the whole batch activates, sorted) and ``split``'s shares for them,
        with one read-back: a transport that writes each worker's rows and their per-expert counts
        needs those sizes on the host, and they come back together (not two per worker)."""
        worker, local = self.assign(topk_ids)  # [n, K] each
        nw, ml = len(self.num_local), self.max_local
        flat = worker.reshape(-1)
        active = torch.zeros(nw, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
        if rows is not None:
            worker, local = worker[rows[0]:rows[1]], local[rows[0]:rows[1]]
        key = (worker * ml + local).reshape(-1)  # [P]
        order = torch.argsort(key, stable=True)  # [P]
        # NOTE: not bincount: its size depends on the largest key, read back on a GPU
        per_key = torch.zeros(nw * ml, dtype=torch.int64, device=key.device).scatter_add_(0, key, torch.ones_like(key))
        per_worker = per_key.view(nw, ml).sum(1)
        host = torch.cat([active, torch.cumsum(per_worker, 0) - per_worker, per_key]).tolist()  # the one read-back
        starts, per = host[nw:2 * nw], host[2 * nw:]
        ws = [w for w in range(nw) if host[w]] if workers is None else list(workers)
        shares = []
        for w in ws:
            counts = per[w * ml:w * ml + self.num_local[w]]
            shares.append(WorkerShare(w, order[starts[w]:starts[w] + sum(counts)], counts))
        return ws, shares

    def local_plan(self, topk_ids: torch.Tensor, worker: int) -> ExpertPlan:
        """The pairs ``worker`` computes, grouped by its local slot (an expert-side router: an FFN
        daemon that routes the rows itself keeps only the replicas chosen for it); as ``plan_pairs``,
        a row for every pair, the others last and masked, so nothing is read back to the host."""
        w, local = self.assign(topk_ids)
        el = self.num_local[worker]
        key = torch.where(w == worker, local, el).reshape(-1)  # [P]: not this worker's, after its slots
        order = torch.argsort(key, stable=True)
        counts = torch.zeros(el + 1, dtype=torch.int64, device=key.device).scatter_add_(0, key, torch.ones_like(key))
        return ExpertPlan(order, order // topk_ids.shape[1], counts[:el], key[order] < el)


# NOTE: while a rebalance switches over, dispatches of two placements may be in flight; the layer
# word of a dispatch header carries the placement's parity, so an expert worker computes each with
# the buffer it was routed for (a new rebalance starts only once the older placement is retired)
EPOCH_STRIDE = 1 << 20


def tag_layer(layer: int, epoch: int) -> int:
    """The header's layer word for ``layer`` routed by placement ``epoch``."""
    return layer + EPOCH_STRIDE * (epoch % 2)


def untag_layer(word: int) -> tuple[int, int]:
    """(layer, placement parity) of a header's layer word."""
    return word % EPOCH_STRIDE, word // EPOCH_STRIDE


class LayeredRoutes:
    """Routes per MoE layer (a rebalanced placement differs by layer): ``for_layer(l)``."""

    def __init__(self, layers: tuple, moe_layer_ids: list[int], num_experts: int, group: int = 0,
                 device: torch.device | str = "cpu"):
        cache: dict[tuple, ExpertRoutes] = {}
        self.by_layer = {}
        for lid, placement in zip(moe_layer_ids, layers):
            if placement not in cache:
                cache[placement] = ExpertRoutes(placement, num_experts, group, device)
            self.by_layer[lid] = cache[placement]

    def for_layer(self, layer: int) -> ExpertRoutes:
        return self.by_layer[layer]
