"""``moeflow bench soak``: a real ``moeflow serve`` under HTTP load for minutes, with random client
disconnects, bad requests and one injected worker kill, watched from outside (issue 18, item 7).

The load is the production workload (Poisson arrivals, heavy-tailed prompts) at a fixed rate;
each arrival is a good request (streamed or not), a client that disconnects after its first
chunks, or a bad request (malformed JSON, a bad field, an unknown model, an oversized body). Half
way through, the MoE worker is SIGKILLed; the server must fail what was in flight and rebuild the
deployment. Every ``sample_s`` the RSS and open descriptors of the server and each worker and the
server's /dev/shm bytes are recorded. ``soak_report`` judges the run and draws it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass

from moeflow.bench.http_client import token_prompts
from moeflow.bench.server_process import ServeProcess, children, is_alive, open_fds, rss_mb, shm_usage
from moeflow.measure.rate_flag import add_request_rate
from moeflow.measure.workload import WorkloadConfig, generate_requests

KINDS = ("ok", "ok_stream", "disconnect", "bad_json", "bad_field", "bad_model", "too_big")
WEIGHTS = (0.4, 0.4, 0.08, 0.03, 0.03, 0.03, 0.03)
MAX_BODY_BYTES = 65536  # the server's limit in the soak: a too_big body is twice this


@dataclass
class Answer:
    """What one request got: ``status`` 0 when the client gave up or disconnected on purpose."""

    kind: str
    sent_s: float  # since the start of the load
    end_s: float
    status: int
    code: str | None = None  # the error body's code
    retry_after: str | None = None
    ttft_s: float | None = None
    finish: str | None = None  # finish_reason of a completed request
    note: str | None = None  # a client-side exception


def add_parser(sub) -> None:
    p = sub.add_parser("soak", help="a server under load for minutes: leaks, errors, a worker kill (issue 18)")
    p.add_argument("--duration-s", type=float, default=600.0)
    add_request_rate(p, "arrivals per second (default 0.4: at 0.6 with 32 output tokens asap D1 E1 on tiny was "
                        "over capacity on the 2-core Zen 3, its queue grew to ~2 min)", type=float, default=0.4, metavar="R")
    p.add_argument("--length-scale", type=float, default=0.1)
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--kill-at-s", type=float, default=None, help="when to SIGKILL the MoE worker (default: half way)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, metavar="OUT",
                   help="writes OUT.json, OUT.png and OUT.md (e.g. soak-out/soak; make soak: docs/results/soak)")
    p.add_argument("--report-only", action="store_true",
                   help="judge OUT.json's recorded run again (its provenance kept) and redraw OUT.png and OUT.md")
    p.add_argument("serve_args", nargs=argparse.REMAINDER,
                   help="after --: moeflow serve's flags (default: --model tiny --mode asap --attn-dp 1 --moe-workers 1)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moeflow.measure.provenance import write_json
    from moeflow.bench.soak_report import judge, write_report

    serve_args = [a for a in args.serve_args if a != "--"] or ["--model", "tiny", "--mode", "asap", "--attn-dp", "1",
                                                               "--moe-workers", "1"]
    if args.report_only:
        with open(args.out + ".json") as f:
            result = json.load(f)
        result["verdict"] = judge(result)
        write_json(args.out + ".json", result)  # the record's own provenance is kept
        write_report(result, args.out)
        print(json.dumps(result["verdict"]["checks"], indent=1))
        return 0 if result["verdict"]["pass"] else 1
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)  # before minutes of load, not after
    kill_at = args.kill_at_s if args.kill_at_s is not None else args.duration_s / 2
    result = soak(serve_args, args.duration_s, args.request_rate, args.length_scale, args.sample_s, kill_at, args.seed)
    write_json(args.out + ".json", result, sys.argv)  # the raw record first: a bug below must not lose the run
    result["verdict"] = judge(result)
    write_json(args.out + ".json", result, sys.argv)
    write_report(result, args.out)
    print(json.dumps(result["verdict"], indent=1))
    return 0 if result["verdict"]["pass"] else 1


def soak(serve_args: list[str], duration_s: float, rps: float, length_scale: float, sample_s: float,
         kill_at_s: float, seed: int) -> dict:
    """Start the server, run the load with its sampler and its kill, stop the server; the raw record."""
    model, flags = _model_of(serve_args)
    log_path = f"/tmp/moeflow-soak-{os.getpid()}.log"
    seen: set[int] = set()
    t0 = time.monotonic()
    srv = ServeProcess(model, [*flags, "--max-body-bytes", str(MAX_BODY_BYTES)], log_path)
    cmd = srv.cmd
    with srv as url:
        t_up = time.monotonic() - t0
        samples, answers, kill = asyncio.run(_drive(srv.proc.pid, url, duration_s, rps, length_scale, sample_s,
                                                    kill_at_s, seed, seen))
    code = srv.proc.returncode
    time.sleep(1.0)
    with open(log_path) as f:
        log_tail = f.read()[-4000:]
    return {"command": cmd, "duration_s": duration_s, "rps": rps, "length_scale": length_scale, "seed": seed,
            "sample_s": sample_s, "startup_s": t_up, "server_exit_code": code, "kill": kill,
            "samples": samples, "answers": [asdict(a) for a in answers],
            "after_shutdown": {"processes_left": sorted(p for p in seen if is_alive(p)),
                               "shm": shm_usage(srv.proc.pid)}, "server_log_tail": log_tail}


def _model_of(serve_args: list[str]) -> tuple[str, list[str]]:
    """``--model M`` out of moeflow serve's flags (the server runner takes it apart); default tiny."""
    if "--model" in serve_args:
        i = serve_args.index("--model")
        return serve_args[i + 1], serve_args[:i] + serve_args[i + 2:]
    return "tiny", serve_args


