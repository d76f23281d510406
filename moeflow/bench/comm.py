"""``moeflow bench comm``: ASAP 5.4 on this machine: one-sided async dispatch vs blocking p2p.

One attention worker (this process) dispatches t tokens of hidden size H to n MoE workers
(spawned processes), three ways, interleaved round by round so that all see the same machine:

- ``async``: the shared-memory one-sided primitives (write, set flag, ring, return);
- ``handshake``: the same shared memory, but each send waits until its receiver copied it out;
- ``p2p``: blocking torch.distributed send over gloo, one receiver after the other.

(a) delivery latency with idle receivers: from the send call until every receiver holds its data
in private memory; (b) time the sender is blocked when receivers are busy with simulated compute
of random length (sleep U(0, 2c)); bandwidth against a memcpy of the same payload in this run.

Columns: ``speedup`` = p2p_us / async_us; ``async_gbps`` = receivers x payload bytes / async_us
(everything delivered); ``memcpy_gbps`` = one single-threaded copy of the payload between two
private buffers, repeated (so as warm in cache as a copy can be).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import random
import socket
import statistics
import time

from moeflow.measure.provenance import write_json

METHODS = ("async", "handshake", "p2p")


def add_parser(sub) -> None:
    p = sub.add_parser("comm", help="one-sided async dispatch vs blocking point-to-point (ASAP 5.4)")
    p.add_argument("--tokens", default="512,1024,2048,4096,8192", help="comma-separated token counts t")
    p.add_argument("--hidden", default=None, help="comma-separated hidden sizes (default: the embedded model's, 7168)")
    p.add_argument("--receivers", default="1,2,4", help="comma-separated MoE worker counts n")
    p.add_argument("--rounds", type=int, default=20, help="latency samples per method and size")
    p.add_argument("--busy-rounds", type=int, default=20, help="sender-blocked samples per method and size")
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=run)


class _Bench:
    """The sender side: the receiver processes, their pipes, and this process's senders."""

    def __init__(self, num_receivers: int):
        import torch.distributed as dist

        ctx = mp.get_context("spawn")
        self.n_max = num_receivers
        self.deployment = f"{os.getpid()}-bench"  # owner pid first: a SIGKILLed run's segments are reclaimed
        self.progress = ctx.Array("d", 2 * num_receivers, lock=False)
        init = f"tcp://127.0.0.1:{_free_port()}"
        self.pipes, self.procs = [], []
        from moeflow.bench.comm_receiver import receiver_main

        for i in range(num_receivers):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=receiver_main, args=(i, num_receivers, init, self.deployment, self.progress, theirs),
                            daemon=True)
            p.start()
            self.pipes.append(mine)
            self.procs.append(p)
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=1 + num_receivers)
        self.senders: dict = {}
        self.deployments: set[str] = set()

    def ask(self, *cmd) -> list:
        for c in self.pipes:
            c.send(cmd)
        return [c.recv() for c in self.pipes]

    def setup(self, hidden: int, max_tokens: int) -> None:
        from moeflow.bench.comm_receiver import bench_configs
        from moeflow.comm import make_transport

        configs = bench_configs(self.deployment, hidden, max_tokens, self.n_max)
        self.deployments |= {c.deployment_id for c in configs.values()}
        self.ask("setup", hidden, max_tokens)  # receivers own the buffers: they go first
        self.senders = {m: make_transport(c).dispatch_sender(0, 0) for m, c in configs.items()}

    def teardown(self) -> None:
        for s in self.senders.values():
            s.close()
        self.ask("teardown")

    def _wait_delivered(self, active, counts) -> float:
        """Wait until every active receiver got one more message; when the last one landed."""
        pr = self.progress
        while any(pr[2 * w] <= counts[w] for w in active):
            os.sched_yield()
        return max(pr[2 * w + 1] for w in active)

    def latency(self, methods, x, active, rounds: int, block: int = 5, gap_s: float = 0.0):
        """Median delivery latency (s) per method, and the receivers' CPU share meanwhile.

        Methods take turns in blocks of ``block`` back-to-back sends (the first of each block is
        a warm-up), so all see the same machine and receivers wait in their loop, not asleep."""
        reps = -(-rounds // (block - 1))
        for c in self.pipes:
            c.send(("latency", list(methods), reps, block, list(active)))
        samples = {m: [] for m in methods}
        for r in range(reps):
            for m in methods:
                for k in range(block):
                    counts = [self.progress[2 * w] for w in range(self.n_max)]
                    if gap_s:
                        time.sleep(gap_s)
                    t0 = time.perf_counter()
                    for w in active:
                        self.senders[m].send(w, x, 0, r)
                    done = self._wait_delivered(active, counts)
                    if k > 0:
                        samples[m].append(done - t0)
        cpu = [c.recv() for c in self.pipes]  # per receiver: (CPU s, wall s) over the phase
        share = statistics.mean(cpu[w][0] / cpu[w][1] for w in active)
        return {m: statistics.median(v) for m, v in samples.items()}, share

    def sender_blocked(self, method, x, active, rounds: int, compute_s: float, seed: int) -> float:
        """Median time one dispatch (to every active receiver) blocks while receivers compute."""
        for c in self.pipes:
            c.send(("busy", method, rounds, list(active), compute_s, seed))
        rng, blocked = random.Random(seed), []
        for r in range(rounds):
            t0 = time.perf_counter()
            for w in active:
                self.senders[method].send(w, x, 0, r)
            blocked.append(time.perf_counter() - t0)
            time.sleep(rng.uniform(0, 2 * compute_s))  # the attention worker's own compute
        for c in self.pipes:
            c.recv()
        return statistics.median(blocked[2:])

    def close(self) -> None:
        import torch.distributed as dist

        from moeflow.comm import cleanup

        for c in self.pipes:
            try:
                c.send(("exit",))
            except OSError:
                pass
        for p in self.procs:
            p.join(20)
            if p.is_alive():
                p.kill()
                p.join(5)
        if dist.is_initialized():
            dist.destroy_process_group()
        for dep in self.deployments:  # the receivers unlink their own; this covers a crash
            cleanup(dep)


def run(args: argparse.Namespace) -> int:
    import torch

    from moeflow.hardware.report import memcpy_s
    from moeflow.model.tiny import TINY_HF_CONFIG

    torch.set_num_threads(1)
    tokens = [int(v) for v in args.tokens.split(",")]
    hiddens = [int(v) for v in args.hidden.split(",")] if args.hidden else [TINY_HF_CONFIG["hidden_size"], 7168]
    receivers = [int(v) for v in args.receivers.split(",")]
    load = os.getloadavg()[0]
    print(f"moeflow bench comm: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load average {load:.2f}; medians of {args.rounds} latency and {args.busy_rounds} busy samples")
    bench = _Bench(max(receivers))
    rows, policies = [], []
    try:
        for hidden in hiddens:
            bench.setup(hidden, max(tokens))
            for t in tokens:
                x = torch.randn(t, hidden).to(torch.bfloat16)  # [t, H]
                nbytes = x.numel() * x.element_size()
                memcpy = memcpy_s(x)
                compute_s = 1e-3 + nbytes / 5e9  # receivers stay busy longer than one transfer takes
                for n in receivers:
                    active = list(range(n))
                    lat, _ = bench.latency(METHODS, x, active, args.rounds)
                    blocked = {m: bench.sender_blocked(m, x, active, args.busy_rounds, compute_s, seed=t + n)
                               for m in ("async", "p2p")}
                    row = {"tokens": t, "hidden": hidden, "receivers": n, "payload_bytes": nbytes,
                           "async_us": lat["async"] * 1e6, "p2p_us": lat["p2p"] * 1e6,
                           "handshake_us": lat["handshake"] * 1e6,
                           "async_sender_us": blocked["async"] * 1e6, "p2p_sender_us": blocked["p2p"] * 1e6,
                           "speedup": lat["p2p"] / lat["async"], "async_gbps": n * nbytes / lat["async"] / 1e9,
                           "memcpy_gbps": nbytes / memcpy / 1e9}
                    rows.append(row)
                    _print_row(row, header=len(rows) == 1)
            if hidden == hiddens[0]:
                policies = _policy_table(bench, hiddens[0], min(max(tokens), 1024), receivers, args.rounds)
            bench.teardown()
    finally:
        bench.close()
    result = {"command": "moeflow bench comm" + (f" --json {args.json}" if args.json else ""),
              "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
              "torch": torch.__version__, "loadavg_at_start": load, "rows": rows, "policies": policies}
    _print_policies(policies)
    if args.json:
        write_json(args.json, result)
    return 0


def _policy_table(bench, hidden: int, t: int, receivers: list[int], rounds: int) -> list[dict]:
    """Async latency under each wait policy, sending after a 2 ms idle gap (long enough that
    the adaptive policy has gone to sleep on its doorbell), and the receivers' CPU share."""
    import torch

    from moeflow.comm import POLICIES

    x = torch.randn(t, hidden).to(torch.bfloat16)
    out = []
    for name in POLICIES:
        bench.ask("policy", name)
        for n in sorted({receivers[0], receivers[-1]}):
            lat, share = bench.latency(["async"], x, list(range(n)), rounds, gap_s=2e-3)
            out.append({"policy": name, "tokens": t, "hidden": hidden, "receivers": n,
                        "async_us": lat["async"] * 1e6, "receiver_cpu_share": share})
    bench.ask("policy", "adaptive")
    return out


def _print_row(r: dict, header: bool) -> None:
    if header:
        print(f"{'tokens':>6} {'hidden':>6} {'n':>2} {'MiB':>6} | {'async_us':>9} {'handshake_us':>12} "
              f"{'p2p_us':>9} {'speedup':>7} | {'async_sender_us':>15} {'p2p_sender_us':>13} | "
              f"{'async_gbps':>10} {'memcpy_gbps':>11} {'ratio':>6}")
    print(f"{r['tokens']:>6} {r['hidden']:>6} {r['receivers']:>2} {r['payload_bytes'] / 2**20:>6.1f} | "
          f"{r['async_us']:>9.0f} {r['handshake_us']:>12.0f} {r['p2p_us']:>9.0f} {r['speedup']:>6.1f}x | "
          f"{r['async_sender_us']:>15.0f} {r['p2p_sender_us']:>13.0f} | {r['async_gbps']:>10.1f} "
          f"{r['memcpy_gbps']:>11.1f} {r['async_gbps'] / r['memcpy_gbps']:>6.0%}", flush=True)


def _print_policies(policies: list[dict]) -> None:
    if not policies:
        return
    print("\nwait policies (async, after a 2 ms idle gap):")
    print(f"{'policy':>9} {'tokens':>6} {'hidden':>6} {'n':>2} | {'async_us':>9} {'receiver CPU':>12}")
    for p in policies:
        print(f"{p['policy']:>9} {p['tokens']:>6} {p['hidden']:>6} {p['receivers']:>2} | {p['async_us']:>9.0f} "
              f"{p['receiver_cpu_share']:>12.0%}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
