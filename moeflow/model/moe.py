"""The layer-oblivious experts op (one stack, or several stacks without merging them), and its
loop-over-experts oracle. The gate: ``model/gate.py``.

Expert weights of all MoE layers sit in two stacked tensors, so "the experts of layer l" is an
index, not a Python object: a MoE worker runs whatever layer arrives with the same code path.

Shape legend: T tokens, K experts per token, P = T*K (token, expert) pairs, H hidden,
F expert intermediate size, Lm MoE layers held, El experts held locally.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F



class ExpertIndex:
    """Global expert ids -> this process's local order (what ``plan_pairs`` groups by)."""

    def __init__(self, expert_ids: tuple[int, ...]):
        self.expert_ids = tuple(expert_ids)
        lut = [-1] * (max(self.expert_ids, default=-1) + 1)
        for i, e in enumerate(self.expert_ids):
            lut[e] = i
        self._lut = lut
        self._on: dict[torch.device, torch.Tensor] = {}  # the table on each device it was asked on

    def local_ids(self, global_ids: torch.Tensor) -> torch.Tensor:
        """Map global expert ids to local ones; -1 where this process does not hold the expert."""
        lut = self._on.get(global_ids.device)
        if lut is None:  # [max id + 1] int64, -1 where not held
            lut = self._on[global_ids.device] = torch.tensor(self._lut, dtype=torch.int64, device=global_ids.device)
        inside = global_ids < lut.numel()
        return torch.where(inside, lut[global_ids.clamp(max=lut.numel() - 1)], -1)


@dataclass
class ExpertWeights:
    """Routed experts of the MoE layers this process holds.

    ``layer_ids`` lists the model layers held; ``expert_ids`` the global expert id of each local
    slot, in local order: one tuple for every layer alike, or one tuple per held layer (a placement
    with redundant experts puts different experts in a slot at different layers). Either may be a
    subset (a MoE worker loads only what it owns).
    """

    w13: torch.Tensor  # [Lm, El, 2F, H] gate rows then up rows
    w2: torch.Tensor  # [Lm, El, H, F]
    layer_ids: tuple[int, ...]  # model layer id of each stacked entry
    expert_ids: tuple[int, ...] | tuple[tuple[int, ...], ...]  # global expert id of each local slot

    def __post_init__(self) -> None:
        self._layer_slot = {lid: i for i, lid in enumerate(self.layer_ids)}
        per_layer = bool(self.expert_ids) and isinstance(self.expert_ids[0], tuple)
        self.slots = tuple(self.expert_ids) if per_layer else (tuple(self.expert_ids),) * len(self.layer_ids)
        if len(self.slots) != len(self.layer_ids) or len({len(s) for s in self.slots}) > 1:
            raise ValueError(f"ExpertWeights: {len(self.layer_ids)} layers need as many slot lists of one length, "
                             f"got {[len(s) for s in self.slots]}")
        # layer 0's lookup (plan_pairs); where slots differ by layer, workers.dispatch.ExpertRoutes routes
        self.index = ExpertIndex(self.slots[0] if self.slots else ())

    @property
    def num_local(self) -> int:
        return len(self.slots[0]) if self.slots else 0

    def layer_slot(self, layer: int) -> int:
        try:
            return self._layer_slot[layer]
        except KeyError:
            raise KeyError(f"experts of layer {layer} are not held here (held: {self.layer_ids})") from None

    def local_ids(self, global_ids: torch.Tensor) -> torch.Tensor:
        return self.index.local_ids(global_ids)


