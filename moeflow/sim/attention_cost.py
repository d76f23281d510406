"""One layer's attention block under the roofline, part by part, and the choices that implementations
make differently (``AttentionOptions``, set per system from its ``SimOptions``).

Parts: projections (GEMMs), the core attention (its FLOPs, or the KV cache read once per sequence,
whichever is longer), the DSA indexer (its key cache read likewise), elementwise traffic, the TP
all-reduce after the o-projection, and the MoE gate + shared experts (or the dense MLP and its
all-reduce). ``AnalyticCost.attention_s`` is their sum; the Fig. 5 cross-check reads them apart.

Choices, each from an implementation's source:

- DSA core (``dsa_attention``). ``mqa``: MLA absorbed into MQA form over the selected keys at every
  length, ``2·H·(2·kv_lora + rope)`` FLOPs per pair (278,528 for DeepSeek-V3.2): vllm-ascend's SFA
  and CANN's DeepSeek-V3.2 recipe ("方案三", one MLA path for prefill and decode) — the Ascend
  stack ASAP runs on. ``mha_short_batch``: masked MHA, ``2·H·(nope + rope + v)`` per pair (81,920),
  for a batch whose longest context is <= index_topk, MQA otherwise (SGLang's
  SGLANG_NSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD = index_topk). ``mha_short_seqs``: the same rule
  per sequence.
- How the T devices of an attention group share a batch (``parallel``). ``tensor``: heads split T
  ways, an all-reduce after the o-projection (and the dense MLP); vLLM, SGLang and vllm-ascend
  replicate MLA's down-projections and the whole DSA indexer on every TP rank (``tp_replicates``:
  the indexer sums over its heads before top-k, so splitting heads would all-reduce an [s, s]
  score matrix; CANN's recipe avoids TP for this reason). ``sequence``: each device owns S/T of
  the batch's tokens (ASAP §4.2: "the maximum sequence length per device to 8k. With TP = 4, ...
  batches up to 32k tokens"; Table 2's K·S/T buffers): it runs every projection, its queries'
  indexer and core attention with the whole weights, after an all-gather of the batch's new KV
  entries over the group's links; no all-reduce. Each device reads the whole KV of the batch (its
  queries may attend to any of it), a bound that matters only at decode.
- Indexer: its int8 score GEMM on the matrix units and, pipelined with it in one fused kernel,
  the vector work (CANN's LightningIndexer guide): the weighted sum over g heads (2·g per pair),
  and the exact top-k, 4.36·S_k + 3.32·k per query whose context S_k exceeds k (the guide's
  count for its sort-and-merge); the kernel takes the longer of the two. We apply the 4.36 per
  pair to every pair (short contexts included), a small over-count below k.
"""
from __future__ import annotations

from dataclasses import dataclass

from moeflow.sim.shape import AttnShape

DSA_MODES = ("mqa", "mha_short_batch", "mha_short_seqs")
PARALLEL = ("tensor", "sequence")
TOPK_OPS_PER_KEY = 4.36  # CANN LightningIndexer guide: top-k over S_k keys costs 4.36·S_k + 3.32·k
TOPK_OPS_PER_SELECTED = 3.32


@dataclass(frozen=True)
class AttentionOptions:
    dsa_attention: str = "mqa"
    tp_replicates: bool = True
    parallel: str = "tensor"

    def __post_init__(self) -> None:
        if self.dsa_attention not in DSA_MODES:
            raise ValueError(f"dsa_attention must be one of {DSA_MODES}, got {self.dsa_attention!r}")
        if self.parallel not in PARALLEL:
            raise ValueError(f"attention_parallel must be one of {PARALLEL}, got {self.parallel!r}")


