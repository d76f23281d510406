"""A probe stops once its TPOT certainly misses the bound: the rule is sound against the statistic
the score reads, and a search with it finds what the search without it finds."""
from __future__ import annotations

import random

import numpy as np
import pytest

import moeflow.plan.search as search_mod
from moeflow.measure.slo import TpotBound
from moeflow.plan.candidates import enumerate_candidates
from moeflow.plan.search import Slo, evaluate

from test_plan import BASE


@pytest.mark.parametrize("quantile", [None, 0.5, 0.9])
def test_a_certain_miss_is_a_miss_whatever_the_rest_do(quantile):
    """Whenever the rule says fails, every completion consistent with the bounds (finished and
    decoding requests at or above theirs, the rest anywhere, any of the rest never completing)
    scores above the bound; and it does say fails in a clear case."""
    rng = random.Random(0)
    rule, said = TpotBound(0.05, quantile), 0
    for _ in range(3000):
        n = rng.randint(1, 30)
        lower = [rng.uniform(0.0, 0.1) for _ in range(rng.randint(0, n))]
        if not rule.certainly_fails(lower, n):
            continue
        said += 1
        for _ in range(20):
            final = [lo + rng.uniform(0, 0.05) for lo in lower]
            final += [rng.uniform(0.0, 0.1) for _ in range(rng.randint(0, n - len(lower)))]
            stat = np.mean(final) if quantile is None else np.percentile(final, quantile * 100)
            assert stat > 0.05, (quantile, n, lower, final)
    assert said > 50
    assert TpotBound(0.05, 0.9).certainly_fails([0.06] * 3 + [0.01] * 7, 10)
    assert not TpotBound(0.05, 0.9).certainly_fails([0.06] + [0.01] * 9, 10)


def test_the_search_with_the_tpot_stop_finds_what_it_finds_without(monkeypatch):
    """The oracle: the same candidate searched with the rule and without it (each probe run to its
    end) gives the same rates and the same probes; the probes that miss TPOT stop early with it."""
    cand = next(c for c in enumerate_candidates(2) if c.name == "dep2")
    base = {**BASE, "workload": {**BASE["workload"], "output_len": 256}}
    slo = Slo(2.0, 0.045, "p90")
    probes = []
    real = search_mod.run_point

    def recording(*a, **kw):
        p, res = real(*a, **kw)
        probes.append((a[3], bool(p.get("stopped_early")), p.get("tpot_p90_s")))
        return p, res
    monkeypatch.setattr(search_mod, "run_point", recording)
    fast = evaluate(cand, base, slo, 4.0)
    with_stop, probes[:] = list(probes), []
    monkeypatch.setattr(Slo, "tpot_bound", lambda self: None)
    slow = evaluate(cand, base, slo, 4.0)
    keys = ("slo_rps", "slo_rps_at_least", "upper_rps", "probes")
    assert {k: fast[k] for k in keys} == {k: slow[k] for k in keys}
    assert [r for r, _, _ in with_stop] == [r for r, _, _ in probes]
    missed = [i for i, (_, stopped, tpot) in enumerate(probes) if not stopped and tpot is not None and tpot > 0.045]
    assert missed, probes  # the case exists: probes that ran to their end only to miss TPOT
    assert all(with_stop[i][1] for i in missed[:1]), (with_stop, probes)
