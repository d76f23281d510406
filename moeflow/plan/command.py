"""The ``moeflow serve`` command line that starts a candidate deployment."""
from __future__ import annotations

import shlex

_ENGINE_FLAGS = {"num_kv_blocks": "--num-kv-blocks", "max_num_seqs": "--max-num-seqs"}  # the rest: serve's defaults


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def engine_runs(system: dict) -> str | None:
    """Why moeflow's engine cannot run ``system`` (None: it can): dep with TP is the simulator's."""
    for lay in (system, system.get("prefill") or {}, system.get("decode") or {}):
        if lay.get("mode") == "dep" and lay.get("tp", 1) > 1:
            return "dep with tp > 1 is simulated only: moeflow's engine runs tp 1 (vLLM, SGLang: --tensor-parallel-size)"
    return None


def serve_command(model: str, system: dict) -> str | None:
    """``moeflow serve`` with the candidate's mode, layout and engine limits as flags (None: the
    engine cannot run it, ``engine_runs`` says why)."""
    if engine_runs(system) is not None:
        return None
    args = ["moeflow", "serve", "--model", model, "--mode", system["mode"]]
    for key, value in system.items():
        if key in ("mode", "engine", "hardware"):  # which devices each role's processes get is the launcher's choice
            continue
        if isinstance(value, dict):  # a pd side: its layout as 'mode=M,key=value,...'
            args += [_flag(key), ",".join(f"{k}={v}" for k, v in value.items())]
        else:
            args += [_flag(key), str(value)]
    for key, value in (system.get("engine") or {}).items():
        if key in _ENGINE_FLAGS:
            args += [_ENGINE_FLAGS[key], str(value)]
    return shlex.join(args)


def autoscale_flags(system: dict) -> str:
    """An elastic candidate's ``--autoscale POLICY.yaml`` and the most members the engine sizes
    for (pd's instances, afd's workers; dep's ranks are its layout's ``--max-dp``)."""
    policy = system["autoscale"]
    most = {"pd": (("--max-prefill-instances", "max_prefill"), ("--max-decode-instances", "max_decode")),
            "afd": (("--max-attn-workers", "max_attention"), ("--max-ffn-workers", "max_ffn"))}.get(system["mode"], ())
    return shlex.join(["--autoscale", "POLICY.yaml"] + [x for flag, key in most for x in (flag, str(policy[key]))])
