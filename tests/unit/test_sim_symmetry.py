"""Every modelling choice is the same for every system of a run unless the config cites why one
differs (``sim/symmetry.py``): found per (system, choice), printed by ``simulate``, and refused
uncited in the repository's configs."""
from __future__ import annotations

import glob

import pytest
import yaml

from moeflow.config import ConfigError
from moeflow.experiment.system import SimOptions, system_from_dict
from moeflow.sim.symmetry import differences, report, unjustified


def _systems(entries: dict) -> dict:
    return {n: system_from_dict(n, d) for n, d in entries.items()}


def test_a_choice_one_system_takes_alone_is_found_and_its_reason_kept():
    systems = _systems({
        "a": {"mode": "dep", "dp": 2},
        "b": {"mode": "dep", "dp": 2, "sim": {"attention_parallel": "sequence"}},
        "c": {"mode": "asap", "sim": {"super_kernel": False, "differs": {"super_kernel": "ASAP §4.3, line 52"}}},
    })
    diffs = differences(systems)
    assert [(d.system, d.choice, d.value, d.usual) for d in diffs] == [
        ("c", "super_kernel", False, True), ("b", "attention_parallel", "sequence", "tensor")]
    assert [d.system for d in unjustified(diffs)] == ["b"]
    text = report(diffs)
    assert "NO REASON GIVEN" in text and "ASAP §4.3, line 52" in text
    assert report(differences(_systems({"a": {"mode": "dep"}, "b": {"mode": "dwdp"}}))).endswith(
        "the same for every system")
    # a choice only dep reads is not compared with a dwdp system's default
    assert differences(_systems({"a": {"mode": "dep", "sim": {"dedup_dispatch": True}}, "b": {"mode": "dwdp"}})) == []


def test_seeds_are_not_choices_and_a_reason_must_name_a_choice_and_say_something():
    systems = _systems({"a": {"mode": "dep", "sim": {"seed": 1}}, "b": {"mode": "dep", "sim": {"expert_seed": 2}}})
    assert differences(systems) == []
    with pytest.raises(ConfigError, match="not a modelling choice"):
        SimOptions(differs={"seed": "why"})
    with pytest.raises(ConfigError, match="give the text"):
        SimOptions(differs={"super_kernel": " "})
    assert SimOptions(differs={"super_kernel": "x"}).differs == (("super_kernel", "x"),)


@pytest.mark.parametrize("path", sorted(glob.glob("configs/*.yaml")))
def test_every_config_cites_each_choice_that_differs_between_its_systems(path):
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    entries = raw.get("systems") or {}
    # NOTE: bench decode's per-system env is the engine's, not a layout's
    systems = _systems({n: {k: v for k, v in d.items() if k != "env"} for n, d in entries.items()
                        if isinstance(d, dict) and "mode" in d})
    assert unjustified(differences(systems)) == [], report(differences(systems))
