"""Compute jitter: devices given equal work do not finish together, and a barrier waits for the last.

Each device's time for one layer's stage is its cost-model time times a factor f drawn per device
and layer, lognormal with mean 1 and coefficient of variation ``cv`` (independent across devices
and layers: an assumption; a slow device that stays slow would lose less per layer and more per
step). Asynchronous stages pay the mean, 1, so jitter costs them nothing on average; a stage that
ends when the slowest of n devices ends pays E[max of n factors] > 1, which grows with n and with
how many devices are busy at once: a synchronisation loss that grows with load. The draws come
from ``SimOptions.seed``; ``cv`` from ``SimOptions.compute_jitter_cv`` or the hardware's.
"""
from __future__ import annotations

import math

import numpy as np


class Jitter:
    def __init__(self, cv: float, seed: int):
        self.cv = float(cv)
        self.sigma = math.sqrt(math.log1p(self.cv ** 2))
        self.mu = -self.sigma ** 2 / 2  # E[f] = 1
        self.rng = np.random.default_rng([seed, 1])

    @property
    def on(self) -> bool:
        return self.cv > 0

    def factors(self, *shape: int) -> np.ndarray:
        """Independent factors, mean 1 (all ones when off)."""
        if not self.on:
            return np.ones(shape)
        return self.rng.lognormal(self.mu, self.sigma, size=shape)

    def slowest(self, num_layers: int, times: np.ndarray, group: int = 1) -> np.ndarray:
        """[num_layers] when the slowest of the devices ends: ``times`` [n] (or [num_layers, n]) per
        device, each a group of ``group`` devices that compute the same time (a TP group: its
        slowest member sets its time). A device with no work (time 0) waits for nobody."""
        times = np.broadcast_to(np.asarray(times, dtype=float), (num_layers, np.shape(times)[-1]))
        if not self.on:
            return times.max(axis=1)
        f = self.factors(num_layers, times.shape[1], group).max(axis=2)
        return (times * f).max(axis=1)

    def expected_max(self, n: int, draws: int = 20000) -> float:
        """E[max of n factors], by sampling with a fixed seed of its own (for reports and tests)."""
        if not self.on or n <= 1:
            return 1.0
        rng = np.random.default_rng(12345)
        return float(rng.lognormal(self.mu, self.sigma, size=(draws, n)).max(axis=1).mean())
