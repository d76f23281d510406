"""CUDA transports between processes: mailbox payloads in device memory shared by CUDA IPC.

A two-process-per-role stress of the ``cuda-ipc`` transport with checksums against the in-process
reference (the CPU suite runs the same plan over host and deferred arenas), then the modes whose
processes exchange activations or weights, on one GPU, against colocated on that GPU: asap with
one attention and one MoE process, dep with two ranks (and with live rebalances moving experts
device to device), dwdp with two ranks pulling each other's experts device to device, afd with one
attention instance and one FFN daemon, and pd (asap prefill, dep decode) whose KV handoff is one copy
out of the prefill worker's cache, shared by CUDA IPC, into the decode ranks' (greedy tokens equal,
prompt logprobs within 1e-3 in float32).
Before them, the KV staging heap on its own: a member process opens the owner's device heap from
the handle in the segment and writes into it. dep, dep with EPLB and pd open their own process's
handles (every rank attaches every rank's mailbox; one process owns the arena and reads it): the
owner's tensor, never a second CUDA-IPC open, which CUDA refuses.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from cuda_support import DEVICE, GPU, TRANSPORT

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integration"))
from comm_deploy import SHM_STRESS, check_against_reference, run_deployment, stress_config  # noqa: E402
from comm_harness import Plan  # noqa: E402

pytestmark = GPU

PROMPTS = [[7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], list(range(40, 70)), list(range(3, 60))]


def test_cuda_ipc_stress_matches_reference(tmp_path):
    from moeflow.comm import list_segments

    config = stress_config(TRANSPORT, device=DEVICE, **SHM_STRESS)
    plan = Plan(seed=6, num_batches=200, inflight=2, device=DEVICE)
    results = run_deployment(config, plan, tmp_path, timeout_s=150.0)
    n = check_against_reference(config, plan, results)
    print(f"{TRANSPORT} stress: {n} messages")
    assert n >= 2000
    assert list_segments(config.deployment_id) == []


MEMBER = """
import sys, torch
from moeflow.comm.kv_arena import KvArena
arena = KvArena.attach(sys.argv[1])
assert arena.heap.device.type == sys.argv[2], arena.heap.device
arena.heap_view(4096, 1 << 20).copy_(torch.arange(1 << 20, device=arena.heap.device) % 251)
if sys.argv[2] == "cuda":
    torch.cuda.synchronize()  # the copy, before the flag (as a KV-holding worker does)
arena.flags[5, 0, 1] = 42
arena.close()
"""


def test_kv_heap_on_the_device_is_written_by_a_member_process(tmp_path):
    import torch

    from moeflow.comm.kv_arena import KvArena

    path = f"/dev/shm/moeflow-gpu-{os.getpid()}.kv-arena"
    owner = KvArena.create(path, 8 << 20, DEVICE, by_handle=True)
    try:
        assert owner.heap.device.type == DEVICE and os.path.getsize(path) < (1 << 20)  # the heap is not in the segment
        p = subprocess.run([sys.executable, "-c", MEMBER, path, DEVICE], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        deadline = time.monotonic() + 10
        while int(owner.flags[5, 0, 1]) != 42 and time.monotonic() < deadline:
            time.sleep(0.01)
        got = owner.heap_view(4096, 1 << 20)
        assert torch.equal(got, (torch.arange(1 << 20, device=got.device) % 251).to(torch.uint8))
    finally:
        owner.close()


@pytest.fixture(scope="module")
def colocated():
    from moeflow import LLM, SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=1, ignore_eos=True)
    with LLM("tiny", device=DEVICE, dtype="float32", num_kv_blocks=64) as llm:
        return params, llm.generate(PROMPTS, params)


EPLB = dict(num_redundant_experts=2, enable_eplb=True, eplb_config={"step_interval": 2, "window_size": 4})


@pytest.mark.parametrize("mode,layout", [("asap", dict(attn_dp=1, moe_workers=1)), ("dep", dict(dp=2)),
                                         ("dwdp", dict(dp=2)), ("afd", dict(attn_workers=1, ffn_workers=1)),
                                         ("dep", dict(dp=2, **EPLB))],  # live rebalances: moves device to device
                         ids=["asap", "dep", "dwdp", "afd", "dep-eplb"])
def test_modes_over_cuda_ipc_match_colocated(colocated, mode, layout):
    from moeflow import LLM

    params, refs = colocated
    with LLM("tiny", mode=mode, device=DEVICE, dtype="float32", num_kv_blocks=64, transport=TRANSPORT,
             **layout) as llm:
        rounds = [llm.generate(PROMPTS, params) for _ in range(3 if "enable_eplb" in layout else 1)]
        history = llm.engine.eplb.history if llm.engine.eplb is not None else []
    for outs in rounds:
        for o, r in zip(outs, refs, strict=True):
            assert o.error is None and o.outputs[0].token_ids == r.outputs[0].token_ids
            for x, y in zip(o.prompt_logprobs[1:], r.prompt_logprobs[1:], strict=True):
                assert x.keys() == y.keys() and max(abs(x[t].logprob - y[t].logprob) for t in x) < 1e-3
    if "enable_eplb" in layout:
        assert sum(r.retired_s is not None for r in history) >= 2, history


def test_pd_on_one_gpu_hands_the_kv_over_in_device_memory(colocated):
    import pickle

    from moeflow import LLM
    from moeflow.comm.ipc_memory import HOST

    params, refs = colocated
    with LLM("tiny", mode="pd", prefill=dict(mode="asap", attn_dp=1, moe_workers=1), decode=dict(mode="dep", dp=2),
             device=DEVICE, dtype="float32", num_kv_blocks=64, transport=TRANSPORT) as llm:
        outs = llm.generate(PROMPTS, params)
        kv, stats = llm.engine.kv, llm.engine.kv.stats
        (region,) = llm.engine.prefill[0].handoff_port().regions(0)
        # read in place: nothing staged; the prefill worker's cache shared by CUDA IPC (its rehearsal: /dev/shm)
        assert not kv.staged and (pickle.loads(region.handle)[0] == HOST) == (DEVICE == "cpu")
    assert stats.transfers == len(PROMPTS) and stats.recomputes == 0
    for o, r in zip(outs, refs, strict=True):
        assert o.error is None and o.outputs[0].token_ids == r.outputs[0].token_ids
        for x, y in zip(o.prompt_logprobs[1:], r.prompt_logprobs[1:], strict=True):
            assert x.keys() == y.keys() and max(abs(x[t].logprob - y[t].logprob) for t in x) < 1e-3
