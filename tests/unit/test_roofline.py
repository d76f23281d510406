"""``moeflow bench roofline``: its random model, its byte counts, and one small run whose JSON must
be whole and agree with itself (rates = work / time, shares = rate / ceiling, bytes growing with
the batch), in a subprocess where the server's packages cannot be imported (the GPU machine's)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from moeflow.bench.flops import prefill_flops
from moeflow.bench.step_bytes import decode_step_bytes, expert_nbytes, weights_nbytes
from moeflow.config import ConfigError
from moeflow.model.family import family_for, load_families
from moeflow.model.random_weights import RandomReader, random_weights
from moeflow.model.shapes import PRESETS, first_layers, shape_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the bench command, with the server's packages refused as on the GPU machine (which has none of them)
_BARE = """
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("fastapi", "uvicorn", "prometheus_client", "starlette", "httpx"):
            raise ImportError(f"{name} refused")
sys.meta_path.insert(0, Refuse())
from moeflow.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _config(hf):
    load_families()
    return family_for(hf).to_model_config(hf)


def test_the_presets_translate_to_their_models_shapes():
    q = _config(PRESETS["qwen3-30b-a3b"].hf)
    assert (q.num_layers, q.hidden_size, q.num_heads, q.num_kv_heads, q.head_dim) == (48, 2048, 32, 4, 128)
    assert (q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size, q.vocab_size) == (128, 8, 768, 151936)
    assert all(q.sparse_layers) and not q.tie_word_embeddings
    d = _config(PRESETS["deepseek-v2-lite"].hf)
    assert d.attention_kind == "mla" and (d.q_lora_rank, d.kv_lora_rank, d.qk_rope_head_dim) == (0, 512, 64)
    assert (d.num_experts, d.num_experts_per_tok, d.shared_expert_intermediate_size) == (64, 6, 2 * 1408)
    assert d.sparse_layers[:2] == (False, True) and d.intermediate_size == 10944
    assert "V3" in PRESETS["deepseek-v2-lite"].note  # the stand-in router is said, not hidden


def test_a_cut_keeps_the_leading_dense_layer_and_at_least_one_moe_layer():
    hf = PRESETS["deepseek-v2-lite"].hf
    assert _config(first_layers(hf, 3)).sparse_layers == (False, True, True)
    assert _config(first_layers(hf, 1)).sparse_layers == (True,)
    with pytest.raises(ConfigError, match="layers must be in 1..27"):
        first_layers(hf, 28)
    with pytest.raises(ConfigError, match="unknown shape"):
        shape_for("no-such-shape")


def test_a_shape_is_also_read_from_a_config_json_or_its_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny-mla"].hf))
    for where in (tmp_path, tmp_path / "config.json"):
        s = shape_for(str(where))
        assert s.hf == PRESETS["tiny-mla"].hf and s.name == str(where) and s.note == ""


def test_random_tensors_depend_on_seed_and_key_only():
    r = RandomReader(torch.float32, seed=3)
    a = r.get("model.layers.0.mlp.gate.weight", (64, 256))
    r.get("model.embed_tokens.weight", (10, 256))  # drawn in between: changes nothing
    assert torch.equal(a, r.get("model.layers.0.mlp.gate.weight", (64, 256)))
    assert not torch.equal(a, RandomReader(torch.float32, seed=4).get("model.layers.0.mlp.gate.weight", (64, 256)))
    assert abs(a.std().item() - 256 ** -0.5) < 0.1 * 256 ** -0.5  # N(0, 1/fan_in)
    assert torch.equal(r.get("model.layers.0.input_layernorm.weight", (8,)), torch.ones(8))
    assert torch.equal(r.get("model.layers.3.mlp.gate.e_score_correction_bias", (8,)), torch.zeros(8))


