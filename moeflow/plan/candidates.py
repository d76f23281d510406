"""The deployments ``moeflow plan`` considers on N devices, and whether each fits in memory.

Aggregated: dep (DP x TP = N), dwdp (N ranks), asap (D attention groups of T dies and E MoE workers,
D·T + E = N) and afd (M attention instances and N' FFN daemons, M + N' = N, m = 1 or 2 micro-batches).
Disaggregated (pd): every pair of a prefill layout (dep, dwdp, asap) and a decode layout (dep, afd)
that fits in N once each; X prefill and Y decode instances of the pair, X·p + Y·d <= N, come from
rate matching (``plan/pd.py``). A candidate is a config's system entry: what ``simulate``'s YAML
takes and what ``moeflow serve`` runs.

Memory (``sim/memory.py``'s plan, the engine's): every process of a candidate gets the device's
memory times ``mem_fraction``; a candidate fits when every device holds its weights, buffers and
activation reserve and every KV-holding one still has room for one whole request. Its KV blocks
come from that plan, as the engine's ``memory_budget_gib`` would size them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from moeflow.layout import make_layout
from moeflow.sim.memory import GIB, plan_kv
from moeflow.sim.model_spec import ModelSpec

_TP = (1, 2, 4, 8)


@dataclass(frozen=True)
class Candidate:
    name: str
    system: dict  # the system entry of a config (mode, layout fields, engine limits)
    devices: int
    kind: str  # "aggregated" or "pd"
    feasible: bool = True
    reason: str | None = None  # why not, with the numbers
    kv_tokens: dict = field(default_factory=dict)  # per side: one attention group's KV capacity


def aggregated_name(system: dict) -> str:
    """An aggregated layout's candidate name: dep8, dep4_tp2, dwdp8, asap_d3t2e2, afd_6a2f_m2."""
    mode = system["mode"]
    if mode == "dep":
        return f"dep{system['dp']}" + (f"_tp{system['tp']}" if system.get("tp", 1) > 1 else "")
    if mode == "dwdp":
        return f"dwdp{system['dp']}"
    if mode == "asap":
        return f"asap_d{system['attn_dp']}t{system.get('attn_tp', 1)}e{system['moe_workers']}"
    return f"afd_{system['attn_workers']}a{system['ffn_workers']}f_m{system.get('micro_batches', 1)}"


