"""``moeflow bench kv-transfer``: the prefill/decode handoff's bandwidth against memcpy, per KV layout.

Two worker processes each hold a paged KV cache of a real model's layout (GQA K/V, MLA's latent
rows, DSA's latent + indexer keys; the layer count cut to fit the machine) in shared memory, as a
pd deployment's instances do; this process is the engine and drives either path over their pipes,
reading their flags (``engine/kv_handoff.py``, ``workers/kv_transfer.py``): ``in-place`` (what a pd
deployment does on one host) sends ``KvRecv`` naming the prefill worker's blocks to the decode
worker, which copies them straight into its own; ``staged`` (a prefill server's, for a decode
server anywhere) sends ``KvSend`` to one (into the staging arena) and then ``KvRecv`` to the
other (out of it). Blocks are scattered on both sides. memcpy: one contiguous copy of
the same bytes in this process, timed in the same run, interleaved with the handoffs; the ratio is
taken per repeat (memcpy time / handoff time) and reported with its 95% interval. With ``--cache
cold`` (the default) a buffer twice the last-level cache is written before every handoff and every
memcpy, so both start from memory, as a long-running server's KV does; ``hot`` leaves the caches
(the memcpy source is then cache-resident). Every size's first handoff is checked: the decode
side's slots equal the prefill side's.
"""
from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
import uuid

_SIZES_MIB = (0.25, 1, 4, 16, 64)
_LAYOUTS = ("gqa", "mla", "dsa")
_PATHS = ("in-place", "staged")
_POLL_S = 50e-6  # the engine reads the flags between its own work; a spinning reader would steal the copier's core


def add_parser(sub) -> None:
    p = sub.add_parser("kv-transfer", help="the pd KV handoff's bandwidth against memcpy, per KV layout")
    p.add_argument("--layouts", default=",".join(_LAYOUTS), help="of gqa (Qwen3-235B), mla (DeepSeek-R1), "
                   "dsa (DeepSeek-V3.2)")
    p.add_argument("--sizes-mib", default=",".join(f"{s:g}" for s in _SIZES_MIB), help="handoff sizes")
    p.add_argument("--paths", default=",".join(_PATHS), help="of in-place (one copy: the decode worker reads the "
                   "prefill worker's cache, pd on one host) and staged (two: through the staging arena)")
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
    from moeflow.sim.hf_configs import DEEPSEEK_R1_HF, DEEPSEEK_V32_HF, QWEN3_235B_A22B_HF

    hf = {"gqa": QWEN3_235B_A22B_HF, "mla": DEEPSEEK_R1_HF, "dsa": DEEPSEEK_V32_HF}[name]
    load_families()
    return tuple(attention_for(family_for(hf).to_model_config(hf)).kv_layout().items())


def _worker(conn, entries, layers: int, num_blocks: int, block_size: int, dtype: str, seed: int, path: str) -> None:
    import torch

    from moeflow.workers.kv_transfer import KvTransfers, shared_cache_of

    torch.set_num_threads(1)
    cache, region, memory = shared_cache_of(dict(entries), layers, num_blocks, block_size, getattr(torch, dtype),
                                            "cpu", path, 0)
    g = torch.Generator().manual_seed(seed)
    for t in cache.entries.values():
        t.copy_(torch.randn(t.shape, generator=g))
    kv = KvTransfers(cache, 0)
    spent: list[float] = []  # seconds of each handle's copy (to its flag store), since the last ask
    conn.send(region)
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
    memory.close()