def experts_grouped(w: ExpertWeights, layer: int, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Run the experts of ``layer`` on rows already grouped by local expert.

    x_sorted: [N, H], rows of local expert 0 first, then 1, ...; counts: [El] int rows per expert.
    Returns [N, H] in the same order. One grouped GEMM per projection, no per-expert Python loop.
    """
    slot = w.layer_slot(layer)
    return grouped(w.w13[slot], w.w2[slot], x_sorted, counts)


def grouped(w13: torch.Tensor, w2: torch.Tensor, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """One stack of experts: w13 [El, 2F, H], w2 [El, H, F]; x_sorted [N, H] grouped by expert, counts [El]."""
    if not _grouped_mm_aligned(w13, w2):
        return _loop(w13, w2, x_sorted, counts)
    offs = torch.cumsum(counts, 0).to(torch.int32)  # [El]
    gate_up = F.grouped_mm(x_sorted, w13.transpose(-2, -1), offs=offs)  # [N, 2F]
    f = w2.shape[-1]
    h = F.silu(gate_up[:, :f]) * gate_up[:, f:]  # [N, F]
    return F.grouped_mm(h, w2.transpose(-2, -1), offs=offs)  # [N, H]


def experts_list(parts: list[tuple[torch.Tensor, torch.Tensor]], x_sorted: torch.Tensor,
                 counts: torch.Tensor) -> torch.Tensor:
    """One layer's experts whose weights sit in several stacks (DWDP: resident, then pulled), run
    stack by stack on their own rows, never copied into one buffer. parts: [(w13 [El_i, 2F, H],
    w2 [El_i, H, F])] in local order; counts: [sum El_i] rows per local expert."""
    out = torch.empty_like(x_sorted)  # [N, H]
    sizes = [w13.shape[0] for w13, _ in parts]
    lasts = [sum(sizes[:i + 1]) - 1 for i, n in enumerate(sizes) if n]  # each non-empty stack's last expert
    # NOTE: the layer's one read-back (not one per stack): where each stack's rows end
    ends = iter(torch.cumsum(counts, 0)[lasts].tolist() if lasts else [])
    row = first = 0
    for (w13, w2), size in zip(parts, sizes):
        if not size:
            continue
        end = next(ends)
        if end > row:
            out[row:end] = grouped(w13, w2, x_sorted[row:end], counts[first:first + size])
        row, first = end, first + size
    return out


def experts_merged(parts: list[tuple[torch.Tensor, torch.Tensor]], x_sorted: torch.Tensor,
                   counts: torch.Tensor) -> torch.Tensor:
    """The ablation DWDP §4.2 removes: copy the stacks into one buffer first, then one grouped op."""
    w13 = torch.cat([p[0] for p in parts])  # [sum El_i, 2F, H]
    w2 = torch.cat([p[1] for p in parts])
    return grouped(w13, w2, x_sorted, counts)


def grouped_on_device(w: ExpertWeights) -> bool:
    """Whether ``w``'s experts run as grouped GEMMs (their row counts stay on the device) rather
    than one matmul per expert, whose sizes are read back to the host (``_loop``)."""
    return w.w13.shape[0] == 0 or _grouped_mm_aligned(w.w13[0], w.w2[0])


def _grouped_mm_aligned(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` runs these weights: on the CPU any float dtype, on CUDA bfloat16 on
    compute capability 9.0 or newer (elsewhere the loop runs); and every row stride a multiple of
    16 bytes (H and F multiples of 8 in bf16): real checkpoints are, odd test shapes may not be."""
    dev = w13.device
    if dev.type == "cuda":
        if w13.dtype != torch.bfloat16 or torch.cuda.get_device_capability(dev) < (9, 0):
            return False
    elif dev.type != "cpu":
        return False
    item = w13.element_size()
    return (w13.shape[-1] * item) % 16 == 0 and (w2.shape[-1] * item) % 16 == 0


def experts_loop(w: ExpertWeights, layer: int, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Oracle for ``experts_grouped`` (and, on the concatenated stacks, ``experts_list``): one plain
    matmul per expert."""
    slot = w.layer_slot(layer)
    return _loop(w.w13[slot], w.w2[slot], x_sorted, counts)


def _loop(w13: torch.Tensor, w2: torch.Tensor, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x_sorted)
    start, f = 0, w2.shape[-1]
    for e, n in enumerate(counts.tolist()):
        if n:
            gate_up = x_sorted[start:start + n] @ w13[e].T
            out[start:start + n] = (F.silu(gate_up[:, :f]) * gate_up[:, f:]) @ w2[e].T
        start += n
    return out


@dataclass
class ExpertPlan:
    """Which (token, k) pairs go to which local expert, in grouped order."""

    pair_index: torch.Tensor  # [N] int64 flat index t*K + k of each grouped row
    token_index: torch.Tensor  # [N] int64 token row of each grouped row
    counts: torch.Tensor  # [El] int64 rows per local expert (their sum: the rows computed, first)
    # [N] bool: rows of a held expert; the rest (pairs of experts held elsewhere) trail the grouped
    # rows, are not computed and add nothing. None: every row is held.
    held: torch.Tensor | None = None


def plan_pairs(topk_ids: torch.Tensor, w: ExpertWeights | ExpertIndex) -> ExpertPlan:
    """Group the pairs by local expert id (stable order), pairs of experts not held here last.

    topk_ids: [T, K] global ids. Every pair keeps a row, so the plan's shapes are the batch's, not
    the data's: nothing is read back to the host (a ``nonzero`` of the held pairs would be). (Slots
    that differ by layer are routed by ``workers.dispatch.ExpertRoutes``, not here.)
    """
    k = topk_ids.shape[1]
    index = w if isinstance(w, ExpertIndex) else w.index
    local = index.local_ids(topk_ids.reshape(-1))  # [P]
    el = len(index.expert_ids)
    key = torch.where(local >= 0, local, el)  # not held here: after every local expert
    order = torch.argsort(key, stable=True)  # [P]
    counts = torch.zeros(el + 1, dtype=torch.int64, device=key.device).scatter_add_(0, key, torch.ones_like(key))
    return ExpertPlan(order, order // k, counts[:el], key[order] < el)


def weighted_sum(num_tokens: int, plan: ExpertPlan, y_sorted: torch.Tensor, topk_weights: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Scatter-add weight * expert output back per token. Returns [T, H] (accumulated in ``out``)."""
    if out is None:
        out = torch.zeros(num_tokens, y_sorted.shape[1], dtype=y_sorted.dtype, device=y_sorted.device)
    wts = topk_weights.reshape(-1)[plan.pair_index].to(y_sorted.dtype).unsqueeze(1)  # [N, 1]
    contrib = y_sorted * wts
    if plan.held is not None:  # rows not computed hold whatever the buffer held: drop them, not scale them
        contrib = torch.where(plan.held.unsqueeze(1), contrib, 0)
    out.index_add_(0, plan.token_index, contrib)
    return out
