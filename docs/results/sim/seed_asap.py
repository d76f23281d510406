"""ASAP's rows of the seed tables (``seed_tables.py``): configs/asap-cm384.yaml's results and its
cost model."""
from __future__ import annotations

from moeflow.experiment.serve import load_experiment
from moeflow.sim.attention_cost import batch_ratio
from moeflow.sim.run import build_cost

import seed_splits as sp  # noqa: E402  (beside this script)
from seed_common import _load, row, verdict  # noqa: E402


def asap_rows() -> list[str]:
    d = _load("asap_cm384")["systems"]
    slo = {n: s["slo_rps_by_metric"]["mean"]["median"] for n, s in d.items()}

    def ttft(n: str, rps: float) -> float:
        return next(p["ttft_mean_s"] for p in d[n]["points"] if p["rps"] == rps)

    cfg = load_experiment("configs/asap-cm384.yaml")
    cost = build_cost(cfg).for_system(cfg.systems["asap"].sim)
    fig5 = batch_ratio(cost, 1, ("core",))  # the core attention, Fig. 5's O(sum s_i^2) term
    block = batch_ratio(cost, 1)
    dep4 = next(p for p in d["dep"]["points"] if p["rps"] == 4)["buckets"][0]
    out = [row("Fig. 5: core attention, 1x32k over 32x1k", "4.2x", f"{fig5:.2f}x", verdict(fig5, 4.2, tol=0.2)),
           row("Fig. 5: the whole attention block (projections, indexer too)", "4.2x", f"{block:.2f}x",
               verdict(block, 4.2, tol=0.2), sp.block_split(cost))]
    for n, paper in (("dep", 6.8), ("chunked", 10.5), ("asap", 20.0)):
        out.append(row(f"Fig. 14: SLO rps (mean TTFT <= 5 s), {n}", f"{paper}", f"{slo[n]}", verdict(slo[n], paper),
                       sp.at_rate(d[n], slo[n])))
    for a, b, paper in (("asap", "chunked", 1.90), ("asap", "dep", 2.94)):
        r = slo[a] / slo[b]
        out.append(row(f"Fig. 14: {a} / {b}", f"{paper}", f"{r:.2f}", verdict(r, paper),
                       f"{b} {sp.at_rate(d[b], slo[b])}"))
    for n, paper in (("asap", 350), ("chunked", 388), ("dep", 533)):
        ms = ttft(n, 1) * 1e3
        out.append(row(f"§5.2: mean TTFT at 1 rps, {n}", f"{paper} ms", f"{ms:.0f} ms", verdict(ms, paper, tol=0.2),
                       sp.at_rate(d[n], 1)))
    for rps, b, paper in ((4, "dep", 54.9), (4, "chunked", 41.8), (8, "chunked", 68.3)):
        cut = (1 - ttft("asap", rps) / ttft(b, rps)) * 100
        out.append(row(f"§5.2: TTFT cut vs {b} at {rps} rps", f"{paper}%", f"{cut:.1f}%", verdict(cut, paper),
                       f"asap {sp.ttft_parts(sp.point(d['asap'], rps))}; {b} {sp.ttft_parts(sp.point(d[b], rps))}"))
    sync, queue = dep4["other_mean_s"] / dep4["ttft_mean_s"] * 100, dep4["queue_mean_s"] / dep4["ttft_mean_s"] * 100
    fig15 = sp.ttft_parts(sp.point(d["dep"], 4), [dep4]) + "; " + sp.device_time(sp.point(d["dep"], 4))
    out.append(row("Fig. 15: Default, prompts < 512, 4 rps: sync wait share", "55%", f"{sync:.0f}%", verdict(sync, 55),
                   fig15))
    out.append(row("Fig. 15: the same, queueing share", "30%", f"{queue:.0f}%", verdict(queue, 30), fig15))
    for n, paper in (("asap-no-dual-batch", 14.3), ("asap-no-overlap", 12.4), ("asap-no-super-kernel", 6.0)):
        if n in slo:
            gain = (slo["asap"] / slo[n] - 1) * 100
            out.append(row(f"§5.5: SLO throughput gain over {n}", f"+{paper}%", f"{gain:+.1f}%",
                           verdict(gain, paper, tol=0.5), f"{slo['asap']} against {slo[n]} rps; {n} "
                           f"{sp.at_rate(d[n], slo[n])}"))
    if "asap-no-super-kernel" in slo:
        saved = (ttft("asap-no-super-kernel", 1) - ttft("asap", 1)) * 1e3
        out.append(row("§5.5: super kernel, TTFT saved at 1 rps", "13 ms", f"{saved:.0f} ms", verdict(saved, 13, tol=0.5)))
    if "asap-no-dual-batch" in slo:
        more = (ttft("asap", 1) / ttft("asap-no-dual-batch", 1) - 1) * 100
        out.append(row("§5.5: dual-batch interleaving, TTFT added at low load (1 rps)", "~6.5%", f"{more:+.1f}%",
                       verdict(more, 6.5, tol=0.5), f"{ttft('asap', 1) * 1e3:.0f} ms against "
                       f"{ttft('asap-no-dual-batch', 1) * 1e3:.0f} ms"))
    sent, split = dispatch_latency(cost, cfg.systems["asap"].layout, 512)
    out.append(row("§5.4: async-dispatch latency, 512 tokens", "< 0.1 ms", f"{sent * 1e3:.3f} ms",
                   "within" if sent < 1e-4 else "MISS", split))
    share, split = moe_over_attention(cost, cfg.systems["asap"].layout, 16384)
    out.append(row("§3.3.2 (Fig. 3): MoE over attention latency, one 16K prompt", "< 15%", f"{share * 100:.1f}%",
                   "within" if share < 0.15 else "MISS", split))
    asap4 = next(p for p in d["asap"]["points"] if p["rps"] == 4)["buckets"][0]
    cut = (1 - (asap4["ttft_mean_s"] - asap4["compute_mean_s"]) / (dep4["ttft_mean_s"] - dep4["compute_mean_s"])) * 100
    out.append(row("§5.3 Fig. 15: ASAP's non-kernel delay cut vs Default, prompts < 512, 4 rps", "up to 80%",
                   f"{cut:.0f}%", verdict(cut, 80), f"asap {sp.ttft_parts(asap4, [asap4])}; dep "
                   f"{sp.ttft_parts(dep4, [dep4])}"))
    dep_cost = build_cost(cfg).for_system(cfg.systems["dep"].sim)
    knee = inflection(dep_cost, 32)
    out.append(row("§2.2.2 Fig. 3b: MoE inflection, tokens per batch at EP32 (20% over the flat floor)", "~2k",
                   f"{knee / 1000:.1f}k", verdict(knee, 2000), sp.experts_split(dep_cost, 32, 2048)))
    for tokens, paper in ((1, "4x"), (8, "5.8x")):
        out.append(row(f"§5.4: synchronous P2P over async dispatch, {tokens}k tokens", paper,
                       "not modelled (no synchronous P2P with handshakes)", "-"))
    return out


