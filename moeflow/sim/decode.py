"""Steady-state decode in the simulator: what ``moeflow bench decode`` measures, for a deployment we
do not have. The same YAML drives both (a decode experiment, ``experiment/decode.py``, with ``hardware:``).

Per (system, context): B requests per attention group, B from the memory budget (``memory.py``:
what the device's budget leaves for KV after the weights it holds and the activation reserve),
arrive at once with ``context``-token prompts; the engine's own scheduler prefills them and they
decode. The window is ``steps`` consecutive steps in which every request decodes one token, after
``warmup_steps`` such steps. TPOT = the window / steps; decode tokens/s per device = all requests /
TPOT / devices. Only the step systems (dep, afd) are measured this way.

FastAFD's factors come out of any (afd, baseline) pair whose baseline runs one attention group per
device: speed-up = (B_afd / B_base) · (T_base / T_afd) · M / (M + N). The same pair is also fed to
the closed form of ``moeflow predict afd`` (``predict/afd.py``): the baseline's simulated TPOT,
B and step split stand for its measured profile, the cost model's experts op for the stage profile.
"""
from __future__ import annotations

import dataclasses

from moeflow.layout.memory import batch_tokens
from moeflow.measure.workload import WorkloadRequest
from moeflow.scheduler.pool import resident_capacity
from moeflow.sim.hardware import hardware_preset
from moeflow.sim.memory import GIB, plan_kv, role_budgets
from moeflow.sim.prices import cost_per_hour, role_devices, unpriced

STEP_MODES = ("dep", "afd")


def simulate_decode(spec, cost, context: int, steps: int, warmup: int, hbm_bytes: float = 0.0,
                    batch: int | None = None) -> dict:
    """One system's steady-state decode at ``context``: B, TPOT, tokens/s per device, the step split.
    ``batch``: resident requests in all, as ``bench decode``'s (None: what each group's KV holds, each
    request reserving its context and the window; ``bench decode`` also reserves what a request decodes
    while its group's others prefill, so it holds a few percent fewer)."""
    from moeflow.sim.run import make_system

    layout, e = spec.layout, spec.engine
    if layout.mode not in STEP_MODES:
        raise ValueError(f"system {spec.name!r}: the simulator measures decode for {STEP_MODES}, not {layout.mode!r}")
    gen = warmup + steps + 4  # the window, the warm-up and the steps in flight at either end
    plan, blocks, capacity, b = _batch(spec, cost, context + gen, hbm_bytes, batch)
    # NOTE: prefill is not what is measured: each group prefills all its requests in one step (the
    # batch limit raised for that), so the window starts at once and the simulation stays short.
    # The memory plan above used the layout's own limit; decode steps are far below either.
    one_step = dataclasses.replace(layout, max_batch_tokens=b * (context + gen), chunked_prefill_size=None)
    engine = dataclasses.replace(e, num_kv_blocks=blocks, max_model_len=context + gen)
    sim = make_system(dataclasses.replace(spec, layout=one_step, engine=engine), cost)
    sim.step_log = []
    total = b * layout.num_groups
    sim.run([WorkloadRequest(0.0, context, gen)] * total)
    log = sim.step_log
    full = [i for i, (_, works, _) in enumerate(log)
            if sum(len(bt.seqs) for w in works for bt in w.batches) == total
            and all(s.num_tokens == 1 for w in works for bt in w.batches for s in bt.seqs)]
    if len(full) < warmup + steps + 1 or full[warmup + steps] - full[warmup] != steps:
        raise RuntimeError(f"system {spec.name!r}: no window of {steps} full decode steps after {warmup} (got {len(full)})")
    i, j = full[warmup], full[warmup + steps]
    wall = log[j][0] - log[i][0]
    tpot = wall / steps
    devices = layout.num_processes
    acc0, acc1 = log[i][2], log[j][2]
    busy = {r: (acc1[r] - acc0[r]) / (sim.num_entities[r] * wall) for r in sim.num_entities}
    split = {k: (acc1[k] - acc0[k]) / (layout.num_groups * wall) for k in sim.split_s}
    return {"system": spec.name, "mode": layout.mode, "context": context, "batch_per_group": b,
            "groups": layout.num_groups, "devices": devices, "tpot_s": tpot, "tok_s_per_device": total / tpot / devices,
            "capacity_per_group": capacity, "busy": busy, "split": split, "decode_tokens_per_request": gen,
            "memory": plan.to_dict(), **_priced(spec, cost, total / tpot)}


