"""A deployment that starts from a placement by layer (``--init-expert-location``): each expert
device loads its own experts per layer and every router routes by the same map, so outputs equal
colocated; under live rebalancing the map is where the moves start from."""
from __future__ import annotations

import json

import pytest

from moeflow import LLM
from moeflow.config import ConfigError
from moeflow.layout import make_layout
from moeflow.model.weights import load_config
from moeflow.scheduler.eplb import rebalance
from moeflow.scheduler.expert_location import initial_map

from parity import PARAMS, PROMPTS, assert_same, colocated_outputs


@pytest.fixture(scope="module")
def reference(checkpoints):
    return colocated_outputs(checkpoints, ("qwen3",))


def _recorded(path: str) -> dict:
    """A load whose hot expert differs by layer, as GET /expert_distribution writes it."""
    mc, _ = load_config(path)
    moe = [lid for lid in range(mc.num_layers) if mc.sparse_layers[lid]]
    count = [[100 if e == (3 * i + 1) % mc.num_experts else 1 + e for e in range(mc.num_experts)]
             for i in range(len(moe))]
    return {"logical_count": count, "moe_layers": moe, "num_experts": mc.num_experts}


@pytest.mark.parametrize("kind,layout,live", [
    ("logical_count", dict(mode="dep", dp=2, num_redundant_experts=2), True),
    ("physical_to_logical_map", dict(mode="asap", attn_dp=1, moe_workers=2, num_redundant_experts=3,
                                     min_batch_tokens=8, max_batch_tokens=128), False),
    ("logical_count", dict(mode="afd", attn_workers=1, ffn_workers=2, topology="all", router="ffn",
                           num_redundant_experts=2), False),
])
def test_a_starting_placement_by_layer_matches_colocated(checkpoints, reference, tmp_path, kind, layout, live):
    path = checkpoints("qwen3").path
    rec = _recorded(path)
    e, moe = rec["num_experts"], rec["moe_layers"]
    held = make_layout(**layout).experts_held(e)
    want = rebalance(rec["logical_count"], len(held), layout["num_redundant_experts"])
    if kind == "physical_to_logical_map":
        rec = {kind: [want.physical(i) for i in range(len(moe))]}
    loc = tmp_path / "location.json"
    loc.write_text(json.dumps(rec))
    assert initial_map(str(loc), held, e, moe) == want and len(set(want.layers)) > 1  # differs by layer
    extra = dict(enable_eplb=True, eplb_config={"step_interval": 2, "window_size": 4}) if live else {}
    with LLM(path, dtype="float32", init_expert_location=str(loc), **extra, **layout) as llm:
        assert llm.engine.expert_load.map == want
        for _ in range(2 if live else 1):
            assert_same(llm.generate(PROMPTS, PARAMS), reference["qwen3"])
        dist = llm.expert_distribution()
        history = llm.engine.eplb.history
    assert dist["moe_layers"] == moe and len({sum(row) for row in dist["logical_count"]}) == 1
    assert not live or sum(r.retired_s is not None for r in history) >= 1  # and rebalances went on from it


@pytest.mark.parametrize("layout,words", [
    (dict(mode="colocated"), "mode colocated holds every expert in one process"),
    (dict(mode="dwdp", dp=2), "mode dwdp has no placement to choose"),
    (dict(mode="afd", attn_workers=2, ffn_workers=2), "mode afd has no placement to choose"),
    (dict(mode="asap", moe_workers=2, expert_placement=((0, 1, 2, 3), (4, 5, 6, 7))),
     "either the layout's expert_placement or a starting placement file"),
    (dict(mode="dep", dp=2), "init_expert_location: '/no/such.json' is neither 'trivial' nor a file"),
])
def test_a_starting_placement_is_refused_where_it_cannot_apply(checkpoints, tmp_path, layout, words):
    loc = "/no/such.json"
    if layout["mode"] != "dep":
        loc = str(tmp_path / "location.json")
        (tmp_path / "location.json").write_text(json.dumps(_recorded(checkpoints("qwen3").path)))
    with pytest.raises(ConfigError) as e:
        LLM(checkpoints("qwen3").path, init_expert_location=loc, **layout)
    assert words in str(e.value)


def test_bench_router_load_saves_a_file_a_deployment_starts_from(checkpoints, tmp_path):
    """The offline recording (one process, the model's own router on a workload's prompts)."""
    from moeflow.cli import main

    path, out = checkpoints("qwen3").path, tmp_path / "load.json"
    assert main(["bench", "router-load", "--model", path, "--num-requests", "3", "--router-skew", "1",
                 "--save-location", str(out)]) == 0
    rec = json.loads(out.read_text())
    mc, _ = load_config(path)
    assert rec["num_experts"] == mc.num_experts and rec["work_items"] == 3
    assert len({sum(row) for row in rec["logical_count"]}) == 1  # every layer routed every token, K each
    held = make_layout("dep", dp=2, num_redundant_experts=2).experts_held(mc.num_experts)
    m = initial_map(str(out), held, mc.num_experts, rec["moe_layers"])
    assert m == rebalance(rec["logical_count"], 2, 2)
