"""The Python half of verify/gpu_check.sh: the machine's versions, the dry run's checks, the summary.

    python3 verify/gpu_check.py env FILE.json           # versions and the device, printed and written
    python3 verify/gpu_check.py dry-run -- BENCH_ARGV   # what a run needs is in place (no GPU needed)
    python3 verify/gpu_check.py bare -- MOEFLOW_ARGV    # a moeflow command with the server's packages refused
    python3 verify/gpu_check.py summary OUT             # OUT/summary.{json,md} from the steps' files

Standard library at the top: torch and moeflow are imported inside the commands (``env`` reports
their absence instead of failing on it).
"""
from __future__ import annotations

import contextlib
import glob
import importlib
import importlib.abc
import importlib.metadata
import io
import json
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_TESTS = os.path.join(ROOT, "tests", "gpu")
# what moeflow serve needs and the GPU machine lacks: neither the GPU tests nor the bench commands may
SERVER_ONLY = ("fastapi", "uvicorn", "prometheus_client", "starlette", "httpx")
# what the GPU tests import inside their functions, beyond what collecting them imports
LAZY_IMPORTS = (("transformers", "AutoModelForCausalLM"), ("moeflow.engine.llm", "resolve_model"),
                ("moeflow.model.tiny", "write_tiny"))
# module name -> its distribution's (versions are read from the installed metadata: importing the
# server's packages to ask would defeat the refusal that follows)
PACKAGES = {"torch": "torch", "transformers": "transformers", "triton": "triton", "safetensors": "safetensors",
            "numpy": "numpy", "yaml": "PyYAML", "pytest": "pytest", "pytest_timeout": "pytest-timeout",
            "fastapi": "fastapi", "uvicorn": "uvicorn"}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(PACKAGES.get(name, name))
    except importlib.metadata.PackageNotFoundError:
        return None


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def machine() -> dict:
    info = {"python": platform.python_version(), "executable": sys.executable, "platform": platform.platform(),
            "commit": _commit(), "packages": {p: _version(p) for p in PACKAGES}}
    if info["packages"]["torch"] is None:
        return info
    import torch

    info["torch_cuda"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    info["matmul_allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
    if info["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        info.update(device_count=torch.cuda.device_count(), device=torch.cuda.get_device_name(0),
                    capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                    memory_gib=round(p.total_memory / 2**30, 1), bf16=torch.cuda.is_bf16_supported())
    return info


def cmd_env(path: str) -> int:
    info = machine()
    for k, v in info.items():
        print(f"{k}: {v}")
    with open(path, "w") as f:
        json.dump(info, f, indent=1)
    return 0


class _Refuse(importlib.abc.MetaPathFinder):
    """Imports of ``names`` fail, as on a machine without them."""

    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r} (refused: the GPU machine lacks it)")
        return None


def cmd_bare(argv: list[str]) -> int:
    """``moeflow ARGV`` in this process with the server's packages refused, as on the GPU machine."""
    sys.meta_path.insert(0, _Refuse(SERVER_ONLY))
    sys.path.insert(0, ROOT)
    from moeflow.cli import main as moeflow_main

    return moeflow_main(argv)


def cmd_dry_run(bench_argv: list[str]) -> int:
    """Without a GPU and with the server's packages refused: the GPU tests collect (through the
    pytest stand-in, as where pytest is missing), what they import lazily imports, and the bench
    command line parses."""
    failures = []

    def check(name: str, ok: bool, detail: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        if not ok:
            failures.append(name)

    info = machine()
    check("torch", info["packages"]["torch"] is not None,
          f"torch {info['packages']['torch']}, CUDA {info.get('torch_cuda')}, cuda available: {info.get('cuda_available')}")
    sys.meta_path.insert(0, _Refuse(SERVER_ONLY))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import mini_pytest

    mini_pytest.install()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        items, _, errors = mini_pytest.collect([GPU_TESTS], "gpu", mini_pytest.Path(ROOT))
    finally:
        os.chdir(cwd)
    files = sorted({i.id.split("::")[0] for i in items})
    check("gpu tests collect", bool(items) and not errors,
          f"{len(items)} tests marked gpu in {len(files)} files, without {', '.join(SERVER_ONLY)}" +
          "".join(f"\n  {p}:\n{tb}" for p, tb in errors))
    for name, attr in LAZY_IMPORTS:
        try:
            getattr(importlib.import_module(name), attr)
            check(f"import {name}.{attr}", True, "imports without the server's packages")
        except Exception as e:  # noqa: BLE001
            check(f"import {name}.{attr}", False, f"{type(e).__name__}: {e}")
    check("bench command", *_parses(bench_argv))
    print(f"dry run: {'ok' if not failures else 'FAILED: ' + ', '.join(failures)}")
    return 1 if failures else 0


def _parses(argv: list[str]) -> tuple[bool, str]:
    from moeflow.cli import build_parser

    parser, err = build_parser(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(argv)
    except SystemExit:
        sub = argv[:2]
        helptext = subprocess.run([sys.executable, "-m", "moeflow", *sub, "--help"], capture_output=True,
                                  text=True, cwd=ROOT).stdout
        why = ("`moeflow " + " ".join(sub) + "` has no --device yet (the device plumbing of issue 28 is not in "
               "this tree)") if "--device" not in helptext else err.getvalue().strip().splitlines()[-1]
        return False, f"`moeflow {' '.join(argv)}` does not parse: {why}"
    device = getattr(args, "device", None)
    return device == "cuda", f"`moeflow {' '.join(argv)}` parses (device={device!r})"


def _test_counts(out: str, junit: str = "pytest.xml") -> dict | None:
    """Counts from mini_pytest's JSON or pytest's JUnit XML (``junit``), whichever the tests step wrote."""
    path = os.path.join(out, "tests.json")
    if os.path.exists(path):
        with open(path) as f:
            d = json.load(f)
        failed = [t["id"] for t in d["tests"] if t["outcome"] == "failed"]
        return {"runner": "mini_pytest", **{k: d[k] for k in ("passed", "failed", "skipped", "errors")}, "failed_ids": failed}
    path = os.path.join(out, junit)
    if not os.path.exists(path):
        return None
    root = ET.parse(path).getroot()
    cases = list(root.iter("testcase"))
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in cases if c.find("failure") is not None]
    errors = sum(c.find("error") is not None for c in cases)
    skipped = sum(c.find("skipped") is not None for c in cases)
    return {"runner": "pytest", "passed": len(cases) - len(failed) - errors - skipped, "failed": len(failed),
            "skipped": skipped, "errors": errors, "failed_ids": failed}


def _bench(out: str) -> dict | None:
    path = os.path.join(out, "bench_decode.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def cmd_summary(out: str) -> int:
    def load(name: str):
        path = os.path.join(out, name)
        return json.load(open(path)) if os.path.exists(path) else None

    steps = []
    if os.path.exists(os.path.join(out, "steps.tsv")):
        for line in open(os.path.join(out, "steps.tsv")):
            name, rc, seconds, limit = line.split("\t")
            steps.append({"step": name, "rc": int(rc), "seconds": int(seconds), "limit_s": int(limit)})
    compare = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, "results", "decode_compare_*.json")))]
    summary = {"machine": load("env.json"), "steps": steps, "tests": _test_counts(out), "decode_compare": compare,
               "bench_decode": _bench(out), "ok": bool(steps) and all(s["rc"] == 0 for s in steps)}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    md = markdown(summary)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


