"""Command-line flags of a deployment, shared by every command that starts one."""
from __future__ import annotations

import argparse

from moeflow.config import DTYPES


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help='local Hugging Face directory, or "tiny" (embedded, random weights)')
    p.add_argument("--mode", default="colocated", choices=["colocated", "asap", "dep"], help="deployment mode")
    p.add_argument("--dtype", default="auto", choices=list(DTYPES),
                   help="auto: the checkpoint's dtype where this machine computes it natively, else float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    lim = p.add_argument_group("engine limits (default: LLM's)")
    lim.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    lim.add_argument("--max-num-seqs", type=int, default=None, help="most requests running at once")
    lim.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache blocks per attention group")
    a = p.add_argument_group("asap mode")
    a.add_argument("--attn-dp", type=int, default=1, help="D: attention data-parallel groups")
    a.add_argument("--attn-tp", type=int, default=1, help="T: tensor-parallel members per group")
    a.add_argument("--moe-workers", type=int, default=1, help="E: MoE worker processes")
    a.add_argument("--pin-cpus", action="store_true", help="pin each worker process to one CPU (asap, dep)")
    a.add_argument("--transport", default="shm", choices=["shm", "dist"], help="dispatch/combine transport")
    a.add_argument("--min-batch-tokens", type=int, default=None, help="length-aware batching threshold")
    a.add_argument("--max-batch-tokens", type=int, default=None, help="S: most tokens in one batch (asap, dep)")
    a.add_argument("--max-batch-wait-s", type=float, default=None)
    a.add_argument("--no-dual-batch", action="store_true", help="ablation: one batch per group at a time")
    a.add_argument("--no-length-aware", action="store_true", help="ablation: batch whatever waits, at once")
    a.add_argument("--no-split", action="store_true", help="ablation: never cut a lone batch into two halves")
    a.add_argument("--no-comm-threads", action="store_true", help="ablation: MoE workers receive/send inline")
    s = p.add_argument_group("dep mode (synchronous baselines)")
    s.add_argument("--dp", type=int, default=1, help="N: ranks of DP attention + expert parallelism")
    s.add_argument("--chunked-prefill-size", type=int, default=None, help="C: the ChunkedPrefill baseline")
    s.add_argument("--dp-placement", default="least_loaded", choices=["least_loaded", "round_robin"],
                   help="dep: a request's rank is the least loaded at its first step, or fixed in turn at arrival")
    p.add_argument("--trace", default=None, metavar="FILE.json", help="write a Chrome/Perfetto trace (asap)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments of ``LLM`` for the parsed flags."""
    kw = dict(model=args.model, mode=args.mode, dtype=args.dtype, seed=args.seed, num_threads=args.threads)
    for name in ("max_model_len", "max_num_seqs", "num_kv_blocks"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.mode == "asap":
        kw.update(attn_dp=args.attn_dp, attn_tp=args.attn_tp, moe_workers=args.moe_workers, pin_cpus=args.pin_cpus,
                  transport=args.transport, trace=args.trace is not None,
                  dual_batch=not args.no_dual_batch, length_aware=not args.no_length_aware,
                  split_lone_batch=not args.no_split,
                  recv_thread=not args.no_comm_threads, send_thread=not args.no_comm_threads)
        for name in ("min_batch_tokens", "max_batch_tokens", "max_batch_wait_s"):
            if getattr(args, name) is not None:
                kw[name] = getattr(args, name)
    elif args.mode == "dep":
        kw.update(dp=args.dp, chunked_prefill_size=args.chunked_prefill_size, placement=args.dp_placement,
                  pin_cpus=args.pin_cpus,
                  trace=args.trace is not None)
        if args.max_batch_tokens is not None:
            kw["max_batch_tokens"] = args.max_batch_tokens
    return kw