def _priced(spec, cost, tok_s: float) -> dict:
    """The devices per hardware preset, and where every preset has a default price, USD per hour and
    output tokens per USD (sim/prices.py)."""
    hw = getattr(cost, "hw", None)
    if hw is None:
        return {}
    by_preset = role_devices(spec.layout, dict(spec.hardware), hw.name)
    out = {"devices_by_hardware": by_preset}
    if not unpriced(by_preset, {}):
        usd = cost_per_hour(by_preset, {})
        out.update(usd_per_hour=usd, tokens_per_usd=tok_s * 3600 / usd)
    return out


def _batch(spec, cost, tokens: int, hbm_bytes: float, batch: int | None):
    """(the memory plan, KV blocks per group, requests of ``tokens`` each group holds, B per group)."""
    layout, e = spec.layout, spec.engine
    if e.memory_budget_gib is None:
        raise ValueError(f"system {spec.name!r}: decode needs engine.memory_budget_gib (B comes from the budget)")
    reserve = None if e.activation_reserve_gib is None else e.activation_reserve_gib * GIB
    budget = e.memory_budget_gib * GIB
    roles = role_budgets(spec, budget, lambda name: hbm_bytes if name is None else hardware_preset(name).hbm_bytes)
    plan = plan_kv(cost.model, layout, budget, batch_tokens(layout, 16384), e.max_num_seqs, reserve,
                   hbm_bytes, cost.engine_buffers, roles)
    blocks = plan.kv_tokens // e.kv_block_size
    b = capacity = resident_capacity(blocks, e.kv_block_size, tokens, e.max_num_seqs)
    if b < 1:
        raise ValueError(f"system {spec.name!r}: the KV cache ({plan.kv_tokens} tokens) holds no request of "
                         f"{tokens} tokens")
    if batch is not None:
        if batch % layout.num_groups or batch // layout.num_groups > b:
            raise ValueError(f"system {spec.name!r}: batch {batch} must split evenly over its {layout.num_groups} "
                             f"groups and fit their KV caches ({b} each at context {tokens})")
        b = batch // layout.num_groups
    return plan, blocks, capacity, b


def simulate_handed_decode(spec, cost, context: int, steps: int, hbm_bytes: float = 0.0,
                           batch: int | None = None) -> dict:
    """Decode of any mode from KV handed over (pd's decode side): B requests per attention group land
    at once with ``context`` tokens of KV and their first token, and decode ``steps`` more each
    through the mode's own scheduler and system; TPOT = the mean of theirs. No prefill runs, so no
    window has to wait for the last prompt (a closed batch that prefills first has none where every
    request decodes: its early requests finish before its last is prefilled); what prefill does to
    decode in an aggregated deployment is left to the time it takes of each (``plan/estimate.py``)."""
    from moeflow.core import Request, SamplingParams
    from moeflow.sim.run import make_system
    from moeflow.sim.system import _Track

    layout, e = spec.layout, spec.engine
    gen = steps + 1
    plan, blocks, capacity, b = _batch(spec, cost, context + gen, hbm_bytes, batch)
    engine = dataclasses.replace(e, num_kv_blocks=blocks, max_model_len=context + gen)
    sim = make_system(dataclasses.replace(spec, engine=engine), cost)
    port = sim.handoff_port()
    total = b * layout.num_groups
    for i in range(total):
        r = Request(f"h{i}", range(context), SamplingParams(max_tokens=gen, ignore_eos=True), 0.0, output_token_ids=[0])
        gid = port.room(r)
        if gid is None:
            raise RuntimeError(f"system {spec.name!r}: no group has room for handed-over request {i} of {total}")
        port.reserve(gid, r)
        sim.track[r.request_id] = _Track(0.0, 0.0, 0.0, 0.0, gen)
        port.arrive(r)
    sim._pending = total
    sim.poke()
    sim.loop.run(None)
    if len(sim.records) != total:
        raise RuntimeError(f"system {spec.name!r}: {len(sim.records)} of {total} handed-over requests decoded")
    tpot = sum(r.tpot_s for r in sim.records) / total
    return {"system": spec.name, "mode": layout.mode, "context": context, "batch_per_group": b,
            "groups": layout.num_groups, "devices": layout.num_processes, "tpot_s": tpot,
            "tok_s_per_device": total / tpot / layout.num_processes, "capacity_per_group": capacity,
            "decode_tokens_per_request": gen, "memory": plan.to_dict()}


