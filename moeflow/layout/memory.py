"""The memory plan of every mode, written once: what each process of a layout holds (its weights,
the communication buffers it owns, what one cached token costs it) from a model's sizes, and the
KV capacity a per-process budget leaves (vLLM's ``gpu_memory_utilization``, as bytes per
process). The engine (``engine/memory.py``: sizes read from the checkpoint's headers) and the
simulator (``sim/memory.py``: sizes from a model spec) both call it, so they cannot disagree on
what a deployment holds.

Every process gets the same budget; a process with a KV cache gets what its fixed part leaves:

    capacity = min over KV-holding processes of (budget - weights - buffers - reserve) // per_token

so a process that holds no routed experts (an asap attention worker, an afd attention instance)
really fits more requests than a dep rank with the same budget. Per mode: colocated, the whole
model; dep, the attention side (its 1/tp) and its expert slots (1/tp of them); asap, attention
members (1/T of the attention) and MoE workers; afd, attention instances and FFN daemons (with
the gates when they route); dwdp, ranks with their resident experts, and two layers' slots of
pulled ones as buffers. Expert slots are doubled under live rebalancing (its second buffer).
Communication buffers are the receive sides the engine allocates (``comm_spec.py``'s geometry).

The activation reserve, unless given, is what one batch of ``max_batch_tokens`` tokens keeps
alive inside one layer, in the compute dtype: the hidden state, residual, attention output, MoE
input and two temporaries (6 H), the q/k/v projections, K dispatched copies with their expert
intermediates (K (H + 2 F_moe)) and the widest dense or shared MLP intermediate (2 F), plus the
float32 logits of ``max_num_seqs`` sampled rows (prompt logprobs over whole prompts are not
reserved for). It is a stated estimate, not a measurement.
"""
from __future__ import annotations

from dataclasses import dataclass

from moeflow.config import ConfigError
from moeflow.layout.comm_spec import CommSpec

GIB = 1 << 30


@dataclass(frozen=True)
class ModelSizes:
    """What a model's parts occupy, in bytes, as a memory plan needs them."""

    attention_layers: float  # the attention of every layer (norms around it included): split by attention TP
    per_expert: float  # one routed expert over every MoE layer
    routers: float  # every MoE layer's gate
    other: float  # embeddings, LM head, final norm, dense MLPs, shared experts
    num_experts: int
    num_moe_layers: int
    kv_per_token: float  # one cached token, every layer, whole heads
    kv_split: bool  # a TP member holds 1/T of a token's KV (GQA's heads); False: all of it (MLA, DSA)
    hidden_size: int
    top_k: int
    dtype: str  # of the activations and the communication buffers
    act_per_token: float  # activation reserve per batch token (``activation_elements`` x the dtype's bytes)
    vocab_size: int

    def attention_side(self, tp: int = 1) -> float:
        """What an attention process holds besides routed experts (a TP member: 1/tp of the attention)."""
        return self.attention_layers / tp + self.routers + self.other

    def experts(self, count: int) -> float:
        return count * self.per_expert

    def kv_member(self, tp: int) -> float:
        return self.kv_per_token / tp if self.kv_split else self.kv_per_token


def activation_elements(hidden: int, top_k: int, q_size: int, kv_size: int, moe_intermediate: int,
                        widest_mlp: int) -> int:
    """Elements one batch token keeps alive inside one layer (the module docstring's reserve)."""
    return 6 * hidden + q_size + 2 * kv_size + top_k * (hidden + 2 * moe_intermediate) + 2 * widest_mlp


@dataclass(frozen=True)
class Process:
    """One process's fixed bytes and what one cached token costs it (0: it holds no KV cache)."""

    name: str  # e.g. "attention0", "ffn1 (4 expert slots)", "rank2"
    weights: float
    buffers: float = 0.0  # communication buffers it owns (the receive sides)
    kv_per_token: float = 0.0
    role: str = ""  # afd's "attention" or "ffn": a role may run on hardware of its own (a budget of its own)


def comm_spec(layout, num_experts: int, top_k: int, hidden_size: int, dtype: str) -> CommSpec | None:
    """The dispatch/combine geometry of ``layout``'s deployment (None: a mode with no such buffers)."""
    mode = layout.mode
    common = dict(num_experts=num_experts, top_k=top_k, hidden_size=hidden_size, dtype=dtype)
    if mode == "dep":  # each rank writes the one lane of its region in every rank's buffer, and owns one (up to the most)
        return CommSpec(num_regions=layout.expert_capacity, lanes_per_region=1, num_expert_ranks=layout.expert_capacity,
                        max_batch_tokens=layout.max_batch_tokens, shared_ranks=True,
                        max_local_experts=max(len(ids) for ids in layout.experts_held(num_experts)), **common)
    if mode == "asap":  # a region per DP group, a lane per TP member, an expert rank per MoE worker (up to the most)
        return CommSpec(num_regions=layout.attention_capacity, lanes_per_region=layout.attn_tp,
                        num_expert_ranks=layout.expert_capacity, max_batch_tokens=layout.scheduler.max_batch_tokens,
                        max_local_experts=max(len(ids) for ids in layout.experts_held(num_experts)), **common)
    if mode == "afd":  # an instance is a region of one lane in every daemon's buffer, m micro-batches in flight
        s = layout.max_batch_tokens
        # elastic: an expert rank for every daemon it may grow to; daemons that join hold the last one's slots
        return CommSpec(num_regions=layout.attention_capacity, lanes_per_region=1,
                        num_expert_ranks=layout.expert_capacity,
                        max_batch_tokens=s, num_slots=max(2, layout.micro_batches),
                        combine_rows=s if layout.router == "ffn" else 0,
                        max_local_experts=max(len(ids) for ids in layout.experts_held(num_experts)), **common)
    return None


