"""dtype="auto" against faked capabilities (both branches), the emulated-dtype warning, the probe
cache, the machine report, and the simulator's measured cpu-here hardware."""
from __future__ import annotations

import json
import warnings

import pytest

from moeflow.hardware import Capability, EmulatedDtypeWarning, GemmRates, decide_dtype
from moeflow.hardware import dtype as dtype_mod


def _cap(native, flags=(), isa="AVX2") -> Capability:
    return Capability("cpu", "Test CPU", isa, tuple(flags), 2, "2.13.0+cpu", tuple(native))


AVX2 = _cap(["float32"], ["avx2", "fma"])
AVX512_BF16 = _cap(["float32", "bfloat16"], ["avx2", "avx512f", "avx512_bf16"], "AVX512")
SAPPHIRE = _cap(["float32", "bfloat16", "float16"], ["avx512_bf16", "amx_bf16", "amx_fp16"], "AVX512")
# measured on the two machines the project has seen (docs/results): bf16 emulated ~70x slower on
# the AVX2 Zen 3, ~2x faster than fp32 with AVX512_BF16
RATES_AVX2 = GemmRates(AVX2.key, {"float32": 91.0, "bfloat16": 1.3, "float16": 1.4}, (256, 256, 256))
RATES_BF16 = GemmRates(AVX512_BF16.key, {"float32": 110.0, "bfloat16": 208.0, "float16": 1.5}, (256, 256, 256))


def test_auto_picks_float32_where_bf16_is_emulated():
    c = decide_dtype("auto", "bfloat16", AVX2, RATES_AVX2)
    assert c.dtype == "float32" and not c.emulated
    assert "AVX512_BF16" in c.reason and "70.0x" in c.reason


def test_auto_keeps_the_checkpoint_dtype_where_it_is_native():
    c = decide_dtype("auto", "bfloat16", AVX512_BF16, RATES_BF16)
    assert c.dtype == "bfloat16" and "AVX512_BF16" in c.reason
    assert decide_dtype("auto", "torch.bfloat16", AVX512_BF16, None).dtype == "bfloat16"  # flags alone


def test_auto_distrusts_a_flag_the_probe_contradicts():
    slow = GemmRates(AVX512_BF16.key, {"float32": 110.0, "bfloat16": 2.0, "float16": 1.5}, (256, 256, 256))
    c = decide_dtype("auto", "bfloat16", AVX512_BF16, slow)
    assert c.dtype == "float32" and "probe" in c.reason


def test_auto_for_float16_and_float32_checkpoints():
    assert decide_dtype("auto", "float32", SAPPHIRE, None).dtype == "float32"
    assert decide_dtype("auto", None, SAPPHIRE, None).dtype == "float32"  # HF's default when unstated
    assert decide_dtype("auto", "float16", SAPPHIRE, None).dtype == "float16"
    # fp16 emulated, bf16 native: bf16, as vLLM does on CPUs
    assert decide_dtype("auto", "float16", AVX512_BF16, RATES_BF16).dtype == "bfloat16"
    assert decide_dtype("auto", "float16", AVX2, RATES_AVX2).dtype == "float32"  # fp16 nowhere emulated


def test_explicit_dtype_is_kept_and_flagged_when_emulated():
    c = decide_dtype("bfloat16", "bfloat16", AVX2, RATES_AVX2)
    assert c.dtype == "bfloat16" and c.emulated and c.slowdown == pytest.approx(70.0)
    assert not decide_dtype("bf16", None, AVX512_BF16, RATES_BF16).emulated
    assert not decide_dtype("float32", "bfloat16", AVX2, RATES_AVX2).emulated
    with pytest.raises(ValueError, match="dtype must be one of"):
        decide_dtype("int8", None, AVX2, RATES_AVX2)


def test_resolve_warns_once_for_an_emulated_dtype(monkeypatch):
    monkeypatch.setattr(dtype_mod, "detect", lambda device="cpu": AVX2)
    monkeypatch.setattr(dtype_mod, "probe_rates", lambda cap: RATES_AVX2)
    monkeypatch.setattr(dtype_mod, "_warned", set())
    with pytest.warns(EmulatedDtypeWarning, match=r"70\.0x the time"):
        assert dtype_mod.resolve_dtype("bfloat16", "bfloat16").dtype == "bfloat16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second deployment in the same process: no second warning
        assert dtype_mod.resolve_dtype("bfloat16", "bfloat16").emulated
        assert dtype_mod.resolve_dtype("auto", "bfloat16").dtype == "float32"


def test_the_probe_is_cached_per_machine(tmp_path, monkeypatch):
    from moeflow.hardware import probe

    monkeypatch.setenv("MOEFLOW_CACHE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(probe, "_measure", lambda cap: calls.append(cap) or RATES_AVX2)
    assert probe.probe_rates(AVX2).gflops == RATES_AVX2.gflops
    assert probe.probe_rates(AVX2).gflops == RATES_AVX2.gflops
    assert len(calls) == 1  # the second start-up read the cache
    (f,) = (tmp_path / "hardware").iterdir()
    assert AVX2.key in f.name and json.loads(f.read_text())["capability"]["isa"] == "AVX2"
    other = _cap(["float32"], ["avx2"], "AVX2")  # another CPU (flags differ): another key, measured anew
    probe.probe_rates(other)
    assert len(calls) == 2 and other.key != AVX2.key


def test_gemm_probe_measures_this_machine():
    import torch

    from moeflow.hardware import gemm_gflops

    assert gemm_gflops(torch.float32, (64, 64, 64), budget_s=0.01) > 0.1


def test_machine_report_and_the_simulators_measured_hardware(capsys, monkeypatch):
    from moeflow.cli import main
    from moeflow.sim.hardware import cpu_hardware, hardware_preset

    assert main(["env", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["cores"] >= 1 and r["isa"] and r["torch"]
    assert set(r["gemm"]) == {"float32", "bfloat16", "float16"} and r["gemm"]["float32"]["gflops"] > 1
    assert r["memcpy_gbps"] > 0.1 and 0 < r["shm_flag_round_trip_us"] < 1e4
    assert r["auto_dtype"] in r["native_dtypes"]
    hw = cpu_hardware(r, "float32")
    assert hw.flops == pytest.approx(r["gemm"]["float32"]["gflops"] * 1e9)
    assert hw.mem_bw_Bps == pytest.approx(r["memcpy_gbps"] * 1e9)
    assert hardware_preset("cpu-here", r).flops == pytest.approx(r["gemm"][r["auto_dtype"]]["gflops"] * 1e9)
    with pytest.raises(ValueError, match="moeflow env --json"):
        hardware_preset("cpu-here")
    monkeypatch.setattr("moeflow.hardware.report.measure", lambda: r)  # the table of the report just measured
    assert main(["env"]) == 0 and "dtype='auto' picks" in capsys.readouterr().out
