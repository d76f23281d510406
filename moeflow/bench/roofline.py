"""``moeflow bench roofline``: the model's prefill and decode on one device against that device's
ceilings, measured in the same run: achieved FLOP/s over the GEMM rate, achieved bytes/s over the
copy rate, and the published peaks where the device is known.

The model is a shape (a preset's Hugging Face config, or a config.json) with random weights made on
the device (``model/random_weights.py``): no checkpoint, so a model too big for the disk is measured,
cut to ``--layers`` when it is too big for the device or the time. It runs the model code directly
(``MoETransformer`` over a paged ``KVCache``), not the engine: it measures the model's compute, not
scheduling. Device-generic PyTorch; the JSON schema is in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback

from moeflow.measure.provenance import provenance, write_result

SCHEMA = "moeflow.bench.roofline/1"
_MEMORY_HEADROOM = 0.85  # refuse a run whose weights and caches would take more of the free memory


def add_parser(sub) -> None:
    p = sub.add_parser("roofline", help="a model shape's prefill FLOP/s and decode bytes/s vs the device's "
                       "measured GEMM and copy ceilings (random weights, no checkpoint)")
    p.add_argument("--shape", default="qwen3-30b-a3b",
                   help="qwen3-30b-a3b, deepseek-v2-lite, tiny, tiny-mla, or a config.json (or its directory)")
    p.add_argument("--layers", type=int, default=None, help="the first N layers only (default: all)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="auto: what moeflow's hardware module picks for the device")
    p.add_argument("--threads", type=int, default=1, help="torch threads on a CPU (moeflow env measures one)")
    p.add_argument("--prefill-batch", type=int, default=4, help="prompts in the prefill (0: no prefill)")
    p.add_argument("--prefill-len", type=int, default=2048, help="tokens per prompt")
    p.add_argument("--decode-batches", type=int, nargs="*", default=[8, 64, 256], help="decode batch sizes")
    p.add_argument("--context", type=int, default=2048, help="cached tokens per decoding request")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5, help="timed decode steps per batch (after one warm-up)")
    p.add_argument("--prefill-repeats", type=int, default=3, help="timed prefills (after one warm-up)")
    p.add_argument("--profile-batch", type=int, default=None,
                   help="decode batch of the profiled step (default: the smallest; 0: no profile)")
    p.add_argument("--router-skew", type=float, default=0.0, help="Zipf tilt of every router (router.skewed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ceilings-only", action="store_true", help="measure the device's ceilings, no model")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--md", default=None, help="write the markdown table here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from moeflow.bench.ceilings import device_facts, measure_ceilings
    from moeflow.bench.roofline_report import markdown, print_result
    from moeflow.hardware import resolve_device, resolve_dtype
    from moeflow.model.family import family_for, load_families
    from moeflow.model.shapes import first_layers, shape_for

    shape = shape_for(args.shape)
    total_layers = shape.hf["num_hidden_layers"]
    hf = first_layers(shape.hf, args.layers or total_layers)
    load_families()
    cfg = family_for(hf).to_model_config(hf)
    device = torch.device(resolve_device(args.device))
    if device.type == "cuda":  # NOTE: set_device and mem_get_info refuse "cuda" without an index
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    torch.set_num_threads(args.threads)
    choice = resolve_dtype(args.dtype, cfg.checkpoint_dtype, device.type)
    dtype = getattr(torch, choice.dtype)
    batches = sorted(set(args.decode_batches))
    profile_batch = (batches[0] if batches else 0) if args.profile_batch is None else args.profile_batch
    print(f"roofline: {shape.name}, {cfg.num_layers} of {total_layers} layers "
          f"({cfg.num_layers - cfg.num_moe_layers} dense, {cfg.num_moe_layers} MoE), {choice.dtype} on {device}"
          + (f"; {shape.note}" if shape.note else ""), flush=True)
    need = None if args.ceilings_only else \
        _check_memory(cfg, hf, dtype, device, max(batches + [profile_batch], default=0), args)
    result = {
        "provenance": provenance(),  # first, and in the markdown too
        "schema": SCHEMA,
        "shape": {"name": shape.name, "note": shape.note or None, "architecture": cfg.architecture,
                  "layers": cfg.num_layers, "layers_total": total_layers,
                  "dense_layers": cfg.num_layers - cfg.num_moe_layers, "moe_layers": cfg.num_moe_layers,
                  "hf_config": hf},
        "device": device_facts(device, args.threads), "dtype": choice.dtype, "dtype_reason": choice.reason,
        "ceilings": measure_ceilings(device, dtype),
        "weights": None, "prefill": None, "decode": [], "profile": None, "errors": {},
    }
    ceilings = result["ceilings"]
    print(f"ceilings: GEMM {_rate(ceilings['gemm']['flop_per_s'], device)}, "
          f"copy {ceilings['copy']['bytes_per_s'] / 1e9:.1f} GB/s", flush=True)
    if not args.ceilings_only:
        from moeflow.bench.step_bytes import weights_nbytes
        from moeflow.model.random_weights import random_weights
        from moeflow.model.transformer import MoETransformer

        t0 = time.perf_counter()
        cfg, w = random_weights(hf, dtype, device, args.seed, args.router_skew)
        model = MoETransformer(cfg, w)
        result["weights"] = {"bytes": weights_nbytes(w), "init_s": time.perf_counter() - t0, "seed": args.seed,
                             "router_skew": args.router_skew, "memory_estimate_bytes": need}
        print(f"random weights: {result['weights']['bytes'] / 1e9:.2f} GB in {result['weights']['init_s']:.1f} s",
              flush=True)
        with torch.inference_mode():
            prefill, decode, profile = _measure(model, batches, profile_batch, args, result["errors"])
        result.update(prefill=_with_shares(prefill, ceilings, choice.dtype, "flop"),
                      decode=[_with_shares(d, ceilings, choice.dtype, "bytes") for d in decode], profile=profile)
    print_result(result)
    write_result(result, args.json, args.md, markdown)
    return 1 if result["errors"] else 0


def _measure(model, batches: list[int], profile_batch: int, args: argparse.Namespace, errors: dict):
    """Prefill, decode per batch, the profiled step; a failing part is recorded in ``errors`` and the
    others still run (a device hour is scarce: one batch too big must not lose the rest)."""
    from moeflow.bench.roofline_steps import decode_cache, profile_decode, time_decode, time_prefill

    prefill = None
    if args.prefill_batch > 0:
        prefill = _guarded("prefill", errors, lambda: time_prefill(
            model, [args.prefill_len] * args.prefill_batch, args.block_size, args.prefill_repeats, args.seed))
    decode, profile = [], None
    if not batches and not profile_batch:
        return prefill, decode, profile
    kv = _guarded("decode_cache", errors, lambda: decode_cache(
        model, max(batches + [profile_batch]), args.context, args.block_size, args.seed))
    if kv is None:
        return prefill, decode, profile
    for b in batches:
        point = _guarded(f"decode_{b}", errors, lambda: time_decode(model, kv, b, args.repeats, args.seed))
        if point is not None:
            decode.append(point)
            print(f"decode batch {b}: {point['seconds'] * 1e3:.1f} ms per step", flush=True)
    if profile_batch:
        profile = _guarded("profile", errors, lambda: profile_decode(model, kv, profile_batch, args.seed))
    return prefill, decode, profile


def _guarded(name: str, errors: dict, fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 -- recorded in the result, the exit status and stderr
        errors[name] = f"{type(e).__name__}: {e}"
        print(f"roofline: {name} failed: {errors[name]}", file=sys.stderr, flush=True)
        traceback.print_exc()
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


def _with_shares(point: dict | None, ceilings: dict, dtype: str, what: str) -> dict | None:
    """The point with its shares of the measured ceiling and of the datasheet's peak (None: unknown)."""
    if point is None:
        return None
    sheet = ceilings["datasheet"]
    if what == "flop":
        rate = point["flop_per_s"]
        peak = sheet["flop_per_s"].get(dtype) if sheet else None
        return {**point, "share_of_gemm": rate / ceilings["gemm"]["flop_per_s"],
                "share_of_datasheet": rate / peak if peak else None}
    rate, copy = point["bytes_per_s"], ceilings["copy"]["bytes_per_s"]
    return {**point, "copy_bound_s": point["bytes"]["total"] / copy, "share_of_copy": rate / copy,
            "share_of_datasheet": rate / sheet["bytes_per_s"] if sheet else None}


