"""The measured split beside each row of the seed tables (``seed_tables.py``): where the simulated
time goes at the row's operating point, read from the same results the row's number comes from (or
computed by the same cost model), so that a row outside its tolerance carries what explains it."""
from __future__ import annotations


def pct(x: float) -> str:
    return f"{x * 100:.0f}%"


def point(system: dict, rps: float) -> dict:
    return next(p for p in system["points"] if p["rps"] == rps)


def device_time(p: dict) -> str:
    """How a system's devices spent the run at point ``p``: a synchronous rank's wall time by activity
    (``sim_split``), else each role's computing share."""
    s = p.get("sim_split")
    if s:
        idle = max(0.0, 1 - sum(s.values()))
        return (f"a rank: attention {pct(s['attention'])}, experts {pct(s['ffn'])}, all-to-all "
                f"{pct(s['transport'])}, barrier wait {pct(s['wait'])}, idle {pct(idle)}")
    return ", ".join(f"{role} devices computing {pct(v)}" for role, v in p["sim_busy"].items())


def ttft_parts(p: dict, buckets: list[dict] | None = None) -> str:
    """Mean TTFT over ``buckets`` (all of ``p``'s) as queue + compute + the rest (transfers, waits at
    barriers, launches), each a count-weighted mean."""
    bs = [b for b in (buckets if buckets is not None else p["buckets"]) if b["count"]]
    n = sum(b["count"] for b in bs)

    def mean(k: str) -> float:
        return sum(b[k] * b["count"] for b in bs) / n * 1e3
    return (f"TTFT {mean('ttft_mean_s'):.0f} ms = queue {mean('queue_mean_s'):.0f} + compute "
            f"{mean('compute_mean_s'):.0f} + transfers and waits {mean('other_mean_s'):.0f}")


def at_rate(system: dict, rps: float) -> str:
    p = point(system, rps)
    return f"at {rps:g} rps: {device_time(p)}; {ttft_parts(p)}"


