"""``moeflow bench decode``: steady-state decode at a context length, for any mode.

Per (system, context, repeat) a fresh deployment: B requests of ``context`` random prompt tokens
(B = what the KV cache holds, from ``--memory-budget-gib`` or ``--num-kv-blocks``, unless
``batch`` is given) are prefilled, decode ``warmup_steps`` tokens, then a window of ``steps``
tokens each is timed. Reported: TPOT (window / tokens per request), decode tokens/s per process,
resident requests per attention group, and each worker's split of the window (attention, FFN,
transport, waiting on the other side, bubbles) from its trace. Systems run in rotated order within
each repeat, so machine drift hits them alike; repeats give 95% intervals and paired ratios.

One system from the command line (``--mode ... --context 2048 8192``), or several from a decode
experiment file (``moeflow/experiment/decode.py`` has the format; ``moeflow simulate`` reads the same).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import random
import time

from moeflow.config import ConfigError, EngineConfig
from moeflow.engine.args import add_engine_args, engine_kwargs
from moeflow.experiment.decode import DecodeExperiment, load_decode_experiment, resident, step_tokens
from moeflow.experiment.system import SystemSpec, system_to_dict
from moeflow.measure.capacity import COMPUTE, TRANSPORT, WAIT, time_split
from moeflow.measure.decode_report import markdown, summarize
from moeflow.measure.provenance import write_result
from moeflow.scheduler.pool import resident_capacity

# the decode step split of ``moeflow bench decode`` (trace span names: workers/stages.py, ffn.py, moe.py)
DECODE_KINDS = {"attention": COMPUTE - {"experts"}, "ffn": {"experts"}, "transport": TRANSPORT,
                "wait": WAIT | {"recv"}}


def add_parser(sub) -> None:
    p = sub.add_parser("decode", help="steady-state decode: TPOT, tokens/s per process and the step split")
    p.add_argument("config", nargs="?", help="a YAML file of systems (else one system from the flags)")
    add_engine_args(p)
    p.add_argument("--context", type=int, nargs="+", default=None, help="context lengths (default 2048 8192)")
    p.add_argument("--batch", type=int, default=None, help="resident requests in all (default: what the KV cache holds)")
    p.add_argument("--steps", type=int, default=None, help="decode tokens per request in the timed window")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--json", default=None, metavar="FILE.json")
    p.add_argument("--md", default=None, metavar="FILE.md")
    p.set_defaults(func=run)


def _from_flags(args: argparse.Namespace) -> DecodeExperiment:
    from moeflow.layout import make_layout

    kw = engine_kwargs(args)
    model, mode, dtype = kw.pop("model"), kw.pop("mode"), kw.pop("dtype")
    kw.pop("revision", None)
    engine_keys = {f.name for f in dataclasses.fields(EngineConfig)}
    layout = make_layout(mode, **{k: v for k, v in kw.items() if k not in engine_keys})
    engine = EngineConfig(model=model, dtype=dtype, **{k: v for k, v in kw.items() if k in engine_keys})
    return DecodeExperiment(model, {mode: SystemSpec(mode, layout, engine)}, dtype)


def run(args: argparse.Namespace) -> int:
    bench = load_decode_experiment(args.config) if args.config else _from_flags(args)
    over = {k: v for k, v in (("contexts", tuple(args.context) if args.context else None), ("batch", args.batch),
                              ("steps", args.steps), ("repeats", args.repeats)) if v is not None}
    bench = dataclasses.replace(bench, **over)
    runs: dict[str, dict[int, list[dict]]] = {n: {c: [] for c in bench.contexts} for n in bench.systems}
    names = list(bench.systems)
    for rep in range(bench.repeats):
        for c in bench.contexts:
            k = (rep + bench.contexts.index(c)) % len(names)
            for name in names[k:] + names[:k]:  # rotated: drift hits every system alike
                with _environment(bench.env.get(name, {})):
                    r = measure(bench.systems[name], c, bench, rep)
                runs[name][c].append(r)
                print(f"[repeat {rep}] {name} context {c}: B={r['batch']} TPOT {r['tpot_s'] * 1e3:.1f} ms, "
                      f"{r['tok_s_per_process']:.1f} tok/s/process", flush=True)
    result = summarize(bench, runs, {n: system_to_dict(s) for n, s in bench.systems.items()})
    print(markdown(result))
    write_result(result, args.json, args.md, markdown)
    return 0


def decoding(engine) -> list:
    """The engines whose groups decode: a pd deployment's decode instances, else the deployment."""
    from moeflow.engine.pd import PdEngine

    return list(engine.decode) if isinstance(engine, PdEngine) else [engine]


