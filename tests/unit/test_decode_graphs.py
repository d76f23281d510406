"""Decode from CUDA graphs (``model/decode_graphs.py``), rehearsed on the CPU: the static buffers,
the padded batch and width buckets and the metadata built over them run eagerly
(``MOEFLOW_DECODE_GRAPHS=eager``) and must give what the eager engine gives, token for token with
logprobs; graphs asked for where they cannot run are refused by name. The capture itself needs a
GPU (``tests/gpu/test_gpu_decode_graphs.py``)."""
from __future__ import annotations

import pytest
import torch

from moeflow import LLM, SamplingParams
from moeflow.config import ConfigError
from moeflow.core import Request
from moeflow.model.decode_graphs import DecodeGraphs, GraphUnavailable, bucket_of, buckets
from moeflow.model.op_count import OpCount


def test_buckets_cover_every_batch_up_to_the_limit_with_the_limit_last():
    assert buckets(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert [bucket_of(n, buckets(48)) for n in (1, 3, 5, 33, 48)] == [1, 4, 8, 48, 48]


def _generate(monkeypatch, graphs: bool, model: str = "tiny", **kw) -> tuple[list, int]:
    if graphs:
        monkeypatch.setenv("MOEFLOW_DECODE_GRAPHS", "eager")
    else:
        monkeypatch.delenv("MOEFLOW_DECODE_GRAPHS", raising=False)
    prompts = [[(5 * i + 7 * j) % 200 + 1 for j in range(3 + 11 * i)] for i in range(5)]  # 3 .. 47 tokens
    params = [SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3, logprobs=1)]
    with LLM(model, dtype="float32", num_kv_blocks=256, max_num_seqs=8, **kw) as llm:
        out = llm.generate(prompts * 2, [params[0]] * 5 + [params[1]] * 5)
        runner = getattr(llm.engine, "runner", None)
        replays = runner.graphs.replays if runner is not None and runner.graphs is not None else 0
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in out], replays


@pytest.mark.parametrize("model", ["tiny", "tiny-mla"])
def test_the_rehearsed_graph_path_decodes_what_the_eager_engine_decodes(monkeypatch, model):
    eager, none = _generate(monkeypatch, False, model)
    rehearsed, replays = _generate(monkeypatch, True, model)
    assert none == 0 and replays > 20  # decode steps went through the static buffers (10 requests, 5 at a time)
    for (ta, la), (tb, lb) in zip(eager, rehearsed):
        assert ta == tb
        for a, b in zip(la, lb):
            assert a.keys() == b.keys()
            for t in a:
                assert abs(a[t].logprob - b[t].logprob) < 1e-4


def test_a_padded_batch_returns_each_request_what_it_alone_would(monkeypatch):
    """3 requests run padded to the bucket of 4 (the pad repeats the first: same KV to the same slot),
    against the same 3 through the engine's own metadata, and each against itself alone."""
    monkeypatch.setenv("MOEFLOW_PAGED_ATTENTION", "batched")
    torch.manual_seed(0)
    with LLM("tiny", dtype="float32", num_kv_blocks=64, max_num_seqs=8) as llm:
        eng = llm.engine
        runner = eng.runner
        lens = [5, 19, 40]
        for i, n in enumerate(lens):
            eng.add_request(Request(f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=4, ignore_eos=True), 0.0))
        eng.step()  # the prompts
        graphs = DecodeGraphs(runner.model, runner.kv_cache, 8, 64, capture=False)
        tables = [eng.scheduler.pool.groups[0].allocator.table(f"r{i}") for i in range(3)]
        tokens = [runner.requests[f"r{i}"].token_ids[-1] for i in range(3)]
        with torch.inference_mode():
            padded = graphs.run(tokens, lens, tables)  # [3, H]
            assert graphs.tables.shape == (8, 4)  # widths 1, 2, 4 blocks (64 positions of 16)
            from moeflow.model.kv_cache import AttentionMetadata

            meta = AttentionMetadata.build([1, 1, 1], lens, tables, 16)
            eager = runner.model.forward(torch.tensor(tokens), meta, runner.kv_cache)
            alone = [runner.model.forward(torch.tensor(tokens[i:i + 1]),
                                          AttentionMetadata.build([1], lens[i:i + 1], tables[i:i + 1], 16),
                                          runner.kv_cache) for i in range(3)]
        torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(padded, torch.cat(alone), atol=1e-5, rtol=1e-5)


def test_the_rehearsed_step_launches_the_same_ops_at_any_batch_and_syncs_once(monkeypatch):
    monkeypatch.setenv("MOEFLOW_DECODE_GRAPHS", "eager")
    monkeypatch.setenv("MOEFLOW_PAGED_ATTENTION", "batched")
    counts = {}
    with LLM("tiny", dtype="float32", num_kv_blocks=1024, max_num_seqs=64) as llm:
        eng = llm.engine
        for b in (1, 8, 64):
            for i in range(b):
                eng.add_request(Request(f"{b}-{i}", list(range(1, 17)), SamplingParams(max_tokens=6, ignore_eos=True),
                                        0.0))
            eng.step(), eng.step()
            with OpCount() as c:
                assert len(eng.step().outputs) == b
            counts[b] = c
            while eng.has_unfinished():
                eng.step()
    ops = [c.ops for c in counts.values()]
    # NOTE: a batch of 1 takes a few views where larger ones take a contiguous(): 1219, 1217, 1215 ops
    assert max(ops) <= 1.01 * min(ops), ops
    assert all(c.syncs <= 1 for c in counts.values()), {b: dict(c.sync_sites) for b, c in counts.items()}


def test_graphs_asked_for_off_cuda_or_for_a_kind_that_decodes_per_request_are_refused(checkpoints):
    with pytest.raises(ConfigError, match="CUDA graphs need a CUDA device"):
        LLM("tiny", dtype="float32", num_kv_blocks=64, cuda_graph=True)
    with pytest.raises(ConfigError, match="not both"):
        LLM("tiny", dtype="float32", num_kv_blocks=64, cuda_graph=True, enforce_eager=True)
    with pytest.raises(GraphUnavailable, match="decodes request by request"):
        with LLM(checkpoints("deepseek_v32").path, dtype="float32", num_kv_blocks=64) as llm:
            DecodeGraphs(llm.engine.runner.model, llm.engine.runner.kv_cache, 4, 64, capture=False)
