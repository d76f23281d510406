"""The simulator's target (hardware, cost, profile, machine, hardware_overrides): one dataclass that the
serving and the decode experiment both hold, read from the same flat keys and validated the same way."""
import pytest

from moeflow.config import ConfigError
from moeflow.experiment.decode import parse_decode_experiment
from moeflow.experiment.serve import parse_experiment
from moeflow.experiment.target import SimTarget

SYSTEMS = {"dep2": {"mode": "dep", "dp": 2}}


def _serve(**top):
    return parse_experiment({"model": "tiny", "workload": {"duration_s": 1}, "systems": SYSTEMS, **top})


def _decode(**top):
    return parse_decode_experiment({"model": "tiny", "contexts": [2048], "systems": SYSTEMS, **top})


def test_both_files_read_the_same_target_from_the_same_keys():
    # NOTE: 28e9 is a string to YAML 1.1; the overrides read it as the number it means
    keys = {"hardware": "cpu-here", "cost": "profiled", "profile": "p.json", "machine": "m.json",
            "hardware_overrides": {"mem_bw_Bps": "28e9", "launch_s": 2e-5}}
    want = SimTarget("cpu-here", "profiled", "p.json", "m.json", (("launch_s", 2e-5), ("mem_bw_Bps", 28e9)))
    assert _serve(**keys).target == want
    assert _decode(**keys).target == want
    assert _serve().target == _decode().target == SimTarget()


@pytest.mark.parametrize("parse", [_serve, _decode])
@pytest.mark.parametrize("keys, message", [
    ({"cost": "roofline"}, "cost must be one of"),
    ({"cost": "profiled"}, "cost: profiled needs profile"),
    ({"hardware_overrides": {"mem_bw_Bps": "fast"}}, "hardware_overrides.mem_bw_Bps must be a number"),
    ({"hardware_overrides": [1, 2]}, "hardware_overrides must be a mapping"),
    ({"hardware": ""}, "hardware must be a name or a path"),
    ({"hardwares": "gb200"}, "unknown keys in the top level"),
])
def test_a_bad_target_fails_in_either_file(parse, keys, message):
    with pytest.raises(ConfigError, match=message):
        parse(**keys)


def test_the_decode_experiment_validates_its_own_fields():
    with pytest.raises(ConfigError, match="contexts must be ints >= 1"):
        _decode(contexts=[0])
    with pytest.raises(ConfigError, match="compare: 'afd' vs 'dep2': both must be systems"):
        _decode(compare=[["afd", "dep2"]])
    d = parse_decode_experiment({"systems": {"a": {"mode": "dep", "dp": 2, "env": {"X": 1}}}})
    assert d.env == {"a": {"X": "1"}} and d.model == "tiny" and d.contexts == (2048, 8192)
