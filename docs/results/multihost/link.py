"""Latency and bandwidth of one dispatch -> combine round trip over the `dist` transport (gloo)
between two "hosts" (run by run.sh: rank 0 in this namespace, rank 1 in the other).

``python link.py <rank> <init_method> <out.json>``: rank 0 (a lane writer) sends n rows of H to
rank 1 (an expert rank), which sends them straight back; median of 30 round trips per size.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from moeflow.comm import CommConfig, CommSpec, make_transport
from moeflow.measure.provenance import write_json

H, SIZES, ROUNDS = 2048, (1, 64, 1024, 4096), 30


def main(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    spec = CommSpec(num_regions=1, lanes_per_region=1, num_expert_ranks=1, num_experts=1, top_k=1, hidden_size=H,
                    max_batch_tokens=max(SIZES), dtype="bfloat16")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    t = make_transport(CommConfig(spec, transport="dist"))
    rows = []
    if rank == 0:
        rx, tx = t.combine_receiver(0, 0), t.dispatch_sender(0, 0)
        for n in SIZES:
            x = torch.randn(n, H).to(torch.bfloat16)  # [n, H]
            rtts = []
            for _ in range(ROUNDS + 3):
                t0 = time.perf_counter()
                tx.send(0, x, 0, 0)
                rx.recv([0], timeout_s=60)
                rtts.append(time.perf_counter() - t0)
            rtt = statistics.median(rtts[3:])
            rows.append({"rows": n, "bytes": n * H * 2, "rtt_us": rtt * 1e6, "gbps": 2 * n * H * 2 / rtt / 1e9})
            print(f"{n:5d} rows x {H} bf16 ({n * H * 2 / 2**20:7.3f} MiB): round trip {rtt * 1e6:9.1f} us, "
                  f"{rows[-1]['gbps']:.2f} GB/s both ways", flush=True)
    else:
        rx, tx = t.dispatch_receiver(0), t.combine_sender(0)
        for _ in range(len(SIZES) * (ROUNDS + 3)):
            msg = rx.recv(timeout_s=60)
            tx.send(0, 0, msg.rows[0].payload, msg.layer_id, msg.batch_id)
    tx.close()
    rx.close()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        write_json(out, {"hidden": H, "dtype": "bfloat16", "transport": "dist (gloo)", "rows": rows}, sys.argv)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