def inflection(cost, ep: int) -> float:
    """Tokens per batch at which one MoE layer's expert time first exceeds its flat floor (its time at
    256 tokens, where every local expert has rows) by 20%, bisected on the cost model (ASAP Fig. 3b:
    perfect load balance, EP ``ep``)."""
    m = cost.model
    local = m.num_experts // ep

    def t(s: float) -> float:
        return cost.experts_s(max(1, round(s * m.top_k / ep)), local)
    lo, hi, floor = 256.0, float(1 << 20), t(256)
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if t(mid) <= 1.2 * floor else (lo, mid)
    return hi


def moe_over_attention(cost, layout, tokens: int) -> tuple[float, str]:
    """One MoE layer's expert time for a prompt of ``tokens`` on ``layout``'s MoE workers (evenly routed)
    over its attention block's time on one attention group (ASAP Fig. 3's two curves at batch one)."""
    from moeflow.sim.shape import AttnShape

    m = cost.model
    attn = cost.attention_s(AttnShape.of([(0, tokens, True)], m.index_topk), layout.attn_tp, False)
    moe = cost.experts_s(round(tokens * m.top_k / layout.moe_workers), m.num_experts // layout.moe_workers)
    return moe / attn, (f"attention block {attn * 1e3:.2f} ms on TP{layout.attn_tp}; experts {moe * 1e3:.2f} ms "
                        f"on each of {layout.moe_workers} MoE workers")


def dispatch_latency(cost, layout, tokens: int) -> tuple[float, str]:
    """ASAP's dispatch of ``tokens`` to ``layout``'s MoE workers as the simulator prices it: every worker
    takes its share of the (token, expert) pairs through its own link at once, one link latency."""
    m = cost.model
    pairs = tokens * m.top_k / layout.moe_workers
    t = cost.transfer_s(cost.dispatch_bytes(tokens) / layout.moe_workers)
    return t, (f"{pairs:.0f} pairs x {m.hidden_size * m.act_bytes:.0f} B per worker over its link at "
               f"{cost.link_bw_Bps / 1e9:.0f} GB/s, {cost.hw.link_latency_s * 1e6:.1f} µs latency")
