"""``moeflow bench decode``: steady-state decode at a context length, for any mode.

Per (system, context, repeat) a fresh deployment: B requests of ``context`` random prompt tokens
(B = what the KV cache holds, from ``--memory-budget-gib`` or ``--num-kv-blocks``, unless
``batch`` is given) are prefilled, decode ``warmup_steps`` tokens, then a window of ``steps``
tokens each is timed. Reported: TPOT (window / tokens per request), decode tokens/s per process,
resident requests per attention group, and each worker's split of the window (attention, FFN,
transport, waiting on the other side, bubbles) from its trace. Systems run in rotated order within
each repeat, so machine drift hits them alike; repeats give 95% intervals and paired ratios.

One system from the command line (``--mode ... --context 2048 8192``), or several from a YAML file:

    model: tiny
    dtype: auto
    contexts: [2048, 8192]
    steps: 16            # decode tokens per request in the timed window
    warmup_steps: 2
    repeats: 3
    batch: null          # resident requests in all; null: as many as the KV cache holds
    systems:
      dep2: {mode: dep, dp: 2, max_batch_tokens: 2048, chunked_prefill_size: 2048, engine: {memory_budget_gib: 1.6}}
      afd: {mode: afd, micro_batches: 2, chunked_prefill_size: 2048, engine: {memory_budget_gib: 1.6}}
      dep2_gather: {mode: dep, dp: 2, ..., env: {MOEFLOW_PAGED_ATTENTION: gather}}   # environment of its workers
    compare: [[afd, dep2]]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import random
import time
from dataclasses import dataclass, field

import yaml

from moeflow.config import ConfigError, EngineConfig
from moeflow.engine.args import add_engine_args, engine_kwargs
from moeflow.experiment import SystemSpec, system_from_dict, system_to_dict
from moeflow.measure.capacity import COMPUTE, TRANSPORT, WAIT, time_split
from moeflow.measure.decode_report import markdown, summarize
from moeflow.measure.provenance import write_json

# the decode step split of ``moeflow bench decode`` (trace span names: workers/stages.py, ffn.py, moe.py)
DECODE_KINDS = {"attention": COMPUTE - {"experts"}, "ffn": {"experts"}, "transport": TRANSPORT,
                "wait": WAIT | {"recv"}}


@dataclass(frozen=True)
class DecodeBench:
    model: str
    systems: dict[str, SystemSpec]
    dtype: str = "auto"
    contexts: tuple[int, ...] = (2048, 8192)
    steps: int = 16
    warmup_steps: int = 2
    repeats: int = 3
    batch: int | None = None
    seed: int = 0
    title: str | None = None
    compare: tuple[tuple[str, str], ...] = field(default=())
    # per system, environment variables its deployment starts with (e.g. MOEFLOW_PAGED_ATTENTION=gather
    # for the before/after of the decode attention kernel)
    env: dict[str, dict[str, str]] = field(default_factory=dict)
    # simulator only (``moeflow simulate`` of a decode file): as in an experiment file
    hardware: str | None = None
    cost: str = "analytic"
    profile: str | None = None
    machine: str | None = None
    hardware_overrides: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("steps", "repeats"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"bench decode: {name} must be an int >= 1, got {getattr(self, name)!r}")
        if not self.contexts or any(not isinstance(c, int) or c < 1 for c in self.contexts):
            raise ConfigError(f"bench decode: contexts must be ints >= 1, got {list(self.contexts)}")
        if self.batch is not None and (not isinstance(self.batch, int) or self.batch < 1):
            raise ConfigError(f"bench decode: batch must be null or an int >= 1, got {self.batch!r}")
        for a, b in self.compare:
            if a not in self.systems or b not in self.systems:
                raise ConfigError(f"bench decode: compare {a!r} vs {b!r}: both must be systems")


def load_bench(path: str) -> DecodeBench:
    with open(path) as f:
        d = dict(yaml.safe_load(f) or {})
    known = {f.name for f in dataclasses.fields(DecodeBench)}
    if set(d) - known or "systems" not in d:
        raise ConfigError(f"bench decode {path}: unknown keys {sorted(set(d) - known)} or no systems (known: {sorted(known)})")
    model, dtype = d.get("model", "tiny"), d.get("dtype", "auto")
    entries = {n: dict(s) for n, s in d["systems"].items()}
    d["env"] = {n: {str(k): str(v) for k, v in (s.pop("env", None) or {}).items()} for n, s in entries.items()}
    d["systems"] = {n: system_from_dict(n, s, model, dtype) for n, s in entries.items()}
    d["contexts"] = tuple(d.get("contexts") or (2048, 8192))
    d["compare"] = tuple(tuple(p) for p in d.get("compare") or ())
    d["hardware_overrides"] = tuple(sorted((k, float(v)) for k, v in (d.get("hardware_overrides") or {}).items()))
    return DecodeBench(**{**d, "model": model, "dtype": dtype})


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


def _from_flags(args: argparse.Namespace) -> DecodeBench:
    from moeflow.layout import make_layout

    kw = engine_kwargs(args)
    model, mode, dtype = kw.pop("model"), kw.pop("mode"), kw.pop("dtype")
    kw.pop("revision", None)
    engine_keys = {f.name for f in dataclasses.fields(EngineConfig)}
    layout = make_layout(mode, **{k: v for k, v in kw.items() if k not in engine_keys})
    engine = EngineConfig(model=model, dtype=dtype, **{k: v for k, v in kw.items() if k in engine_keys})
    return DecodeBench(model, {mode: SystemSpec(mode, layout, engine)}, dtype)


def run(args: argparse.Namespace) -> int:
    bench = load_bench(args.config) if args.config else _from_flags(args)
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
    if args.json:
        write_json(args.json, result)
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(result))
    return 0


def step_tokens(lay, engine) -> int:
    """The fewest prompt tokens any step of a system (layout ``lay``, EngineConfig ``engine``) may
    take: its smallest batch limit."""
    limits = [engine.max_num_batched_tokens]
    for obj in (lay, getattr(lay, "scheduler", None)):
        limits += [v for k in ("chunked_prefill_size", "max_batch_tokens") if (v := getattr(obj, k, None))]
    return min(limits)


def decode_tokens(warmup_steps: int, steps: int, context: int = 0, per_group: int = 0, step_limit: int = 1) -> int:
    """Tokens each request is asked for (its KV reservation), so that nobody finishes inside the window:
    the window and warm-up, up to two steps in flight at either end, groups that decode at their own
    pace (asap, dwdp) running ahead of the window's average, and, the largest part, what a request
    prefilled first decodes (one token per step, decode first) while the other ``per_group - 1`` of its
    group prefill: at most one step per ``step_limit - per_group`` prompt tokens (the decodes share each
    step's budget) plus one per request. The simulator prefills a group in one step and reserves its
    own, shorter window (``sim/decode.py``), so its B is a few percent above this one's."""
    prefill_steps = per_group * -(-context // max(1, step_limit - per_group)) + per_group if per_group else 0
    return warmup_steps + 2 * steps + 6 + prefill_steps


def resident(capacity_at, context: int, warmup_steps: int, steps: int, step_limit: int,
             first: int | None = None) -> tuple[int, int]:
    """(requests per group the KV cache holds, decode tokens each is asked for) at ``context``;
    ``capacity_at(gen)``: requests per group that fit when each reserves ``context + gen`` tokens.
    ``first``: the group's requests when given (``batch``), else what fits the bare window."""
    first = capacity_at(decode_tokens(warmup_steps, steps)) if first is None else first
    gen = decode_tokens(warmup_steps, steps, context, first, step_limit)
    return capacity_at(gen), gen


def measure(spec: SystemSpec, context: int, bench: DecodeBench, repeat: int) -> dict:
    """One deployment, prefilled at ``context``, one timed decode window."""
    from moeflow import LLM, SamplingParams

    engine_cfg = dataclasses.replace(spec.engine, trace=True)
    with LLM(layout=spec.layout, **dataclasses.asdict(engine_cfg)) as llm:
        engine = llm.engine
        pool = engine.scheduler.pool
        a = pool.groups[0].allocator
        def capacity_at(gen: int) -> int:
            return min(pool.max_num_seqs, a.num_blocks // a.blocks_for(context + gen))
        per_group, gen = resident(capacity_at, context, bench.warmup_steps, bench.steps,
                                  step_tokens(spec.layout, spec.engine),
                                  None if bench.batch is None else -(-bench.batch // len(pool.groups)))
        if context + gen > engine.max_model_len:
            raise ConfigError(f"bench decode: context {context} + {gen} decode tokens exceed max_model_len "
                              f"{engine.max_model_len}")
        capacity = per_group * len(pool.groups)
        b = bench.batch or capacity
        if b > capacity:
            raise ConfigError(f"bench decode: batch {b} exceeds what the KV caches hold at context {context} "
                              f"({per_group} per group x {len(pool.groups)})")
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
        return {"dtype": llm.config.dtype, "batch": b, "capacity": capacity, "resident_per_group": b / len(pool.groups), "context": context,
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
