"""Prefill and decode servers' roles without HTTP: a prefill deployment answers with a handle to its
staged KV (through its JSON form, as the router passes it), a decode deployment of another mode
takes the KV over the KV link and decodes. Greedy outputs and prompt logprobs equal colocated's;
the decode side computed no prompt; every block and range returns on both sides."""
from __future__ import annotations

import dataclasses
import time

import pytest

from moeflow import LLM, SamplingParams
from moeflow.core import Request
from moeflow.engine.output import OutputTracker
from moeflow.kv_handle import KvHandle

from parity import PARAMS, PROMPTS, assert_same, colocated_outputs

ASAP = {"mode": "asap", "attn_dp": 1, "moe_workers": 1, "min_batch_tokens": 8, "max_batch_tokens": 128,
        "max_batch_wait_s": 0.005}
AFD = {"mode": "afd", "attn_workers": 1, "ffn_workers": 1, "micro_batches": 2}


def run_split(p: LLM, d: LLM, prompts, params: SamplingParams, tamper=None, timeout_s: float = 60.0):
    """What ``moeflow router`` does, in process: each prompt to the prefill side with max_tokens=1 and
    a remote decode asked for, its handle (through JSON) to the decode side with the original params."""
    trackers, handles, done = {}, {}, set()
    for i, ids in enumerate(prompts):
        first = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        r = p.make_request({"prompt_token_ids": ids}, first, f"p{i}")
        r.kv_handoff = True
        p.engine.add_request(r)
    pending = {f"p{i}" for i in range(len(prompts))}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pending:
            res = p.engine.step()
            for r in res.finished:
                pending.discard(r.request_id)
                assert r.error is None and r.kv_handle is not None, r.error
                params_json = r.kv_handle.to_params()
                h = KvHandle.from_params(tamper(params_json) if tamper else params_json)
                i = int(r.request_id[1:])
                rd = d.make_request({"prompt_token_ids": prompts[i]}, params, f"d{i}")
                rd.kv_source = h
                d.engine.add_request(rd)
                trackers[rd.request_id] = OutputTracker(rd, d.tokenizer)
                handles[rd.request_id] = h
        res = d.engine.step()
        for rid, o in res.outputs.items():
            trackers[rid].on_step(o)
        done |= {r.request_id for r in res.finished}
        if not pending and len(done) == len(prompts):
            break
        p.engine.check_workers()
    assert len(done) == len(prompts)
    return [trackers[f"d{i}"].output() for i in range(len(prompts))], handles


def assert_roles_clean(p: LLM, d: LLM) -> None:
    deadline = time.monotonic() + 5
    while p.engine.offered and time.monotonic() < deadline:  # releases cross the link, then are reaped
        time.sleep(0.01)
        p.engine.check_workers()
    for e in (p.engine, d.engine):
        pool = e.inner.scheduler.pool
        assert not pool.leases and not e.inner.handoff_port().arrivals.reserved
        assert all(g.allocator.num_free == g.allocator.num_blocks for g in pool.groups)
    assert p.engine.kv.heap.used_bytes == 0 and not p.engine.staging and not p.engine.offered and not p.engine.leased
    assert d.engine.kv.heap.used_bytes == 0 and not d.engine.incoming


@pytest.mark.parametrize("name,prefill,decode,in_place", [
    ("qwen3", dict(ASAP, attn_tp=2), AFD, True),  # heads split on the prefill side, whole on the decode side
    ("qwen3", dict(ASAP, attn_tp=2), AFD, False),  # staged: copied out into the arena, then in
    pytest.param("deepseek_v3", {"mode": "colocated"}, {"mode": "dep", "dp": 2}, True,  # MLA's latent rows
                 marks=pytest.mark.slow),
])
def test_roles_match_colocated(checkpoints, name, prefill, decode, in_place):
    ref = colocated_outputs(checkpoints, (name,))[name]
    path = checkpoints(name).path
    with LLM(path, dtype="float32", kv_transfer_config={"role": "prefill", "in_place": in_place}, **prefill) as p, \
            LLM(path, dtype="float32", kv_transfer_config={"role": "decode"}, **decode) as d:
        outs, handles = run_split(p, d, PROMPTS, PARAMS)
        assert_same(outs, ref)
        assert all(h.in_place == in_place for h in handles.values())
        st = d.engine.kv.stats
        assert st.transfers == len(PROMPTS) and st.recomputes == 0 and st.failures == 0
        assert st.bytes_total == sum(d.engine.kv.bytes_for(len(x)) for x in PROMPTS)
        assert_roles_clean(p, d)


def test_a_decode_server_of_another_model_refuses_the_handle(checkpoints):
    path = checkpoints("qwen3").path
    with LLM(path, dtype="float32", kv_transfer_config={"role": "prefill"}) as p, \
            LLM(checkpoints("deepseek_v3").path, dtype="float32", kv_transfer_config={"role": "decode"}) as d:
        r = p.make_request({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=1, temperature=0), "x")
        r.kv_handoff = True
        p.engine.add_request(r)
        while not (fin := p.engine.step().finished):
            pass
        rd = d.make_request({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4), "y")
        rd.kv_source = fin[0].kv_handle
        with pytest.raises(ValueError, match="prefilled by Qwen3MoeForCausalLM.*this decode server runs Deepseek"):
            d.engine.add_request(rd)


def test_another_host_pulls_over_gloo(checkpoints):
    """A handle from another host (its host id differs): the decode side pulls the range over the
    link's gloo pair into its own arena; outputs as colocated."""
    ref = colocated_outputs(checkpoints, ("deepseek_v32",))["deepseek_v32"]
    path = checkpoints("deepseek_v32").path  # DSA: latent rows and indexer keys
    with LLM(path, dtype="float32", kv_transfer_config={"role": "prefill"}) as p, \
            LLM(path, dtype="float32", kv_transfer_config={"role": "decode"}) as d:
        outs, handles = run_split(p, d, PROMPTS, PARAMS, tamper=lambda x: {**x, "remote_host_id": "another-host"})
        assert_same(outs, ref)
        assert not d.engine.arenas.attached  # nothing of the prefill side's shared memory was mapped
        assert d.engine.kv.stats.transfers == len(PROMPTS)
        assert_roles_clean(p, d)
