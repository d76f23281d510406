"""asap's attention and MoE workers in one process and one thread, on the reference transport
(the workers take their transport from outside): the same roles the engine spawns, driven by
the engine's own scheduler, must match the colocated reference."""
from __future__ import annotations

import pytest

from moeflow import LLM, SamplingParams
from moeflow.comm import CommConfig, CommSpec, make_transport
from moeflow.config import EngineConfig
from moeflow.core import Request
from moeflow.layout import make_layout
from moeflow.messages import NewRequest, RunWork, WorkerSetup
from moeflow.model.weights import load_config
from moeflow.scheduler import make_scheduler
from moeflow.workers.roles import build_worker

PROMPTS = [[7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6, 7], list(range(40, 70))]
PARAMS = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2, ignore_eos=True)


def _run_in_process(path: str, moe_workers: int) -> dict[str, tuple[list, list[int]]]:
    layout = make_layout("asap", moe_workers=moe_workers, min_batch_tokens=8, max_batch_tokens=128,
                         max_batch_wait_s=0.0)
    config = EngineConfig(model=path, dtype="float32", num_kv_blocks=64)
    mc, _ = load_config(path)
    placement = layout.experts_held(mc.num_experts)
    spec = CommSpec(num_regions=1, lanes_per_region=1, num_expert_ranks=moe_workers, num_experts=mc.num_experts,
                    top_k=mc.num_experts_per_tok, hidden_size=mc.hidden_size,
                    max_batch_tokens=layout.scheduler.max_batch_tokens, dtype="float32",
                    max_local_experts=max(map(len, placement)))
    comm = CommConfig(spec, "reference")
    transport = make_transport(comm)

    def setup(role: str, index: int) -> WorkerSetup:
        return WorkerSetup(role, index, path, config, layout, comm, placement)

    moe = [build_worker(setup("moe", e), transport, None) for e in range(moe_workers)]
    attention = build_worker(setup("attention", 0), transport, None)
    transport.pump = lambda: any(w.step() for w in moe)  # the MoE side runs when attention waits on it

    sched = make_scheduler(layout, config, 512)
    requests = [Request(str(i), p, PARAMS) for i, p in enumerate(PROMPTS)]
    for r in requests:
        sched.add(r)
    plp: dict[str, list] = {r.request_id: [] for r in requests}
    known: set[str] = set()
    work_id = 0
    while sched.has_unfinished():
        for work in sched.schedule(now=1e9):  # every batch is due
            new = [NewRequest(r.request_id, r.prompt_token_ids, r.params) for b in work.batches for s in b.seqs
                   for r in [sched.pool.get(s.request_id)] if r.request_id not in known]
            known |= {n.request_id for n in new}
            work_id += 1
            done = attention.run_work(RunWork(work_id, work.batches, new, []))
            for b in work.batches:
                out = done.outputs[b.batch_id]
                for rid, o in out.items():
                    plp[rid] += o.prompt_logprobs
                sched.update(0, b, {rid: o.token_id for rid, o in out.items() if o.token_id is not None})
            sched.release(work.group)
    attention.close()
    for w in moe:
        w.close()
    return {r.request_id: (plp[r.request_id], r.output_token_ids) for r in requests}


@pytest.mark.parametrize("moe_workers", [1, 3])
def test_asap_roles_in_one_process_match_colocated(checkpoints, moe_workers):
    path = checkpoints("qwen3").path
    got = _run_in_process(path, moe_workers)
    with LLM(path, dtype="float32") as llm:
        refs = llm.generate(PROMPTS, PARAMS)
    for i, ref in enumerate(refs):
        plp, tokens = got[str(i)]
        assert tokens == ref.outputs[0].token_ids
        assert len(plp) == len(ref.prompt_logprobs) - 1
        for x, y in zip(plp, ref.prompt_logprobs[1:]):
            assert x.keys() == y.keys()
            assert max(abs(x[t][0] - y[t].logprob) for t in x) < 1e-3