def measure_layout(name: str, sizes_mib, repeats: int, dtype: str, layers: int, cache: str = "cold",
                   out=sys.stdout, paths=_PATHS) -> list[dict]:
    import torch

    from moeflow.measure.stats import mean_ci, paired_ratio_ci

    from moeflow.comm.kv_arena import READ, WRITE
    from moeflow.comm.segment import cleanup, segment_path
    from moeflow.engine.kv_handoff import DONE, KvConnector
    from moeflow.messages import KvRecv, KvSend, KvSource

    entries = kv_layout(name)
    item = getattr(torch, dtype).itemsize
    per_token = layers * item * sum(_prod(s) for _, s in entries)
    block_size = 16
    max_tokens = int(max(sizes_mib) * 2**20 // per_token) + block_size
    num_blocks = 2 * (max_tokens // block_size + 1)
    run_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    conn = KvConnector(run_id, int(max(sizes_mib) * 2**20 * 1.1) + (1 << 20), layers, dtype, entries)
    ctx = mp.get_context("spawn")
    pipes, procs, regions = [], [], []
    try:
        for seed in (1, 2):
            a, b = ctx.Pipe()
            path = segment_path(run_id, f"kv-cache-{seed}")
            p = ctx.Process(target=_worker, args=(b, entries, layers, num_blocks, block_size, dtype, seed, path),
                            daemon=True)
            p.start()
            pipes.append(a)
            procs.append(p)
        regions = [a.recv() for a in pipes]
        rng = random.Random(0)
        flush = _Flush(torch) if cache == "cold" else (lambda: None)

        def wait(stage, side) -> None:
            while conn.status(stage, side, 1) != DONE:
                time.sleep(_POLL_S)

        def handoff(path: str, n: int, pb, db) -> tuple[float, float, list[float]]:
            """(seconds out, seconds in, each worker's own copy seconds) of one handoff."""
            stage = conn.open(n)
            flush()
            t0 = time.perf_counter()
            if path == "staged":
                pipes[0].send(KvSend(stage, pb))
                wait(stage, WRITE)
                t1 = time.perf_counter()
                pipes[1].send(KvRecv(stage, db))
            else:  # the decode worker reads the prefill worker's blocks where they are
                t1 = t0
                pipes[1].send(KvRecv(dataclasses.replace(stage, source=KvSource((regions[0],), pb)), db))
            wait(stage, READ)
            t2 = time.perf_counter()
            conn.close(stage)
            spent = []
            for a in pipes:
                a.send("spent")
                spent.append(sum(a.recv()))
            return t1 - t0, t2 - t1, spent

        rows = []
        for mib in sizes_mib:
            n = max(1, int(mib * 2**20 // per_token))
            nbytes = conn.bytes_for(n)
            src = torch.randn(nbytes // item, dtype=torch.float32).to(getattr(torch, dtype))
            dst = torch.empty_like(src)
            got = {p: {"out": [], "in": [], "worker_out": [], "worker_in": []} for p in paths}
            copy = []
            for rep in range(repeats):
                for path in paths:  # interleaved: every path and memcpy once per repeat
                    blocks = rng.sample(range(num_blocks), 2 * (-(-n // block_size)))
                    pb, db = tuple(blocks[:len(blocks) // 2]), tuple(blocks[len(blocks) // 2:])
                    t_out, t_in, (w_out, w_in) = handoff(path, n, pb, db)
                    g = got[path]
                    g["out"].append(t_out), g["in"].append(t_in), g["worker_out"].append(w_out)
                    g["worker_in"].append(w_in)
                    if rep == 0:
                        _check(pipes, pb, db, n, f"{name}, {mib:g} MiB, {path}")
                flush()
                c0 = time.perf_counter()
                dst.copy_(src)
                copy.append(time.perf_counter() - c0)
            for path in paths:
                g = got[path]
                hand = [a + b for a, b in zip(g["out"], g["in"])]
                h, c = statistics.median(hand), statistics.median(copy)
                ratio = paired_ratio_ci(copy, hand)  # per repeat: memcpy time / handoff time
                out_s, in_s = statistics.median(g["worker_out"]), statistics.median(g["worker_in"])
                row = {"layout": name, "path": path, "size_mib": nbytes / 2**20, "tokens": n, "cache": cache,
                       "handoff_ms": h * 1e3, "copy_out_ms": statistics.median(g["out"]) * 1e3,
                       "copy_in_ms": statistics.median(g["in"]) * 1e3,
                       # inside the workers: the copies themselves (the rest: messages, wake-ups, flag reads)
                       "worker_out_ms": out_s * 1e3, "worker_in_ms": in_s * 1e3,
                       "handoff_gbps": nbytes / h / 1e9, "memcpy_gbps": nbytes / c / 1e9,
                       "of_memcpy": ratio.to_dict(), "handoff_ms_ci": mean_ci([x * 1e3 for x in hand]).to_dict(),
                       "memcpy_ms_all": [x * 1e3 for x in copy]}
                rows.append(row)
                print(f"{name:4} {path:8} {row['size_mib']:8.2f} MiB {n:7d} tok | handoff {row['handoff_ms']:8.2f} ms "
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
        cleanup(run_id)  # the workers' caches, had one been killed


def _check(pipes, pb, db, n: int, what: str) -> None:
    """The decode worker's slots equal the prefill worker's (checksums per entry)."""
    pipes[0].send((pb, n))
    pipes[1].send((db, n))
    a, b = pipes[0].recv(), pipes[1].recv()
    if a != b:
        raise RuntimeError(f"{what}: the decode side's KV differs from the prefill side's (checksums {a} vs {b})")


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
    paths = tuple(p for p in args.paths.split(",") if p)
    bad = [p for p in paths if p not in _PATHS]
    if bad or not paths:
        raise ValueError(f"--paths: {bad or args.paths!r}: give one or more of {_PATHS}")
    rows = []
    for name in [s for s in args.layouts.split(",") if s]:
        if name not in _LAYOUTS:
            raise ValueError(f"--layouts: {name!r} is not one of {_LAYOUTS}")
        rows += measure_layout(name, sizes, args.repeats, args.dtype, args.layers, args.cache, paths=paths)
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
             "in-place: the decode worker copies the prefill worker's blocks into its own (one copy, what a pd "
             "deployment does on one host); staged: out into the staging arena, then in (two, a prefill server's). "
             "out/in ms: from the message sent to the flag seen; (copying): inside the worker.",
             "", "| KV | path | MiB | tokens | handoff ms | out ms (copying) | in ms (copying) | handoff GB/s "
             "| memcpy GB/s | of memcpy (medians) | of memcpy (paired) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ratio = r["of_memcpy"]
        lines.append(f"| {r['layout']} | {r.get('path', 'staged')} | {r['size_mib']:.2f} | {r['tokens']} | "
                     f"{r['handoff_ms']:.2f} | "
                     f"{r['copy_out_ms']:.2f} ({r['worker_out_ms']:.2f}) | "
                     f"{r['copy_in_ms']:.2f} ({r['worker_in_ms']:.2f}) "
                     f"| {r['handoff_gbps']:.2f} | {r['memcpy_gbps']:.2f} | "
                     f"{100 * r['handoff_gbps'] / r['memcpy_gbps']:.1f}% | {100 * ratio['mean']:.1f} ± "
                     f"{50 * (ratio['ci95'][1] - ratio['ci95'][0]):.1f}% |")
    return "\n".join(lines) + "\n"