def block_split(cost, total: int = 32768, n: int = 32) -> str:
    """One layer's attention block at 1 x ``total`` and ``n`` x total/n tokens, by part (ASAP Fig. 5)."""
    from moeflow.sim.attention_cost import attention_parts
    from moeflow.sim.shape import AttnShape

    def parts(spans) -> dict:
        return attention_parts(cost, AttnShape.of(spans, cost.model.index_topk), 1, False)
    one, many = parts([(0, total, True)]), parts([(0, total // n, True)] * n)
    return "; ".join(f"{k} {one[k] * 1e3:.2f} / {many[k] * 1e3:.2f} ms" for k in one
                     if one[k] or many[k]) + f" (1x{total // 1024}k / {n}x{total // n // 1024}k)"


def experts_split(cost, ep: int, tokens: int, per_rank: bool = False) -> str:
    """One MoE layer on one of ``ep`` expert devices for a batch of ``tokens`` (top-k routed, uniform;
    ``per_rank``: ``tokens`` on every one of the ``ep`` ranks): the weights' read against the FLOPs (the
    cost model's roofline takes the longer), and the batch at which the FLOPs pass the read."""
    m, hw, roof = cost.model, cost.hw, cost.roof
    local = m.num_experts // ep

    def parts(s: int) -> tuple[float, float]:
        flops, nbytes = cost.experts_work(max(1, round(s * m.top_k / (1 if per_rank else ep))), local)
        return (roof.op_s(0.0, nbytes, cost.expert_low, fp4=cost.expert_fp4) - hw.launch_s,
                roof.op_s(flops, 0.0, cost.expert_low, fp4=cost.expert_fp4) - hw.launch_s)
    read, comp = parts(tokens)
    cross = next((s for s in range(tokens, 1 << 20, 1 if per_rank else 64) if parts(s)[1] >= parts(s)[0]), None)
    return (f"at {tokens} tokens: the weights' read {read * 1e6:.0f} µs, the FLOPs {comp * 1e6:.0f} µs "
            f"(at gemm_eff {hw.gemm_eff:g} of the peak), launch {hw.launch_s * 1e6:.0f} µs; the FLOPs pass the "
            f"read at {cross} tokens")


def dwdp_point(row: dict, dep: str = "dep4_dedup", dwdp: str = "dwdp4", ranks: int = 4) -> str:
    """A saturation point of DEP against DWDP: what a DEP rank does besides computing, and how much of
    its time a DWDP rank's copy engine pulls and the rank waits on it."""
    a, b = row[dep], row[dwdp]
    s = a.get("sim_split")
    dep_txt = (f"DEP{ranks} rank: computes {pct(s['attention'] + s['ffn'])}, all-to-all {pct(s['transport'])}, "
               f"barrier wait {pct(s['wait'])}" if s else f"DEP{ranks} rank computes {pct(a['sim_busy']['rank'])}")
    bb = b["sim_busy"]
    return (f"{dep_txt}; DWDP{ranks} rank computes {pct(bb['rank'])}, its copy engine pulls "
            f"{pct(bb['copy_engine'])}, waits on pulls {pct(bb['pull_wait'])}")


def roofline_split(points: list[dict], isls: tuple[int, ...]) -> str:
    by = {p["isl"]: p for p in points}
    return "; ".join(f"ISL {i // 1024}K: compute {by[i]['compute_s'] * 1e3:.2f} ms, pull {by[i]['prefetch_s'] * 1e3:.2f} ms"
                     for i in isls if i in by)


def copy_split(cost) -> str:
    m = cost.model
    nbytes = m.num_experts * m.expert_bytes
    t = cost.device_copy_s(nbytes)
    return (f"{m.num_experts} experts x {m.expert_bytes / 1e6:.1f} MB = {nbytes / 1e9:.2f} GB copied in "
            f"{t * 1e6:.0f} µs ({nbytes / t / 1e12:.2f} TB/s); 34 µs at that rate copies {nbytes / t * 34e-6 / 1e9:.2f} GB")


def three_factors(afd: dict, dep: dict) -> str:
    """FastAFD's own decomposition of a per-GPU speed-up (§6): resident requests per attention device x
    step-time ratio x the attention devices' share of all devices."""
    b = afd["batch_per_group"] / dep["batch_per_group"]
    t = dep["tpot_s"] / afd["tpot_s"]
    share = (afd["groups"] / afd["devices"]) / (dep["groups"] / dep["devices"])
    return (f"B {afd['batch_per_group']} vs {dep['batch_per_group']} ({b:.2f}) x TPOT {dep['tpot_s'] * 1e3:.1f} / "
            f"{afd['tpot_s'] * 1e3:.1f} ms ({t:.2f}) x attention devices {afd['groups']}/{afd['devices']} vs "
            f"{dep['groups']}/{dep['devices']} ({share:.3f}) = {b * t * share:.2f}")


def afd_busy(r: dict) -> str:
    """Who computes how much of a step; a daemon's seconds are its experts op, once per micro-batch
    (decode reads every weight each time), so they bound the step from below."""
    daemon_ms = r["busy"]["ffn"] * r["tpot_s"] * 1e3
    return (f"instances computing {pct(r['busy']['attention'])}, daemons {pct(r['busy']['ffn'])} "
            f"(a daemon's experts: {daemon_ms:.1f} ms a step)")


def kv_split(r: dict, ctx: int) -> str:
    """A colocated rank's memory: its weights beside the KV cache that sets the batch at ``ctx``."""
    dev, mem = r["memory"]["devices"][0], r["memory"]
    return (f"a rank: {mem['budget_gib']:.1f} GiB = weights {dev['weights_gib']:.1f} + KV {dev['kv_cache_gib']:.1f} "
            f"({mem['kv_tokens']:,} tokens; the paper's per-rank limit: 808,704) / {ctx} per request")
