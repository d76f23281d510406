"""The roofline's GEMM against published kernel rates nobody here measured: DeepGEMM's first
README (deepseek-ai/DeepGEMM at a6d97a1, February 2025) times its FP8 GEMMs on an H800 SXM5 by M,
the shapes of DeepSeek-V3's layers. The `h800` preset prices them from the datasheet (FP8 peak,
HBM) and the efficiencies every NVIDIA preset shares; nothing here is fitted to these rows.

What the rows say (docs/simulator.md, "Round four"), priced over measured time, the launch the
roofline charges each op left out (DeepGEMM times kernels back to back): the experts' two GEMMs
(up: N 4096 x K 7168; down: N 7168 x K 2048) are priced 6-7% and 21-26% fast when compute-bound,
the down projection's short K costing the difference; near the ridge (M 256-1024 per group) 11-34%
fast (median 23%), the smooth bend a roofline cannot draw; memory-bound (M 64, 128) the experts'
shapes 4-14% fast. With the launch (5 us) a memory-bound op is priced 4-74% slow."""
from __future__ import annotations

import statistics

import pytest

from moeflow.sim.cost import Roofline
from moeflow.sim.hardware import hardware_preset

# (groups, M per group, N, K, TFLOPS measured): normal GEMMs, then grouped (contiguous, masked)
DEEPGEMM_H800 = [
    (1, 64, 2112, 7168, 206), (1, 64, 24576, 1536, 289), (1, 64, 32768, 512, 219), (1, 64, 7168, 16384, 336),
    (1, 64, 4096, 7168, 287), (1, 64, 7168, 2048, 295), (1, 128, 2112, 7168, 352), (1, 128, 24576, 1536, 535),
    (1, 128, 32768, 512, 358), (1, 128, 7168, 16384, 645), (1, 128, 4096, 7168, 533), (1, 128, 7168, 2048, 510),
    (1, 4096, 2112, 7168, 1058), (1, 4096, 24576, 1536, 990), (1, 4096, 32768, 512, 590),
    (1, 4096, 7168, 16384, 1358), (1, 4096, 4096, 7168, 1304), (1, 4096, 7168, 2048, 1025),
    (4, 8192, 4096, 7168, 1297), (4, 8192, 7168, 2048, 1099), (8, 4096, 4096, 7168, 1288), (8, 4096, 7168, 2048, 1093),
    (1, 1024, 4096, 7168, 1233), (1, 1024, 7168, 2048, 925), (2, 512, 4096, 7168, 1040), (2, 512, 7168, 2048, 916),
    (4, 256, 4096, 7168, 932), (4, 256, 7168, 2048, 815),
]
EXPERTS = ((4096, 7168), (7168, 2048))  # DeepSeek-V3's expert GEMMs: gate+up, down


def _ratios(launch: bool) -> dict[tuple, float]:
    """Priced over measured time per row (< 1: the roofline is optimistic)."""
    roof = Roofline(hardware_preset("h800"))
    out = {}
    for g, m, n, k, tflops in DEEPGEMM_H800:
        flops, nbytes = 2 * g * m * n * k, g * (n * k + m * k + 2 * m * n)  # FP8 in, bf16 out
        priced = roof.op_s(flops, nbytes, low_precision=True) - (0 if launch else roof.hw.launch_s)
        out[g, m, n, k] = priced / (flops / (tflops * 1e12))
    return out


def test_compute_bound_the_experts_gemms_run_slower_than_priced_the_short_k_most():
    r = _ratios(launch=False)
    big = [key for key in r if key[0] * key[1] >= 4096 and key[2:] in EXPERTS]
    up = [r[key] for key in big if key[2:] == EXPERTS[0]]
    down = [r[key] for key in big if key[2:] == EXPERTS[1]]
    assert len(up) == len(down) == 3
    assert all(0.92 <= x <= 0.95 for x in up), up
    assert all(0.73 <= x <= 0.80 for x in down), down


def test_near_the_ridge_the_roofline_is_optimistic():
    r = _ratios(launch=False)
    ridge = [r[key] for key in r if 256 <= key[1] <= 1024]
    assert len(ridge) == 6 and all(0.66 <= x <= 0.90 for x in ridge), ridge
    assert statistics.median(ridge) == pytest.approx(0.77, abs=0.01)


def test_memory_bound_it_is_close_without_the_launch_and_pessimistic_with_it():
    small = [key for key in _ratios(True) if key[1] <= 128]
    bare, with_launch = _ratios(False), _ratios(True)
    experts = [bare[key] for key in small if key[2:] in EXPERTS]
    assert len(experts) == 4 and all(0.85 <= x <= 0.96 for x in experts), experts
    assert all(1.03 <= with_launch[key] <= 1.75 for key in small)  # 5 us per op against back-to-back kernels
