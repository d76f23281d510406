"""The cost model: how long each stage of a layer takes, behind one interface.

Sources, one small class each:

- ``Roofline``: one operator = max(FLOPs / (peak · efficiency), bytes / (bandwidth · efficiency))
  + a fixed launch cost. The grouped expert GEMM's memory-bound plateau and linear growth
  (ASAP Fig. 3b) come out of it: below the inflection the expert weights' bytes dominate.
- ``Links``: a transfer = latency + bytes / (link bandwidth · efficiency); the simulator queues
  transfers that share a port, which is where contention comes from.
- ``ProfiledCost`` (profiled.py): tables measured by ``moeflow profile`` on the real engine.

All times are for one layer of one stage on one device group, in seconds.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np

from moeflow.sim.attention_cost import AttentionOptions, attention_parts
from moeflow.sim.hardware import Hardware
from moeflow.sim.model_spec import ModelSpec
from moeflow.sim.shape import AttnShape


class CostModel(abc.ABC):
    model: ModelSpec
    engine_buffers = False  # whether a memory plan counts moeflow's own communication buffers (memory.py)
    # cores every process of a deployment shares (sim/cores.py); None: each process has its own device
    shared_cores: int | None = None

    @abc.abstractmethod
    def attention_s(self, shape: AttnShape, tp: int, dense_layer: bool) -> float:
        """One layer's attention block on a group of ``tp`` devices: norms, projections, core
        attention (and indexer), TP all-reduce, the MoE gate or the dense MLP, shared experts, and
        the weighted sum of the returned expert outputs."""

    @abc.abstractmethod
    def experts_s(self, num_routed: int, num_local_experts: int) -> float:
        """One MoE layer on one expert device: ``num_routed`` (token, expert) pairs over its experts."""

    def experts_s_many(self, num_routed: np.ndarray, num_local_experts: int) -> np.ndarray:
        """``experts_s`` of every element of ``num_routed`` (a cost model may vectorize it)."""
        flat = [self.experts_s(int(n), num_local_experts) for n in np.ravel(num_routed)]
        return np.reshape(np.array(flat, dtype=float), np.shape(num_routed))

    def for_system(self, sim) -> "CostModel":
        """This cost model as one system's ``SimOptions`` (``sim``) refine it; the same one when no
        option concerns it."""
        for f, default in (("a2a_bw_GBps", None), ("attention_parallel", "tensor")):
            if getattr(sim, f) != default:
                raise ValueError(f"sim: {f} applies to the analytic cost only, not {type(self).__name__} "
                                 f"(it prices what the engine runs)")
        return self

    def on(self, hw) -> "CostModel":
        """The same model priced on hardware ``hw`` (a role of a heterogeneous deployment)."""
        raise ValueError(f"hardware per role needs the analytic cost (presets), not {type(self).__name__}: "
                         f"a profile prices the one machine it was taken on")

    @abc.abstractmethod
    def head_s(self, shape: AttnShape, tp: int) -> float:
        """Embedding before the first layer and final norm + logits + sampling after the last."""

    @abc.abstractmethod
    def transfer_s(self, nbytes: float) -> float:
        """One point-to-point message of ``nbytes`` on an idle link."""

    @abc.abstractmethod
    def all_to_all_s(self, nbytes: float) -> float:
        """One synchronous all-to-all in which each device sends ``nbytes`` (the baselines' collective)."""

    def all_to_all_s_many(self, nbytes: np.ndarray) -> np.ndarray:
        """``all_to_all_s`` of every element of ``nbytes`` (a cost model may vectorize it)."""
        flat = [self.all_to_all_s(float(x)) for x in np.ravel(nbytes)]
        return np.reshape(np.array(flat, dtype=float), np.shape(nbytes))

    @abc.abstractmethod
    def device_copy_s(self, nbytes: float) -> float:
        """A copy of ``nbytes`` from one buffer to another in the same device's memory."""

    def kv_handoff_s(self, nbytes: float) -> tuple[float, float]:
        """A pd handoff of ``nbytes`` of KV: (copy out of the prefill instance, copy into the decode
        instance). By default one one-sided transfer over the link into the reserved blocks (an
        RDMA write, NIXL's way): all of it is the copy out."""
        return self.transfer_s(nbytes), 0.0

    @property
    @abc.abstractmethod
    def link_bw_Bps(self) -> float:
        """Achieved bandwidth of one port, to serialize transfers that share it."""

    @property
    @abc.abstractmethod
    def host_dispatch_s(self) -> float:
        """Host-side launch of one MoE layer's kernels (paid when there is no super kernel)."""

    @property
    def copy_slowdown(self) -> float:
        """How much slower a device computes while its copy engine pulls weights (1: not at all)."""
        return 1.0

    @property
    def host_step_s(self) -> float:
        """The host's work between two steps (schedule, prepare inputs) when it is not overlapped."""
        return 0.0

    @property
    def compute_jitter_cv(self) -> float:
        """Per device and layer, the CV of compute time at equal work (sim/jitter.py; 0: none)."""
        return 0.0

    def dispatch_bytes(self, num_tokens: int) -> float:
        """Hidden states sent to the experts: one copy per (token, expert) pair (the ASAP §5.5
        estimate of 63 MB per 1k tokens for DeepSeek-V3.2 is this with int8 plus scales)."""
        m = self.model
        return num_tokens * m.top_k * m.hidden_size * m.act_bytes

    def combine_bytes(self, num_tokens: int) -> float:
        """Expert outputs sent back, unquantized (bf16, or the engine's float32)."""
        return num_tokens * self.model.top_k * self.model.hidden_size * self.model.base_bytes


@dataclass(frozen=True)
class Roofline:
    hw: Hardware

    def op_s(self, flops: float, nbytes: float, low_precision: bool = False, attention: bool = False,
             fp4: bool = False) -> float:
        hw = self.hw
        peak = self.peak(low_precision, fp4)
        eff = hw.attn_eff if attention else hw.gemm_eff
        mem_eff = (hw.attn_mem_eff or hw.mem_eff) if attention else hw.mem_eff
        return hw.launch_s + max(flops / (peak * eff), nbytes / (hw.mem_bw_Bps * mem_eff))

    def peak(self, low_precision: bool = False, fp4: bool = False) -> float:
        """The FLOP/s peak an operator of that precision runs at (4-bit falls back to the 8-bit peak)."""
        hw = self.hw
        return hw.flops_fp4 if fp4 and hw.flops_fp4 else hw.flops_int8 if low_precision or fp4 else hw.flops


@dataclass(frozen=True)
class Links:
    hw: Hardware

    def transfer_s(self, nbytes: float) -> float:
        return self.hw.link_latency_s + nbytes / self.bw_Bps

    @property
    def bw_Bps(self) -> float:
        return self.hw.link_bw_Bps * self.hw.link_eff


class AnalyticCost(CostModel):
    """Roofline operators and links for a model on a hardware preset."""

    # NOTE: elementwise traffic per token per layer, in hidden-size activations read or written:
    # 2 RMSNorms, rotary, residual adds, the weighted sum of K expert outputs (K + 1 reads).
    ELEMENTWISE_ACTS = 10

    def __init__(self, model: ModelSpec, hw: Hardware, options: AttentionOptions = AttentionOptions()):
        self.model, self.hw, self.options = model, hw, options
        self.roof, self.links = Roofline(hw), Links(hw)
        self.low = model.weight_bytes < 2  # 8-bit weights run on the int8 peak
        expert_bytes = model.expert_weight_bytes or model.weight_bytes
        self.expert_low, self.expert_fp4 = expert_bytes < 2, expert_bytes < 1  # 4-bit experts: the fp4 peak

    def for_system(self, sim):
        hw = self.hw if sim.a2a_bw_GBps is None else self.hw.with_overrides(a2a_bw_Bps=sim.a2a_bw_GBps * 1e9)
        options = AttentionOptions(sim.dsa_attention, sim.tp_replicates, sim.attention_parallel)
        return self if (hw, options) == (self.hw, self.options) else AnalyticCost(self.model, hw, options)

    def on(self, hw):
        return self if hw == self.hw else AnalyticCost(self.model, hw, self.options)

    def _gemm_s(self, tokens: float, params: float, tp: int) -> float:
        m = self.model
        return self.roof.op_s(2 * tokens * params / tp,
                              params * m.weight_bytes / tp + tokens * m.hidden_size * 2 * 2 / tp, self.low)

    def attention_s(self, shape, tp, dense_layer):
        if shape.num_tokens == 0:
            return 0.0
        return sum(attention_parts(self, shape, tp, dense_layer).values())

    def experts_work(self, num_routed, num_local_experts):
        """(FLOPs, bytes) of one MoE layer's experts on one device for ``num_routed`` (token, expert) pairs,
        a number or an array: the experts that receive at least one of the uniformly routed pairs read
        their weights."""
        m = self.model
        active = num_local_experts * (1 - (1 - 1 / num_local_experts) ** num_routed)
        return (2 * num_routed * m.expert_params,
                active * m.expert_bytes + num_routed * m.hidden_size * (m.act_bytes + 2))

    def experts_s(self, num_routed, num_local_experts):
        if num_routed <= 0:
            return 0.0
        return self.roof.op_s(*self.experts_work(num_routed, num_local_experts), self.expert_low, fp4=self.expert_fp4)

    def experts_s_many(self, num_routed, num_local_experts):
        # experts_s over an array, the same formula (a unit test holds them equal)
        hw = self.hw
        n = np.asarray(num_routed, dtype=float)
        flops, nbytes = self.experts_work(n, num_local_experts)
        peak = self.roof.peak(self.expert_low, self.expert_fp4)
        t = hw.launch_s + np.maximum(flops / (peak * hw.gemm_eff), nbytes / (hw.mem_bw_Bps * hw.mem_eff))
        return np.where(n > 0, t, 0.0)

    def head_s(self, shape, tp):
        m = self.model
        return self._gemm_s(shape.num_sampled, m.hidden_size * m.vocab_size, tp)

    def transfer_s(self, nbytes):
        return self.links.transfer_s(nbytes)

    def device_copy_s(self, nbytes):
        return self.roof.op_s(0, 2 * nbytes)  # read and write

    def all_to_all_s(self, nbytes):
        hw = self.hw
        if hw.a2a_bw_Bps:
            return hw.a2a_latency_s + nbytes / hw.a2a_bw_Bps
        return self.links.transfer_s(nbytes)

    def all_to_all_s_many(self, nbytes):
        # all_to_all_s over an array, the same formula (a unit test holds them equal)
        hw = self.hw
        if hw.a2a_bw_Bps:
            return hw.a2a_latency_s + np.asarray(nbytes, dtype=float) / hw.a2a_bw_Bps
        return hw.link_latency_s + np.asarray(nbytes, dtype=float) / self.links.bw_Bps

    @property
    def link_bw_Bps(self):
        return self.links.bw_Bps

    @property
    def host_dispatch_s(self):
        return self.hw.host_dispatch_s

    @property
    def copy_slowdown(self):
        return self.hw.copy_slowdown

    @property
    def host_step_s(self):
        return self.hw.host_step_s

    @property
    def compute_jitter_cv(self):
        return self.hw.compute_jitter_cv
