"""The sampling fields through a real ``moeflow serve`` and the official openai client: each answer
equals what the offline ``LLM`` gives for the same ``SamplingParams``; n choices, stop strings,
logit_bias, penalties, logprobs in both endpoints' shapes, prompt logprobs; streams carry the
same text as JSON answers; a client that leaves an n-choice stream aborts every choice."""
from __future__ import annotations

import math
import time

import httpx
import openai
import pytest

from moeflow import LLM, SamplingParams
from server_harness import ServerProcess

NAME = "moe-sampling"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory):
    path = checkpoints("qwen3").path
    log = tmp_path_factory.mktemp("server_sampling") / "server.log"
    s = ServerProcess(path, "--served-model-name", NAME, "--max-model-len", "128", log_path=str(log))
    llm = LLM(model=path, max_model_len=128)
    with openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield s, client, llm
    llm.shutdown()
    assert s.stop() in (0, 143), s.log()


def _offline(llm, **kw):
    return llm.generate([PROMPT], SamplingParams(**kw))[0]


CASES = {
    "greedy": dict(temperature=0, max_tokens=12),
    "seeded": dict(temperature=1.0, top_k=20, top_p=0.9, seed=11, max_tokens=12),
    "min_p": dict(temperature=0.8, min_p=0.2, seed=3, max_tokens=12),
    "penalties": dict(temperature=0, presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.3, max_tokens=16),
    "min_tokens": dict(temperature=0, min_tokens=6, max_tokens=10),
    "n=3": dict(n=3, temperature=1.0, seed=5, max_tokens=8),
}


@pytest.mark.parametrize("case", list(CASES))
def test_completions_equal_offline(served, case):
    s, client, llm = served
    kw = CASES[case]
    extra = {k: kw[k] for k in ("top_k", "min_p", "repetition_penalty", "min_tokens") if k in kw}
    std = {k: v for k, v in kw.items() if k not in extra}
    r = client.completions.create(model=NAME, prompt=PROMPT, extra_body=extra, **std)
    want = _offline(llm, **kw)
    assert [c.index for c in r.choices] == list(range(kw.get("n", 1)))
    assert [c.text for c in r.choices] == [o.text for o in want.outputs]
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in want.outputs)
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)


def test_stop_strings_cut_the_text_and_stream_the_same(served):
    s, client, llm = served
    full = client.completions.create(model=NAME, prompt=PROMPT, temperature=0, max_tokens=24).choices[0].text
    stop = full[5:8]  # some characters the greedy answer writes
    assert len(stop) == 3 and full.index(stop) == 5
    for include in (False, True):
        r = client.completions.create(model=NAME, prompt=PROMPT, temperature=0, max_tokens=24, stop=[stop, "zzzz"],
                                      extra_body={"include_stop_str_in_output": include})
        c = r.choices[0]
        assert c.text == full[:8 if include else 5] and c.finish_reason == "stop"
        assert c.model_extra["stop_reason"] == stop
        chunks = list(client.completions.create(model=NAME, prompt=PROMPT, temperature=0, max_tokens=24,
                                                stop=[stop, "zzzz"], stream=True,
                                                extra_body={"include_stop_str_in_output": include}))
        assert "".join(ch.choices[0].text for ch in chunks) == c.text
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_choices_stream_like_the_json_answer(served):
    s, client, llm = served
    kw = dict(model=NAME, temperature=1.0, seed=9, max_tokens=10, n=3,
              messages=[{"role": "user", "content": "Tell me"}])
    whole = client.chat.completions.create(**kw)
    texts = {i: "" for i in range(3)}
    finished = set()
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finished.add(c.index)
    assert finished == {0, 1, 2}
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert len(set(texts.values())) > 1  # three samples, not one thrice


def test_logit_bias_forces_a_token_and_is_checked(served):
    s, client, llm = served
    r = client.completions.create(model=NAME, prompt=PROMPT, temperature=0, max_tokens=4, logit_bias={"65": 100})
    assert r.choices[0].text == "AAAA"  # byte-level vocabulary: id 65 is "A"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, logit_bias={"999999": 5})
    assert e.value.body["param"] == "logit_bias" and "999999" in e.value.body["message"]


