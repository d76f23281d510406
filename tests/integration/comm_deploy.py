"""Running a comm plan as real processes: every rank of a ``CommConfig``'s spec spawned with
``comm_harness.run_worker``, stopped and cleaned up whatever happens, results checked against the
in-process reference. Shared by the CPU stress tests and the GPU transport tests (no pytest here:
the GPU machine may run them under verify/mini_pytest.py).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import time
import uuid

from comm_harness import Plan, assert_matches_reference, run_worker

from moeflow.comm import CommConfig, CommSpec, cleanup

_CTX = mp.get_context("spawn")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_deployment(config: CommConfig, plan: Plan, tmp_path, timeout_s: float = 120.0) -> dict:
    """Start every rank of ``config.spec`` as a process, run ``plan``, return results by name;
    every process is stopped and the deployment's segments removed, whatever happens."""
    spec = config.spec
    init = f"tcp://127.0.0.1:{free_port()}" if config.transport in ("dist", "p2p", "links") else None
    roles = ([("attention", r) for r in range(spec.num_lanes)]
             + [("moe", e) for e in range(spec.num_expert_ranks)])
    procs = {}
    try:
        for role, i in roles:
            path = str(tmp_path / f"{role}{i}.pkl")
            p = _CTX.Process(target=run_worker, args=(role, i, config, plan, path, init), daemon=True)
            p.start()
            procs[(role, i)] = (p, path)
        deadline = time.monotonic() + timeout_s
        while any(p.is_alive() for p, _ in procs.values()) and time.monotonic() < deadline:
            if any(_failed(p, path) for p, path in procs.values()):
                break  # the others would wait for it forever
            time.sleep(0.2)
        hung = [k for k, (p, path) in procs.items() if p.is_alive()]
        assert not hung or any(_failed(p, path) for p, path in procs.values()), \
            f"processes still running after {timeout_s} s: {hung}"
    finally:
        for p, _ in procs.values():
            if p.is_alive():
                p.kill()
                p.join(5)
        cleanup(config.deployment_id)
    results = {}
    for key, (p, path) in procs.items():
        if os.path.exists(path):
            with open(path, "rb") as f:
                results[key] = pickle.load(f)
    fatal = {k: r["fatal"] for k, r in results.items() if "fatal" in r}
    assert not fatal, "\n".join(f"{k} failed:\n{tb}" for k, tb in fatal.items())
    missing = {k: p.exitcode for k, (p, _) in procs.items() if k not in results}
    assert not missing, f"processes without a result (exit codes): {missing}"
    for key, r in results.items():
        assert not r["errors"], f"{key}: {r['errors'][:5]}"
        assert procs[key][0].exitcode == 0, f"{key} exited with {procs[key][0].exitcode}"
    return results


def _failed(p, path: str) -> bool:
    if p.is_alive() or not os.path.exists(path):
        return False
    with open(path, "rb") as f:
        return "fatal" in pickle.load(f)


def check_against_reference(config: CommConfig, plan: Plan, results: dict) -> int:
    return assert_matches_reference(config, plan, [entry for r in results.values() for entry in r["log"]])


def stress_config(transport: str, rank_nodes: tuple[int, ...] = (), arena: str = "host", device: str = "cpu",
                  store: tuple[str, int] | None = None, **spec) -> CommConfig:
    # 512 B chunks: payloads above 4 rows of H = 64 are streamed, so both read paths are exercised.
    return CommConfig(CommSpec(**spec), transport=transport, deployment_id=f"t{uuid.uuid4().hex[:12]}",
                      stream_chunk_bytes=512, rank_nodes=rank_nodes, arena=arena, compute_device=device, store=store)


SHM_STRESS = dict(num_regions=2, lanes_per_region=2, num_expert_ranks=3, num_experts=6, top_k=2, hidden_size=64,
                  max_batch_tokens=16)