def attention_parts(cost, shape: AttnShape, tp: int, dense_layer: bool) -> dict[str, float]:
    """Seconds per part of one layer's attention block of ``shape`` on ``tp`` devices
    (``cost``: an AnalyticCost)."""
    m, roof, o = cost.model, cost.roof, cost.options
    if o.parallel == "sequence" and tp > 1:
        return _sequence_parts(cost, shape, tp, dense_layer)
    t = shape.num_tokens
    replicated = m.tp_replicated_params if o.tp_replicates and tp > 1 else 0
    parts = {"projections": cost._gemm_s(t, m.attn_proj_params - replicated, tp)
             + (cost._gemm_s(t, replicated, 1) if replicated else 0.0)}
    # the core reads the KV cache once per sequence (a GQA cache is split over TP, MLA's latent is
    # not): decode, one query per sequence, is priced by this read
    kv = shape.num_sparse_keys * m.attn_kv_bytes_per_token_layer / (tp if m.attention == "gqa" else 1)
    parts["core"] = roof.op_s(core_flops(m, shape, o.dsa_attention) / tp, kv, attention=True)
    if m.index_pair_flops:
        parts["indexer"] = _indexer_s(cost, shape, 1 if o.tp_replicates else tp)
    parts["elementwise"] = roof.op_s(0, cost.ELEMENTWISE_ACTS * t * m.hidden_size * 2 / tp)
    allreduce = cost.links.transfer_s(2 * (tp - 1) / tp * t * m.hidden_size * 2) if tp > 1 else 0.0
    parts["tp_allreduce"] = allreduce  # after the row-parallel o-projection
    if dense_layer:  # the dense MLP is split T ways too: one more all-reduce after its down-projection
        parts["mlp"] = cost._gemm_s(t, m.dense_mlp_params, tp) + allreduce
    else:
        parts["gate_shared"] = cost._gemm_s(t, m.hidden_size * m.num_experts, tp) + (
            cost._gemm_s(t, m.shared_params, tp) if m.shared_params else 0.0)
    return parts


def _sequence_parts(cost, shape: AttnShape, tp: int, dense_layer: bool) -> dict[str, float]:
    """``attention_parts`` when each of the ``tp`` devices owns 1/tp of the batch's tokens (and of its
    causal pairs: a balanced split); the slowest device is an average one."""
    m, roof = cost.model, cost.roof
    t = shape.num_tokens / tp
    parts = {"projections": cost._gemm_s(t, m.attn_proj_params, 1)}
    kv = shape.num_sparse_keys * m.attn_kv_bytes_per_token_layer
    parts["core"] = roof.op_s(core_flops(m, shape, cost.options.dsa_attention) / tp, kv, attention=True)
    if m.index_pair_flops:
        parts["indexer"] = _indexer_s(cost, shape, tp)
    parts["elementwise"] = roof.op_s(0, cost.ELEMENTWISE_ACTS * t * m.hidden_size * 2)
    # every device receives the other devices' new cache entries (latent + rope key, indexer key)
    parts["kv_allgather"] = cost.links.transfer_s((tp - 1) * t * m.kv_bytes_per_token_layer)
    if dense_layer:
        parts["mlp"] = cost._gemm_s(t, m.dense_mlp_params, 1)
    else:
        parts["gate_shared"] = cost._gemm_s(t, m.hidden_size * m.num_experts, 1) + (
            cost._gemm_s(t, m.shared_params, 1) if m.shared_params else 0.0)
    return parts


def _indexer_s(cost, shape: AttnShape, split: int) -> float:
    """The DSA indexer of ``shape`` with its pairs split ``split`` ways."""
    m, hw = cost.model, cost.hw
    cube_s = m.index_pair_flops * shape.num_pairs / split / (hw.flops_int8 * hw.attn_eff)
    vector_s = 0.0
    if hw.vector_flops:
        ops = ((2 * m.index_heads + TOPK_OPS_PER_KEY) * shape.num_pairs
               + TOPK_OPS_PER_SELECTED * m.index_topk * shape.num_long_queries)
        vector_s = ops / split / (hw.vector_flops * hw.attn_eff)
    # every device reads the whole indexer key cache (one 8-bit key per token, shared by the heads)
    read_s = shape.num_keys * m.index_head_dim / (hw.mem_bw_Bps * hw.mem_eff)
    return hw.launch_s + max(cube_s, vector_s, read_s)


def core_flops(m, shape: AttnShape, mode: str) -> float:
    """FLOPs of the core attention over ``shape`` when DSA's core runs in ``mode``."""
    if not m.index_topk or mode == "mqa":
        return m.attn_pair_flops * shape.num_sparse_pairs
    if mode == "mha_short_batch":
        short = shape.num_sparse_pairs if shape.max_context <= m.index_topk else 0
    else:
        short = shape.num_short_pairs
    return m.attn_pair_flops_mha * short + m.attn_pair_flops * (shape.num_sparse_pairs - short)


def batch_ratio(cost, tp: int, parts: tuple[str, ...] | None = None, total: int = 32768, n: int = 32) -> float:
    """ASAP Fig. 5's comparison: one layer's attention time for 1 prompt of ``total`` tokens over
    ``n`` prompts of total/n tokens (the paper: 4.2x for 1x32k vs 32x1k), summing only ``parts``
    (None: the whole block)."""
    def timed(spans):
        p = attention_parts(cost, AttnShape.of(spans, cost.model.index_topk), tp, False)
        return sum(v for k, v in p.items() if parts is None or k in parts)

    return timed([(0, total, True)]) / timed([(0, total // n, True)] * n)
