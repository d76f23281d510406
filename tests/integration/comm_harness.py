"""Worker loops for the multi-process comm tests: spawned by pytest, or run as a script inside a
network namespace (``python comm_harness.py <role> ...``, see test_comm_netns.py).

Every message is derived from a seeded plan, so a receiver regenerates what it should have got
and any process can recompute the whole traffic. Each process logs what it received
(lane, seq, layer, batch, rows, rows per expert, crc32 of the payload bytes); the test runs the
same plan through the in-process ReferenceTransport and compares the logs lane by lane.
"""
from __future__ import annotations

import os
import pickle
import random
import sys
import time
import traceback
import zlib
from collections import deque
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Plan:
    seed: int
    num_batches: int  # per region
    inflight: int  # batches a lane writer keeps in flight (<= num_slots: deadlock-free)
    delay_prob: float = 0.1  # chance of a random pause around any send or receive
    max_delay_s: float = 2e-3
    num_layers: int = 4
    device: str = "cpu"  # where payloads are made and compared (the receivers' compute device)


def batch_plan(spec, plan: Plan, region: int, batch: int):
    """(layer, ranks activated in ascending order, rows[lane][rank], tpe[lane][rank])."""
    rng = random.Random(f"{plan.seed}/{region}/{batch}")
    ranks = sorted(rng.sample(range(spec.num_expert_ranks), rng.randint(1, spec.num_expert_ranks)))
    rows, tpe = [], []
    for _j in range(spec.lanes_per_region):
        r, s = {}, {}
        for e in ranks:
            n = 0 if rng.random() < 0.2 else rng.randint(1, spec.dispatch_rows)  # 0 tokens is common
            cuts = sorted(rng.randint(0, n) for _ in range(spec.experts_per_rank - 1))
            s[e] = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
            r[e] = n
        rows.append(r)
        tpe.append(s)
    return batch % plan.num_layers, ranks, rows, tpe


def payload(spec, plan: Plan, region: int, lane: int, rank: int, batch: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{plan.seed}/{region}/{lane}/{rank}/{batch}".encode()))
    return torch.randn(n, spec.hidden_size, generator=g).to(plan.device, getattr(torch, spec.dtype))  # [n, H]


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.cpu().contiguous().view(torch.uint8).numpy().tobytes()) if t.numel() else 0


def deferred_copies(*ends) -> int:
    """Copies the deferred arena (the CUDA arena's CPU fake) queued in these ends' mailboxes."""
    boxes = [mb for end in ends for mb in ([end.mailbox] if hasattr(end, "mailbox") else
                                           getattr(getattr(end, "writer", None), "mailboxes", []))]
    return sum(getattr(mb.arena, "num_deferred", 0) for mb in boxes)


def _maybe_pause(rng: random.Random, plan: Plan) -> None:
    if rng.random() < plan.delay_prob:
        time.sleep(rng.uniform(0, plan.max_delay_s))


def writer_loop(transport, spec, plan: Plan, region: int, lane: int, timeout_s: float = 60.0) -> dict:
    rx = transport.combine_receiver(region, lane)  # receivers first: senders attach to them
    tx = transport.dispatch_sender(region, lane)
    rng = random.Random(f"pause/a/{plan.seed}/{region}/{lane}")
    log, errors, inflight = [], [], deque()
    lane_id = spec.lane_id(region, lane)

    def collect() -> None:
        batch, layer, ranks = inflight.popleft()
        msg = rx.recv(ranks, timeout_s=timeout_s)
        if msg is None:
            raise TimeoutError(f"lane writer {lane_id}: no combine for batch {batch} from {ranks}")
        for e, seg in sorted(msg.segments.items()):
            want = payload(spec, plan, region, lane, e, batch, batch_plan(spec, plan, region, batch)[2][lane][e]) * 2
            if (seg.layer_id, seg.batch_id) != (layer, batch) or not torch.equal(seg.payload, want):
                errors.append(f"combine lane {lane_id} from {e} batch {batch}: wrong header or payload")
            log.append(("combine", lane_id, e, seg.seq, seg.layer_id, seg.batch_id, seg.payload.shape[0],
                        crc(seg.payload)))
        _maybe_pause(rng, plan)

    for batch in range(plan.num_batches):
        layer, ranks, rows, tpe = batch_plan(spec, plan, region, batch)
        for e in ranks:
            _maybe_pause(rng, plan)
            tx.send(e, payload(spec, plan, region, lane, e, batch, rows[lane][e]), layer, batch, tpe[lane][e])
        inflight.append((batch, layer, ranks))
        if len(inflight) == plan.inflight:
            collect()
    while inflight:
        collect()
    stats = asdict(tx.stats)
    stats["deferred_copies"] = deferred_copies(rx, tx)
    tx.close()
    rx.close()
    return {"log": log, "errors": errors, "stats": stats}


