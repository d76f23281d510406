"""One spelling of the request rate: ``--request-rate`` on every command that takes a rate, and
``request_rate:`` in an experiment file; the older ``--rps`` (the demo's ``--rates``) and ``rps:``
still work, the flags with a one-line warning, and giving both spellings is refused."""
from __future__ import annotations

import argparse
import json

import pytest
import yaml

from moeflow.cli import build_parser, main
from moeflow.config import ConfigError
from moeflow.experiment.serve import apply_overrides, parse_experiment
from moeflow.measure.rate_flag import DeprecatedFlag

# (command words, the old spelling, the words a parse needs besides the rate, a rate, what it parses to)
RATE_COMMANDS = [
    (["simulate"], "--rps", ["--config", "x.yaml"], "1,2", "1,2"),
    (["bench", "compare"], "--rps", ["x.yaml"], "0.5", "0.5"),
    (["bench", "soak"], "--rps", ["--out", "soak"], "0.6", 0.6),
    (["demo"], "--rates", [], "1", "1"),
]
EXPERIMENT = """
model: tiny
hardware: h200
workload: {kind: fixed, fixed_len: 64, output_len: 4, num_requests: 8, seed: 0}
systems:
  dep1: {mode: dep, dp: 1}
"""


def _commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()):
    """Every command's own parser, with its words (``bench serve``: ("bench", "serve"))."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield words, parser
    for sub in subs:
        for name, p in sub.choices.items():
            yield from _commands(p, words + (name,))


def test_every_command_that_takes_a_rate_takes_request_rate():
    with_rate = {}
    for words, p in _commands(build_parser()):
        flags = {o: a for a in p._actions for o in a.option_strings}
        if {"--rps", "--rates"} & set(flags) or "--request-rate" in flags:
            with_rate[" ".join(words)] = flags
    assert {"simulate", "bench serve", "bench compare", "bench soak", "demo"} <= set(with_rate)
    for command, flags in with_rate.items():
        assert "--request-rate" in flags, command
        old = [flags[o] for o in ("--rps", "--rates") if o in flags]
        assert all(isinstance(a, DeprecatedFlag) and a.help == argparse.SUPPRESS for a in old), command


@pytest.mark.parametrize("words, old, rest, rate, parsed", RATE_COMMANDS)
def test_the_old_spelling_lands_in_the_same_place_with_a_warning(words, old, rest, rate, parsed, capsys):
    parser = build_parser()
    new = parser.parse_args([*words, *rest, "--request-rate", rate])
    assert new.request_rate == parsed and capsys.readouterr().err == ""
    args = parser.parse_args([*words, *rest, old, rate])
    assert vars(args) == vars(new)
    err = capsys.readouterr().err
    assert err == f"moeflow {' '.join(words)}: warning: {old} is deprecated; use --request-rate\n"
    with pytest.raises(SystemExit) as e:
        parser.parse_args([*words, *rest, old, rate, "--request-rate", rate])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_simulate_runs_the_same_points_under_either_flag(tmp_path, capsys):
    cfg = tmp_path / "x.yaml"
    cfg.write_text(EXPERIMENT)
    points = {}
    for flag in ("--request-rate", "--rps"):
        out = tmp_path / f"{flag.strip('-')}.json"
        assert main(["simulate", "--config", str(cfg), flag, "2,4", "--json", str(out)]) == 0
        points[flag] = json.loads(out.read_text())["points"]  # one system: its result is the file
    assert [p["rps"] for p in points["--request-rate"]] == [2.0, 4.0]
    assert points["--rps"] == points["--request-rate"]
    assert "--rps is deprecated" in capsys.readouterr().err
    assert main(["simulate", "--config", str(cfg), "--request-rate", "2,-1"]) == 2
    assert "--request-rate: rates must be positive numbers" in capsys.readouterr().err


def test_an_experiment_file_takes_request_rate_or_rps_not_both():
    base = yaml.safe_load(EXPERIMENT)
    new, old = parse_experiment({**base, "request_rate": [0.5, 1]}), parse_experiment({**base, "rps": [0.5, 1]})
    assert new == old and new.rps == (0.5, 1.0)
    with pytest.raises(ConfigError, match="give the rates once: request_rate .rps is its older name., not both"):
        parse_experiment({**base, "request_rate": [1], "rps": [1]})
    # an override replaces the rates whichever spelling the file used
    assert parse_experiment(apply_overrides({**base, "rps": [1]}, ("request_rate=[3]",))).rps == (3.0,)
    assert parse_experiment(apply_overrides({**base, "request_rate": [1]}, ("rps=[4]",))).rps == (4.0,)


def test_rates_per_system_name_every_system_with_as_many_each(tmp_path):
    base = {**yaml.safe_load(EXPERIMENT), "systems": {"dep1": {"mode": "dep", "dp": 1}, "dep2": {"mode": "dep", "dp": 2}}}
    exp = parse_experiment({**base, "request_rate": {"dep1": [1, 2], "dep2": [3, 6]}})
    assert exp.rates("dep1") == (1.0, 2.0) and exp.rates("dep2") == (3.0, 6.0)
    assert parse_experiment({**base, "request_rate": [1, 2]}).rates("dep2") == (1.0, 2.0)
    with pytest.raises(ConfigError, match=r"must name every system \['dep1', 'dep2'\], got \['dep1'\]"):
        parse_experiment({**base, "request_rate": {"dep1": [1]}})
    with pytest.raises(ConfigError, match="the same number of rates"):
        parse_experiment({**base, "request_rate": {"dep1": [1], "dep2": [1, 2]}})
    with pytest.raises(ConfigError, match=r"request_rate.dep2 must be a list of numbers"):
        parse_experiment({**base, "request_rate": {"dep1": [1], "dep2": ["fast"]}})
    # the simulator runs each system at its own rates
    cfg = tmp_path / "x.yaml"
    cfg.write_text(yaml.safe_dump({**base, "request_rate": {"dep1": [1], "dep2": [3]}}))
    out = tmp_path / "x.json"
    assert main(["simulate", "--config", str(cfg), "--json", str(out)]) == 0
    systems = json.loads(out.read_text())["systems"]
    assert [p["rps"] for p in systems["dep1"]["points"]] == [1.0] and [p["rps"] for p in systems["dep2"]["points"]] == [3.0]
