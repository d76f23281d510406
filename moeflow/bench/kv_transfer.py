"""``moeflow bench kv-transfer``: the prefill/decode handoff's bandwidth against memcpy, per KV layout.

Two worker processes each hold a paged KV cache of a real model's layout (GQA K/V, MLA's latent
rows, DSA's latent + indexer keys; the layer count cut to fit the machine); this process is the
engine: it opens stages on the staging arena, sends ``KvSend`` to one and ``KvRecv`` to the other
over their pipes and reads their flags, exactly as a pd deployment does (``engine/kv_handoff.py``,
``workers/kv_transfer.py``). Blocks are scattered on both sides. memcpy: one contiguous copy of
the same bytes in this process, timed in the same run, interleaved. Every size's first handoff is
checked: the decode side's slots equal the prefill side's.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
import uuid

_SIZES_MIB = (0.25, 1, 4, 16, 64)
_LAYOUTS = ("gqa", "mla", "dsa")


def add_parser(sub) -> None:
    p = sub.add_parser("kv-transfer", help="the pd KV handoff's bandwidth against memcpy, per KV layout")
    p.add_argument("--layouts", default=",".join(_LAYOUTS), help="of gqa (Qwen3-235B), mla (DeepSeek-R1), "
                   "dsa (DeepSeek-V3.2)")
    p.add_argument("--sizes-mib", default=",".join(f"{s:g}" for s in _SIZES_MIB), help="handoff sizes")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="the KV cache's dtype")
    p.add_argument("--layers", type=int, default=8, help="layers of each cache (the model's per-layer rows)")
    p.add_argument("--json", default=None, metavar="FILE.json")
    p.set_defaults(func=run)


def kv_layout(name: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The per-token, per-layer entries of ``name``'s model (from its Hugging Face config)."""
    from moeflow.model.attention import attention_for
    from moeflow.model.family import family_for, load_families
    from moeflow.sim.model_spec import DEEPSEEK_R1_HF, DEEPSEEK_V32_HF, QWEN3_235B_A22B_HF

    hf = {"gqa": QWEN3_235B_A22B_HF, "mla": DEEPSEEK_R1_HF, "dsa": DEEPSEEK_V32_HF}[name]
    load_families()
    return tuple(attention_for(family_for(hf).to_model_config(hf)).kv_layout().items())


def _worker(conn, entries, layers: int, num_blocks: int, block_size: int, dtype: str, seed: int) -> None:
    import torch

    from moeflow.model.kv_cache import KVCache
    from moeflow.workers.kv_transfer import KvTransfers

    torch.set_num_threads(1)
    cache = KVCache(dict(entries), layers, num_blocks, block_size, getattr(torch, dtype))
    g = torch.Generator().manual_seed(seed)
    for t in cache.entries.values():
        t.copy_(torch.randn(t.shape, generator=g))
    kv = KvTransfers(cache, 0)
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        if isinstance(msg, tuple):  # (block ids, tokens): a checksum of those slots
            from moeflow.model.kv_cache import slots_for
            slots = slots_for(msg[0], 0, msg[1], block_size)
            conn.send([float(t.index_select(1, slots).double().sum()) for t in cache.entries.values()])
        else:
            kv.handle(msg)
    kv.close()


