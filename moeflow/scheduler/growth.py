"""How many members a shortfall asks for, shared by the controllers (``autoscale.py``,
``autoscale_ep.py``, ``autoscale_pd.py``): the KV in use extrapolated to the next chance to act, the
members that keep ``band`` of it free, the prompts' wait and the members that wait asks for."""
from __future__ import annotations

import math


def kv_need(kv: list[tuple[float, float]], interval_s: float) -> float:
    """The KV in use by ``interval_s`` from now, at the rate it grew over ``kv`` ((time, KV in use in
    members' worth), oldest first); never less than now. Members' worth (members x the share in use)
    does not change with the membership, so a trend crosses a change."""
    (t0, u0), (t1, u1) = kv[0], kv[-1]
    return u1 + max(0.0, (u1 - u0) / (t1 - t0)) * interval_s if t1 > t0 else u1


def kv_growth(need: float, members: int, band: float, max_step: int) -> int:
    """Members to add so that ``need`` (members' worth) leaves ``band`` free: at least one, at most
    ``max_step``."""
    return max(1, min(max_step, math.ceil(need / (1 - band) - members)))


def prompt_wait(s) -> float:
    """How long prompts have waited, from a window ``s``: the oldest unanswered request's wait, or the
    finished ones' p90 TTFT while requests are queued (they tell of a backlog late, by their decode)."""
    return max(s.queue_wait_s, s.ttft_p90_s if s.queue > 0 and s.ttft_p90_s is not None else 0.0)


def ttft_growth(wait: float, members: int, ttft_slo_s: float, max_step: int) -> int:
    """Members to add for prompts that waited ``wait`` against ``ttft_slo_s``: in proportion to how far
    over it they are, at least one, at most ``max_step``."""
    return min(max_step, max(1, math.ceil(members * (wait / ttft_slo_s - 1))))
