"""Expert load: how one batch's (token, expert) pairs fall on the expert devices, layer by layer.

ASAP Fig. 3b assumes "perfect expert load balancing", yet names "the most congested expert" as a
straggler source of synchronous systems (§1). The model (``SimOptions``):

- ``cv = 0``: every device receives exactly its share, n/N pairs (no draw; the old model).
- ``cv > 0``: per MoE layer, expert popularity p ~ Dirichlet(α, ..., α) over the model's E
  experts, α chosen so that the coefficient of variation of pᵢ across experts is ``cv``
  (CV² = (E−1)/(Eα+1)). It is drawn once per run from ``expert_seed``, the same for every system
  (a layer's hot experts stay hot for the run, which is what EPLB's statistics rely on). A
  placement sums p into per-device shares; each batch's n pairs then fall
  Multinomial(n, shares), independently per layer.

Placements: ``contiguous`` (device d owns experts [d·E/N, (d+1)·E/N), as moeflow places them);
``eplb``: DeepSeek-V3 §3.4's prefill deployment, one redundant expert per device: the N hottest
experts of the layer get a second copy (each copy takes half its load), then all copies are
packed heaviest first onto the least loaded device that has a free slot, knowing p exactly (the
best EPLB can do with perfect statistics).

NOTE: a token's K experts are distinct, so per-device counts vary slightly less than multinomial.
"""
from __future__ import annotations

import functools
import heapq
import math

import numpy as np

PLACEMENTS = ("contiguous", "eplb")


def dirichlet_alpha(num_experts: int, cv: float) -> float:
    """The symmetric Dirichlet concentration whose marginals have coefficient of variation ``cv``."""
    e = num_experts
    alpha = ((e - 1) / cv ** 2 - 1) / e
    if not alpha > 0:
        raise ValueError(f"expert_load_cv {cv} is too large for {e} experts (at most {math.sqrt(e - 1):.2f})")
    return alpha


def popularity(num_experts: int, num_layers: int, cv: float, seed: int) -> np.ndarray:
    """[L, E] per-layer expert popularity (rows sum to 1)."""
    rng = np.random.default_rng([seed, 0])
    return rng.dirichlet(np.full(num_experts, dirichlet_alpha(num_experts, cv)), size=num_layers)


def place(pop: np.ndarray, num_devices: int, placement: str) -> np.ndarray:
    """[L, N] share of each layer's pairs that each device receives."""
    num_layers, e = pop.shape
    if placement == "contiguous":
        owner = np.arange(e) * num_devices // e
        return np.stack([np.bincount(owner, weights=row, minlength=num_devices) for row in pop])
    if placement == "eplb":
        return np.stack([_eplb(row, num_devices) for row in pop])
    raise ValueError(f"expert_placement must be one of {PLACEMENTS}, got {placement!r}")


def _eplb(p: np.ndarray, n: int) -> np.ndarray:
    units = [float(x) for x in p]
    for i in np.argsort(-p, kind="stable")[:n]:  # the n hottest experts get a second copy
        units[i] /= 2
        units.append(units[i])
    slots = math.ceil(len(units) / n)
    load = np.zeros(n)
    free = [slots] * n
    heap = [(0.0, d) for d in range(n)]
    for u in sorted(units, reverse=True):
        _, d = heapq.heappop(heap)  # least loaded device with a free slot
        load[d] += u
        free[d] -= 1
        if free[d]:
            heapq.heappush(heap, (load[d], d))
    return load


@functools.lru_cache(maxsize=32)
def _shares(num_experts: int, num_layers: int, num_devices: int, cv: float, placement: str,
            seed: int) -> np.ndarray:
    shares = place(popularity(num_experts, num_layers, cv, seed), num_devices, placement)
    shares.setflags(write=False)  # cached: shared by every system built with these arguments
    return shares


class ExpertLoads:
    """Per-batch (token, expert) pairs per expert device for every MoE layer of one system."""

    def __init__(self, num_experts: int, num_layers: int, num_devices: int, cv: float = 0.0,
                 placement: str = "contiguous", seed: int = 0):
        if placement not in PLACEMENTS:
            raise ValueError(f"expert_placement must be one of {PLACEMENTS}, got {placement!r}")
        self.num_devices = num_devices
        self.balanced = cv == 0 or num_devices == 1  # one device takes every pair, however skewed
        if not self.balanced:
            self.shares = _shares(num_experts, num_layers, num_devices, float(cv), placement, seed)  # [L, N]
            self._rng = np.random.default_rng([seed, 1])
        self._imbalance_sum = 0.0
        self._num_draws = 0

    def draw(self, num_pairs: int) -> np.ndarray:
        """[L, N] pairs each device receives in each MoE layer (not for balanced loads: n/N each)."""
        if self.balanced:
            raise ValueError("ExpertLoads.draw: balanced loads have no draw (every device gets n/N)")
        loads = self._rng.multinomial(num_pairs, self.shares)
        if num_pairs > 0:
            self._imbalance_sum += float(loads.max(axis=1).mean()) * self.num_devices / num_pairs
            self._num_draws += 1
        return loads

    @property
    def mean_imbalance(self) -> float | None:
        """Mean over the batches drawn of the most loaded device's load / the mean load (per layer,
        averaged over layers); None before any draw."""
        return self._imbalance_sum / self._num_draws if self._num_draws else None

    @property
    def share_imbalance(self) -> float:
        """Max / mean of the devices' expected shares, averaged over layers (the skew without noise)."""
        return 1.0 if self.balanced else float(self.shares.max(axis=1).mean() * self.num_devices)
