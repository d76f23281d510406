"""The bytes one decode step must read from memory: the weights it touches and the KV cache it attends
over, counted from the tensors the model holds (``flops.py`` counts a prefill's arithmetic).

Touched: every layer's attention (its norms included) and MoE gate, the shared expert or dense MLP,
the routed experts the step's routing selected (each distinct expert once per layer, however many
tokens chose it), the final norm and the LM head, and one embedding row per token. Read from the
cache: every request's context and the new token (written, then read). Left out: activations,
the logits written, block tables: a few MB at most against GB of weights.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moeflow.model.weights import ModelWeights


def nbytes(obj) -> int:
    """Bytes of every tensor in ``obj``: a tensor, a dataclass of them, or a dict or list of either."""
    if obj is None:
        return 0
    if hasattr(obj, "nbytes") and hasattr(obj, "dtype"):
        return int(obj.nbytes)
    if dataclasses.is_dataclass(obj):
        return sum(nbytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


def weights_nbytes(w: ModelWeights) -> int:
    """Every weight once (a tied LM head is the embedding: not counted twice)."""
    lm_head = 0 if w.lm_head is w.embed else nbytes(w.lm_head)
    return (nbytes(w.embed) + nbytes(w.final_norm) + lm_head + nbytes(w.attention) + nbytes(w.gates)
            + nbytes(w.dense) + nbytes(w.shared) + nbytes(w.experts))


def expert_nbytes(w: ModelWeights) -> int:
    """One routed expert's weights (gate, up and down)."""
    e = w.experts
    return int(e.w13[0, 0].nbytes + e.w2[0, 0].nbytes)


def decode_step_bytes(w: ModelWeights, experts_touched: dict[int, int], num_tokens: int,
                      kv_read_bytes: int) -> dict[str, int]:
    """What one decode step of ``num_tokens`` requests reads, by part. ``experts_touched``: MoE layer ->
    distinct experts its routing selected in this step; ``kv_read_bytes``: the cache entries attended."""
    hidden_row = w.embed.shape[1] * w.embed.element_size()
    parts = {
        "attention": nbytes(w.attention),
        "routers": nbytes(w.gates),
        "experts": sum(experts_touched.values()) * expert_nbytes(w) if w.experts is not None else 0,
        "shared_experts": nbytes(w.shared),
        "dense_mlp": nbytes(w.dense),
        "lm_head": nbytes(w.lm_head) + nbytes(w.final_norm),
        "embedding_rows": num_tokens * hidden_row,
        "kv_cache": kv_read_bytes,
    }
    parts["total"] = sum(parts.values())
    return parts
