"""How much CPU the engine's front process (the one that runs LLM, the scheduler and the step loop)
takes while dep 2 and afd M1 N1 m2 decode: its process time over the wall time of a generate call.

    OMP_NUM_THREADS=1 python docs/results/afd/front_cpu_probe.py
"""
import time
import numpy as np
from moeflow import LLM, SamplingParams


def main():
    rng = np.random.default_rng(0)
    for mode, kw in (("dep", {"dp": 2}), ("afd", {"micro_batches": 2})):
        with LLM(model="tiny", mode=mode, **kw) as llm:
            vocab = llm.engine.model_config.vocab_size
            for B, ctx in ((1, 512), (8, 512), (8, 2048)):
                prompts = [rng.integers(0, vocab, ctx).tolist() for _ in range(B)]
                llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
                p = SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True)
                c0, w0 = time.process_time(), time.perf_counter()
                outs = llm.generate(prompts, p)
                c1, w1 = time.process_time(), time.perf_counter()
                t = outs[0].metrics.token_times_s
                dec = t[-1] - t[0]
                print(f"{mode} B={B} ctx={ctx}: front CPU {c1-c0:.3f} s over {w1-w0:.2f} s wall "
                      f"({(c1-c0)/(w1-w0)*100:.0f}%), decode {dec / 32 * 1e3:.1f} ms/step", flush=True)


if __name__ == "__main__":
    main()
