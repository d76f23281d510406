"""``moeflow bench kv-transfer``: the prefill/decode handoff's bandwidth against memcpy, per KV layout.

Two worker processes each hold a paged KV cache of a real model's layout (GQA K/V, MLA's latent
rows, DSA's latent + indexer keys; the layer count cut to fit the machine); this process is the
engine: it opens stages on the staging arena, sends ``KvSend`` to one and ``KvRecv`` to the other
over their pipes and reads their flags, exactly as a pd deployment does (``engine/kv_handoff.py``,
``workers/kv_transfer.py``). Blocks are scattered on both sides. memcpy: one contiguous copy of
the same bytes in this process, timed in the same run, interleaved with the handoffs; the ratio is
taken per repeat (memcpy time / handoff time) and reported with its 95% interval. With ``--cache
cold`` (the default) a buffer twice the last-level cache is written before every handoff and every
memcpy, so both start from memory, as a long-running server's KV does; ``hot`` leaves the caches
(the memcpy source is then cache-resident). Every size's first handoff is checked: the decode
side's slots equal the prefill side's.
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
_POLL_S = 50e-6  # the engine reads the flags between its own work; a spinning reader would steal the copier's core


def add_parser(sub) -> None:
    p = sub.add_parser("kv-transfer", help="the pd KV handoff's bandwidth against memcpy, per KV layout")
    p.add_argument("--layouts", default=",".join(_LAYOUTS), help="of gqa (Qwen3-235B), mla (DeepSeek-R1), "
                   "dsa (DeepSeek-V3.2)")
    p.add_argument("--sizes-mib", default=",".join(f"{s:g}" for s in _SIZES_MIB), help="handoff sizes")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="the KV cache's dtype")
    p.add_argument("--layers", type=int, default=8, help="layers of each cache (the model's per-layer rows)")
    p.add_argument("--cache", default="cold", choices=("cold", "hot"), help="cold: evict the CPU caches before "
                   "every handoff and memcpy; hot: leave them")
    p.add_argument("--json", default=None, metavar="FILE.json")
    p.add_argument("--md", default=None, metavar="FILE.md", help="the table, with the command and provenance")
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
    spent: list[float] = []  # seconds of each handle's copy (to its flag store), since the last ask
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        if msg == "spent":
            conn.send(spent)
            spent = []
        elif isinstance(msg, tuple):  # (block ids, tokens): a checksum of those slots
            from moeflow.model.kv_cache import slots_for
            slots = slots_for(msg[0], 0, msg[1], block_size)
            conn.send([float(t.index_select(1, slots).double().sum()) for t in cache.entries.values()])
        else:
            kv.handle(msg)
            spent.append(kv.last_copy_s)
    kv.close()


def measure_layout(name: str, sizes_mib, repeats: int, dtype: str, layers: int, cache: str = "cold",
                   out=sys.stdout) -> list[dict]:
    import torch

    from moeflow.measure.stats import mean_ci, paired_ratio_ci

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
        flush = _Flush(torch) if cache == "cold" else (lambda: None)
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
                flush()
                t0 = time.perf_counter()
                pipes[0].send(KvSend(stage, pb))
                while conn.status(stage, WRITE, 1) != DONE:
                    time.sleep(_POLL_S)
                t1 = time.perf_counter()
                pipes[1].send(KvRecv(stage, db))
                while conn.status(stage, READ, 1) != DONE:
                    time.sleep(_POLL_S)
                t2 = time.perf_counter()
                conn.close(stage)
                flush()
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
            for a in pipes:
                a.send("spent")
            out_s, in_s = (statistics.median(a.recv()) for a in pipes)
            h, c = statistics.median(hand), statistics.median(copy)
            ratio = paired_ratio_ci(copy, hand)  # per repeat: memcpy time / handoff time
            row = {"layout": name, "size_mib": nbytes / 2**20, "tokens": n, "cache": cache, "handoff_ms": h * 1e3,
                   "copy_out_ms": statistics.median(write) * 1e3, "copy_in_ms": statistics.median(read) * 1e3,
                   # inside the workers: the copies themselves (the rest: messages, wake-ups, flag reads)
                   "worker_out_ms": out_s * 1e3, "worker_in_ms": in_s * 1e3,
                   "handoff_gbps": nbytes / h / 1e9, "memcpy_gbps": nbytes / c / 1e9,
                   "of_memcpy": ratio.to_dict(), "handoff_ms_ci": mean_ci([x * 1e3 for x in hand]).to_dict(),
                   "memcpy_ms_all": [x * 1e3 for x in copy]}
            rows.append(row)
            print(f"{name:4} {row['size_mib']:8.2f} MiB {n:7d} tok | handoff {row['handoff_ms']:8.2f} ms "
                  f"(out {row['copy_out_ms']:.2f} + in {row['copy_in_ms']:.2f}; copying {out_s * 1e3:.2f} + "
                  f"{in_s * 1e3:.2f}) {row['handoff_gbps']:6.2f} GB/s | "
                  f"memcpy {row['memcpy_gbps']:6.2f} GB/s | {ratio.fmt(100, 3)}% of memcpy",
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


class _Flush:
    """Evict the CPU caches: write a buffer twice the last-level cache (Linux's sysfs says how big)."""

    def __init__(self, torch):
        self.buf = torch.empty(2 * _llc_bytes(), dtype=torch.uint8)
        self.k = 0

    def __call__(self) -> None:
        self.k += 1
        self.buf.fill_(self.k % 251)


def _llc_bytes() -> int:
    sizes = []
    for idx in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{idx}/size") as f:
                text = f.read().strip()
        except OSError:
            break
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
        sizes.append(int(text.rstrip("KMG")) * mult)
    return max(sizes, default=64 << 20)


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def run(args: argparse.Namespace) -> int:
    from moeflow.measure.provenance import provenance, write_result

    sizes = [float(s) for s in args.sizes_mib.split(",") if s]
    rows = []
    for name in [s for s in args.layouts.split(",") if s]:
        if name not in _LAYOUTS:
            raise ValueError(f"--layouts: {name!r} is not one of {_LAYOUTS}")
        rows += measure_layout(name, sizes, args.repeats, args.dtype, args.layers, args.cache)
    result = {"provenance": provenance(), "dtype": args.dtype, "layers": args.layers, "repeats": args.repeats,
              "cache": args.cache, "rows": rows}
    write_result(result, args.json, args.md, markdown)
    return 0


def markdown(result: dict) -> str:
    """One row per layout and size: the handoff, where its time went, and memcpy of the same bytes."""
    prov = result["provenance"]
    lines = [f"# KV handoff vs memcpy ({result['cache']} caches)", "",
             f"Command: `{prov['command']}`  ", f"Commit {prov['commit']}{' (dirty)' if prov.get('dirty') else ''}, "
             f"{prov['date']}, {prov['cpu_model']} ({prov.get('isa', '?')}), {prov['cores']} cores, torch "
             f"{prov['torch']}; {result['dtype']} KV, {result['layers']} layers, {result['repeats']} repeats, "
             "medians; the ratio per repeat (memcpy time / handoff time) as mean ± half-width of its 95% interval.",
             "", "| KV | MiB | tokens | handoff ms | out ms (copying) | in ms (copying) | handoff GB/s | memcpy GB/s "
             "| of memcpy (medians) | of memcpy (paired) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ratio = r["of_memcpy"]
        lines.append(f"| {r['layout']} | {r['size_mib']:.2f} | {r['tokens']} | {r['handoff_ms']:.2f} | "
                     f"{r['copy_out_ms']:.2f} ({r['worker_out_ms']:.2f}) | "
                     f"{r['copy_in_ms']:.2f} ({r['worker_in_ms']:.2f}) "
                     f"| {r['handoff_gbps']:.2f} | {r['memcpy_gbps']:.2f} | "
                     f"{100 * r['handoff_gbps'] / r['memcpy_gbps']:.1f}% | {100 * ratio['mean']:.1f} ± "
                     f"{50 * (ratio['ci95'][1] - ratio['ci95'][0]):.1f}% |")
    return "\n".join(lines) + "\n"
