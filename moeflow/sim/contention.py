"""Source contention of DWDP's asynchronous weight pulls (DWDP §4.3), and what each copy plan makes of it.

The paper's random-state model: N ranks, each pulling from one of its N-1 peers at a time, the
source uniform among them. For a marked pull, each of the other N-2 ranks hits the same source with
probability 1/(N-1), so the contention level (pulls at that source, the marked one included) is

    C = 1 + X,   X ~ Binomial(N - 2, 1 / (N - 1))          (Table 2 tabulates Pr[C = c])

What a pull pays for it, stated assumptions (the paper stops at the probabilities):

- A source's outbound link is shared equally by the C pulls it serves (processor sharing, which
  is what a copy engine interleaving requests approximates), and a destination's inbound link
  caps what its own pulls take together.
- ``naive`` plan: one whole pull in flight at a time, so it runs at 1/C of the link: C times
  its uncontended time (the paper's "fully serialized equal-size" approximation, C·tau).
- ``sliced`` plan (1 MB slices round-robin over the sources): the copy engine keeps two slices in
  flight, from two different sources (the plan alternates sources), each seeing its own C drawn
  independently. The destination gets min(1, 1/C1 + 1/C2) of its link: no loss while
  both C <= 2 (the paper: "two contention-2 slices still keep the port busy"), a loss whenever both
  reach 3 (the paper's condition), and also a smaller one for C = (2, >=3), which the paper's
  statement leaves out. A pull is thousands of slices, so it pays the mean factor.
"""
from __future__ import annotations

import math
import random

from moeflow.layout import COPY_PLANS


def contention_pmf(n: int) -> dict[int, float]:
    """Pr[C = c] for c = 1..n-1 in a DWDP group of ``n`` ranks (DWDP Table 2)."""
    if n < 2:
        raise ValueError(f"contention needs a DWDP group of at least 2 ranks, got {n}")
    k, p = n - 2, 1 / (n - 1)
    return {x + 1: math.comb(k, x) * p ** x * (1 - p) ** (k - x) for x in range(k + 1)}


def _factor(plan: str, levels: tuple[int, ...]) -> float:
    """Time of a pull (or slice pair) over its uncontended time, given its in-flight levels."""
    if plan == "naive":
        return float(levels[0])
    return max(1.0, 1 / sum(1 / c for c in levels))  # the inbound link caps the pair at 1


def expected_slowdown(n: int, plan: str) -> float:
    """E[pull time] / uncontended pull time for a DWDP group of ``n`` ranks under ``plan``."""
    if plan not in COPY_PLANS:
        raise ValueError(f"copy plan must be one of {COPY_PLANS}, got {plan!r}")
    pmf = contention_pmf(n)
    if plan == "naive":
        return sum(c * p for c, p in pmf.items())
    return sum(pa * pb * _factor(plan, (a, b)) for a, pa in pmf.items() for b, pb in pmf.items())


class ContentionDraws:
    """Seeded draws of C for the naive plan's whole pulls (sliced pulls pay the mean: no draws)."""

    def __init__(self, n: int, seed: int):
        self.n, self.rng = n, random.Random(seed)
        levels = sorted(contention_pmf(n).items())
        self.levels = [c for c, _ in levels]
        self.cum = [sum(p for _, p in levels[:i + 1]) for i in range(len(levels))]

    def draw(self) -> int:
        u = self.rng.random()
        return next((c for c, cp in zip(self.levels, self.cum) if u < cp), self.levels[-1])
