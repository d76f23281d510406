"""Backpressure against a slow receiver, and /dev/shm hygiene across SIGKILL and restart."""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import time
import uuid

import pytest
from comm_flood import flood_sender, slow_receiver

from moeflow.comm import CommConfig, CommSpec, cleanup, list_segments

_CTX = mp.get_context("spawn")


def _config(deployment_id: str | None = None) -> CommConfig:
    spec = CommSpec(num_regions=1, lanes_per_region=1, num_expert_ranks=1, num_experts=1, top_k=1, hidden_size=128,
                    max_batch_tokens=24)
    return CommConfig(spec, deployment_id=deployment_id or f"t{uuid.uuid4().hex[:12]}", attach_timeout_s=20.0)


def _load(path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f)


def _stop(*procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(10)


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_slow_receiver_is_never_overwritten(tmp_path):
    config = _config()
    n = 600
    rx = _CTX.Process(target=slow_receiver, args=(config, n, 2e-3, str(tmp_path / "rx.pkl")))
    tx = _CTX.Process(target=flood_sender, args=(config, n, str(tmp_path / "tx.pkl")))
    try:
        rx.start()
        tx.start()
        rx.join(90)
        tx.join(10)
        assert rx.exitcode == 0 and tx.exitcode == 0, (rx.exitcode, tx.exitcode)
    finally:
        _stop(rx, tx)
        leftover = list_segments(config.deployment_id)
        cleanup(config.deployment_id)
    got, sent = _load(tmp_path / "rx.pkl"), _load(tmp_path / "tx.pkl")
    assert "fatal" not in got and "fatal" not in sent, got.get("fatal") or sent.get("fatal")
    assert got["errors"] == [] and got["received"] == n
    stats = sent["stats"]
    print(f"slow receiver: {n} messages, backpressure {stats['num_backpressure']} "
          f"({stats['backpressure_s'] * 1e3:.0f} ms)")
    assert stats["num_backpressure"] > n // 4, "a fast sender must have waited for the slow receiver"
    assert stats["num_overlapped"] > 0
    assert leftover == [], f"the receiver left {leftover}"


def test_sigkill_of_a_sender_leaves_nothing(tmp_path):
    config = _config()
    stop, ready, started = _CTX.Event(), _CTX.Event(), _CTX.Event()
    rx = _CTX.Process(target=slow_receiver, args=(config, 0, 1e-3, str(tmp_path / "rx.pkl"), stop, ready))
    tx = _CTX.Process(target=flood_sender, args=(config, 0, str(tmp_path / "tx.pkl"), started))
    try:
        rx.start()
        assert ready.wait(60)
        tx.start()
        # traffic flows: the sender's start-up (spawn, imports) took up to 20 s on a loaded machine
        assert started.wait(60)
        time.sleep(1.0)
        os.kill(tx.pid, signal.SIGKILL)
        tx.join(10)
        stop.set()
        rx.join(30)
        assert rx.exitcode == 0
        leftover = list_segments(config.deployment_id)
    finally:
        _stop(rx, tx)
        cleanup(config.deployment_id)
    got = _load(tmp_path / "rx.pkl")
    assert "fatal" not in got and got["errors"] == [] and got["received"] > 0
    assert leftover == [], f"segments left after the owner's shutdown: {leftover}"


def test_sigkill_of_the_owner_then_restart_over_stale_segments(tmp_path):
    config = _config()
    dep = config.deployment_id
    ready, started = _CTX.Event(), _CTX.Event()
    rx = _CTX.Process(target=slow_receiver, args=(config, 0, 0.0, str(tmp_path / "rx.pkl"), None, ready))
    tx = _CTX.Process(target=flood_sender, args=(config, 0, str(tmp_path / "tx.pkl"), started))
    try:
        rx.start()
        assert ready.wait(60)
        tx.start()
        assert started.wait(60)  # the owner dies while the sender is sending, not before it starts
        time.sleep(1.0)
        os.kill(rx.pid, signal.SIGKILL)
        rx.join(10)
        stale = list_segments(dep)
        assert stale, "a SIGKILLed owner cannot unlink: its segments must still be there"
        # The sender fills both slots, then sees under backpressure that its reader is gone.
        tx.join(30)
        assert tx.exitcode == 0
        assert "is gone" in _load(tmp_path / "tx.pkl").get("fatal", "")

        # Restart with the same deployment id over the stale segments, without cleaning up.
        rx2 = _CTX.Process(target=slow_receiver, args=(config, 200, 0.0, str(tmp_path / "rx2.pkl")))
        tx2 = _CTX.Process(target=flood_sender, args=(config, 200, str(tmp_path / "tx2.pkl")))
        try:
            rx2.start()
            tx2.start()
            rx2.join(60)
            tx2.join(10)
            assert rx2.exitcode == 0 and tx2.exitcode == 0
        finally:
            _stop(rx2, tx2)
        got = _load(tmp_path / "rx2.pkl")
        assert "fatal" not in got and got["errors"] == [] and got["received"] == 200
        assert list_segments(dep) == [], "the new owner replaced the stale segments and removed its own"
    finally:
        _stop(rx, tx)
        removed = cleanup(dep)
    assert list_segments(dep) == [] and removed == []
