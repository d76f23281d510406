"""AsyncEngine's promise against a scripted engine: every accepted request ends with a result or
an explicit error — on completion, on a step that raises, on shutdown — and admission is bounded."""
from __future__ import annotations

import asyncio
import threading

import pytest

from moeflow.core import Request, RequestError, SamplingParams
from moeflow.engine.base import Engine, EngineLoad, StepResult, clock
from moeflow.engine.restart import RestartPolicy
from moeflow.server.async_engine import AsyncEngine
from moeflow.server.health import EngineUnavailable, Overloaded
from moeflow.server.metrics import ServerMetrics


class _Out:
    def __init__(self, token_id):
        self.token_id = token_id


class FakeEngine(Engine):
    """One token per request per step; ``max_tokens`` ends a request; ``explode`` makes step raise
    (the interface's defaults: never degraded, no stall watchdog)."""

    max_model_len = 100
    failed = None

    def __init__(self):
        self.requests: dict[str, Request] = {}
        self.explode = False
        self.gate = threading.Event()  # step only runs while set
        self.gate.set()

    def add_request(self, r: Request) -> None:
        if not r.prompt_token_ids:
            raise RequestError(f"request {r.request_id}: the prompt is empty")
        self.requests[r.request_id] = r

    def step(self) -> StepResult:
        self.gate.wait(5)
        if self.explode:
            raise RuntimeError("boom")
        outputs, finished = {}, []
        for rid, r in list(self.requests.items()):
            outputs[rid] = _Out(7)
            if r.append_token(7):
                finished.append(self.requests.pop(rid))
        return StepResult(outputs, finished, {"fake": 0.001})

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def abort(self, rid: str) -> None:
        self.requests.pop(rid, None)

    def check_workers(self) -> StepResult:
        return StepResult({}, [])

    def load(self) -> EngineLoad:
        return EngineLoad(0, len(self.requests), 10, 10)


class FakeLLM:
    restart_policy = RestartPolicy()  # off, as in the Python API

    def __init__(self):
        self.engine = FakeEngine()
        self.is_shut_down = False
        self.restarts = 0
        self.hold = threading.Event()  # a restart waits for it (the test looks at the server meanwhile)
        self.hold.set()

    def restart(self, sleep):
        sleep(self.restart_policy.delay_s(0))
        self.hold.wait(5)
        self.engine = FakeEngine()
        self.restarts += 1

    def make_request(self, prompt, params, request_id):
        return Request(request_id, list(prompt["prompt_token_ids"]), params, arrival_s=clock())

    def shutdown(self):
        self.is_shut_down = True


def _engine(max_pending: int = 8) -> AsyncEngine:
    e = AsyncEngine(FakeLLM, max_pending, ServerMetrics(10.0, clock))
    e.start()
    return e


def _request(e: AsyncEngine, rid: str, max_tokens: int = 3, prompt=(1, 2)) -> Request:
    return e.llm.make_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=max_tokens), rid)


async def _drain(stream) -> tuple[list[int], object]:
    tokens, last = [], None
    async for d in stream:
        tokens += d.token_ids
        last = d
    return tokens, last


def test_requests_complete_and_refusals_are_answered():
    e = _engine()

    async def main():
        ok = e.submit(_request(e, "a", max_tokens=4))
        bad = e.submit(_request(e, "b", prompt=()))
        await ok.accepted()
        with pytest.raises(RequestError, match="empty"):
            await bad.accepted()
        return await _drain(ok)

    tokens, last = asyncio.run(main())
    assert tokens == [7] * 4 and last.finish_reason == "length"
    assert e.snapshot().num_pending == 0 and e.snapshot().healthy
    e.shutdown()
    assert e.llm.is_shut_down


def test_admission_is_bounded():
    e = _engine(max_pending=2)
    e.llm.engine.gate.clear()  # hold the step loop: nothing finishes

    async def main():
        streams = [e.submit(_request(e, f"r{i}")) for i in range(2)]
        with pytest.raises(Overloaded):
            e.submit(_request(e, "r2"))
        e.llm.engine.gate.set()
        return [await _drain(s) for s in streams]

    assert all(last.finish_reason == "length" for _, last in asyncio.run(main()))
    e.shutdown()


def test_a_step_that_raises_fails_every_request_and_health():
    e = _engine()
    e.llm.engine.gate.clear()

    async def main():
        streams = [e.submit(_request(e, f"r{i}", max_tokens=50)) for i in range(3)]
        for s in streams:
            await s.accepted()
        e.llm.engine.explode = True
        e.llm.engine.gate.set()
        results = [await _drain(s) for s in streams]
        with pytest.raises(EngineUnavailable, match="boom"):
            e.submit(_request(e, "late"))
        return results

    results = asyncio.run(main())
    assert all(last.finish_reason == "error" and "boom" in last.error for _, last in results)
    assert not e.snapshot().healthy and "boom" in e.snapshot().failure
    e.shutdown()


class HealingLLM(FakeLLM):
    restart_policy = RestartPolicy(max_restarts=2, backoff_s=0.0)


