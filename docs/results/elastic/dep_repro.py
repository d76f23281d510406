"""Reproduce the rare dep mismatch under rank changes (docs/elastic.md, "Under load"; not yet split).

    python docs/results/elastic/dep_repro.py 660     # seconds to run; prints every wrong request

24 random prompts (the embedded model, fp32, greedy, prompt logprobs) generated while dep's ranks go
2 <-> 3 (each change asked for with the prompts in flight, then the prompts twice more), against the
colocated engine. A wrong request is printed with the first prompt position whose logprob is off and
each of its steps (work id, group, the placement's epoch, ranks). Seen: 4 of 141 changes.
"""
import os, sys, time
import numpy as np
from moeflow import LLM, SamplingParams
if __name__ == "__main__":
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 250, int(rng.integers(4, 120))).tolist() for _ in range(24)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=1)
    with LLM("tiny", dtype="float32") as ref:
        refs = ref.generate(prompts, sp)
    kw = dict(mode="dep", dp=2, max_dp=3, max_batch_tokens=128, max_num_seqs=8)
    with LLM("tiny", dtype="float32", **kw) as llm:
        engine = llm.engine
        log = []
        orig = engine._run_work
        def run_work(group, batches, workers, _orig=orig):
            for b in batches:
                for sq in b.seqs:
                    log.append((engine._work_ids + 1, group, sq.request_id, engine.eplb.epoch, len(engine.ranks),
                                engine._out is None))
            return _orig(group, batches, workers)
        engine._run_work = run_work
        t_end = time.monotonic() + float(sys.argv[1])
        cycle = 0
        def check(outs, tag):
            for i, (o, r) in enumerate(zip(outs, refs)):
                if o.outputs[0].token_ids == r.outputs[0].token_ids:
                    continue
                first = None
                for k, (x, y) in enumerate(zip(o.prompt_logprobs[1:], r.prompt_logprobs[1:])):
                    d = max((abs(x[t].logprob - y[t].logprob) for t in x if t in y), default=99)
                    if d > 1e-3 or x.keys() != y.keys():
                        first = (k + 1, round(d, 4)); break
                steps = [e for e in log if e[2] == o.request_id]
                print(f"{tag}: request {i} len {len(prompts[i])} WRONG; first prompt pos off {first}; "
                      f"tokens {o.outputs[0].token_ids} want {r.outputs[0].token_ids}; steps(work,group,epoch,ranks) "
                      f"{[(e[0], e[1], e[3], e[4]) for e in steps][:14]}", flush=True)
        while time.monotonic() < t_end:
            for n in (3, 2):
                log.clear()
                llm.scale(ep_size=n, wait=False)
                outs = llm.generate(prompts, sp)
                st = llm.scale(wait=True)
                check(outs, f"cycle {cycle} during ->{n}")
                for rep in range(2):
                    log.clear()
                    check(llm.generate(prompts, sp), f"cycle {cycle} after {n} rep {rep}")
                print(cycle, n, st["events"][-1]["outcome"][:20], "epoch", engine.eplb.epoch, flush=True)
            cycle += 1
