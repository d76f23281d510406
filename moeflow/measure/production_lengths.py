"""ASAP's production prompt lengths (§2.3): a lognormal fitted to the trace's stated mean and tail,
restricted to [31, 32768] (§5.1 leaves out requests above 32k). Pure Python + numpy.

``production_mean`` says which mean is 5k: ``kept`` (the default, what every committed measurement
used) fits the mean of the requests that remain after the 32k cut; ``raw`` fits the mean of the
whole trace before it, which is how §2.3 states it (the kept mean is then ~4.2k).
"""
from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

PRODUCTION_MIN_LEN = 31  # shortest prompt in ASAP's trace (§2.3)
PRODUCTION_MAX_LEN = 32768  # ASAP §5.1 leaves out requests above 32k
PRODUCTION_MEAN_LEN = 5000  # mean prompt length of ASAP's trace (§2.3)
PRODUCTION_TAIL_LEN = 100_000  # "a heavy tail extending up to 100k" ...
PRODUCTION_TAIL_QUANTILE = 0.999  # ... read as: 0.1% of the raw trace lies above it
# ln(tokens) ~ Normal(mu, sigma) before the restriction to [31, 32768]; fitted by
# fit_production_lognormal(mean_of) (a unit test re-runs both fits).
PRODUCTION_LOG_MU = 8.052101  # "kept": the mean after the 32k cut is 5k; median e^mu = 3140 tokens
PRODUCTION_LOG_SIGMA = 1.119924
PRODUCTION_RAW_LOG_MU = 7.792208  # "raw": the mean of the whole trace is 5k (kept mean 4221); median e^mu = 2422
PRODUCTION_RAW_LOG_SIGMA = 1.204025
PRODUCTION_MEANS = ("kept", "raw")


def production_params(mean_of: str = "kept") -> tuple[float, float]:
    """(mu, sigma) of the production lognormal whose ``mean_of`` mean is PRODUCTION_MEAN_LEN."""
    if mean_of not in PRODUCTION_MEANS:
        raise ValueError(f"production_mean must be one of {PRODUCTION_MEANS}, got {mean_of!r}")
    return ((PRODUCTION_LOG_MU, PRODUCTION_LOG_SIGMA) if mean_of == "kept"
            else (PRODUCTION_RAW_LOG_MU, PRODUCTION_RAW_LOG_SIGMA))


def sample_production_lens(rng: np.random.Generator, n: int, mean_of: str = "kept") -> np.ndarray:
    """``n`` lengths from the fitted lognormal, rounded; outside [31, 32768] redrawn (left out)."""
    mu, sigma = production_params(mean_of)
    return restricted_draws(lambda k: rng.lognormal(mu, sigma, k), PRODUCTION_MIN_LEN, PRODUCTION_MAX_LEN, n)


def restricted_draws(draw, lo: int, hi: int, n: int) -> np.ndarray:
    """``n`` rounded values of ``draw(k)`` (k samples at a time), those outside [lo, hi] redrawn."""
    out = np.empty(0, dtype=np.int64)
    while len(out) < n:
        x = np.rint(draw(max(2 * (n - len(out)), 64)))
        x = x[(x >= lo) & (x <= hi)].astype(np.int64)
        out = np.concatenate([out, x[:n - len(out)]])
    return out


def restricted_lognormal_mean(mu: float, sigma: float, lo: float, hi: float) -> float:
    """E[X | lo <= X <= hi] for ln X ~ Normal(mu, sigma) (closed form; hi may be math.inf)."""
    phi = NormalDist().cdf
    a, b = math.log(lo), math.log(hi)
    num = phi((b - mu - sigma ** 2) / sigma) - phi((a - mu - sigma ** 2) / sigma)
    den = phi((b - mu) / sigma) - phi((a - mu) / sigma)
    return math.exp(mu + sigma ** 2 / 2) * num / den


def fit_production_lognormal(mean_of: str = "kept") -> tuple[float, float]:
    """(mu, sigma) with (1) the raw PRODUCTION_TAIL_QUANTILE at PRODUCTION_TAIL_LEN and (2) the mean
    at PRODUCTION_MEAN_LEN: restricted to [PRODUCTION_MIN_LEN, PRODUCTION_MAX_LEN] (``kept``: the
    requests §5.1 keeps) or to [PRODUCTION_MIN_LEN, inf) (``raw``: the whole trace of §2.3).

    (1) fixes mu = ln(tail) - z·sigma; along that line the restricted mean falls monotonically
    with sigma (more mass moves below the tail anchor; for the raw mean while sigma < z), so (2)
    is one root, found by bisection.
    """
    production_params(mean_of)  # validates mean_of
    z = NormalDist().inv_cdf(PRODUCTION_TAIL_QUANTILE)
    top = math.log(PRODUCTION_TAIL_LEN)
    upper = PRODUCTION_MAX_LEN if mean_of == "kept" else math.inf

    def excess(sigma: float) -> float:
        return restricted_lognormal_mean(top - z * sigma, sigma, PRODUCTION_MIN_LEN, upper) - PRODUCTION_MEAN_LEN

    lo, hi = 0.3, (4.0 if mean_of == "kept" else z)  # excess(lo) > 0 > excess(hi)
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
    sigma = (lo + hi) / 2
    return top - z * sigma, sigma
