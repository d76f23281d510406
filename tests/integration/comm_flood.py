"""Processes for the lifecycle tests: a sender that floods one expert rank's dispatch buffer, and
a receiver that may be slow. Message i carries a payload derived from i, so the receiver checks
each one exactly (a slot overwritten before it was read shows up as a mismatch)."""
from __future__ import annotations

import pickle
import random
import time
import traceback
from dataclasses import asdict

import torch


def flood_payload(spec, i: int) -> torch.Tensor:
    n = i % (spec.dispatch_rows + 1)  # sizes cycle through 0 .. capacity
    g = torch.Generator().manual_seed(i)
    return torch.randn(n, spec.hidden_size, generator=g).to(getattr(torch, spec.dtype))  # [n, H]


def flood_sender(config, num_messages: int, out_path: str, started=None) -> None:
    """Send ``num_messages`` (0 = forever) to expert rank 0 as lane (0, 0); write stats. Sets
    ``started`` (an Event) once the first message is sent."""
    torch.set_num_threads(1)
    from moeflow.comm import make_transport

    result: dict = {}
    try:
        tx = make_transport(config).dispatch_sender(0, 0)
        i = 0
        while num_messages == 0 or i < num_messages:
            tx.send(0, flood_payload(config.spec, i), layer_id=i % 7, batch_id=i)
            if i == 0 and started is not None:
                started.set()
            i += 1
        result = {"stats": asdict(tx.stats)}
        tx.close()
    except BaseException:
        result = {"fatal": traceback.format_exc()}
    with open(out_path, "wb") as f:
        pickle.dump(result, f)


def slow_receiver(config, num_messages: int, max_pause_s: float, out_path: str, stop=None, ready=None) -> None:
    """Receive from lane (0, 0) with random pauses, checking every message; stop after
    ``num_messages`` or when ``stop`` (an Event) is set. Sets ``ready`` once its buffer exists."""
    torch.set_num_threads(1)
    from moeflow.comm import make_transport

    result: dict = {"received": 0, "errors": []}
    try:
        rx = make_transport(config).dispatch_receiver(0)
        if ready is not None:
            ready.set()
        rng = random.Random(0)
        i = 0
        while num_messages == 0 or i < num_messages:
            if stop is not None and stop.is_set():
                break
            msg = rx.recv(timeout_s=0.2)
            if msg is None:
                continue
            row = msg.rows[0]
            if (msg.seq, row.batch_id, row.layer_id) != (i + 1, i, i % 7) or not torch.equal(
                    row.payload, flood_payload(config.spec, i)):
                result["errors"].append(f"message {i}: seq {msg.seq} batch {row.batch_id} torn or out of order")
            i += 1
            result["received"] = i
            time.sleep(rng.uniform(0, max_pause_s))
        rx.close()
    except BaseException:
        result["fatal"] = traceback.format_exc()
    with open(out_path, "wb") as f:
        pickle.dump(result, f)