def markdown(s: dict) -> str:
    m = s["machine"] or {}
    pk = m.get("packages", {})
    lines = ["# GPU check", "", f"device: {m.get('device', 'none')} (capability {m.get('capability')}, "
             f"{m.get('memory_gib')} GiB, bf16 {m.get('bf16')}); torch {pk.get('torch')} CUDA {m.get('torch_cuda')}, "
             f"transformers {pk.get('transformers')}, triton {pk.get('triton')}, python {m.get('python')}, "
             f"pytest {pk.get('pytest') or 'absent'}; commit {m.get('commit')}", "",
             "| step | exit | seconds (limit) |", "|---|---|---|"]
    lines += [f"| {st['step']} | {st['rc']}{' (timed out)' if st['rc'] == 124 else ''} | {st['seconds']} ({st['limit_s']}) |"
              for st in s["steps"]]
    t = s["tests"]
    lines += ["", "tests: " + (f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped, {t['errors']} "
                               f"errors ({t['runner']})" + "".join(f"\n- failed: {i}" for i in t["failed_ids"])
                               if t else "no result")]
    if s["decode_compare"]:
        lines += ["", "decode tokens/s, colocated moeflow vs transformers generate (same checkpoint, batch, context):",
                  "", "| dtype | batch | context | moeflow tok/s | transformers tok/s | ratio | greedy tokens agreeing |",
                  "|---|---|---|---|---|---|---|"]
        for c in s["decode_compare"]:
            r = c["moeflow_over_transformers"]
            lines.append(f"| {c['dtype']} | {c['batch']} | {c['context']} | {_num(c['moeflow']['decode_tok_s'])} | "
                         f"{_num(c['transformers']['decode_tok_s'])} | {_num(r, 2)} | {c['agreeing_tokens']}/{c['tokens']} |")
    b = s["bench_decode"]
    if b:
        for name, by_ctx in b.get("results", {}).items():
            for ctx, r in by_ctx.items():
                dtype = (r.get("runs") or [{}])[0].get("dtype", b.get("dtype"))
                lines.append(f"\nbench decode {name} context {ctx}, batch {r['batch']}, dtype {dtype}: TPOT "
                             f"{_num(r['tpot_s']['mean'] * 1e3, 2)} ms, {_num(r['tok_s_per_process']['mean'])} tok/s")
    lines += ["", f"overall: {'ok' if s['ok'] else 'FAILED'}", ""]
    return "\n".join(lines)


def _num(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "env":
        return cmd_env(argv[1])
    if argv and argv[0] == "dry-run":
        rest = argv[1:]
        return cmd_dry_run(rest[1:] if rest[:1] == ["--"] else rest)
    if argv and argv[0] == "bare":
        rest = argv[1:]
        return cmd_bare(rest[1:] if rest[:1] == ["--"] else rest)
    if len(argv) >= 2 and argv[0] == "summary":
        return cmd_summary(argv[1])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
