"""The decode experiment file: steady-state decode at context lengths, for ``moeflow bench decode`` (the
real engine) and ``moeflow simulate`` (a file with ``contexts:`` is one of these):

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
    hardware: cpu-here   # simulator only, with cost / profile / machine / hardware_overrides (target.py)

``systems:`` entries are the serving experiment's (``system.py``) plus ``env``. Also here: how many
requests a system holds resident and how many tokens each is asked for, which ``bench decode`` and
``moeflow predict afd`` both size the same way. Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import yaml

from moeflow.config import ConfigError
from moeflow.experiment.system import SystemSpec, check_systems, field_names, pick_keys, system_from_dict
from moeflow.experiment.target import TARGET_KEYS, SimTarget, pop_target


@dataclass(frozen=True)
class DecodeExperiment:
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
    target: SimTarget = field(default_factory=SimTarget)  # simulator only: the file's hardware/cost keys

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(f"decode experiment: {msg}")

        check_systems("decode experiment", self.dtype, self.systems, self.compare)
        for name in ("steps", "repeats"):
            v = getattr(self, name)
            need(isinstance(v, int) and v >= 1, f"{name} must be an int >= 1, got {v!r}")
        need(isinstance(self.warmup_steps, int) and self.warmup_steps >= 0,
             f"warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        need(bool(self.contexts) and all(isinstance(c, int) and c >= 1 for c in self.contexts),
             f"contexts must be ints >= 1, got {list(self.contexts)}")
        need(self.batch is None or (isinstance(self.batch, int) and self.batch >= 1),
             f"batch must be null or an int >= 1, got {self.batch!r}")


def parse_decode_experiment(d: dict) -> DecodeExperiment:
    if not isinstance(d, dict):
        raise ConfigError("decode experiment: the file must hold a mapping")
    d = dict(pick_keys(d, field_names(DecodeExperiment) - {"target", "env"} | set(TARGET_KEYS), "the top level"))
    if "systems" not in d:
        raise ConfigError("decode experiment: missing 'systems'")
    model, dtype = d.get("model", "tiny"), d.get("dtype", "auto")
    entries = {n: dict(s) if isinstance(s, dict) else s for n, s in (d["systems"] or {}).items()}
    d["env"] = {n: {str(k): str(v) for k, v in (s.pop("env", None) or {}).items()}
                for n, s in entries.items() if isinstance(s, dict)}
    d["systems"] = {n: system_from_dict(n, s, model, dtype) for n, s in entries.items()}
    d["contexts"] = tuple(d.get("contexts") or (2048, 8192))
    d["compare"] = tuple(tuple(p) for p in d.get("compare") or ())
    d["target"] = pop_target(d)
    return DecodeExperiment(**{**d, "model": model, "dtype": dtype})


def load_decode_experiment(path: str) -> DecodeExperiment:
    with open(path) as f:
        return parse_decode_experiment(yaml.safe_load(f) or {})


def step_tokens(lay, engine) -> int:
    """The fewest prompt tokens any step of a system (layout ``lay``, EngineConfig ``engine``) may
    take: its smallest batch limit."""
    limits = [engine.max_num_batched_tokens]
    lay = getattr(lay, "prefill", None) or lay  # pd: its prefill instances take the prompts
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
