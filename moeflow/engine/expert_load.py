"""The engine's view of expert load: the recent window of tokens per (MoE layer, logical expert)
that its workers routed (``workers/expert_load.py``), and what the placement makes of it — each
expert device's load and every layer's balancedness (mean / max device load, vLLM's measure).

The window is the last ``window_size`` work items that routed anything (vLLM's ``window_size``
counts engine steps; here a group's work item is the unit, since asap's and afd's groups step on
their own: a dep step is one work item per rank).
"""
from __future__ import annotations

from collections import deque

import numpy as np

from moeflow.layout.expert_map import ExpertMap

HOTTEST = 3  # experts per layer /metrics names


class ExpertLoadWindow:
    def __init__(self, expert_map: ExpertMap, moe_layer_ids: list[int], window_size: int = 1000,
                 computes: bool = True):
        if not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"the expert load window must be a positive number of steps, got {window_size!r}")
        self.map, self.layer_ids, self.window_size = expert_map, list(moe_layer_ids), window_size
        shape = (expert_map.num_layers, expert_map.num_experts)
        self.window = np.zeros(shape, dtype=np.int64)  # [Lm, E] tokens over the window
        self.total = np.zeros(shape, dtype=np.int64)  # since the deployment started
        self._buckets: deque[np.ndarray] = deque()
        self.items = 0  # work items that routed anything, since the deployment started
        self.computes = computes  # whether a device computes the experts it holds (see window_for)

    def add(self, counts: np.ndarray | None) -> None:
        """One work item's report ([Lm, E] tokens; None: it routed nothing)."""
        if counts is None:
            return
        counts = counts.astype(np.int64)
        self._buckets.append(counts)
        self.window += counts
        self.total += counts
        self.items += 1
        if len(self._buckets) > self.window_size:
            self.window -= self._buckets.popleft()

    def balancedness(self) -> list[float]:
        """Per MoE layer, mean / max device load over the window (1.0 before any token); none where
        the devices do not compute by placement."""
        return self.map.balancedness(self.window.tolist()) if self.computes else []

    def distribution(self) -> dict:
        """Tokens per (MoE layer, logical expert) since the deployment started, as a file that
        ``--init-expert-location`` reads (``scheduler/expert_location``). Read from another thread
        (the server's), a count may miss the work item being added: a load statistic, not an invariant."""
        return {"logical_count": self.total.tolist(), "moe_layers": list(self.layer_ids),
                "num_experts": self.map.num_experts, "work_items": self.items}

    def hottest(self, n: int = HOTTEST) -> list[tuple[int, int, float]]:
        """(model layer id, expert, share of the layer's tokens) of each layer's ``n`` hottest experts."""
        out = []
        for i, row in enumerate(self.window):
            total = int(row.sum())
            if total:
                for e in np.argsort(-row, kind="stable")[:n]:
                    out.append((self.layer_ids[i], int(e), float(row[e]) / total))
        return out


def window_for(mc, held: tuple[tuple[int, ...], ...] | ExpertMap, computes: bool = True,
               window_size: int = 1000) -> ExpertLoadWindow:
    """The window of a deployment whose expert-holding processes hold ``held`` in every MoE layer
    (or by layer: an ``ExpertMap``, a starting placement).
    ``computes``: each process computes the pairs of the experts it holds (dep, asap, afd with
    topology all), so the placement decides its load; False (dwdp ranks, which pull what they lack
    and compute their own tokens; afd's blocks) keeps the window without a device balance."""
    moe = [lid for lid in range(mc.num_layers) if mc.sparse_layers[lid]]
    m = held if isinstance(held, ExpertMap) else ExpertMap((held,) * len(moe), mc.num_experts)
    return ExpertLoadWindow(m, moe, window_size, computes)