def measure(spec: SystemSpec, context: int, bench: DecodeExperiment, repeat: int) -> dict:
    """One deployment, prefilled at ``context``, one timed decode window."""
    from moeflow import LLM, SamplingParams

    engine_cfg = dataclasses.replace(spec.engine, trace=True)
    with LLM(layout=spec.layout, **dataclasses.asdict(engine_cfg)) as llm:
        engine = llm.engine
        pools = [e.handoff_port().pool for e in decoding(engine)]
        groups = [g for p in pools for g in p.groups]
        a = groups[0].allocator
        def capacity_at(gen: int) -> int:
            return resident_capacity(a.num_blocks, a.block_size, context + gen, pools[0].max_num_seqs)
        per_group, gen = resident(capacity_at, context, bench.warmup_steps, bench.steps,
                                  step_tokens(spec.layout, spec.engine),
                                  None if bench.batch is None else -(-bench.batch // len(groups)))
        if context + gen > engine.max_model_len:
            raise ConfigError(f"bench decode: context {context} + {gen} decode tokens exceed max_model_len "
                              f"{engine.max_model_len}")
        capacity = per_group * len(groups)
        b = bench.batch or capacity
        if b > capacity:
            raise ConfigError(f"bench decode: batch {b} exceeds what the KV caches hold at context {context} "
                              f"({per_group} per group x {len(groups)})")
        rng = random.Random(bench.seed * 1000 + repeat)
        vocab = engine.model_config.vocab_size
        reqs = [llm.make_request([rng.randrange(vocab) for _ in range(context)],
                                 SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)) for _ in range(b)]
        for r in reqs:
            engine.add_request(r)
        t_prefill = time.monotonic()
        while min(len(r.output_token_ids) for r in reqs) < 1 + bench.warmup_steps:
            if engine.step().finished:
                # the usual cause: a rank admits a waiting prompt only when its whole next chunk fits
                # beside the running decodes, so with max_batch_tokens == chunked_prefill_size the
                # rest wait for the first requests to finish
                raise ConfigError(f"bench decode: a request finished before every request was resident at context "
                                  f"{context}: give max_batch_tokens room for a prompt chunk beside the decodes "
                                  f"(>= chunked_prefill_size + requests per group)")
        prefill_s = time.monotonic() - t_prefill
        engine.drain()
        _spans(engine)  # drop what prefill and warm-up recorded
        done0 = sum(len(r.output_token_ids) for r in reqs)
        t0 = time.monotonic()
        while sum(len(r.output_token_ids) for r in reqs) - done0 < bench.steps * b:
            if engine.step().finished:
                raise RuntimeError("bench decode: a request finished inside the timed window")
        engine.drain()
        t1 = time.monotonic()
        tokens = sum(len(r.output_token_ids) for r in reqs) - done0
        spans = _spans(engine)
        plan = engine.memory_plan
        for r in reqs:
            engine.abort(r.request_id)
        wall = t1 - t0
        procs = spec.layout.num_processes
        return {"dtype": llm.config.dtype, "batch": b, "capacity": capacity, "resident_per_group": b / len(groups), "context": context,
                "num_kv_blocks": a.num_blocks, "max_tokens": gen, "wall_s": wall, "tokens": tokens, "tpot_s": wall * b / tokens,
                "tok_s_per_process": tokens / wall / procs, "prefill_s": prefill_s,
                "memory": plan.to_dict() if plan else None,
                "split": time_split(spans, t0, t1, DECODE_KINDS, rest="bubble") if spans else None}


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """``env`` set while a system's deployment runs (its workers inherit it), restored after."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _spans(engine) -> list:
    try:
        return engine.collect_spans()
    except ConfigError:  # in-process modes record none
        return []
