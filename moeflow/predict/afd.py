"""``moeflow predict afd``: FastAFD's per-process speed-up of afd over a baseline, from the
baseline's decode profile:

    speedup = (B_AFD / B_base) * (T_base / T_AFD) * M / (M + N)

resident-request expansion (the memory plan under the same budget: an attention instance holds
no routed experts), full-step latency ratio, and the FFN daemons' share of the processes.

From the baseline (a ``bench decode`` result of dep or colocated with traces) come T_base, B_base
and the step split: attention-side compute per request per step, transport per token, and the
engine's per-step overhead (the time no worker span covers). From a stage profile (``moeflow
profile``) comes the experts op's time against routed pairs for a daemon's number of experts.
Then per MoE layer, with A the attention side's time and F the daemon's (m micro-batches, each
reading the experts' weights again):

    T_AFD = L_moe * max(A, F) + min(A, F) / m       (m >= 2)
    T_AFD = L_moe * (A + F)                          (m = 1: nothing overlaps)

(DBO: micro-batch u's FFN runs while u+1's attention does, and the next layer's first
micro-batch needs only the first micro-batch's combine, so the pipeline runs across layers: the
longer side is busy throughout and only the first attention / last FFN of the step is exposed).
DBO hides the FFN only while A >= F, i.e. T_attn(ub) >= T_FFN(ub) + T_comm: a prediction where
it does not is flagged. With overlap scheduling the engine's per-step overhead is hidden;
without it, it is added. Pure Python.
"""
from __future__ import annotations

import bisect
import statistics
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Baseline:
    """What one baseline decode run measured (per process)."""

    tpot_s: float  # T_base: one decode step
    resident: float  # B_base: requests per attention group (a dep rank, the colocated process)
    attention: float  # fractions of the step: attention-side compute, experts, transport, overhead
    ffn: float
    transport: float
    overhead: float

    @classmethod
    def from_result(cls, result: dict, system: str, context: int) -> "Baseline":
        r = result["results"][system][str(context)]
        split = r.get("split")
        if not split:
            raise ValueError(f"baseline {system} at context {context} has no step split: run it with a mode "
                             f"that has worker traces (dep)")
        procs = list(split.values())

        def mean(k):
            return statistics.fmean(p[k] for p in procs)
        return cls(r["tpot_s"]["mean"], r["resident_per_group"], mean("attention"), mean("ffn"), mean("transport"),
                   mean("bubble"))


@dataclass(frozen=True)
class AfdPrediction:
    m: int
    b_afd: int
    b_base: float
    b_ratio: float
    t_afd_s: float
    t_base_s: float
    t_ratio: float
    node_factor: float
    speedup: float
    attention_per_layer_s: float  # A
    ffn_per_layer_s: float  # F: m micro-batches' experts and their combine-sends
    overlap_holds: bool  # A >= F: DBO hides the FFN
    fastafd_t_afd_s: float  # FastAFD's approximation: the attention-only step

    def to_dict(self) -> dict:
        return asdict(self)


def experts_s(profile: dict, pairs: float, local: int) -> float:
    """The experts op's time for ``pairs`` routed (token, expert) pairs over ``local`` experts, from
    the profile's table (interpolated; below its smallest point, scaled by the experts touched)."""
    table = profile["experts"].get(str(local))
    if table is None:
        raise ValueError(f"the profile has no experts table for {local} local experts (it has "
                         f"{sorted(profile['experts'], key=int)}); profile the model with that placement")
    xs, ys = [p for p, _ in table], [s for _, s in table]
    if pairs <= xs[0]:
        def touched(p):
            return local * (1 - (1 - 1 / local) ** p)
        return ys[0] * touched(pairs) / touched(xs[0])
    i = min(bisect.bisect_left(xs, pairs), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (pairs - x0) / (x1 - x0)


ATTENTION_MODELS = ("linear", "profile")


def decode_block_s(profile: dict, seqs: float, context: int) -> float:
    """One layer's attention block for ``seqs`` sequences decoding after ``context`` tokens, from
    the profile's decode fit (c0 + per sequence + per cached key; a row's keys: context + itself)."""
    fit = (profile.get("decode") or {}).get("fit")
    if fit is None:
        raise ValueError("the profile has no decode fit (decode batches timed by moeflow profile): "
                         "re-run moeflow profile, or use the linear attention model")
    return fit["c0"] + fit["per_seq"] * seqs + fit["per_key"] * seqs * (context + 1)


def predict(base: Baseline, profile: dict, *, m: int, attn_workers: int, ffn_workers: int, served: int,
            local_experts: int, b_afd: int, num_layers: int, num_moe_layers: int, top_k: int,
            overlap_scheduling: bool = True, pair_share: float = 1.0, attention: str = "linear",
            context: int | None = None) -> AfdPrediction:
    """``served``: attention instances one daemon aggregates; ``local_experts``: experts it holds;
    ``pair_share``: the share of a served token's (token, expert) pairs one daemon computes (1 when
    each daemon holds every expert, 1/N when the experts are split over N daemons).

    ``attention``: how the attention side grows from the baseline's B to afd's. "linear" is
    FastAFD's: B_AFD x the baseline's attention per request, which charges every request a share of
    the fixed costs a small baseline batch divides among few. "profile": the baseline's measured
    attention side plus what the profile's decode fit adds per layer from B_base requests to m
    micro-batches of B_AFD / m at ``context`` (the fit's fixed part paid once per micro-batch)."""
    if attention not in ATTENTION_MODELS:
        raise ValueError(f"attention model {attention!r}: one of {ATTENTION_MODELS}")
    t_base, b_base = base.tpot_s, base.resident
    per_req_attention = t_base * base.attention / b_base  # per step, all layers
    per_tok_transport = t_base * base.transport / b_base  # dispatch and combine-send of one token's rows
    if attention == "linear":
        attn_step = b_afd * per_req_attention
    else:
        if context is None:
            raise ValueError("the profile attention model needs the context")
        grown = m * decode_block_s(profile, b_afd / m, context) - decode_block_s(profile, b_base, context)
        attn_step = t_base * base.attention + num_layers * grown
    a = (attn_step + b_afd * per_tok_transport / 2) / num_layers  # attention side, per layer
    ub_pairs = served * b_afd / m * top_k * pair_share  # one daemon's pairs of one micro-batch
    # per MoE layer: its experts and its combine-sends (the baseline's transport is over all MoE layers)
    f = m * (experts_s(profile, ub_pairs, local_experts) + ub_pairs / top_k * per_tok_transport / 2 / num_moe_layers)
    dense = num_layers - num_moe_layers
    moe = num_moe_layers * (a + f) if m == 1 else num_moe_layers * max(a, f) + min(a, f) / m
    t_afd = moe + dense * a
    if not overlap_scheduling:
        t_afd += t_base * base.overhead
    node = attn_workers / (attn_workers + ffn_workers)
    b_ratio, t_ratio = b_afd / b_base, t_base / t_afd
    return AfdPrediction(m, b_afd, b_base, b_ratio, t_afd, t_base, t_ratio, node, b_ratio * t_ratio * node,
                         a, f, a >= f, a * num_layers)