def batch_tokens(layout, default: int) -> int:
    """Most tokens of one batch of ``layout`` (what the reserve is sized for); ``default``: the
    engine's ``max_num_batched_tokens``, for a mode without its own limit."""
    if layout.mode == "asap":
        return layout.scheduler.max_batch_tokens
    return getattr(layout, "max_batch_tokens", default)


def processes(layout, m: ModelSizes, eplb: bool = False, buffers: bool = True) -> list[Process]:
    """Every process of ``layout`` with what it holds; ``eplb``: live rebalancing (a second buffer
    of expert slots); ``buffers``: count the engine's communication buffers (the simulator of an
    NVLink system leaves them to the collective library)."""
    mode = layout.mode
    spec = comm_spec(layout, m.num_experts, m.top_k, m.hidden_size, m.dtype) if buffers else None
    dispatch = spec.dispatch_buffer_bytes if spec else 0
    combine = spec.combine_buffer_bytes if spec else 0

    def experts(name: str, slots: int, tp: int = 1) -> tuple[str, float]:
        if getattr(layout, "num_redundant_experts", 0) or eplb:
            name += f" ({slots} expert slots{', two buffers for live rebalancing' if eplb else ''})"
        return name, m.experts(slots) * (2 if eplb else 1) / tp

    if mode == "colocated":
        return [Process("colocated", m.attention_side() + m.experts(m.num_experts), 0, m.kv_per_token)]
    held = layout.experts_held(m.num_experts)
    if mode == "dep":
        tp = layout.tp
        return [Process(name, m.attention_side(tp) + nbytes, dispatch + combine, m.kv_member(tp))
                for r in range(layout.dp) for name, nbytes in [experts(f"rank{r}", len(held[r]), tp)]]
    if mode == "asap":
        t = layout.attn_tp
        return [*(Process(f"attention{r}", m.attention_side(t), combine, m.kv_member(t))
                  for r in range(layout.num_attention_workers)),
                *(Process(*experts(f"moe{i}", len(held[i])), dispatch) for i in range(layout.moe_workers))]
    if mode == "afd":
        gates = m.routers if layout.router == "ffn" else 0
        return [*(Process(f"attention{i}", m.attention_side(), combine, m.kv_per_token, "attention")
                  for i in range(layout.attn_workers)),
                *(Process(name, nbytes + gates, dispatch, role="ffn") for j in range(layout.ffn_workers)
                  for name, nbytes in [experts(f"ffn{j}", len(held[j]))])]
    if mode == "dwdp":  # resident experts, and two layers' worth of pulled ones (the ping-pong slots)
        return [Process(f"rank{r}", m.attention_side() + m.experts(len(ids)),
                        2 * (m.num_experts - len(set(ids))) * m.per_expert / max(m.num_moe_layers, 1), m.kv_per_token)
                for r, ids in enumerate(held)]
    raise ConfigError(f"memory plan: mode {mode!r} has no processes of its own (a pd deployment's are its instances')")


def reserve(m: ModelSizes, max_batch_tokens: int, max_num_seqs: int) -> float:
    """The default activation reserve (the module docstring), in bytes."""
    return max_batch_tokens * m.act_per_token + max_num_seqs * m.vocab_size * 4


def kv_capacity(procs: list[Process], budget: float, reserve_bytes: float, tokens_per_unit: int = 1,
                per: str = "process", role_budgets: dict[str, float] | None = None) -> int:
    """KV capacity per attention group in units of ``tokens_per_unit`` tokens (a block, or 1) under
    ``budget`` bytes per process (``role_budgets``: a role's own, where it runs on other hardware);
    refuses a process whose fixed part exceeds its budget, with the numbers."""
    def budget_of(p: Process) -> float:
        return (role_budgets or {}).get(p.role, budget)

    for p in procs:
        fixed = p.weights + p.buffers + reserve_bytes
        if fixed > budget_of(p):
            raise ConfigError(
                f"memory budget {budget_of(p) / GIB:g} GiB per {per} is too small for {p.name}: weights "
                f"{p.weights / GIB:.3f} GiB + communication buffers {p.buffers / GIB:.3f} GiB + activation reserve "
                f"{reserve_bytes / GIB:.3f} GiB = {fixed / GIB:.3f} GiB")
    kv = [p for p in procs if p.kv_per_token]
    if not kv:
        raise ConfigError("memory plan: no process holds a KV cache")
    units = min(int((budget_of(p) - p.weights - p.buffers - reserve_bytes) // (p.kv_per_token * tokens_per_unit))
                for p in kv)
    if units < 1:
        tight = min(kv, key=lambda p: budget_of(p) - p.weights - p.buffers)
        raise ConfigError(f"memory budget {budget_of(tight) / GIB:g} GiB per {per} leaves {tight.name} no room for one KV "
                          f"{'block' if tokens_per_unit > 1 else 'token'} ({tight.kv_per_token * tokens_per_unit:g} "
                          f"bytes)")
    return units