def test_decode_bytes_count_each_touched_expert_once_and_every_other_weight():
    cfg, w = random_weights(first_layers(PRESETS["tiny-mla"].hf, 3), torch.float32)
    assert cfg.sparse_layers == (False, True, True)
    h, f = cfg.hidden_size, cfg.moe_intermediate_size
    assert expert_nbytes(w) == 3 * h * f * 4
    b = decode_step_bytes(w, {1: 5, 2: 7}, num_tokens=3, kv_read_bytes=1000)
    assert b["experts"] == 12 * expert_nbytes(w) and b["kv_cache"] == 1000 and b["embedding_rows"] == 3 * h * 4
    assert b["total"] == sum(v for k, v in b.items() if k != "total")
    # a step touching every expert reads every weight but the embedding table, once
    everything = decode_step_bytes(w, {1: cfg.num_experts, 2: cfg.num_experts}, 0, 0)["total"]
    assert everything == weights_nbytes(w) - w.embed.nbytes


def test_roofline_json_is_whole_and_consistent(tmp_path):
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    args = ["bench", "roofline", "--shape", "tiny", "--layers", "2", "--device", "cpu", "--dtype", "float32",
            "--prefill-batch", "2", "--prefill-len", "48", "--prefill-repeats", "1", "--decode-batches", "4", "1",
            "--context", "40", "--block-size", "16", "--repeats", "2", "--json", str(out), "--md", str(md)]
    env = {**os.environ, "MOEFLOW_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _BARE, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["schema"] == "moeflow.bench.roofline/1" and res["errors"] == {}
    assert res["provenance"]["commit"] and res["dtype"] == "float32" and res["device"]["kind"] == "cpu"
    assert res["shape"]["layers"] == 2 and res["shape"]["layers_total"] == 8 and res["shape"]["moe_layers"] == 2
    cfg = _config(res["shape"]["hf_config"])
    gemm, copy = res["ceilings"]["gemm"]["flop_per_s"], res["ceilings"]["copy"]["bytes_per_s"]
    assert gemm > 0 and copy > 0 and res["ceilings"]["datasheet"] is None

    p = res["prefill"]
    assert p["flops"] == pytest.approx(prefill_flops(cfg, [48, 48]))
    assert p["flop_per_s"] == pytest.approx(p["flops"] / p["seconds"])
    assert p["share_of_gemm"] == pytest.approx(p["flop_per_s"] / gemm) and 0 < p["share_of_gemm"] <= 1.5
    assert p["share_of_datasheet"] is None and len(p["seconds_all"]) == 1

    d1, d4 = res["decode"]  # in batch order
    kv_token_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # k and v, float32
    for d in (d1, d4):
        b = d["bytes"]
        assert b["total"] == sum(v for k, v in b.items() if k != "total")
        assert b["kv_cache"] == d["batch"] * (40 + 1) * kv_token_bytes
        assert len(d["experts_touched"]) == 2
        assert all(cfg.num_experts_per_tok <= n <= min(cfg.num_experts, d["batch"] * cfg.num_experts_per_tok)
                   for n in d["experts_touched"])
        assert b["experts"] == sum(d["experts_touched"]) * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
        assert d["tokens_per_s"] == pytest.approx(d["batch"] / d["seconds"]) and len(d["seconds_all"]) == 2
        assert d["bytes_per_s"] == pytest.approx(b["total"] / d["seconds"])
        assert d["share_of_copy"] == pytest.approx(d["bytes_per_s"] / copy) and 0 < d["share_of_copy"] <= 1.5
        assert d["copy_bound_s"] == pytest.approx(b["total"] / copy)
    assert d1["experts_touched"] == [cfg.num_experts_per_tok] * 2  # one token: its own top-k
    assert d4["bytes"]["total"] > d1["bytes"]["total"] and d4["bytes"]["attention"] == d1["bytes"]["attention"]

    prof = res["profile"]
    assert prof["batch"] == 1 and prof["ops"] > 0 and 0 < prof["busy_share"] <= 1
    assert [t["seconds"] for t in prof["top"]] == sorted((t["seconds"] for t in prof["top"]), reverse=True)
    text = md.read_text()
    assert "## Prefill" in text and "## Decode" in text and "shape tiny" in text and "moeflow bench roofline" in text


def test_a_model_too_big_for_the_memory_is_refused_before_it_is_made(tmp_path):
    env = {**os.environ, "MOEFLOW_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "moeflow", "bench", "roofline", "--shape", "qwen3-30b-a3b",
                        "--layers", "2", "--device", "cpu", "--decode-batches", "100000"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "pass fewer --layers or smaller --decode-batches" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_ceilings_only_measures_the_device_and_makes_no_model(tmp_path, capsys):
    from moeflow.cli import build_parser

    out = tmp_path / "c.json"
    args = build_parser().parse_args(["bench", "roofline", "--ceilings-only", "--device", "cpu", "--dtype", "float32",
                                      "--json", str(out)])
    assert args.func(args) == 0
    res = json.loads(out.read_text())
    assert res["weights"] is None and res["prefill"] is None and res["decode"] == [] and res["profile"] is None
    assert res["ceilings"]["gemm"]["flop_per_s"] > 0 and res["ceilings"]["copy"]["bytes_per_s"] > 0
    assert res["device"]["name"] and "no model (ceilings only)" in capsys.readouterr().out


def _event(name, start_us, end_us, device="CPU", kind="cpu_op", parent=None, self_us=None):
    from types import SimpleNamespace

    return SimpleNamespace(name=name, device_type=SimpleNamespace(name=device), activity_type=kind,
                           time_range=SimpleNamespace(start=start_us, end=end_us), cpu_parent=parent,
                           self_cpu_time_total=end_us - start_us if self_us is None else self_us)


def test_a_cuda_profile_counts_kernels_apart_from_copies_and_busy_as_their_union():
    from moeflow.bench.step_profile import summarize

    launch = _event("aten::mm", 0, 10)
    events = [launch, _event("cudaLaunchKernel", 1, 2, kind="cuda_runtime"),
              _event("gemm_kernel", 5, 45, device="CUDA", kind="kernel"),
              _event("gemm_kernel", 40, 60, device="CUDA", kind="kernel"),  # overlaps the first: 5..60 busy
              _event("Memcpy DtoH (Device -> Pinned)", 80, 100, device="CUDA", kind="gpu_memcpy"),
              _event("annotation", 0, 100, device="CUDA", kind="gpu_user_annotation")]
    s = summarize(events, "cuda")
    assert s["ops"] == 2 and s["copies"] == 1 and s["ops_what"] == "CUDA kernels launched"
    assert s["span_s"] == pytest.approx(100e-6) and s["busy_s"] == pytest.approx(75e-6)
    assert s["busy_share"] == pytest.approx(0.75)
    assert s["top"][0] == {"name": "gemm_kernel", "count": 2, "seconds": pytest.approx(60e-6),
                           "share_of_span": pytest.approx(0.6)}


def test_a_cpu_profile_counts_top_level_ops_and_ranks_by_self_time():
    from moeflow.bench.step_profile import summarize

    linear = _event("aten::linear", 0, 50, self_us=5)
    events = [linear, _event("aten::mm", 5, 50, parent=linear), _event("aten::add", 60, 70),
              _event("[memory]", 0, 0, kind=None)]
    s = summarize(events, "cpu")
    assert s["ops"] == 2 and s["copies"] is None
    assert s["busy_s"] == pytest.approx(60e-6) and s["busy_share"] == pytest.approx(60 / 70)
    assert [t["name"] for t in s["top"]] == ["aten::mm", "aten::add", "aten::linear"]


def test_datasheet_peaks_are_given_for_the_parts_listed_only():
    from moeflow.bench.ceilings import datasheet_named

    assert datasheet_named("NVIDIA H200").bytes_per_s == 4.8e12
    assert datasheet_named("NVIDIA H100 80GB HBM3").name == "NVIDIA H100 SXM"
    assert datasheet_named("NVIDIA H200").flop_per_s["bfloat16"] == 989.5e12
    assert datasheet_named("NVIDIA H100 PCIe") is None and datasheet_named("NVIDIA H200 NVL") is None
