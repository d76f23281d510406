"""Node 0 of the multi-host tests, run inside host A's namespace (test_multihost.py):
``python multihost_node0.py <checkpoint> <request.json> <out.pkl>``.

It builds the deployment across the two hosts, generates the parity prompts (``rounds`` times),
then (``scale``) changes the number of expert holders (``ep_size``) to each target in turn, generating while the
change is under way and after it, then (``kill``) kills the MoE-side workers on the other host by pid (one pid namespace: network
namespaces only separate the network), times how long a request takes to fail, and generates
again on the deployment the restart rebuilt. Outputs are written as plain data for the test to compare.
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import time
import traceback


def _plain(outs) -> list:
    return [{"error": o.error, "token_ids": list(o.outputs[0].token_ids),
             "prompt_logprobs": [None if p is None else {t: lp.logprob for t, lp in p.items()}
                                 for p in o.prompt_logprobs]} for o in outs]


def main(argv: list[str]) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from parity import PARAMS, PROMPTS

    from moeflow import LLM, SamplingParams
    from moeflow.config import ClusterConfig

    path, req, out_path = argv[0], json.loads(open(argv[1]).read()), argv[2]
    result: dict = {}
    try:
        t0 = time.monotonic()
        llm = LLM(path, dtype="float32", cluster=ClusterConfig(**req["cluster"]), max_restarts=1,
                  restart_backoff_s=0.01, **req["layout"])
        try:
            result["start_s"] = time.monotonic() - t0
            result["nodes"] = {w.name: getattr(w.process, "node", None) is not None
                               for w in llm.engine.deployment.workers}
            t0 = time.monotonic()
            result["outputs"] = _plain(llm.generate(PROMPTS, PARAMS))
            result["generate_s"] = time.monotonic() - t0
            # more rounds of the same prompts (live rebalancing: each round across placements)
            result["rounds"] = [_plain(llm.generate(PROMPTS, PARAMS)) for _ in range(req.get("rounds", 1) - 1)]
            # elastic: each change asked for while the prompts are in flight, then the prompts again
            result["scaled"] = []
            for target in req.get("scale", []):
                llm.scale(ep_size=target, wait=False)
                during = _plain(llm.generate(PROMPTS, PARAMS))
                status = llm.scale(wait=True)
                nodes = {f"{w.role} {w.index}": getattr(w.process, "node", None) is not None
                         for w in llm.engine.deployment.workers}
                result["scaled"].append((status, during, _plain(llm.generate(PROMPTS, PARAMS)), nodes))
            eplb = getattr(llm.engine, "eplb", None)
            result["rebalances"] = [] if eplb is None else [(r.retired_s is not None, r.moved_bytes, r.peer_bytes)
                                                            for r in eplb.history]
            if req.get("kill"):
                remote = [w for w in llm.engine.deployment.workers if getattr(w.process, "node", None) is not None]
                for w in remote:
                    os.kill(w.process.pid, signal.SIGKILL)
                t0 = time.monotonic()
                failed = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=200, ignore_eos=True))
                result["fail_s"], result["fail_error"] = time.monotonic() - t0, failed[0].error
                t0 = time.monotonic()
                result["healed_outputs"] = _plain(llm.generate(PROMPTS, PARAMS))
                result["heal_s"], result["restarts"] = time.monotonic() - t0, llm.restarts
        finally:
            llm.shutdown()
    except BaseException:
        result["fatal"] = traceback.format_exc()
    with open(out_path, "wb") as f:
        pickle.dump(result, f)
    return 1 if "fatal" in result else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