def _aggregated(n: int) -> list[tuple[str, dict]]:
    lays = [{"mode": "dep", "dp": n // tp, **({"tp": tp} if tp > 1 else {})} for tp in _TP if n % tp == 0]
    if n >= 2:
        lays.append({"mode": "dwdp", "dp": n})
    for t in _TP:
        for e in range(1, n):
            if (n - e) % t == 0 and n - e >= t:
                lays.append({"mode": "asap", "attn_dp": (n - e) // t, "attn_tp": t, "moe_workers": e})
    for m in range(1, n):
        for mb in (1, 2):
            topology = {} if m >= n - m else {"topology": "all"}  # fewer instances than daemons: each sees all
            lays.append({"mode": "afd", "attn_workers": m, "ffn_workers": n - m, "micro_batches": mb, **topology})
    return [(aggregated_name(lay), lay) for lay in lays]


def _sides(n: int, modes: tuple[str, ...]) -> list[tuple[str, dict, int]]:
    """(name, layout, devices) of the instance layouts of at most n devices in ``modes``: instance
    sizes of powers of two (and 3), one layout per mode and size (dep without TP; asap with half the
    devices on experts; afd with M:N of 1:1 or 3:1, two micro-batches), so that the search stays near
    a hundred candidates where the whole product would be thousands."""
    out = []
    for size in sorted({1, 3} | {2 ** k for k in range(1, 8)}):
        if size > n:
            break
        lays = [(f"dep{size}", {"mode": "dep", "dp": size})]
        if size >= 2:
            lays.append((f"dwdp{size}", {"mode": "dwdp", "dp": size}))
            e = size // 2
            lays.append((f"asap_d{size - e}e{e}", {"mode": "asap", "attn_dp": size - e, "moe_workers": e}))
            for f in {size // 2, size // 4} - {0}:
                if size - f >= f:
                    lays.append((f"afd_{size - f}a{f}f", {"mode": "afd", "attn_workers": size - f, "ffn_workers": f,
                                                          "micro_batches": 2}))
        out += [(name, lay, size) for name, lay in lays if lay["mode"] in modes]
    return out


def _disaggregated(n: int) -> list[tuple[str, dict]]:
    """Every (prefill layout, decode layout) pair that fits in n devices once each; the instance
    counts come from rate matching (``plan/pd.py``)."""
    return [(f"pd_{pname}_{dname}", {"mode": "pd", "prefill": play, "decode": dlay})
            for pname, play, p in _sides(n - 1, ("dep", "dwdp", "asap"))
            for dname, dlay, d in _sides(n - p, ("dep", "afd"))]


def _layout(system: dict):
    """The layout of a candidate's (or a pd side's) system entry: its fields, not its hardware."""
    return make_layout(system["mode"], **{k: v for k, v in system.items() if k not in ("mode", "hardware")})


def side_devices(layout: dict) -> int:
    return _layout(layout).num_processes


def enumerate_candidates(n: int, kinds: tuple[str, ...] = ("aggregated", "pd")) -> list[Candidate]:
    """Every aggregated deployment of exactly ``n`` devices and every pd pair of at most ``n``, each once."""
    out = []
    if "aggregated" in kinds:
        out += [Candidate(name, lay, n, "aggregated") for name, lay in _aggregated(n)]
    if "pd" in kinds:
        out += [Candidate(name, lay, side_devices(lay["prefill"]) + side_devices(lay["decode"]), "pd")
                for name, lay in _disaggregated(n)]
    names = [c.name for c in out]
    assert len(names) == len(set(names)), "candidate names must be unique"
    for c in out:
        if c.kind == "aggregated":
            assert side_devices(c.system) == n, (c.name, n)
        else:
            assert c.devices <= n, (c.name, n)
    return out


def memory_fit(q, m: ModelSpec, choice, hw, isl: int) -> Callable[[Candidate], Candidate]:
    """``check_memory`` as the plan applies it to every candidate of question ``q``: requests of
    prompts up to ``isl`` long, on ``hw`` (None: a profiled host, nothing to check)."""
    def fit(c: Candidate) -> Candidate:
        return check_memory(with_batch_tokens(c, q.max_batch_tokens), m, hw.hbm_bytes if hw else 0.0,
                            q.mem_fraction, isl + q.osl, max_batch_tokens=q.max_batch_tokens or max(8192, isl),
                            max_num_seqs=256, block_size=16, hbm_of=choice.hbm_bytes if choice else None)
    return fit


def candidates_for(q, m: ModelSpec, choice, hw, isl: int) -> list[Candidate]:
    """Every deployment of ``q.devices`` devices in ``q.kinds`` (and beside each whose roles the
    hardware choice moves, the same there), each checked for memory (``memory_fit``)."""
    fit = memory_fit(q, m, choice, hw, isl)
    return [fit(c) for c in with_hardware(enumerate_candidates(q.devices, q.kinds),
                                          choice.roles_for if choice else lambda mode: {})]


def with_batch_tokens(c: Candidate, n: int | None) -> Candidate:
    """``c`` with every layout's batch limit at ``n`` tokens (None: each mode's default)."""
    if n is None:
        return c
    if c.kind == "pd":
        system = {**c.system, "prefill": {**c.system["prefill"], "max_batch_tokens": n},
                  "decode": {**c.system["decode"], "max_batch_tokens": n}}
    else:
        system = {**c.system, "max_batch_tokens": n}
    return Candidate(c.name, system, c.devices, c.kind, c.feasible, c.reason, c.kv_tokens)


def with_hardware(cands: list[Candidate], roles_for) -> list[Candidate]:
    """Every candidate, and beside each whose mode has roles that ``roles_for(mode)`` puts on other
    hardware, the same layout with them there (``name@attention=h200``): the search prices both."""
    out = []
    for c in cands:
        out.append(c)
        roles = roles_for(c.system["mode"])
        if roles:
            tag = ",".join(f"{r}={p}" for r, p in sorted(roles.items()))
            out.append(Candidate(f"{c.name}@{tag}", {**c.system, "hardware": dict(roles)}, c.devices, c.kind,
                                 c.feasible, c.reason, c.kv_tokens))
    return out


def check_memory(c: Candidate, m: ModelSpec, device_bytes: float, mem_fraction: float, request_tokens: int,
                 max_batch_tokens: int, max_num_seqs: int, block_size: int, hbm_of=None) -> Candidate:
    """``c`` with its KV blocks sized from the memory plan, or marked infeasible with the reason.
    ``hbm_of(preset)``: a preset's memory, for a candidate whose roles run on hardware of their own
    (each role's budget ``mem_fraction`` of its own device)."""
    if not device_bytes:
        return c  # the hardware preset gives no memory: nothing to check, the engine's default blocks
    roles = c.system.get("hardware") or {}
    sides = {"prefill": c.system["prefill"], "decode": c.system["decode"]} if c.kind == "pd" else {"": c.system}
    kv, engine = {}, {}
    for side, sys in sides.items():
        lay = _layout(sys)
        where = f"{side} instance: " if side else ""
        own = device_bytes if side not in roles else hbm_of(roles[side])
        budget = own * mem_fraction
        by_role = {r: hbm_of(p) * mem_fraction for r, p in roles.items()} if c.kind != "pd" and roles else None
        try:
            plan = plan_kv(m, lay, budget, max_batch_tokens, max_num_seqs, hbm_bytes=own, role_budgets=by_role)
        except ValueError as e:
            return _infeasible(c, where + str(e))
        if plan.kv_tokens < request_tokens:
            return _infeasible(c, f"{where}KV room for {plan.kv_tokens} tokens per attention group, "
                                  f"one request needs {request_tokens} (budget {budget / GIB:.1f} GiB per device)")
        kv[side or "all"] = plan.kv_tokens
        engine[side or "all"] = plan.kv_tokens // block_size
    blocks = min(engine.values())  # the engine's one num_kv_blocks for every instance of the deployment
    system = {**c.system, "engine": {"num_kv_blocks": blocks, "kv_block_size": block_size,
                                     "max_num_seqs": max_num_seqs}}
    return Candidate(c.name, system, c.devices, c.kind, True, None, kv)


def _infeasible(c: Candidate, reason: str) -> Candidate:
    return Candidate(c.name, c.system, c.devices, c.kind, False, reason)
