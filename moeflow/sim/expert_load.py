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

Placements are the engine's (``layout/expert_map.py``), priced the way the engine routes: a
replicated expert's pairs split evenly over its copies. ``contiguous``: the engine's placement
before any load is known (device d holds the d-th share of the E + R slots; the R redundant ones
replicate experts 0..R-1). ``eplb``: the engine's rebalance (``scheduler/eplb.py``, global policy)
of the layer's popularity p, known exactly (what a live rebalance converges to with perfect
statistics), with R redundant slots; R = 0 on the system means DeepSeek-V3 §3.4's prefill
deployment, one redundant expert per device.

NOTE: a token's K experts are distinct, so per-device counts vary slightly less than multinomial.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from moeflow.layout.expert_map import ExpertMap
from moeflow.scheduler.eplb import rebalance

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


def expert_map(pop: np.ndarray, num_devices: int, placement: str, num_redundant: int = 0) -> ExpertMap:
    """The engine's placement of ``pop`` [L, E] over ``num_devices``."""
    num_layers, e = pop.shape
    if placement == "contiguous":
        return ExpertMap.contiguous(e, num_devices, num_layers, num_redundant)
    if placement == "eplb":
        return rebalance(pop.tolist(), num_devices, num_redundant or num_devices, policy="global")
    raise ValueError(f"expert_placement must be one of {PLACEMENTS}, got {placement!r}")


def place(pop: np.ndarray, num_devices: int, placement: str, num_redundant: int = 0) -> np.ndarray:
    """[L, N] share of each layer's pairs that each device receives."""
    return np.asarray(expert_map(pop, num_devices, placement, num_redundant).device_load(pop.tolist()))


@functools.lru_cache(maxsize=32)
def _shares(num_experts: int, num_layers: int, num_devices: int, cv: float, placement: str,
            seed: int, num_redundant: int) -> np.ndarray:
    pop = (np.full((num_layers, num_experts), 1 / num_experts) if cv == 0
           else popularity(num_experts, num_layers, cv, seed))
    shares = place(pop, num_devices, placement, num_redundant)
    shares.setflags(write=False)  # cached: shared by every system built with these arguments
    return shares


class ExpertLoads:
    """Per-batch (token, expert) pairs per expert device for every MoE layer of one system."""

    def __init__(self, num_experts: int, num_layers: int, num_devices: int, cv: float = 0.0,
                 placement: str = "contiguous", seed: int = 0, num_redundant: int = 0):
        if placement not in PLACEMENTS:
            raise ValueError(f"expert_placement must be one of {PLACEMENTS}, got {placement!r}")
        self.num_devices = num_devices
        # one device takes every pair, however skewed; uneven replicas make even a flat popularity uneven
        self.balanced = (cv == 0 and num_redundant == 0) or num_devices == 1
        if not self.balanced:
            self.shares = _shares(num_experts, num_layers, num_devices, float(cv), placement, seed,
                                  num_redundant)  # [L, N]
            self._rng = np.random.default_rng([seed, 1])
        self._imbalance_sum = 0.0
        self._num_draws = 0

    @classmethod
    def of_map(cls, placement: ExpertMap, pop: np.ndarray, seed: int) -> "ExpertLoads":
        """The loads of a given placement of ``pop`` [L, E] (an elastic deployment's, after ``resize``)."""
        loads = cls.__new__(cls)
        loads.num_devices = placement.num_devices
        loads.balanced = placement.num_devices == 1 or (
            len(set(placement.slots_per_device)) == 1 and placement.slots_per_device[0] * placement.num_devices
            == placement.num_experts and bool(np.allclose(pop, pop[0, 0])))
        if not loads.balanced:
            loads.shares = np.asarray(placement.device_load(pop.tolist()))
            loads._rng = np.random.default_rng([seed, 1])
        loads._imbalance_sum, loads._num_draws = 0.0, 0
        return loads

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
