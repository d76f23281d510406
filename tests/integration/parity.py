"""What every mode's parity test against colocated runs and checks (fp32: prompt logprobs within
1e-3 at every position, greedy output identical)."""
from __future__ import annotations

from moeflow import LLM, SamplingParams

# ragged: a 1-token prompt (with E=3 some worker gets no token in some layer), short and longer
# prompts; small batch limits cut them into several batches
PROMPTS = [[7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6, 7], list(range(40, 70)), list(range(3, 60)),
           [150, 151, 152, 153]]
PARAMS = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=1, ignore_eos=True)


def assert_same(outs, refs) -> None:
    for o, r in zip(outs, refs, strict=True):
        assert o.error is None and o.outputs[0].token_ids == r.outputs[0].token_ids
        assert o.prompt_logprobs[0] is None
        for x, y in zip(o.prompt_logprobs[1:], r.prompt_logprobs[1:], strict=True):
            assert x.keys() == y.keys() and max(abs(x[t].logprob - y[t].logprob) for t in x) < 1e-3


_REFERENCES: dict[str, list] = {}  # checkpoint path -> outputs: one colocated run per session, shared by every mode


def colocated_outputs(checkpoints, names) -> dict:
    """The colocated reference's outputs on PROMPTS, per checkpoint variant."""
    out = {}
    for name in names:
        path = checkpoints(name).path
        if path not in _REFERENCES:
            with LLM(path, dtype="float32") as llm:
                _REFERENCES[path] = llm.generate(PROMPTS, PARAMS)
        out[name] = _REFERENCES[path]
    return out


def generate_while_draining(llm, monkeypatch, want, group: int = 1) -> int:
    """``PROMPTS`` generated while attention group ``group`` (the last) is asked to leave as soon as
    it holds requests (they finish there, or are handed over where the deployment shares its KV
    caches); the outputs equal ``want``. Returns how many it held then (> 0)."""
    engine, step, resident = llm.engine, llm.engine.step, []

    def step_then_drain():
        if not resident and engine.scheduler.pool.groups[group].requests:
            resident.append(len(engine.scheduler.pool.groups[group].requests))
            engine.scale(attention=group)
        return step()

    monkeypatch.setattr(engine, "step", step_then_drain)
    assert_same(llm.generate(PROMPTS, PARAMS), want)
    monkeypatch.undo()
    assert resident and resident[0] > 0
    return resident[0]
