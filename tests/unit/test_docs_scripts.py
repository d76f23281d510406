"""The scripts under docs/results run on the committed results and write what is committed: the
tables of dwdp.md and afd.md, multihost.md, session 8's refitted profiles; multihost/run.sh's
commands still parse. These read docs/results by design (as the provenance check does): the
committed results are what they are about, not fixtures of the library's tests.
multihost/link.py runs in tests/integration/test_multihost_link.py."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
RESULTS = os.path.join(ROOT, "docs", "results")


def _script(path: str, *args: str) -> subprocess.CompletedProcess:
    # PYTHONPATH: this checkout's moeflow, not whichever one the interpreter has installed
    env = {**os.environ, "PYTHONPATH": os.path.abspath(ROOT)}
    return subprocess.run([sys.executable, os.path.join(RESULTS, path), *args], capture_output=True, text=True,
                          env=env, timeout=120, check=True)


@pytest.mark.parametrize("script,written", [("dwdp/report.py", "dwdp/tables.md"), ("afd/report.py", "afd/tables.md"),
                                            ("multihost/report.py", "multihost.md")])
def test_a_report_writes_the_committed_tables_from_the_committed_results(script, written, tmp_path):
    out = tmp_path / "tables.md"
    _script(script, str(out))
    with open(os.path.join(RESULTS, written)) as f:
        assert out.read_text() == f.read()


@pytest.mark.parametrize("variant,flags", [("profile_without_8192", ["--without-8192"]),
                                           ("profile_relative", ["--relative"]),
                                           ("profile_relative_without_8192", ["--relative", "--without-8192"])])
def test_the_session8_refit_gives_the_committed_fits(variant, flags, tmp_path):
    here = os.path.join(RESULTS, "dwdp", "session8")
    out = tmp_path / "refit.json"
    _script("dwdp/session8/refit.py", os.path.join(here, "profile.json"), str(out), *flags)
    with open(os.path.join(here, variant + ".json")) as f:
        committed = json.load(f)
    got = json.loads(out.read_text())
    assert got["attention"]["fit"] == pytest.approx(committed["attention"]["fit"], rel=1e-9, abs=1e-15)
    assert got["attention"]["samples"] == committed["attention"]["samples"]


def test_the_multihost_run_parses_and_its_commands_take_their_flags():
    """run.sh needs root and two namespaces (not run here): its shell and every moeflow command's
    flags are checked against today's parsers, which is where such a script goes stale."""
    from moeflow.cli import build_parser

    path = os.path.join(RESULTS, "multihost", "run.sh")
    subprocess.run(["bash", "-n", path], check=True)
    with open(path) as f:
        arrays = {name: shlex.split(body) for name, body in re.findall(r"^(SERVE|BENCH)=\((.*)\)$", f.read(), re.M)}
    assert set(arrays) == {"SERVE", "BENCH"}
    parser = build_parser()
    node = ["--nnodes", "2", "--master-addr", "10.214.7.1", "--master-port", "29611"]
    parser.parse_args(["serve", *arrays["SERVE"], "--port", "8611"])
    parser.parse_args(["serve", *arrays["SERVE"], "--port", "8612", *node, "--node-rank", "0"])
    parser.parse_args(["worker-node", *node, "--node-rank", "1"])
    parser.parse_args(["bench", "serve", "--base-url", "http://127.0.0.1:8611", *arrays["BENCH"], "--seed", "0",
                       "--json", "one_host_r1.json"])
