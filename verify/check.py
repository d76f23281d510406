"""Model-check the one-sided protocol (verify/protocol.pml) with spin; `make verify` runs this.

Each case is one exhaustive safety run (assertions and invalid end states) of the model in one
configuration. The shipped protocol must pass every "pass" case; each mutant must fail with the
error it exists to show, so that a check which could never fail would be noticed: the old
doorbell ring (the counterexample kept from the fix), a waiter that drains after its re-check,
weakly ordered stores, more batches in flight than the slots allow. Exit status 0 iff every case
ends as expected. docs/protocol_model.md explains the model and the cases.

    python3 verify/check.py [--json] [CASE ...]     # no CASE: every case
    python3 verify/check.py --trail CASE            # replay a failing case's (shortened) trail

Standard library only: it runs before and without the project's virtual environment.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

MODEL = Path(__file__).resolve().with_name("protocol.pml")
INSTALL_HINT = "spin is not installed: `make verify` installs it (`sudo apt-get install -y spin` on Debian/Ubuntu)"
LOST_WAKEUP = "!(lost_wakeup)"  # the assertion pan reports


@dataclass(frozen=True)
class Case:
    name: str
    defines: tuple[str, ...]  # -D flags for the model (see its header)
    expect: str  # "pass", or a piece of the error pan must report
    what: str


# Geometries. tp2: one attention group of 2 TP lanes (two ringers on one doorbell; a region is
# complete only with both lanes), dual-batch (2 batches in flight on the default 2 slots), 3
# messages a lane (slots reused). dep2: 2 regions of one lane each, lockstep, as dep mode runs.
_TP2 = ("THREADS=0", "NREG=1", "W=2", "NMSG=3", "MAXF=2")
_DEP2 = ("THREADS=0", "NREG=2", "W=1", "NMSG=2", "MAXF=1")
_THREADS = ("THREADS=1", "NREG=1", "W=1", "NMSG=4", "MAXF=2")

CASES = [
    Case("tp2", _TP2, "pass", "two lanes of one region, dual-batch, slots reused"),
    Case("dep2", _DEP2, "pass", "two regions of one lane each (the round-robin scan), lockstep as in dep"),
    Case("threads", _THREADS, "pass", "the MoE worker's receive and send threads, each slot reused"),
    Case("backpressure", ("THREADS=1", "NREG=1", "W=1", "NMSG=5", "MAXF=4"), "pass",
         "4 batches in flight on 2 slots: the writer waits for its slot"),
    Case("old-ring", ("THREADS=0", "NREG=1", "W=2", "NMSG=1", "OLD_RING"), LOST_WAKEUP,
         "the ring before the fix: a ringer's flag still in its store buffer when it loads the word"),
    Case("old-ring-sc", _TP2 + ("OLD_RING", "SC"), LOST_WAKEUP,
         "the ring before the fix without store buffers: a ringer preempted between load and store"),
    Case("drain-after-poll", _TP2 + ("DRAIN_AFTER_POLL",), LOST_WAKEUP, "the waiter drains after its re-check"),
    Case("weak-order", _THREADS + ("WEAK_ORDER",), "assertion violated",
         "a younger store may pass an older one (ARM/POWER without release): the flag before the payload"),
    Case("too-many-in-flight", ("THREADS=0", "NREG=1", "W=1", "NMSG=7", "MAXF=6"), "invalid end state",
         "6 batches in flight on 2 slots, one MoE thread: writer and worker wait on each other"),
]


@dataclass
class Result:
    name: str
    expect: str
    ok: bool  # ended as expected
    error: str  # pan's first error line, "" if none
    states: int
    transitions: int
    depth: int
    seconds: float


def _require_tools() -> None:
    for tool, hint in (("spin", INSTALL_HINT), ("gcc", "gcc is not installed (spin compiles its verifier with it)")):
        if shutil.which(tool) is None:
            sys.exit(f"error: {hint}")


def _build(case: Case, workdir: Path, *cflags: str) -> None:
    shutil.copy(MODEL, workdir / MODEL.name)
    # NOTE: -O0: pan.c is 350 kB and these runs take seconds, so an optimizing compile costs more than it saves
    for cmd in (["spin", *(f"-D{d}" for d in case.defines), "-a", MODEL.name],
                ["gcc", "-w", "-O0", "-DSAFETY", "-DNOBOUNDCHECK", "-DMEMLIM=2048", *cflags, "-o", "pan", "pan.c"]):
        done = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"error: {case.name}: {' '.join(cmd)} failed:\n{done.stdout}{done.stderr}")


def _number(pattern: str, text: str) -> int:
    m = re.search(pattern, text)
    return int(float(m.group(1))) if m else -1


def run_case(case: Case) -> Result:
    with tempfile.TemporaryDirectory(prefix="moeflow-spin-") as d:
        workdir = Path(d)
        _build(case, workdir)
        t0 = time.monotonic()
        out = subprocess.run(["./pan", "-m100000", "-w22", "-n"], cwd=workdir, capture_output=True, text=True,
                             check=False).stdout
        seconds = time.monotonic() - t0
    errors = _number(r"errors: (\d+)", out)
    first = next((m.group(1) for m in re.finditer(r"^pan:\d+: (.*)$", out, re.MULTILINE)), "")
    incomplete = any(s in out for s in ("max search depth too small", "MEMLIM", "out of memory"))
    if case.expect == "pass":
        ok = errors == 0 and not incomplete
    else:
        ok = errors > 0 and case.expect in first
    return Result(case.name, case.expect, ok, first, _number(r"(\d+) states, stored", out),
                  _number(r"(\d+) transitions", out), _number(r"depth reached (\d+)", out), round(seconds, 2))


def show_trail(case: Case) -> int:
    """Find a short counterexample (pan -i) and print the model's account of it."""
    with tempfile.TemporaryDirectory(prefix="moeflow-spin-") as d:
        workdir = Path(d)
        _build(case, workdir, "-DREACH")
        subprocess.run(["./pan", "-m100000", "-w22", "-n", "-i"], cwd=workdir, capture_output=True, text=True, check=False)
        if not (workdir / f"{MODEL.name}.trail").exists():
            print(f"{case.name}: no error, no trail")
            return 1
        out = subprocess.run(["spin", *(f"-D{d}" for d in case.defines), "-t", MODEL.name], cwd=workdir,
                             capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        if line.startswith("#processes"):
            break
        print(line.strip())
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cases", nargs="*", help=f"of {[c.name for c in CASES]} (default: all)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--trail", metavar="CASE", help="replay a short counterexample of CASE")
    args = ap.parse_args(argv)
    _require_tools()
    by_name = {c.name: c for c in CASES}
    unknown = [n for n in args.cases + ([args.trail] if args.trail else []) if n not in by_name]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {list(by_name)}")
    if args.trail:
        return show_trail(by_name[args.trail])
    results = []
    for case in [by_name[n] for n in args.cases] or CASES:
        r = run_case(case)
        results.append(r)
        if not args.json:
            outcome = r.error or "no error"
            print(f"{'ok  ' if r.ok else 'FAIL'} {r.name:<19} {outcome:<50} {r.states:>9} states "
                  f"{r.transitions:>9} transitions  depth {r.depth:>4}  {r.seconds:5.2f} s   ({case.what})", flush=True)
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=1))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