def _check_memory(cfg, hf: dict, dtype, device, max_batch: int, args: argparse.Namespace) -> int:
    """Bytes the weights and caches will take (built on the meta device: shapes only); refuses a run
    that would not fit in the device's free memory (on a CPU: MemAvailable), naming --layers."""
    import torch

    from moeflow.bench.step_bytes import weights_nbytes
    from moeflow.model.kv_cache import KVCache
    from moeflow.model.random_weights import random_weights

    _, w = random_weights(hf, dtype, "meta")
    per = -(-(args.context + 1) // args.block_size)
    need = weights_nbytes(w) + KVCache.for_model(cfg, max_batch * per, args.block_size, dtype, "meta").nbytes
    if args.prefill_batch:
        need += KVCache.for_model(cfg, args.prefill_batch * -(-args.prefill_len // args.block_size),
                                  args.block_size, dtype, "meta").nbytes
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else _mem_available()
    if free is not None and need > _MEMORY_HEADROOM * free:
        raise ValueError(f"{cfg.num_layers} layers with a KV cache for batch {max_batch} x {args.context} "
                         f"need {need / 1e9:.1f} GB; {free / 1e9:.1f} GB is free on {device}: "
                         f"pass fewer --layers or smaller --decode-batches")
    return need


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _rate(flop_per_s: float, device) -> str:
    return f"{flop_per_s / 1e12:.1f} TFLOP/s" if device.type == "cuda" else f"{flop_per_s / 1e9:.1f} GFLOP/s"
