"""``moeflow`` command line: generate, serve, simulate, plan, predict, profile, demo, bench."""
from __future__ import annotations

import argparse
import sys
import time

from moeflow import lifecycle
from moeflow.engine.args import add_engine_args


def cmd_generate(args: argparse.Namespace) -> int:
    from moeflow import LLM, SamplingParams
    from moeflow.engine.args import engine_kwargs
    from moeflow.engine.trace import write_chrome_trace

    t0 = time.perf_counter()
    with LLM(**engine_kwargs(args)) as llm:
        t_load = time.perf_counter() - t0
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
        t1 = time.perf_counter()
        out = llm.generate([args.prompt], params)[0]
        t_gen = time.perf_counter() - t1
        if args.trace:
            write_chrome_trace(llm.engine.collect_spans(), args.trace)
    c, m = out.outputs[0], out.metrics
    n_out = len(c.token_ids)
    decode_s = (m.token_times_s[-1] - m.token_times_s[0]) if n_out > 1 else 0.0
    print(f"prompt ({len(out.prompt_token_ids)} tokens): {args.prompt!r}")
    print(f"output ({n_out} tokens, finish_reason={c.finish_reason}): {c.text!r}")
    print(f"token ids: {c.token_ids}")
    print(f"model load {t_load:.2f} s | TTFT {m.ttft_s * 1e3:.1f} ms | "
          f"decode {(n_out - 1) / decode_s if decode_s > 0 else 0.0:.1f} tok/s | total {t_gen:.2f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Every command and its flags (the docs test checks the commands the docs show against it)."""
    parser = argparse.ArgumentParser(prog="moeflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    add_engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(func=cmd_generate)

    from moeflow.bench import (
        comm,
        compare,
        contention,
        decode,
        decode_attention,
        decode_ops,
        demo,
        env,
        experts,
        front_cpu,
        kv_transfer,
        plot,
        prefill,
        profile,
        roofline,
        router_load,
        serve,
        soak,
        trace_summary,
    )
    from moeflow.plan import cli as plan_cli
    from moeflow.predict import cli as predict_cli
    from moeflow.engine import worker_node_command as worker_node
    from moeflow.server import router_command as router
    from moeflow.server import serve as server
    from moeflow.sim import cli as sim_cli

    server.add_parser(sub)
    router.add_parser(sub)
    worker_node.add_parser(sub)
    sim_cli.add_parser(sub)
    plan_cli.add_parser(sub)
    predict_cli.add_parser(sub)
    profile.add_parser(sub)
    demo.add_parser(sub)
    env.add_parser(sub)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    for m in (prefill, decode, decode_attention, decode_ops, comm, experts, router_load, serve, soak, compare, plot, trace_summary,
              contention, front_cpu, kv_transfer, roofline):
        m.add_parser(bsub)

    return parser


def main(argv: list[str] | None = None) -> int:
    # SIGTERM/SIGHUP unwind like Ctrl-C: every command's `with`/finally (and atexit) release what it started
    lifecycle.handle_signals()
    parser = build_parser()
    args = parser.parse_args(argv)
    from moeflow.measure.provenance import set_command

    set_command(["moeflow", *(sys.argv[1:] if argv is None else argv)])
    if args.command == "worker-node" or (args.command in ("generate", "serve")
                                         and getattr(args, "mode", "colocated") != "colocated"):
        from moeflow.workers.fork_start import start_early
        start_early()  # its imports beside ours (workers/fork_start.py)
    try:
        return args.func(args)
    except Exception as e:
        if (code := lifecycle.signal_exit_code()) is not None:  # the signal's SystemExit, turned into e
            print(f"moeflow: stopped by a signal ({type(e).__name__} on the way out: {e})", file=sys.stderr)
            return code
        if isinstance(e, ValueError):  # ConfigError, RequestError, CheckpointError: a clear message
            print(f"moeflow: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
