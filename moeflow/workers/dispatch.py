"""Which MoE worker gets which (token, expert) pair, in the row order the worker computes in.

Legend: n tokens of this member's share, K experts per token, P = n*K pairs, Epw experts held by
one worker, H hidden size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class WorkerShare:
    worker: int
    pair_index: torch.Tensor  # [m] int64 flat t*K + k, grouped by the worker's local expert
    counts: list[int]  # [Epw] rows per local expert (the header's tokens-per-expert)


class ExpertRoutes:
    """Placement lookups for one attention DP group (replicas are chosen per group)."""

    def __init__(self, placement: tuple[tuple[int, ...], ...], num_experts: int, group: int,
                 device: torch.device | str = "cpu"):
        copies: dict[int, list[int]] = {}
        for w, ids in enumerate(placement):
            for e in ids:
                copies.setdefault(e, []).append(w)
        worker = [copies[e][group % len(copies[e])] for e in range(num_experts)]
        self.worker_of = torch.tensor(worker, dtype=torch.int64, device=device)  # [E_total]
        self.local_of = torch.tensor([placement[worker[e]].index(e) for e in range(num_experts)],
                                     dtype=torch.int64, device=device)  # [E_total] index on that worker
        self.num_local = [len(ids) for ids in placement]
        self.max_local = max(self.num_local)

    def workers_for(self, topk_ids: torch.Tensor) -> list[int]:
        """The MoE workers a batch activates (sorted). topk_ids: [n, K]."""
        return torch.unique(self.worker_of[topk_ids]).tolist()

    def split(self, topk_ids: torch.Tensor, workers: list[int]) -> list[WorkerShare]:
        """One share per listed worker (possibly empty), pairs ordered by (worker, local expert)."""
        flat = topk_ids.reshape(-1)  # [P]
        key = self.worker_of[flat] * self.max_local + self.local_of[flat]
        order = torch.argsort(key, stable=True)  # [P]
        per_key = torch.bincount(key, minlength=len(self.num_local) * self.max_local).view(-1, self.max_local)
        starts = torch.cumsum(per_key.sum(1), 0) - per_key.sum(1)
        out = []
        for w in workers:
            counts = per_key[w, :self.num_local[w]].tolist()
            s = int(starts[w])
            out.append(WorkerShare(w, order[s:s + sum(counts)], counts))
        return out