async def _drive(server: int, url: str, duration_s: float, rps: float, length_scale: float, sample_s: float,
                 kill_at_s: float, seed: int, seen: set[int]):
    import httpx

    reqs = generate_requests(WorkloadConfig(kind="production", rate_rps=rps, duration_s=duration_s,
                                            length_scale=length_scale, seed=seed, output_len=32))
    prompts = token_prompts(reqs, seed)
    rng = random.Random(seed)
    kinds = rng.choices(KINDS, WEIGHTS, k=len(reqs))
    samples: list[dict] = []
    kill: dict = {}
    start = time.monotonic()
    done = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=120.0,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=32)) as c:
        async def sampler():
            while not done.is_set():
                samples.append(await _sample(c, server, time.monotonic() - start, seen))
                try:
                    await asyncio.wait_for(done.wait(), sample_s)
                except asyncio.TimeoutError:
                    pass
            samples.append(await _sample(c, server, time.monotonic() - start, seen))

        async def killer():
            await asyncio.sleep(kill_at_s)
            workers = [p for p, role in children(server).items() if role == "worker"]
            victim = min(workers)  # the expert side is started first
            t = time.monotonic() - start
            os.kill(victim, signal.SIGKILL)
            kill.update(pid=victim, at_s=t)
            # NOTE: first the server's notice (health leaves 200: the engine saw the death), then its
            # recovery; a 200 before the notice is the old deployment's, not a healed one
            for wanted, key in ((False, "noticed_at_s"), (True, "healed_at_s")):
                while time.monotonic() - start < kill_at_s + 600:
                    await asyncio.sleep(0.05)
                    try:
                        ok = (await c.get("/health", timeout=5)).status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    if ok == wanted:
                        kill[key] = time.monotonic() - start
                        break

        async def one(i: int) -> Answer:
            await asyncio.sleep(max(0.0, start + reqs[i].arrival_s - time.monotonic()))
            return await _send(c, kinds[i], prompts[i], reqs[i].output_len, start)

        tasks = [asyncio.ensure_future(sampler()), asyncio.ensure_future(killer())]
        answers = await asyncio.gather(*(one(i) for i in range(len(reqs))))
        done.set()
        await asyncio.gather(*tasks)
    return samples, answers, kill


async def _send(c, kind: str, prompt: list[int], max_tokens: int, start: float) -> Answer:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    t0 = time.monotonic()
    a = Answer(kind, t0 - start, 0.0, 0)
    try:
        if kind in ("ok_stream", "disconnect"):
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                a.status = r.status_code
                if r.status_code != 200:
                    a.code = json.loads(await r.aread()).get("error", {}).get("code")
                    a.retry_after = r.headers.get("retry-after")
                chunks = 0
                async for line in (r.aiter_lines() if r.status_code == 200 else _nothing()):
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if "error" in data:
                        a.code = data["error"].get("code")
                        break
                    chunks += 1
                    if chunks == 1:
                        a.ttft_s = time.monotonic() - t0
                    a.finish = data["choices"][0].get("finish_reason") or a.finish
                    if kind == "disconnect" and chunks == 2:
                        a.note = "disconnected"
                        break
        else:
            if kind == "ok":
                r = await c.post("/v1/completions", json=body)
            elif kind == "bad_json":
                r = await c.post("/v1/completions", content=b'{"prompt": [1, 2', headers={"content-type": "application/json"})
            elif kind == "bad_field":
                r = await c.post("/v1/completions", json={**body, "max_tokens": -5})
            elif kind == "bad_model":
                r = await c.post("/v1/completions", json={**body, "model": "no-such-model"})
            else:  # too_big
                r = await c.post("/v1/completions", content=b'{"prompt": "' + b"a" * (2 * MAX_BODY_BYTES) + b'"}',
                                 headers={"content-type": "application/json"})
            a.status = r.status_code
            out = r.json()
            if r.status_code == 200:
                a.finish = out["choices"][0]["finish_reason"]
            else:
                a.code = out.get("error", {}).get("code")
            a.retry_after = r.headers.get("retry-after")
    except Exception as e:  # noqa: BLE001  (a client-side failure is recorded, judged by the report)
        a.note = f"{type(e).__name__}: {e}"[:200]
    a.end_s = time.monotonic() - start
    return a


async def _nothing():
    return
    yield


async def _sample(c, server: int, t: float, seen: set[int]) -> dict:
    procs = {server: "server", **children(server)}
    seen.update(procs)
    stats = {}
    for pid, role in procs.items():
        rss, fds = rss_mb(pid), open_fds(pid)
        if rss is not None:
            stats[str(pid)] = {"role": role, "rss_mb": rss, "fds": fds}
    try:
        health = (await c.get("/health", timeout=5)).status_code
    except Exception:  # noqa: BLE001
        health = 0
    return {"t": t, "procs": stats, "shm": shm_usage(server), "health": health}
