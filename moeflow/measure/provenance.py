"""Provenance: which code, command and machine a result file came from; every JSON a benchmark,
``moeflow simulate`` or ``moeflow profile`` writes goes through ``write_json`` and carries it.

Pure Python: the simulator writes results too. The machine's measured rates (ISA, GEMM probe)
are added when torch is already loaded in this process (benchmarks and profiles load it; the
simulator, whose results do not depend on this machine's speed, does not).
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata

from moeflow.hardware.cpuinfo import cpu_model

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CODE_PATHS = ("moeflow", "pyproject.toml", "Makefile")  # what "dirty" looks at (results being written do not count)
_command: list[str] | None = None  # set by the CLI: the moeflow command this process runs


def set_command(argv: list[str]) -> None:
    global _command
    _command = list(argv)


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", _REPO, *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def provenance(command: list[str] | None = None) -> dict:
    """commit, dirty, command, date, torch, python, cpu_model, cores, hostname_hash (+ machine rates)."""
    status = _git("status", "--porcelain", "--", *_CODE_PATHS)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    p = {"commit": _git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None,
         "command": shlex.join(command or _command or [os.path.basename(sys.argv[0]), *sys.argv[1:]]),
         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         "torch": _version("torch"), "python": platform.python_version(), "cpu_model": cpu_model(),
         "cores": cores, "hostname_hash": hashlib.sha1(platform.node().encode()).hexdigest()[:12]}
    if "torch" in sys.modules:
        try:
            from moeflow.hardware.report import machine_facts

            f = machine_facts()
            p.update(isa=f["isa"], isa_flags=f["isa_flags"], native_dtypes=f["native_dtypes"],
                     probe_gemm_gflops=f["probe_gemm_gflops"], auto_dtype=f["auto_dtype"])
        except Exception as e:  # provenance must never lose a result
            p["machine_error"] = f"{type(e).__name__}: {e}"
    return p


def result_text(result: dict) -> str:
    """A result file's text: a top-level key per line, each value compact (indentation was a third
    of the bytes of docs/results; ``python -m json.tool`` indents a file to read it)."""
    return "{\n" + ",\n".join(f"{json.dumps(str(k))}: {json.dumps(v, separators=(',', ':'), default=_plain)}"
                              for k, v in result.items()) + "\n}\n"


def write_json(path: str, result: dict, command: list[str] | None = None) -> None:
    """Write ``result`` with a ``provenance`` block first (a result already carrying one keeps it)."""
    out = {"provenance": result.get("provenance") or provenance(command), **result}
    # encoded whole before the file is touched: a value with no JSON form must not leave a
    # truncated result behind (one was committed that way)
    text = result_text(out)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_result(result: dict, json_path: str | None, md_path: str | None, markdown) -> None:
    """A benchmark's outputs: the JSON (``write_json``) and ``markdown(result)``, each where asked."""
    if json_path:
        write_json(json_path, result)
    if md_path:
        with open(md_path, "w") as f:
            f.write(markdown(result))


def _plain(o):
    # configs that ride along in a result (e.g. an engine's ClusterConfig) are frozen dataclasses
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    # numpy scalars (a comparison of numpy floats is a numpy bool) carry their Python value
    if getattr(o, "shape", None) == () and hasattr(o, "item"):
        return o.item()
    raise TypeError(f"a result holds a {type(o).__name__}, which has no JSON form")