def factors(afd: dict, base: dict, layout) -> dict:
    """FastAFD's three factors of ``afd`` over ``base`` (both ``simulate_decode`` results)."""
    b_ratio, t_ratio = afd["batch_per_group"] / base["batch_per_group"], base["tpot_s"] / afd["tpot_s"]
    node = layout.attn_workers / (layout.attn_workers + layout.ffn_workers)
    return {"b_ratio": b_ratio, "t_ratio": t_ratio, "node_factor": node, "speedup": b_ratio * t_ratio * node,
            "tok_s_ratio": afd["tok_s_per_device"] / base["tok_s_per_device"]}


def closed_form(afd: dict, base: dict, layout, cost) -> dict:
    """``moeflow predict afd`` on the same inputs: the simulated baseline as its profile."""
    from moeflow.predict.afd import Baseline, predict

    m = cost.model
    sp = base["split"]
    baseline = Baseline(base["tpot_s"], base["batch_per_group"], sp["attention"], sp["ffn"], sp["transport"], 0.0)
    local = len(layout.experts_held(m.num_experts)[0])
    grid = sorted({round(1.5 ** k) for k in range(40)})  # 1 .. ~1e7 routed pairs
    profile = {"experts": {str(local): [[p, cost.experts_s(p, local)] for p in grid]}}
    pred = predict(baseline, profile, m=layout.micro_batches, attn_workers=layout.attn_workers,
                   ffn_workers=layout.ffn_workers, served=len(layout.served_by(0)), local_experts=local,
                   b_afd=afd["batch_per_group"], num_layers=m.num_layers, num_moe_layers=m.num_moe_layers,
                   top_k=m.top_k, overlap_scheduling=layout.overlap_scheduling, pair_share=1 / len(layout.ffns_of(0)))
    # FastAFD's own predictor: T_AFD taken as the baseline profile's attention-only step (§6)
    fastafd = pred.b_ratio * pred.t_base_s / pred.fastafd_t_afd_s * pred.node_factor
    return {**pred.to_dict(), "fastafd_speedup": fastafd}


def against_measured(results: dict, measured: dict) -> list[dict]:
    """Simulated (at the measured B) vs a ``bench decode`` result of the same file: per system and
    context, B per group measured and what the simulator's memory plan holds, TPOT and decode tokens/s
    per process (device), the error against the measured mean and whether it falls inside the
    measured 95% interval."""
    rows = []
    for name, by_ctx in results.items():
        for c, sim in by_ctx.items():
            meas = measured.get("results", {}).get(name, {}).get(str(c))
            if meas is None:
                continue
            tok, tpot = meas["tok_s_per_process"], meas["tpot_s"]
            lo, hi = tok["ci95"]
            rows.append({"system": name, "context": c, "b_measured": meas["resident_per_group"],
                         "b_plan": sim["capacity_per_group"], "tpot_measured_s": tpot["mean"],
                         "tpot_simulated_s": sim["tpot_s"], "tok_s_measured": tok["mean"], "tok_s_ci95": [lo, hi],
                         "tok_s_simulated": sim["tok_s_per_device"],
                         "error": sim["tok_s_per_device"] / tok["mean"] - 1,
                         "inside": lo <= sim["tok_s_per_device"] <= hi})
    return rows


def against_best(results: dict, systems: dict, contexts) -> dict:
    """Every afd system against the best colocated (dep) system of the run at each context: the one
    with the most decode tokens/s per device, whatever its EP size (a result that holds only against a
    hand-picked baseline is no result)."""
    deps = [n for n in results if systems[n].layout.mode == "dep"]
    out = {}
    for c in contexts:
        if not deps:
            break
        top = max(deps, key=lambda n: results[n][c]["tok_s_per_device"])
        for a in (n for n in results if systems[n].layout.mode == "afd"):
            ratio = results[a][c]["tok_s_per_device"] / results[top][c]["tok_s_per_device"]
            out.setdefault(a, []).append({"context": c, "best": top, "tok_s_ratio": ratio})
            print(f"{a} / the best colocated ({top}) at {c}: tokens/s per device x{ratio:.2f}")
    return out


