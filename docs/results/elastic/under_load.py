"""Scaling while a server is under Poisson load (docs/elastic.md, "Under load").

    python docs/results/elastic/under_load.py > docs/results/elastic/under_load.txt
    python docs/results/elastic/under_load.py --afd > docs/results/elastic/under_load_afd.txt
    python docs/results/elastic/under_load.py --handover > docs/results/elastic/under_load_handover.txt
    python docs/results/elastic/under_load.py --dep > docs/results/elastic/under_load_dep.txt
    python docs/results/elastic/under_load.py --dwdp > docs/results/elastic/under_load_dwdp.txt

A real ``moeflow serve`` (asap, the embedded model in fp32, 1-2 attention groups, 2-3 MoE workers; with
``--afd``: afd, 1-2 attention instances, 2-3 FFN daemons; with ``--dep``: dep, 2-3 ranks, each an
attention group and an expert holder, so every change is one of ranks: 2 -> 3, 3 -> 2 in turn; with
``--dwdp``: dwdp, the same)
takes Poisson arrivals over HTTP (streamed completions, greedy) while another client asks for a
change 4 s after the last one ended, in turn: expert holders 2 -> 3, attention 1 -> 2, expert holders 3 -> 2,
attention 2 -> 1. One expert scale-up has its joining worker SIGKILLed before it switches, and
is asked for again. Then: every request answered; each output against the colocated engine's on the
same prompt (fp32, offline); TTFT and TPOT of the requests whose life overlapped a change against the
others; the server's shared memory and workers gone once it stops.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import sys
import threading
import time

import httpx
import numpy as np

from moeflow import LLM, SamplingParams
from moeflow.bench.server_process import ServeProcess, children, shm_usage

RATE, DURATION_S, MAX_TOKENS, SEED = 2.0, 90.0, 16, 0
KILL_AT = 4  # the change (index into the changes) whose joiner is killed: the second expert scale-up
MODES = {  # the server's flags, and the name of its expert holders in POST /scale
    "asap": (["--mode", "asap", "--attn-dp", "1", "--max-attn-dp", "2", "--moe-workers", "2", "--max-moe-workers",
              "3"], "moe"),
    "afd": (["--mode", "afd", "--topology", "all", "--attn-workers", "1", "--max-attn-workers", "2", "--ffn-workers",
             "2", "--max-ffn-workers", "3"], "ffn"),
    "dep": (["--mode", "dep", "--dp", "2", "--max-dp", "3"], "ep_size"),
    "dwdp": (["--mode", "dwdp", "--dp", "2", "--max-dp", "3"], "ep_size"),
}
MODE = next((m for m in ("afd", "dep", "dwdp") if f"--{m}" in sys.argv), "asap")
FLAGS = MODES[MODE][0] + ["--dtype", "float32", "--served-model-name", "m"] + (
    ["--share-kv-cache"] if "--handover" in sys.argv else [])  # a leaving group's requests are handed over
CHANGES = ([(MODES[MODE][1], 3), ("attention", 2), (MODES[MODE][1], 2), ("attention", 1)] * 3
           if MODE not in ("dep", "dwdp") else [(MODES[MODE][1], 3), (MODES[MODE][1], 2)] * 6)  # a rank is both


async def one(client, url: str, prompt: list[int], at: float, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
    sent, first, ids, text = time.monotonic(), None, [], ""
    # token ids, not text: a byte-level token may complete no character, and where the stream's chunks
    # fall (timing) would then decide how an incomplete character shows
    body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            if r.status_code != 200:
                return {"sent": sent, "error": f"HTTP {r.status_code}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"sent": sent, "error": chunk["error"]["message"]}
                if first is None:  # the first chunk, as vllm bench serve times it (its text may be empty:
                    first = time.monotonic()  # a byte-level token that completes no character yet)
                ids += [int(t.split(":")[1]) for t in chunk["choices"][0]["logprobs"]["tokens"]]
                text += chunk["choices"][0]["text"]
    except httpx.HTTPError as e:
        return {"sent": sent, "error": repr(e)}
    return {"sent": sent, "first": first, "end": time.monotonic(), "ids": ids, "text": text}


async def load(url: str, prompts: list[list[int]], arrivals: list[float]) -> list[dict]:
    t0 = time.monotonic()
    async with httpx.AsyncClient() as client:
        return await asyncio.gather(*(one(client, url, p, a, t0) for p, a in zip(prompts, arrivals)))


def scaler(url: str, server_pid: int, stop: threading.Event, log: list) -> None:
    """Ask for each change in turn, 4 s after the last one ended; kill one joiner."""
    for i, (kind, n) in enumerate(CHANGES):
        if stop.wait(4.0):
            return
        before = set(children(server_pid))
        r = httpx.post(url + "/scale", json={kind: n}, timeout=30)
        log.append(f"POST /scale {{{kind!r}: {n}}} -> {r.status_code}")
        if i == KILL_AT:
            deadline = time.monotonic() + 30
            while not (new := set(children(server_pid)) - before) and time.monotonic() < deadline:
                time.sleep(0.02)
            for pid in new:
                os.kill(pid, signal.SIGKILL)
                log.append(f"SIGKILL joining worker pid {pid}")
        while httpx.get(url + "/scale", timeout=30).json()["in_progress"]:
            time.sleep(0.05)
        if i == KILL_AT:  # asked again: the deployment served on as it was, and a new try goes through
            r = httpx.post(url + "/scale", json={kind: n}, timeout=30)
            log.append(f"POST /scale {{{kind!r}: {n}}} again -> {r.status_code}")
            while httpx.get(url + "/scale", timeout=30).json()["in_progress"]:
                time.sleep(0.05)


def main(changes: bool = True) -> None:
    """``changes``: False for the control run, the same load with no change at all."""
    rng = np.random.default_rng(SEED)
    arrivals = np.cumsum(rng.exponential(1 / RATE, int(RATE * DURATION_S * 1.5)))
    arrivals = [float(a) for a in arrivals if a < DURATION_S]
    prompts = [rng.integers(0, 256, int(rng.integers(8, 200))).tolist() for _ in arrivals]
    stop, log = threading.Event(), []
    server = ServeProcess("tiny", FLAGS, "/tmp/moeflow-under-load.log")
    with server as url:
        pid = server.proc.pid
        t = threading.Thread(target=scaler if changes else lambda *_: None, args=(url, pid, stop, log), daemon=True)
        t.start()
        results = asyncio.run(load(url, prompts, arrivals))
        stop.set()
        t.join()
        status = httpx.get(url + "/scale", timeout=30).json()
        metrics = [line for line in httpx.get(url + "/metrics", timeout=30).text.splitlines()
                   if line.startswith(("moeflow_members", "moeflow_scale_events_total"))]
        workers = children(pid)
    left = shm_usage(pid)
    with LLM("tiny", dtype="float32") as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    want = [list(o.outputs[0].token_ids) for o in outs]
    texts = sum(r.get("text") == o.outputs[0].text for r, o in zip(results, outs))
    report(results, want, status, metrics, log, left, workers, pid)
    print(f"streamed text equal to colocated's final text: {texts} of {len(results)}")


def report(results, want, status, metrics, log, left, workers, pid) -> None:
    windows = [(e["requested_s"], e["left_s"] or e["switched_s"] or e["requested_s"]) for e in status["events"]]
    ok = [r for r in results if "error" not in r]
    print(f"{len(results)} requests (Poisson {RATE:g}/s over {DURATION_S:g} s, prompts 8-199 tokens, "
          f"{MAX_TOKENS} output tokens, greedy): {len(ok)} answered, "
          f"{sum(r.get('ids') == w for r, w in zip(results, want))} equal to colocated's output (token ids)")
    for r in results:
        if "error" in r:
            print("  error:", r["error"])
    for i, (r, w) in enumerate(zip(results, want)):
        if "error" not in r and r["ids"] != w:
            at = next((k for k, (a, b) in enumerate(windows) if r["sent"] <= b and r["end"] >= a), None)
            same = next((k for k in range(min(len(w), len(r["ids"]))) if w[k] != r["ids"][k]), None)
            print(f"  request {i} differs from token {same} on ({r['ids']} against {w}); "
                  f"{'during change ' + str(at) if at is not None else 'outside any change'}")
    for line in log:
        print(" ", line)
    print("changes (server clock: requested -> serving -> old member gone):")
    for e in status["events"]:
        sw = "-" if e["switched_s"] is None else f"{e['switched_s'] - e['requested_s']:.2f} s"
        gone = "-" if e["left_s"] is None else f"{e['left_s'] - e['requested_s']:.2f} s"
        print(f"  {e['kind']} {e['before']} -> {e['after']}: {e['outcome']}, serving after {sw}, gone after {gone}"
              + (f", {e['handed']} requests handed over" if e["handed"] else ""))
    during = [r for r in ok if any(r["sent"] <= b and r["end"] >= a for a, b in windows)]
    outside = [r for r in ok if r not in during]
    for name, rs in (("during a change", during), ("outside", outside)):
        ttft = [r["first"] - r["sent"] for r in rs]
        tpot = [(r["end"] - r["first"]) / (MAX_TOKENS - 1) for r in rs]
        if rs:
            print(f"{name}: {len(rs)} requests, TTFT median {statistics.median(ttft) * 1e3:.0f} ms "
                  f"p90 {np.percentile(ttft, 90) * 1e3:.0f} ms, TPOT median {statistics.median(tpot) * 1e3:.1f} ms "
                  f"p90 {np.percentile(tpot, 90) * 1e3:.1f} ms")
    print(f"mode {MODE}; at the end:", {k: v for k, v in status.items() if k in ("attention", "ffn", "moe", "dep", "dwdp")}, "; /metrics:", "; ".join(metrics))
    print(f"after the server stopped: /dev/shm files of pid {pid}: {left['files']}; worker processes alive: "
          f"{sum(os.path.exists(f'/proc/{w}') for w in workers)} of {len(workers)}")


if __name__ == "__main__":
    sys.exit(main(changes="--control" not in sys.argv))
