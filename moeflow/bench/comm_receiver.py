"""The MoE-side process of ``moeflow bench comm``: one receiver per method, driven by commands.

Commands arrive on a pipe and are answered on it; every receive records its completion time
(``time.perf_counter``: CLOCK_MONOTONIC, comparable across processes on one host) and bumps a
counter in a shared array, so the sender measures delivery without an extra message.
"""
from __future__ import annotations

import random
import time


def bench_spec(hidden: int, max_tokens: int, num_receivers: int):
    """One attention rank (one region of one lane) sending to ``num_receivers`` MoE workers (expert
    ranks), one expert each."""
    from moeflow.comm import CommSpec

    return CommSpec(num_regions=1, lanes_per_region=1, num_expert_ranks=num_receivers, num_experts=num_receivers,
                    top_k=1, hidden_size=hidden, max_batch_tokens=max_tokens)


def bench_configs(deployment: str, hidden: int, max_tokens: int, num_receivers: int) -> dict:
    """method -> CommConfig; the two shared-memory methods get buffers of their own."""
    from moeflow.comm import CommConfig

    spec = bench_spec(hidden, max_tokens, num_receivers)
    return {"async": CommConfig(spec, "shm", f"{deployment}a{hidden}"),
            "handshake": CommConfig(spec, "shm-handshake", f"{deployment}h{hidden}"),
            "p2p": CommConfig(spec, "p2p", f"{deployment}p{hidden}")}


def receiver_main(index: int, num_receivers: int, init_method: str, deployment: str, progress, conn) -> None:
    """progress[2 * index]: messages received; progress[2 * index + 1]: when the last one landed."""
    import torch
    import torch.distributed as dist

    from moeflow import lifecycle
    from moeflow.comm import POLICIES, make_transport

    lifecycle.die_with_parent()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=1 + index, world_size=1 + num_receivers)
    receivers: dict = {}
    count = 0

    def got_one() -> None:
        nonlocal count
        count += 1
        progress[2 * index + 1] = time.perf_counter()
        progress[2 * index] = count  # after the timestamp: the sender reads the count first

    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "setup":
                hidden, max_tokens = args
                receivers = {m: make_transport(c).dispatch_receiver(index)
                             for m, c in bench_configs(deployment, hidden, max_tokens, num_receivers).items()}
                conn.send("ok")
            elif cmd == "latency":  # reps x methods x block messages, in that order
                methods, reps, block, active = args
                cpu0, wall0 = time.process_time(), time.perf_counter()
                if index in active:
                    for _ in range(reps):
                        for m in methods:
                            for _ in range(block):
                                receivers[m].recv()
                                got_one()
                conn.send((time.process_time() - cpu0, time.perf_counter() - wall0))
            elif cmd == "busy":  # simulated compute of random length after every message
                method, rounds, active, compute_s, seed = args
                rng = random.Random(seed + index)
                if index in active:
                    for _ in range(rounds):
                        receivers[method].recv()
                        got_one()
                        time.sleep(rng.uniform(0, 2 * compute_s))
                conn.send("ok")
            elif cmd == "policy":
                for r in receivers.values():
                    r.policy = POLICIES[args[0]]
                conn.send("ok")
            elif cmd == "teardown":
                for r in receivers.values():
                    r.close()
                receivers = {}
                conn.send("ok")
            elif cmd == "exit":
                break
    finally:
        for r in receivers.values():
            r.close()
        dist.destroy_process_group()
