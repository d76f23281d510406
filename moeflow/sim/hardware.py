"""Devices as the cost model sees them: peak rates, efficiencies and links.

One ``Hardware`` per device kind; every constant cites its public source here and in
docs/simulator.md. Efficiencies (the fraction of a peak an operator reaches) are the only numbers
not read off a datasheet; each says where it comes from.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float  # dense bf16/fp16 peak per device, FLOP/s
    flops_int8: float  # dense int8/fp8 peak per device (weights and indexer in 8 bits), FLOP/s
    mem_bw_Bps: float  # HBM (or DRAM) bandwidth per device, bytes/s
    link_bw_Bps: float  # scale-up link bandwidth per device, one direction, bytes/s
    link_latency_s: float  # one message over the scale-up network
    launch_s: float  # fixed cost of one operator (kernel launch + tail)
    host_dispatch_s: float  # per layer, when a host issues each MoE layer's kernels (no super kernel)
    gemm_eff: float  # fraction of peak FLOP/s a large GEMM reaches
    attn_eff: float  # fraction of peak FLOP/s the attention kernel reaches
    mem_eff: float  # fraction of peak bandwidth a streaming kernel reaches
    link_eff: float  # fraction of link bandwidth a transfer reaches
    # the synchronous all-to-all of the baselines, as a collective library achieves it (0: the link's)
    a2a_bw_Bps: float = 0.0
    a2a_latency_s: float = 0.0
    # vector (non-matrix) peak, FLOP/s: the DSA indexer's head reduction and top-k run there
    # (0: not modelled, that work is left out)
    vector_flops: float = 0.0
    flops_fp4: float = 0.0  # dense fp4 peak (4-bit experts run on it); 0: none, they run on flops_int8
    hbm_bytes: float = 0.0  # device memory, for memory budgets (0: not modelled)
    # kernels run this much slower while the copy engine moves weights over the links (power-capped
    # clocks, shared HBM); 1: not modelled
    copy_slowdown: float = 1.0
    host_step_s: float = 0.0  # host work between steps that overlap scheduling hides (0: not modelled)
    # per device and layer, the coefficient of variation of compute time at equal work (sim/jitter.py)
    compute_jitter_cv: float = 0.0
    # fraction of peak bandwidth the attention kernel reaches where it streams the KV cache (decode);
    # 0: mem_eff, as any streaming kernel
    attn_mem_eff: float = 0.0

    def __post_init__(self) -> None:
        for f in self.__dataclass_fields__:
            v = getattr(self, f)
            if f != "name" and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(f"Hardware {self.name!r}: {f} must be a number, got {v!r}")
        for f in ("flops", "flops_int8", "mem_bw_Bps", "link_bw_Bps"):
            if not getattr(self, f) > 0:
                raise ValueError(f"Hardware {self.name!r}: {f} must be > 0, got {getattr(self, f)}")
        if self.copy_slowdown < 1:
            raise ValueError(f"Hardware {self.name!r}: copy_slowdown must be >= 1, got {self.copy_slowdown}")
        if not 0 <= self.compute_jitter_cv < 1:
            raise ValueError(f"Hardware {self.name!r}: compute_jitter_cv must be in [0, 1), got {self.compute_jitter_cv}")
        for f in ("gemm_eff", "attn_eff", "mem_eff", "link_eff"):
            if not 0 < getattr(self, f) <= 1:
                raise ValueError(f"Hardware {self.name!r}: {f} must be in (0, 1], got {getattr(self, f)}")
        if not 0 <= self.attn_mem_eff <= 1:
            raise ValueError(f"Hardware {self.name!r}: attn_mem_eff must be in [0, 1] (0: mem_eff), got {self.attn_mem_eff}")
        for f in ("link_latency_s", "launch_s", "host_dispatch_s", "a2a_bw_Bps", "a2a_latency_s", "vector_flops",
                  "flops_fp4", "hbm_bytes", "host_step_s"):
            if getattr(self, f) < 0:
                raise ValueError(f"Hardware {self.name!r}: {f} must be >= 0, got {getattr(self, f)}")

    def with_overrides(self, **kw) -> "Hardware":
        unknown = set(kw) - set(self.__dataclass_fields__)
        if unknown:
            raise ValueError(f"Hardware {self.name!r}: unknown fields {sorted(unknown)}")
        return replace(self, **kw)


# Shared modelling constants where no datasheet has a number (Huawei's own simulator,
# Ascend/msmodeling tensor_cast/device.py, uses the same efficiencies and launch cost for Ascend;
# we reuse them for the NVIDIA parts rather than invent others).
_LAUNCH_S = 5e-6  # msmodeling STATIC_COST.mma_op_cost_s
_HOST_DISPATCH_S = 220e-6  # ASAP §5.5.3, measured on CloudMatrix384 per MoE layer
_LINK_EFF = 0.7  # msmodeling comm_efficiency
_MEM_EFF = 0.6  # msmodeling memory efficiency
# NVIDIA parts have published streaming rates of their own, used instead: an FP8 grouped GEMM (the
# MoE experts' op) at 3,705 GB/s on H200 (FBGEMM's Triton kernel at batch 256, SGLang's
# benchmark/fbgemm/README.md: 4.8 TB/s peak), and decode attention streaming the KV cache at "up to
# 3000 GB/s in memory-bound configuration" on H800 SXM5 (deepseek-ai/FlashMLA README; 3.35 TB/s peak)
_NV_MEM_EFF = 3705e9 / 4.8e12
_NV_ATTN_MEM_EFF = 3000e9 / 3.35e12
# Compute jitter at equal work, per device and layer (sim/jitter.py). The one equal-work measurement
# found for accelerators: vLLM issue #52911 (TP8 decode step, MI350-class GPUs, every rank the same
# sharded work): per-rank fused-GEMM times 106.6, 108.2, 92.4, 86.3, 112.3, 104.4, 104.6, 105.0 us,
# CV 7.9%. One step of one kernel on one node: applied per layer to every preset, an upper end.
_JITTER_CV = 0.079
# This machine's engine: dep with 2 ranks at equal work waits 14.5-16.2% of its compute at the
# barriers (docs/results/sim/jitter_cpu_here.json, measured by the script beside it): CV 0.26-0.29,
# the CV whose E[max of 2 factors] - 1 gives that wait. Profiled costs use it unless the profile has its own.
CPU_HERE_JITTER_CV = 0.27

PRESETS: dict[str, Hardware] = {
    # One Ascend 910C die (a 910C chip has two) as in CloudMatrix384 (ASAP §4.1).
    "ascend-910c-die": Hardware(
        "ascend-910c-die",
        flops=376e12,  # CM384 paper: 752 TFLOPS dense bf16 per 910C chip, two dies
        flops_int8=752e12,  # CM384 paper: 6,688 tok/s / 4.45 tok/s/TFLOPS = 1,503 int8 TOPS per chip
        mem_bw_Bps=1.6e12,  # 3.2 TB/s per chip (CM384 paper) / 2 dies
        hbm_bytes=64e9,  # 128 GB of HBM per 910C chip (CM384 paper) / 2 dies
        link_bw_Bps=196e9,  # UB, 7 x 224 Gb/s per die, one direction (CM384 paper; msmodeling A3_INTERCONNECT)
        link_latency_s=0.5e-6,  # msmodeling A3_INTERCONNECT, one-level CLOS
        launch_s=_LAUNCH_S, host_dispatch_s=_HOST_DISPATCH_S,
        gemm_eff=0.774,  # CM384 paper: INT8 GEMM at 77.4-82.7% of peak (lower end)
        attn_eff=0.654,  # CM384 paper: MLA kernel at 65.4% of compute peak
        mem_eff=_MEM_EFF, link_eff=_LINK_EFF,
        # DeepEP-Ascend (sgl-project/sgl-kernel-npu README) normal mode on the A3 384 SuperPOD, EP32,
        # 4,096 tokens: dispatch 102 GB/s, combine 95 GB/s; comm op cost 10 us (msmodeling)
        a2a_bw_Bps=98.5e9, a2a_latency_s=10e-6,
        compute_jitter_cv=_JITTER_CV,
        vector_flops=22e12),  # msmodeling ATLAS_800_A3_752T_128G_DIE gp_ops, fp16/bf16 (48 vector cores)
    # NVIDIA H200 SXM: 989.5 TFLOPS dense bf16, 1,979 dense fp8 (datasheet figures halved: they
    # are quoted with sparsity), 4.8 TB/s HBM3e, NVLink 4 900 GB/s both ways.
    "h200": Hardware(
        "h200", flops=989.5e12, flops_int8=1979e12, mem_bw_Bps=4.8e12, link_bw_Bps=450e9, hbm_bytes=141e9,
        compute_jitter_cv=_JITTER_CV,
        link_latency_s=2e-6,  # no NVIDIA figure; the ~1-2 us commonly quoted for NVLink, upper end
        launch_s=_LAUNCH_S, host_dispatch_s=_HOST_DISPATCH_S,
        gemm_eff=0.7,  # msmodeling's compute efficiency
        attn_eff=0.667,  # CM384 paper's comparison: FlashMLA on H800 at 66.7% of peak
        mem_eff=_NV_MEM_EFF, attn_mem_eff=_NV_ATTN_MEM_EFF, link_eff=_LINK_EFF),
    # NVIDIA H100 SXM5 (H100 datasheet, sparse figures halved): 989.5 TFLOPS dense bf16, 1,979 dense
    # fp8, 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s both ways. Across nodes an all-to-all rides one
    # 400 Gb/s InfiniBand NIC per GPU, 50 GB/s (DeepSeek-V3 technical report §3.2.2, its cluster's).
    "h100": Hardware(
        "h100", flops=989.5e12, flops_int8=1979e12, mem_bw_Bps=3.35e12, link_bw_Bps=450e9, hbm_bytes=80e9,
        link_latency_s=2e-6, launch_s=_LAUNCH_S, host_dispatch_s=_HOST_DISPATCH_S, gemm_eff=0.7, attn_eff=0.667,
        mem_eff=_NV_MEM_EFF, attn_mem_eff=_NV_ATTN_MEM_EFF, link_eff=_LINK_EFF, a2a_bw_Bps=50e9, compute_jitter_cv=_JITTER_CV),
    # NVIDIA H800 SXM5: the H100's compute and memory with NVLink cut to 400 GB/s both ways (200 one
    # way); DeepSeek-V3 §3.2.2 measures 160 GB/s of NVLink against 50 GB/s of IB per GPU on its H800
    # nodes, and cross-node all-to-alls ride the IB.
    "h800": Hardware(
        "h800", flops=989.5e12, flops_int8=1979e12, mem_bw_Bps=3.35e12, link_bw_Bps=200e9, hbm_bytes=80e9,
        link_latency_s=2e-6, launch_s=_LAUNCH_S, host_dispatch_s=_HOST_DISPATCH_S, gemm_eff=0.7, attn_eff=0.667,
        mem_eff=_NV_MEM_EFF, attn_mem_eff=_NV_ATTN_MEM_EFF, link_eff=_LINK_EFF, a2a_bw_Bps=50e9, compute_jitter_cv=_JITTER_CV),
    # One B200 of a GB200 NVL72 (NVIDIA's GB200 NVL72 page, per rack, sparse figures halved, / 72):
    # 360 PFLOPS bf16 -> 2.5 PFLOPS dense, 720 fp8 -> 5, 1,440 fp4 -> 10; 576 TB/s -> 8 TB/s HBM3e;
    # 13.4 TB HBM3e -> 186 GB (372 GB per GB200 superchip of two GPUs); NVLink 5 1.8 TB/s both ways.
    "gb200": Hardware(
        "gb200", flops=2.5e15, flops_int8=5e15, flops_fp4=10e15, hbm_bytes=186e9, mem_bw_Bps=8e12,
        link_bw_Bps=900e9, link_latency_s=2e-6,
        # DWDP Appendix A, Table 7: an attention kernel under short copy-engine overlaps (the pattern
        # of DWDP's pulls) takes 1.226x as long, at 0.798x the clock
        copy_slowdown=1.226,
        # FastAFD §5 (Qwen3-235B, 8K prompts): overlap scheduling takes 9.8 ms off every decode step
        host_step_s=9.8e-3,
        compute_jitter_cv=_JITTER_CV,
        launch_s=_LAUNCH_S, host_dispatch_s=_HOST_DISPATCH_S, gemm_eff=0.7, attn_eff=0.667,
        mem_eff=_NV_MEM_EFF, attn_mem_eff=_NV_ATTN_MEM_EFF, link_eff=_LINK_EFF),
}

# Devices of two different presets sit in different racks: what crosses between them rides the
# scale-out network, one 400 Gb/s NIC per GPU (50 GB/s; DeepSeek-V3 technical report §3.2.2, its
# cluster's), at the slower side's latency and efficiency
SCALE_OUT_BW_Bps = 50e9


def between(a: Hardware, b: Hardware) -> Hardware:
    """``a`` with the links a transfer between a device of ``a`` and one of ``b`` has (``a`` itself
    when they are the same preset: its scale-up link)."""
    if a == b:
        return a
    return a.with_overrides(name=f"{a.name}<->{b.name}", link_bw_Bps=min(a.link_bw_Bps, b.link_bw_Bps, SCALE_OUT_BW_Bps),
                            link_latency_s=max(a.link_latency_s, b.link_latency_s), link_eff=min(a.link_eff, b.link_eff))


# "cpu-here" is not a constant: one core of the machine a ``moeflow env --json`` report measured,
# at the dtype the engine runs there (processors differ between machines by 100x in bf16).
MEASURED = "cpu-here"


def cpu_hardware(report: dict, dtype: str | None = None) -> Hardware:
    """One process on one core of the machine ``report`` (``moeflow env --json``) describes.

    Rates are the report's measurements for ``dtype`` (default: what ``auto`` picks there): GEMM
    GFLOP/s on one thread, memcpy bandwidth (a shared-memory transfer is a copy), the shared-memory
    flag round trip as link latency. Efficiencies: GEMM 0.6 (bench prefill's MFU against the
    measured GEMM rate, 58-61% on the AVX-512 machine); the rest assumed, as before: for
    predictions here the profiled cost replaces them.
    """
    dtype = dtype or report.get("auto_dtype", "float32")
    gemm = report.get("gemm", {}).get(dtype)
    if gemm is None:
        raise ValueError(f"hardware {MEASURED}: the machine report has no GEMM rate for {dtype!r} "
                         f"(has {sorted(report.get('gemm', {}))}); regenerate it with moeflow env --json")
    flops = float(gemm["gflops"]) * 1e9
    copy_bps = float(report["memcpy_gbps"]) * 1e9
    return Hardware(MEASURED, flops=flops, flops_int8=flops, mem_bw_Bps=copy_bps, link_bw_Bps=copy_bps,
                    link_latency_s=float(report["shm_flag_round_trip_us"]) * 1e-6, launch_s=20e-6,
                    host_dispatch_s=0.0, gemm_eff=0.6, attn_eff=0.5, mem_eff=0.8, link_eff=1.0,
                    compute_jitter_cv=CPU_HERE_JITTER_CV)


def hardware_preset(name: str, report: dict | None = None, dtype: str | None = None) -> Hardware:
    if name == MEASURED:
        if report is None:
            raise ValueError(f"hardware {MEASURED} is measured, not a constant: give machine: FILE.json, "
                             f"the report of `moeflow env --json > FILE.json` on the machine to simulate")
        return cpu_hardware(report, dtype)
    if name not in PRESETS:
        raise ValueError(f"unknown hardware preset {name!r}; known: {', '.join(sorted([*PRESETS, MEASURED]))}")
    return PRESETS[name]