def test_a_failed_engine_is_restarted_and_serves_again():
    e = AsyncEngine(HealingLLM, 8, ServerMetrics(10.0, clock))
    e.start()
    e.llm.engine.gate.clear()
    e.llm.hold.clear()  # the restart holds until the test has seen the server restarting

    async def main():
        s = e.submit(_request(e, "r", max_tokens=50))
        await s.accepted()
        e.llm.engine.explode = True
        e.llm.engine.gate.set()
        _, last = await _drain(s)
        while not e.snapshot().restarting:
            await asyncio.sleep(0.01)
        with pytest.raises(EngineUnavailable, match="restarting") as refused:
            e.submit(_request(e, "during"))
        assert refused.value.retry_after_s > 0
        e.llm.hold.set()
        while not e.snapshot().healthy:
            await asyncio.sleep(0.01)
        after = e.submit(_request(e, "after", max_tokens=2))
        return last, await _drain(after)

    last, (tokens, done) = asyncio.run(main())
    assert last.finish_reason == "error" and "boom" in last.error  # the affected request still ends with the error
    assert tokens == [7, 7] and done.finish_reason == "length"
    assert e.llm.restarts == 1 and e.metrics.restarts.labels("ok")._value.get() == 1
    deadline = clock() + 5  # the snapshot is refreshed after the engine thread's iteration, not with the answer
    while e.snapshot().num_pending and clock() < deadline:
        threading.Event().wait(0.01)
    assert e.snapshot().num_pending == 0
    e.shutdown()


def test_shutdown_answers_requests_in_flight():
    e = _engine()
    e.llm.engine.gate.clear()

    async def main():
        s = e.submit(_request(e, "r", max_tokens=50))
        await s.accepted()
        threading.Thread(target=e.shutdown).start()  # the engine thread is stuck in step until the gate opens
        await asyncio.sleep(0.05)
        e.llm.engine.gate.set()
        return await _drain(s)

    _, last = asyncio.run(main())
    assert last.finish_reason == "abort" and "shutting down" in last.error
    with pytest.raises(EngineUnavailable):
        asyncio.run(_submit_now(e))


async def _submit_now(e):
    e.submit(_request(e, "after"))


class BrokenBuildLLM(FakeLLM):
    """Restarts are on, but every rebuild fails to come up."""

    restart_policy = RestartPolicy(max_restarts=2, backoff_s=0.0)

    def restart(self, sleep):
        raise RuntimeError("the deployment failed (boom) and 2 restart attempt(s) in a row failed to bring it back")


@pytest.mark.parametrize("llm", [FakeLLM, BrokenBuildLLM])  # restarts off; restarts that all fail
def test_a_deployment_that_stays_failed_tells_the_server_once(llm):
    told = []
    e = AsyncEngine(llm, 8, ServerMetrics(10.0, clock), on_give_up=told.append)
    e.start()
    e.llm.engine.explode = True

    async def main():
        s = e.submit(_request(e, "r", max_tokens=5))
        await s.accepted()
        return await _drain(s)

    _, last = asyncio.run(main())
    deadline = clock() + 5
    while not told and clock() < deadline:
        threading.Event().wait(0.01)
    threading.Event().wait(0.3)  # more iterations of the thread: still told once
    assert len(told) == 1 and "boom" in told[0], told
    assert last.finish_reason == "error" and not e.snapshot().healthy and not e.snapshot().restarting
    if llm is BrokenBuildLLM:
        assert "restart failed" in told[0] and e.metrics.restarts.labels("failed")._value.get() == 1
    e.shutdown()


class DegradedEngine(FakeEngine):
    """A deployment that lost a part: it goes on serving; ``heal`` makes it whole a few checks later."""

    def __init__(self):
        super().__init__()
        self.lost, self.heals, self.checks_to_whole = "rank 1 is lost (killed)", 0, None

    def load(self) -> EngineLoad:
        return EngineLoad(0, len(self.requests), 10, 10, degraded=self.lost)

    def heal(self):
        self.heals += 1
        if self.checks_to_whole is None:
            self.checks_to_whole = 3
        return True

    def check_workers(self):
        if self.checks_to_whole is not None:
            self.checks_to_whole -= 1
            if self.checks_to_whole <= 0:
                self.lost = None
        return StepResult({}, [])


class DegradedLLM(HealingLLM):
    def __init__(self):
        super().__init__()
        self.engine = DegradedEngine()


def test_a_degraded_deployment_is_healed_in_place_and_says_so():
    e = AsyncEngine(DegradedLLM, 8, ServerMetrics(10.0, clock), on_give_up=lambda why: None)
    e.start()
    deadline = clock() + 5
    seen = set()
    while clock() < deadline:
        s = e.snapshot()
        seen.add(s.degraded)
        if s.degraded is None and len(seen) > 1:
            break
        threading.Event().wait(0.01)
    assert "rank 1 is lost (killed)" in seen and e.snapshot().healthy and e.snapshot().degraded is None, seen
    assert e.llm.engine.heals >= 1 and e.llm.restarts == 0  # in place: no rebuild
    assert e.metrics.restarts.labels("ok")._value.get() == 1
    e.shutdown()
