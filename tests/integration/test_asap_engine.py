"""Mode asap against the colocated reference: real worker processes, real shared memory.

Every deployment here is a set of spawned processes on 2 shared cores, so the suite keeps to a
handful of them and tiny checkpoints (hidden 64, 8 experts top-2).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from moeflow import LLM, SamplingParams
from moeflow.comm import list_segments

# ragged: a 1-token prompt (2 experts active: with E=3 some worker gets no token in every layer),
# short and longer prompts; min_batch_tokens 8 splits them into several batches that get paired.
PROMPTS = [[7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6, 7], list(range(40, 70)), list(range(3, 60)),
           [150, 151, 152, 153]]
PARAMS = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=2, ignore_eos=True)
SCHED = dict(min_batch_tokens=8, max_batch_tokens=128, max_batch_wait_s=0.005)


def _max_err(outs, refs) -> float:
    err = 0.0
    for o, r in zip(outs, refs):
        assert o.prompt_logprobs[0] is None
        for x, y in zip(o.prompt_logprobs[1:], r.prompt_logprobs[1:]):
            assert x.keys() == y.keys()
            err = max(err, max(abs(x[t].logprob - y[t].logprob) for t in x))
    return err


@pytest.fixture(scope="module")
def reference(checkpoints):
    cache: dict[str, list] = {}  # asap's own PARAMS (two prompt logprobs): not parity.py's references

    def ref(name: str):
        if name not in cache:
            with LLM(checkpoints(name).path, dtype="float32") as llm:
                cache[name] = llm.generate(PROMPTS, PARAMS)
        return cache[name]
    return ref


@pytest.mark.parametrize("name,layout", [
    ("qwen3", (1, 1, 1)),
    pytest.param("qwen3", (2, 1, 2), marks=pytest.mark.slow),  # the full matrix: make test-slow
    ("qwen2_moe", (1, 2, 1)),  # TP attention with qkv bias, a shared expert and a dense layer
    pytest.param("qwen3", (2, 1, 3), marks=pytest.mark.slow),  # 8 experts on 3 workers: 3/3/2, not a multiple
    ("deepseek_v3", (1, 2, 2)),  # MLA heads split over 2 TP members, the latent replicated
    ("deepseek_v32", (2, 1, 2)),  # DSA on two groups
    pytest.param("deepseek_v3_noqlora", (1, 2, 1), marks=pytest.mark.slow),  # q from the hidden state, TP 2
])
def test_asap_matches_colocated(checkpoints, reference, name, layout):
    d, t, e = layout
    refs = reference(name)
    with LLM(checkpoints(name).path, dtype="float32", mode="asap", attn_dp=d, attn_tp=t, moe_workers=e,
             trace=True, **SCHED) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        spans = llm.engine.collect_spans()
        deployment_id = llm.engine.deployment_id
    assert _max_err(outs, refs) < 1e-3
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in refs]
    assert all(o.outputs[0].finish_reason == "length" and o.error is None for o in outs)
    assert list_segments(deployment_id) == []
    names = {s.name for s in spans}
    assert {"attention", "router", "dispatch", "wait-combine", "combine", "experts"} <= names
    pairs = [s for s in spans if s.name == "attention" and s.args.get("layer") == 0]
    assert len({s.args["batch"] for s in pairs}) >= 2  # several batches were formed
    # a batch activates only the workers holding its experts; the others receive nothing for that layer
    dispatches = [s for s in spans if s.name == "dispatch"]
    assert all(1 <= s.args["workers"] <= e for s in dispatches)
    if e == 3:
        assert any(s.args["workers"] < e for s in dispatches)
    # TTFT decomposes into queueing, this batch's compute, and the rest (other stages)
    for o in outs:
        m = o.metrics
        assert m.prefill_compute_s > 0 and m.prefill_wait_s >= 0
        assert m.arrival_s <= m.first_scheduled_s <= m.prefill_start_s < m.first_token_s
    if d > 1:
        # MoE workers ran layers out of order: some layer id follows a higher one
        layers = [s.args["layer"] for s in sorted(spans, key=lambda s: s.start_s)
                  if s.name == "experts" and s.track.startswith("moe0")]
        assert any(b < a for a, b in zip(layers, layers[1:]))


def test_lone_batches_split_in_two_halves_match(checkpoints, reference):
    refs = reference("qwen3")
    with LLM(checkpoints("qwen3").path, dtype="float32", mode="asap", moe_workers=2, min_batch_tokens=8,
             max_batch_tokens=128, max_batch_wait_s=0.0, min_split_tokens=16) as llm:
        outs = [llm.generate([p], PARAMS)[0] for p in PROMPTS]  # one at a time: every batch is alone
    assert _max_err(outs, refs) < 1e-3
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in refs]


def test_replicated_experts(checkpoints, reference):
    refs = reference("qwen3")
    placement = [list(range(8)), [0, 1, 2, 3]]  # experts 0-3 live on both workers
    with LLM(checkpoints("qwen3").path, dtype="float32", mode="asap", attn_dp=2, moe_workers=2,
             expert_placement=placement, **SCHED) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
    assert _max_err(outs, refs) < 1e-3


def test_bad_layouts_are_rejected_clearly(checkpoints):
    path = checkpoints("qwen3").path
    with pytest.raises(ValueError, match="leaves experts"):
        LLM(path, mode="asap", moe_workers=2, expert_placement=[[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="TP size 3"):
        LLM(path, mode="asap", attn_tp=3)
    with pytest.raises(ValueError, match="unknown mode"):
        LLM(path, mode="nope")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead for our purposes
        return f.read().split(")")[-1].split()[0] != "Z"


def test_dead_moe_worker_errors_requests_fast_and_cleans_up(checkpoints):
    llm = LLM(checkpoints("qwen3").path, dtype="float32", mode="asap", moe_workers=2, **SCHED)
    pids = [w.process.pid for w in llm.engine.deployment.workers]
    moe_pid = next(w.process.pid for w in llm.engine.deployment.workers if w.role == "moe")
    os.kill(moe_pid, signal.SIGKILL)
    t0 = time.monotonic()
    outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=50, ignore_eos=True))
    assert time.monotonic() - t0 < 15
    assert all(o.outputs[0].finish_reason == "error" and "moe worker" in o.error for o in outs)
    with pytest.raises(RuntimeError, match="has failed"):
        llm.generate(PROMPTS[:1], PARAMS)
    llm.shutdown()
    assert not any(_alive(p) for p in pids)
    assert list_segments(llm.engine.deployment_id) == []


def test_ctrl_c_leaves_no_process_or_segment(checkpoints, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import faulthandler, signal, sys
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for stacks if we hang
        # NOTE: a child started from a background job inherits SIGINT ignored, and Python then keeps
        # it ignored; install the handler a terminal's Python would have
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from moeflow import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM({checkpoints("qwen3").path!r}, mode="asap", moe_workers=1)
            pids = [w.process.pid for w in llm.engine.deployment.workers]
            print(llm.engine.deployment_id, *pids, flush=True)
            try:
                with llm:
                    while True:  # busy until the signal lands, wherever it lands
                        llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=200, ignore_eos=True))
            except KeyboardInterrupt:
                print("interrupted", flush=True)
                sys.exit(130)
    """))
    # NOTE: output goes to files, not pipes: a child that fills a pipe nobody reads blocks forever
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out, "w") as fo, open(err, "w") as fe:
        p = subprocess.Popen([sys.executable, str(script)], stdout=fo, stderr=fe, text=True)
    deadline = time.monotonic() + 120
    while not out.read_text().endswith("\n") and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    deployment_id, *pids = out.read_text().split()
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    try:
        rc = p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        p.kill()
        p.wait()
        pytest.fail(f"no exit 30 s after SIGINT; stdout: {out.read_text()!r}; stderr tail: {err.read_text()[-4000:]}")
    assert rc == 130, err.read_text()[-4000:]
    assert "interrupted" in out.read_text()
    time.sleep(0.5)
    assert not any(_alive(int(x)) for x in pids)
    assert list_segments(deployment_id) == []