def measure_layout(name: str, sizes_mib, repeats: int, dtype: str, layers: int, out=sys.stdout) -> list[dict]:
    import torch

    from moeflow.comm.kv_arena import READ, WRITE
    from moeflow.engine.kv_handoff import DONE, KvConnector
    from moeflow.messages import KvRecv, KvSend

    entries = kv_layout(name)
    item = getattr(torch, dtype).itemsize
    per_token = layers * item * sum(_prod(s) for _, s in entries)
    block_size = 16
    max_tokens = int(max(sizes_mib) * 2**20 // per_token) + block_size
    num_blocks = 2 * (max_tokens // block_size + 1)
    conn = KvConnector(f"{os.getpid()}-{uuid.uuid4().hex[:8]}", int(max(sizes_mib) * 2**20 * 1.1) + (1 << 20),
                       layers, dtype, entries)
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    try:
        for seed in (1, 2):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(b, entries, layers, num_blocks, block_size, dtype, seed), daemon=True)
            p.start()
            pipes.append(a)
            procs.append(p)
        for a in pipes:
            assert a.recv() == "ready"
        rng = random.Random(0)
        rows = []
        for mib in sizes_mib:
            n = max(1, int(mib * 2**20 // per_token))
            nbytes = conn.bytes_for(n)
            src = torch.randn(nbytes // item, dtype=torch.float32).to(getattr(torch, dtype))
            dst = torch.empty_like(src)
            hand, write, read, copy = [], [], [], []
            for rep in range(repeats):
                blocks = rng.sample(range(num_blocks), 2 * (-(-n // block_size)))
                pb, db = tuple(blocks[:len(blocks) // 2]), tuple(blocks[len(blocks) // 2:])
                stage = conn.open(n)
                t0 = time.perf_counter()
                pipes[0].send(KvSend(stage, pb))
                while conn.status(stage, WRITE, 1) != DONE:
                    time.sleep(0)
                t1 = time.perf_counter()
                pipes[1].send(KvRecv(stage, db))
                while conn.status(stage, READ, 1) != DONE:
                    time.sleep(0)
                t2 = time.perf_counter()
                conn.close(stage)
                c0 = time.perf_counter()
                dst.copy_(src)
                copy.append(time.perf_counter() - c0)
                hand.append(t2 - t0)
                write.append(t1 - t0)
                read.append(t2 - t1)
                if rep == 0:
                    pipes[0].send((pb, n))
                    pipes[1].send((db, n))
                    a, b = pipes[0].recv(), pipes[1].recv()
                    if a != b:
                        raise RuntimeError(f"{name}, {mib:g} MiB: the decode side's KV differs from the prefill "
                                           f"side's (checksums {a} vs {b})")
            h, c = statistics.median(hand), statistics.median(copy)
            row = {"layout": name, "size_mib": nbytes / 2**20, "tokens": n, "handoff_ms": h * 1e3,
                   "copy_out_ms": statistics.median(write) * 1e3, "copy_in_ms": statistics.median(read) * 1e3,
                   "handoff_gbps": nbytes / h / 1e9, "memcpy_gbps": nbytes / c / 1e9, "of_memcpy": c / h,
                   "handoff_ms_all": [x * 1e3 for x in hand], "memcpy_ms_all": [x * 1e3 for x in copy]}
            rows.append(row)
            print(f"{name:4} {row['size_mib']:8.2f} MiB {n:7d} tok | handoff {row['handoff_ms']:8.2f} ms "
                  f"(out {row['copy_out_ms']:.2f} + in {row['copy_in_ms']:.2f}) {row['handoff_gbps']:6.2f} GB/s | "
                  f"memcpy {row['memcpy_gbps']:6.2f} GB/s | {100 * row['of_memcpy']:5.1f}% of memcpy",
                  file=out, flush=True)
        return rows
    finally:
        for a in pipes:
            try:
                a.send(None)
            except OSError:
                pass
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        conn.shutdown()


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def run(args: argparse.Namespace) -> int:
    from moeflow.measure.provenance import provenance, write_json

    sizes = [float(s) for s in args.sizes_mib.split(",") if s]
    rows = []
    for name in [s for s in args.layouts.split(",") if s]:
        if name not in _LAYOUTS:
            raise ValueError(f"--layouts: {name!r} is not one of {_LAYOUTS}")
        rows += measure_layout(name, sizes, args.repeats, args.dtype, args.layers)
    if args.json:
        write_json(args.json, {"provenance": provenance(), "dtype": args.dtype, "layers": args.layers,
                               "repeats": args.repeats, "rows": rows})
    return 0
