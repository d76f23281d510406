"""Decode attention over the paged KV cache: the in-place kernel against the float32 oracle
(``attention_reference``) and the gather path, its wiring into attention, and how it is built."""
from __future__ import annotations

import os

import pytest
import torch

from moeflow.model import extension, paged_attention
from moeflow.model.attention import attention_for
from moeflow.model.kv_cache import AttentionMetadata, KVCache
from moeflow.model.layers import attention_core, attention_reference
from moeflow.model.weights import load_weights
from moeflow.model.paged_attention import (DecodeBatch, batched_decode_attention, gathered_decode_attention,
                                           kernel_status, paged_decode_attention, path_for, uses_kernel)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def kernel():
    status = kernel_status()
    if not status.available:
        pytest.skip(f"the paged attention kernel could not be built here (no C++ compiler?): {status.reason}")
    return status


def _paged(b: int, hkv: int, dk: int, dv: int, block_size: int, max_len: int, dtype, seed: int, latent: bool = False):
    """A cache with shuffled blocks, mixed context lengths (not multiples of the block size) and a
    block 0 that no request owns (padding points at it). -> k, v views, tables, lens."""
    g = torch.Generator().manual_seed(seed)
    per = -(-max_len // block_size)
    num_blocks = b * per + 1
    n = num_blocks * block_size
    if latent:  # MLA: one kv head; values are the first dv columns of the key rows
        rows = torch.randn(n, dk, generator=g).to(dtype)  # [N, Dk]
        k, v = rows.unsqueeze(1), rows[:, None, :dv]
    else:
        k = torch.randn(n, hkv, dk, generator=g).to(dtype)  # [N, Hkv, Dk]
        v = torch.randn(n, hkv, dv, generator=g).to(dtype)  # [N, Hkv, Dv]
    lens = torch.randint(1, max_len + 1, (b,), generator=g, dtype=torch.int32)
    lens[0] = max_len  # the longest sets the table width
    tables = torch.zeros(b, per, dtype=torch.int32)
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    for i, n_keys in enumerate(lens.tolist()):
        used = -(-n_keys // block_size)
        tables[i, :used] = torch.tensor(ids[:used], dtype=torch.int32)
        ids = ids[used:]
    return k, v, tables, lens


def _reference(q, k, v, tables, lens, block_size) -> torch.Tensor:
    """attention_reference per request, on the request's keys copied out of the cache (float32)."""
    out = []
    for i, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        slots = tables[i].long()[pos // block_size] * block_size + pos % block_size
        out.append(attention_reference(q[i:i + 1].float(), k[slots].float(), v[slots].float(), n - 1)[0])
    return torch.stack(out)  # [B, Hq, Dv]


SHAPES = [(g, hkv, d) for g in (1, 2, 4, 8) for hkv, d in ((2, 64), (1, 128))]


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("group,hkv,d", SHAPES)
def test_kernel_matches_the_reference_fp32(kernel, group, hkv, d, block_size):
    k, v, tables, lens = _paged(5, hkv, d, d, block_size, 45, torch.float32, seed=group * d + block_size)
    q = torch.randn(5, group * hkv, d, generator=torch.Generator().manual_seed(1))
    out = paged_decode_attention(q, k, v, tables, lens, block_size)
    torch.testing.assert_close(out, _reference(q, k, v, tables, lens, block_size), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group,hkv,d", [(4, 2, 64), (8, 1, 128)])
def test_kernel_close_to_the_reference_in_half_precision(kernel, dtype, group, hkv, d):
    k, v, tables, lens = _paged(4, hkv, d, d, 16, 70, dtype, seed=3)
    q = torch.randn(4, group * hkv, d, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = paged_decode_attention(q, k, v, tables, lens, 16)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), _reference(q, k, v, tables, lens, 16), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_kernel_reads_mla_latents_through_a_view(kernel, dtype, atol, block_size):
    # DeepSeek's shape: keys the whole [c_kv | k_pe] row (512 + 64), values a view of c_kv
    k, v, tables, lens = _paged(3, 1, 576, 512, block_size, 37, dtype, seed=4, latent=True)
    assert v.data_ptr() == k.data_ptr() and not v.is_contiguous()
    q = torch.randn(3, 16, 576, generator=torch.Generator().manual_seed(5)).to(dtype)
    out = paged_decode_attention(q, k, v, tables, lens, block_size, scale=0.07)
    ref = _reference(q * 0.07 * 576 ** 0.5, k, v, tables, lens, block_size)  # the oracle scales by Dk^-0.5
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=atol)


def test_kernel_matches_the_gather_path_on_odd_dims(kernel):
    # head dims that are not a whole number of vectors, Dk != Dv, seven query heads on one kv head
    k, v, tables, lens = _paged(4, 1, 20, 12, 3, 31, torch.float32, seed=6)
    q = torch.randn(4, 7, 20, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(paged_decode_attention(q, k, v, tables, lens, 3),
                               gathered_decode_attention(q, k, v, tables, lens, 3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("group,hkv,d", SHAPES)
def test_the_batched_path_matches_the_reference_fp32(group, hkv, d, block_size):
    """The path a GPU takes (one gather and one SDPA for the batch), on the CPU: padding slots of
    shorter requests point at block 0 and are masked."""
    k, v, tables, lens = _paged(5, hkv, d, d, block_size, 45, torch.float32, seed=group * d + block_size)
    q = torch.randn(5, group * hkv, d, generator=torch.Generator().manual_seed(1))
    out = batched_decode_attention(q, k, v, tables, lens, block_size)
    torch.testing.assert_close(out, _reference(q, k, v, tables, lens, block_size), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_batched_path_reads_mla_latents_and_odd_dims(dtype, atol):
    k, v, tables, lens = _paged(3, 1, 576, 512, 16, 37, dtype, seed=4, latent=True)
    q = torch.randn(3, 16, 576, generator=torch.Generator().manual_seed(5)).to(dtype)
    out = batched_decode_attention(q, k, v, tables, lens, 16, scale=0.07)
    assert out.dtype == dtype and out.shape == (3, 16, 512)
    ref = _reference(q * 0.07 * 576 ** 0.5, k, v, tables, lens, 16)
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=atol)
    k, v, tables, lens = _paged(4, 1, 20, 12, 3, 31, torch.float32, seed=6)
    q = torch.randn(4, 7, 20, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(batched_decode_attention(q, k, v, tables, lens, 3),
                               gathered_decode_attention(q, k, v, tables, lens, 3), atol=1e-5, rtol=1e-5)


def test_kernel_rejects_a_block_outside_the_cache(kernel):
    k, v, tables, lens = _paged(2, 2, 64, 64, 16, 20, torch.float32, seed=8)
    tables[1, 0] = k.shape[0] // 16  # one past the last block
    with pytest.raises(RuntimeError, match="outside the cache"):
        paged_decode_attention(torch.randn(2, 4, 64), k, v, tables, lens, 16)


# -- wiring ------------------------------------------------------------------------------------

HQ, HKV, D, BLOCK = 8, 2, 16, 4


def _mixed_batch(cache: KVCache) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prefill two requests, then one batch of: two decodes, a chunk over context, a fresh prefill."""
    g = torch.Generator().manual_seed(9)
    tables = [(11, 3, 8, 0), (5, 9, 2), (1, 7), (4, 6, 10)]
    first = AttentionMetadata.build([9, 6, 5], [0, 0, 0], tables[:3], BLOCK)
    attention_core(torch.randn(20, HQ, D, generator=g), torch.randn(20, HKV, D, generator=g),
                   torch.randn(20, HKV, D, generator=g), first, cache, 0)
    meta = AttentionMetadata.build([1, 1, 3, 5], [9, 6, 5, 0], tables, BLOCK)
    return (meta, torch.randn(10, HQ, D, generator=g), torch.randn(10, HKV, D, generator=g),
            torch.randn(10, HKV, D, generator=g))


def test_decode_batch_is_built_once_per_batch():
    meta = AttentionMetadata.build([1, 4, 1, 1], [7, 0, 3, 0], [(2, 5), (1,), (0,), (3,)], 4)
    d = meta.decode
    assert meta.decode is d  # every layer reads the same tensors
    assert d.rows.tolist() == [0, 5]  # the third request's row; the last request has no context
    assert d.context_lens.tolist() == [8, 4] and d.context_lens.dtype == torch.int32
    assert d.block_tables.tolist() == [[2, 5], [0, 0]]
    assert AttentionMetadata.no_cache([3, 1]).decode is None


def test_attention_core_kernel_equals_gather_on_a_mixed_batch(kernel, monkeypatch):
    outs = {}
    for mode in ("kernel", "gather"):
        monkeypatch.setenv("MOEFLOW_PAGED_ATTENTION", mode)
        cache = KVCache({"k": (HKV, D), "v": (HKV, D)}, 1, 12, BLOCK, torch.float32)
        meta, q, k, v = _mixed_batch(cache)
        outs[mode] = attention_core(q, k, v, meta, cache, 0)
    torch.testing.assert_close(outs["kernel"], outs["gather"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v32"])
def test_mla_decode_in_place_equals_the_per_request_absorbed_path(kernel, checkpoints, name):
    cfg, w = load_weights(checkpoints(name).path, torch.float32)
    g = torch.Generator().manual_seed(10)
    prompt = AttentionMetadata.build([9, 6], [0, 0], [(3, 0, 5), (1, 4)], BLOCK)
    x0 = torch.randn(15, cfg.hidden_size, generator=g)
    step = AttentionMetadata.build([1, 3, 1], [9, 6, 0], [(3, 0, 5), (1, 4, 2), (6,)], BLOCK)
    x1 = torch.randn(5, cfg.hidden_size, generator=g)
    outs = []
    for in_place in (True, False):  # False: each request gathers its latents and runs ``absorbed``
        kind = attention_for(cfg)
        kind.decode_in_place = in_place and kind.decode_in_place  # DSA keeps its gather either way
        cache = KVCache.for_model(cfg, num_blocks=8, block_size=BLOCK, dtype=torch.float32)
        kind.forward(w.attention[1], x0, prompt, cache, 1, None)
        outs.append(kind.forward(w.attention[1], x1, step, cache, 1, None))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_mode_is_validated_and_a_non_cpu_device_takes_the_batched_path(monkeypatch):
    monkeypatch.setenv("MOEFLOW_PAGED_ATTENTION", "fast")
    with pytest.raises(ValueError, match="MOEFLOW_PAGED_ATTENTION='fast'"):
        uses_kernel(torch.device("cpu"))
    monkeypatch.setenv("MOEFLOW_PAGED_ATTENTION", "gather")
    assert not uses_kernel(torch.device("cpu")) and path_for(torch.device("cpu")) == "gather"
    monkeypatch.setenv("MOEFLOW_PAGED_ATTENTION", "batched")
    assert path_for(torch.device("cpu")) == "batched"
    monkeypatch.setenv("MOEFLOW_PAGED_ATTENTION", "auto")
    assert not uses_kernel(torch.device("meta")) and path_for(torch.device("meta")) == "batched"
    monkeypatch.setenv("MOEFLOW_PAGED_ATTENTION", "kernel")
    with pytest.raises(RuntimeError, match="CPU-only"):
        uses_kernel(torch.device("meta"))


def test_a_failed_build_falls_back_with_one_warning(monkeypatch, caplog):
    def broken(name, path):
        raise extension.ExtensionError("no C++ compiler: 'c++' is not on PATH")

    monkeypatch.setattr(paged_attention, "load_extension", broken)
    paged_attention.kernel_status.cache_clear()
    try:
        monkeypatch.setenv("MOEFLOW_PAGED_ATTENTION", "auto")
        assert not uses_kernel(torch.device("cpu")) and not uses_kernel(torch.device("cpu"))
        warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
        assert len(warnings) == 1 and "no C++ compiler" in warnings[0].getMessage()
        monkeypatch.setenv("MOEFLOW_PAGED_ATTENTION", "kernel")
        with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
            uses_kernel(torch.device("cpu"))
    finally:
        paged_attention.kernel_status.cache_clear()


# -- building ----------------------------------------------------------------------------------

def test_missing_compiler_is_named(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(extension.ExtensionError, match="no C\\+\\+ compiler: 'no-such-compiler-xyz'"):
        extension.load_extension("moeflow_paged_attention", paged_attention._SOURCE)


def test_the_build_key_follows_source_and_cpu(monkeypatch):
    key = extension.build_key("src", extension.CFLAGS, "c++")
    assert extension.build_key("src2", extension.CFLAGS, "c++") != key
    monkeypatch.setattr(extension, "cpu_flags", lambda: {"avx512f"})
    assert extension.build_key("src", extension.CFLAGS, "c++") != key


def test_a_lock_left_by_a_killed_build_is_removed(kernel):
    with open(os.path.join(os.path.dirname(kernel.reason), "lock"), "w"):
        pass  # what torch's FileBaton leaves when its builder dies mid-build
    ext = extension.load_extension("moeflow_paged_attention", paged_attention._SOURCE)  # would wait forever
    assert not ext.built and not os.path.exists(os.path.join(ext.build_dir, "lock"))


def test_a_failed_build_is_remembered(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++\n")
    with pytest.raises(extension.ExtensionError, match="building moeflow_bad failed"):
        extension.load_extension("moeflow_bad", str(bad))
    with pytest.raises(extension.ExtensionError, match="an earlier build failed"):
        extension.load_extension("moeflow_bad", str(bad))


def test_decode_batch_rows_skip_prefill():
    assert DecodeBatch.build([3, 2], [0, 4], [(0,), (1, 2)], 4) is None