def run_decode(path: str, names: list[str] | None = None, measured: dict | None = None) -> dict:
    """``moeflow simulate --config DECODE.yaml``: every system at every context, the pairs compared;
    with ``measured`` (``--compare-with``, a ``bench decode`` result), the error against it."""
    from moeflow.experiment.decode import load_decode_experiment
    from moeflow.sim import symmetry
    from moeflow.sim.run import build_cost

    exp = load_decode_experiment(path)
    cost = build_cost(exp)
    hbm = getattr(getattr(cost, "hw", None), "hbm_bytes", 0.0)
    names = names or list(exp.systems)
    if measured is not None:
        names = [n for n in names if n in measured.get("results", {})
                 and exp.systems[n].layout.mode in STEP_MODES]
        if not names:
            raise ValueError(f"--compare-with: none of its systems {sorted(measured.get('results', {}))} is a "
                             f"{'/'.join(STEP_MODES)} system of {path}")
    def batch(n: str, c: int) -> int | None:  # against a measurement: at the B it ran
        return measured["results"][n][str(c)]["batch"] if measured is not None else exp.batch
    print(symmetry.report(symmetry.differences({n: exp.systems[n] for n in names})))
    results = {n: {c: simulate_decode(exp.systems[n], cost, c, exp.steps, exp.warmup_steps, hbm, batch(n, c))
                   for c in exp.contexts} for n in names}
    priced = any("tokens_per_usd" in r for rs in results.values() for r in rs.values())
    print(f"{'system':>16} {'context':>8} {'B/group':>8} {'TPOT ms':>8} {'tok/s/device':>13}"
          + (f" {'Mtok/USD':>9}" if priced else "") + "  busy")
    for n in names:
        for c, r in results[n].items():
            busy = ", ".join(f"{k} {v:.0%}" for k, v in r["busy"].items())
            usd = f" {r['tokens_per_usd'] / 1e6:>9.3f}" if "tokens_per_usd" in r else f" {'-':>9}" if priced else ""
            print(f"{n:>16} {c:>8} {r['batch_per_group']:>8} {r['tpot_s'] * 1e3:>8.2f} {r['tok_s_per_device']:>13.1f}"
                  f"{usd}  {busy}")
    compared = {}
    for a, b in exp.compare:
        if a not in results or b not in results:
            continue
        layout = exp.systems[a].layout
        for c in exp.contexts:
            ra, rb = results[a][c], results[b][c]
            row = {"context": c, "simulated": factors(ra, rb, layout) if layout.mode == "afd" else
                   {"tok_s_ratio": ra["tok_s_per_device"] / rb["tok_s_per_device"]}}
            if layout.mode == "afd" and exp.systems[b].layout.mode == "dep":
                row["closed_form"] = closed_form(ra, rb, layout, cost)
            compared.setdefault(f"{a}/{b}", []).append(row)
            f = row["simulated"]
            line = f"{a} / {b} at {c}: tokens/s per device x{f['tok_s_ratio']:.2f}"
            if "b_ratio" in f:
                line += f" = B {f['b_ratio']:.2f} x T {f['t_ratio']:.2f} x M/(M+N) {f['node_factor']:.2f}"
            if "closed_form" in row:
                p = row["closed_form"]
                line += (f"; predict afd: x{p['speedup']:.2f} (T {p['t_ratio']:.2f}"
                         f"{'' if p['overlap_holds'] else ', overlap fails'}), {p['speedup'] / f['tok_s_ratio'] - 1:+.1%}; "
                         f"attention-only T: x{p['fastafd_speedup']:.2f}, {p['fastafd_speedup'] / f['tok_s_ratio'] - 1:+.1%}")
            print(line)
    best = against_best(results, exp.systems, exp.contexts)
    out = {"model": exp.model, "hardware": exp.target.hardware, "steps": exp.steps, "warmup_steps": exp.warmup_steps,
           "results": {n: {str(c): r for c, r in rs.items()} for n, rs in results.items()}, "compare": compared,
           "against_best": best}
    if measured is not None:
        out["measured_commit"] = (measured.get("provenance") or {}).get("commit")
        out["against_measured"] = rows = against_measured(results, measured)
        print(f"\n{'system':>16} {'context':>8} {'B meas/plan':>11} {'TPOT ms meas/sim':>17} "
              f"{'tok/s/process measured [95%]':>30} {'simulated':>10} {'error':>7}")
        for r in rows:
            lo, hi = r["tok_s_ci95"]
            print(f"{r['system']:>16} {r['context']:>8} {r['b_measured']:>5g}/{r['b_plan']:<5g} "
                  f"{r['tpot_measured_s'] * 1e3:>8.1f}/{r['tpot_simulated_s'] * 1e3:<8.1f} "
                  f"{r['tok_s_measured']:>12.1f} [{lo:.1f}, {hi:.1f}]{'':>4} {r['tok_s_simulated']:>10.1f} "
                  f"{r['error']:>+7.1%}{'' if r['inside'] else ' (outside)'}")
    return out