def test_completion_logprobs_legacy_shape(served):
    s, client, llm = served
    kw = dict(model=NAME, prompt=PROMPT, temperature=0, max_tokens=6, logprobs=3)
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    # texts collide (every lone non-ASCII byte is U+FFFD): ids keep the top 3 apart
    lp = client.completions.create(extra_body={"return_tokens_as_token_ids": True}, **kw).choices[0].logprobs
    want = _offline(llm, temperature=0, max_tokens=6, logprobs=3).outputs[0]
    assert lp.tokens == [f"token_id:{t}" for t in want.token_ids]
    for got, top, pos, t in zip(lp.token_logprobs, lp.top_logprobs, want.logprobs, want.token_ids):
        assert math.isclose(got, pos[t].logprob, abs_tol=1e-5)
        best = sorted(pos, key=lambda u: pos[u].rank)[:3]
        assert list(top) == [f"token_id:{u}" for u in best]
        assert math.isclose(max(top.values()), got, abs_tol=1e-6)  # greedy: the best


def test_chat_logprobs_content_shape_and_stream(served):
    s, client, llm = served
    kw = dict(model=NAME, messages=[{"role": "user", "content": "hi"}], temperature=0, max_tokens=5, logprobs=True,
              top_logprobs=2)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(e.top_logprobs) == 2 for e in content)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)
    assert all(e.token == e.top_logprobs[0].token for e in content), content  # greedy: the best
    assert all(e.bytes == list(e.token.encode()) for e in content if "\ufffd" not in e.token), content
    streamed = [e for ch in client.chat.completions.create(stream=True, **kw) for c in ch.choices
                if c.logprobs is not None for e in c.logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]


def test_prompt_logprobs(served):
    s, client, llm = served
    r = httpx.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2},
                   timeout=60).json()
    plp = r["choices"][0]["prompt_logprobs"]
    want = _offline(llm, max_tokens=1, prompt_logprobs=2).prompt_logprobs
    assert plp[0] is None and len(plp) == len(want) == len(PROMPT)
    for got, pos in zip(plp[1:], want[1:]):
        assert {int(k): round(v["logprob"], 4) for k, v in got.items()} == \
            {k: round(v.logprob, 4) for k, v in pos.items()}


def test_leaving_an_n_stream_aborts_every_choice(served):
    s, client, llm = served
    before = s.metrics().get('moeflow_requests_finished_total{finish_reason="abort"}', 0)
    with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                      json={"prompt": PROMPT, "n": 3, "max_tokens": 100, "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                break
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = s.metrics()
        if m.get('moeflow_requests_finished_total{finish_reason="abort"}', 0) - before == 3:
            break
        time.sleep(0.1)
    assert m.get('moeflow_requests_finished_total{finish_reason="abort"}', 0) - before == 3, m
    assert m.get("moeflow_num_requests_running", 0) == 0, m


def test_chat_options_reach_the_template_and_request_id_names_the_answer(served):
    s, client, llm = served
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    r = client.chat.completions.create(model=NAME, messages=msgs, temperature=0, max_tokens=5, extra_body={
        "add_generation_prompt": False, "continue_final_message": True, "request_id": "mine-1"})
    c = client.completions.create(model=NAME, prompt="<|user|>\nHi\n<|assistant|>\nHel", temperature=0, max_tokens=5)
    assert r.choices[0].message.content == c.choices[0].text and r.usage.prompt_tokens == c.usage.prompt_tokens
    assert r.id == "chatcmpl-mine-1"


def test_a_request_id_in_use_is_a_400_and_the_first_answer_goes_on(served):
    s, client, llm = served
    body = {"prompt": PROMPT, "max_tokens": 60, "ignore_eos": True, "stream": True, "request_id": "dup"}
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as first:
        lines = first.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        again = httpx.post(s.url + "/v1/completions", json={**body, "stream": False}, timeout=60)
        assert again.status_code == 400 and again.json()["error"]["param"] == "request_id", again.text
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2].replace(" ", ""), rest[-3:]