def expert_loop(transport, spec, plan: Plan, rank: int, timeout_s: float = 60.0) -> dict:
    rx = transport.dispatch_receiver(rank)
    tx = transport.combine_sender(rank)
    rng = random.Random(f"pause/m/{plan.seed}/{rank}")
    expected = sum(rank in batch_plan(spec, plan, i, b)[1]
                   for i in range(spec.num_regions) for b in range(plan.num_batches))
    log, errors = [], []
    for _ in range(expected):
        msg = rx.recv(timeout_s=timeout_s)
        if msg is None:
            raise TimeoutError(f"expert rank {rank}: {len(log)} regions of {expected}, then silence")
        for row in msg.rows:
            b = row.batch_id
            layer, ranks, rows, tpe = batch_plan(spec, plan, msg.region, b)
            want = payload(spec, plan, msg.region, row.lane, rank, b, rows[row.lane].get(rank, 0))
            if (row.layer_id != layer or rank not in ranks or row.tokens_per_expert != tpe[row.lane][rank]
                    or not torch.equal(row.payload, want)):
                errors.append(f"dispatch rank {rank} region {msg.region} lane {row.lane} batch {b}: torn or wrong")
            log.append(("dispatch", rank, spec.lane_id(msg.region, row.lane), msg.seq, row.layer_id, b,
                        row.payload.shape[0], tuple(row.tokens_per_expert), crc(row.payload)))
        _maybe_pause(rng, plan)  # simulated compute of random length
        for row in msg.rows:
            tx.send(msg.region, row.lane, row.payload * 2, row.layer_id, row.batch_id)
    stats = asdict(tx.stats)
    stats["streamed_rows"] = rx.reader.num_streamed_rows if hasattr(rx, "reader") else 0
    stats["deferred_copies"] = deferred_copies(rx, tx)
    tx.close()
    rx.close()
    return {"log": log, "errors": errors, "stats": stats}


def reference_logs(config, plan: Plan) -> list:
    """The whole plan through the in-process oracle: one batch of every region at a time."""
    from moeflow.comm import CommConfig, make_transport

    spec = config.spec
    ref = make_transport(CommConfig(spec, transport="reference"))
    att = {(i, j): (ref.dispatch_sender(i, j), ref.combine_receiver(i, j))
           for i in range(spec.num_regions) for j in range(spec.lanes_per_region)}
    moe = [(ref.dispatch_receiver(e), ref.combine_sender(e)) for e in range(spec.num_expert_ranks)]
    log = []
    for b in range(plan.num_batches):
        for (i, j), (tx, _) in att.items():
            layer, ranks, rows, tpe = batch_plan(spec, plan, i, b)
            for e in ranks:
                tx.send(e, payload(spec, plan, i, j, e, b, rows[j][e]), layer, b, tpe[j][e])
        for e, (rx, tx) in enumerate(moe):
            while (msg := rx.poll()) is not None:
                for row in msg.rows:
                    log.append(("dispatch", e, spec.lane_id(msg.region, row.lane), msg.seq, row.layer_id,
                                row.batch_id, row.payload.shape[0], tuple(row.tokens_per_expert), crc(row.payload)))
                    tx.send(msg.region, row.lane, row.payload * 2, row.layer_id, row.batch_id)
        for (i, j), (_, rx) in att.items():
            msg = rx.poll(batch_plan(spec, plan, i, b)[1])
            for e, seg in sorted(msg.segments.items()):
                log.append(("combine", spec.lane_id(i, j), e, seg.seq, seg.layer_id, seg.batch_id,
                            seg.payload.shape[0], crc(seg.payload)))
    return log


def by_lane(log: list) -> dict:
    """(kind, receiver, sender) -> the ordered list of what arrived on that lane."""
    out: dict = {}
    for entry in log:
        out.setdefault(entry[:3], []).append(entry[3:])
    return out


def assert_matches_reference(config, plan: Plan, logs: list) -> int:
    """Every lane of ``logs`` (all processes' logs together) equals the reference; returns the count."""
    got, want = by_lane(logs), by_lane(reference_logs(config, plan))
    assert got.keys() == want.keys(), f"lanes differ: {sorted(set(got) ^ set(want))[:5]}"
    for lane in want:
        assert got[lane] == want[lane], f"lane {lane} differs from the reference"
    return sum(len(v) for v in want.values())


def run_worker(role: str, index: int, config, plan: Plan, out_path: str, init_method: str | None = None) -> None:
    """Process entry: one lane writer (role "attention", index = lane id) or expert rank (role "moe")."""
    torch.set_num_threads(1)
    result: dict = {}
    try:
        spec = config.spec
        if init_method is not None:
            import torch.distributed as dist

            rank = index if role == "attention" else spec.expert_world_rank(index)
            dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=spec.world_size)
        from moeflow.comm import make_transport

        transport = make_transport(config)
        if role == "attention":
            result = writer_loop(transport, spec, plan, index // spec.lanes_per_region, index % spec.lanes_per_region)
        else:
            result = expert_loop(transport, spec, plan, index)
        if init_method is not None:
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        result = {"fatal": traceback.format_exc()}
    with open(out_path, "wb") as f:
        pickle.dump(result, f)


def main(argv: list[str]) -> int:
    """Script entry for the netns test: <role> <index> <transport> <init_method> <out_path>."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from moeflow.comm import CommConfig

    role, index, transport, init_method, out_path = argv[0], int(argv[1]), argv[2], argv[3], argv[4]
    config = CommConfig(netns_spec(), transport=transport)
    run_worker(role, index, config, NETNS_PLAN, out_path, init_method)
    with open(out_path, "rb") as f:
        result = pickle.load(f)
    print(f"{role} {index}: {len(result.get('log', []))} messages, errors={result.get('errors')}, "
          f"fatal={'fatal' in result}", flush=True)
    return 0 if "fatal" not in result and not result["errors"] else 1


NETNS_PLAN = Plan(seed=7, num_batches=150, inflight=1, delay_prob=0.05, max_delay_s=1e-3)


def netns_spec():
    from moeflow.comm import CommSpec

    return CommSpec(num_regions=1, lanes_per_region=1, num_expert_ranks=1, num_experts=2, top_k=2, hidden_size=256,
                    max_batch_tokens=32)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
