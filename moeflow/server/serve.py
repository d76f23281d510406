"""``moeflow serve``: any deployment mode behind the OpenAI-compatible HTTP server (uvicorn)."""
from __future__ import annotations

import argparse
import sys

from moeflow import lifecycle, settings
from moeflow.config import KV_ROLES, ConfigError
from moeflow.engine.args import add_engine_args, cluster_config, engine_kwargs
from moeflow.engine.worker_node_command import run_node
from moeflow.server.config import ServerConfig

_DEFAULTS = ServerConfig()
GAVE_UP_EXIT = 3  # the deployment could not be brought back: a supervisor should restart the server


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_engine_args(p)
    s = p.add_argument_group("HTTP server")
    s.add_argument("--host", default=_DEFAULTS.host, help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=_DEFAULTS.port)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health "
                   "(default: $MOEFLOW_API_KEY, else $VLLM_API_KEY; the environment keeps it out of the process list)")
    s.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    s.add_argument("--max-pending-requests", type=int, default=_DEFAULTS.max_pending_requests,
                   help="requests accepted and unfinished (queued + running); past it new ones get 429")
    s.add_argument("--max-body-bytes", type=int, default=_DEFAULTS.max_body_bytes,
                   help="larger request bodies get 413")
    s.add_argument("--max-restarts", type=int, default=5,
                   help="when a worker dies, rebuild the deployment; give up after this many attempts in a row "
                        "that fail to bring it up (0: never rebuild)")
    s.add_argument("--restart-backoff-s", type=float, default=1.0,
                   help="wait before the first restart attempt, doubled before each next one and in a crash "
                        "loop (at most 30 s)")
    s.add_argument("--keep-alive-on-failure", action="store_true",
                   help=f"once the deployment stays failed, keep answering 503 instead of exiting with status "
                        f"{GAVE_UP_EXIT} (vLLM's VLLM_KEEP_ALIVE_ON_ENGINE_DEATH)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--autoscale", default=None, metavar="POLICY.yaml",
                   help="resize the deployment from its live load (afd: attention instances and FFN daemons, started "
                        "with --max-attn-workers and --max-ffn-workers; pd: prefill and decode instances, "
                        "--max-prefill-instances and --max-decode-instances; dep and dwdp: ranks, --max-dp; "
                        "docs/elastic.md)")
    r = p.add_argument_group("prefill/decode roles (behind moeflow router; docs/pd.md)")
    r.add_argument("--role", "--disaggregation-mode", dest="role", default=None, choices=KV_ROLES,
                   help="prefill: answer a request with kv_transfer_params {do_remote_decode: true} with its first "
                        "token and a handle to its KV; decode: take such a handle's KV instead of computing the "
                        "prompt. --kv-lease-s, --kv-load-failure-policy, --max-pending-handoffs and --kv-buffer-mib "
                        "apply (default: whole requests)")
    r.add_argument("--kv-host", default="127.0.0.1", help="prefill: the KV port's address, advertised to decode "
                   "servers (this host's address on the network they share)")
    r.add_argument("--kv-port", type=int, default=0, help="prefill: the KV port (0: any free one)")
    r.add_argument("--kv-staged", action="store_true", help="prefill: copy each request's KV into the staging "
                   "arena before offering it (two copies on a host), instead of offering the blocks in place "
                   "(a decode server on this host copies them once; the default)")
    r.add_argument("--kv-secret", default=None, help="what a decode server proves it knows (an HMAC of a fresh "
                   "nonce) to pair with a prefill server's KV port; the same on every prefill and decode server "
                   "(default: $MOEFLOW_KV_SECRET, else the API key; neither: any decode server that reaches the port "
                   "may pair, and each staged range still needs its own token)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from moeflow import LLM
    from moeflow.engine.base import clock
    from moeflow.server.app import build_app
    from moeflow.server.async_engine import AsyncEngine
    from moeflow.server.metrics import ServerMetrics

    cluster = cluster_config(args)
    if cluster.node_rank > 0:  # as torchrun starts the same command on every host
        return run_node(cluster)
    if args.trace:
        raise ConfigError("moeflow serve records no trace (--trace); use moeflow bench serve --trace")
    config = ServerConfig(model_name=args.served_model_name or args.model, host=args.host, port=args.port,
                          api_key=args.api_key or settings.api_key(), max_pending_requests=args.max_pending_requests,
                          max_body_bytes=args.max_body_bytes, role=args.role)
    kwargs = {**engine_kwargs(args), "max_restarts": args.max_restarts, "restart_backoff_s": args.restart_backoff_s}
    if args.role is not None:
        kwargs["kv_transfer_config"]["secret"] = args.kv_secret or settings.kv_secret() or config.api_key
    metrics = ServerMetrics(config.busy_window_s, clock)
    http: list[uvicorn.Server] = []  # set below; the engine thread stops it when it gives up
    gave_up: list[str] = []

    def give_up(reason: str) -> None:
        gave_up.append(reason)
        if http:
            http[0].should_exit = True  # a graceful stop: requests in flight get their answers

    engine = AsyncEngine(lambda: LLM(**kwargs), config.max_pending_requests, metrics,
                         on_give_up=None if args.keep_alive_on_failure else give_up)
    if args.autoscale is not None:
        from moeflow.engine.autoscaler import Autoscaler, load_policy
        if args.mode not in ("afd", "asap", "pd", "dep", "dwdp"):
            raise ConfigError(f"--autoscale: mode {args.mode!r} does not change its members while serving (afd, "
                              f"asap, pd, dep and dwdp do)")
        if args.mode == "pd":
            from moeflow.autoscale_config import PdAutoscalePolicy
            from moeflow.engine.pd_autoscaler import PdAutoscaler
            engine.autoscaler = PdAutoscaler(*load_policy(args.autoscale, PdAutoscalePolicy), counter=metrics.autoscale)
        elif args.mode in ("dep", "dwdp"):
            from moeflow.autoscale_config import EpAutoscalePolicy
            from moeflow.engine.ep_autoscaler import EpAutoscaler
            engine.autoscaler = EpAutoscaler(*load_policy(args.autoscale, EpAutoscalePolicy), counter=metrics.autoscale)
        else:
            engine.autoscaler = Autoscaler(*load_policy(args.autoscale), counter=metrics.autoscale)
    # NOTE: uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal; with
    # SIGTERM's default action that would kill us before the workers and shared memory are
    # released, so SIGTERM (and SIGHUP, which uvicorn leaves alone) become an exception that
    # runs the ``finally`` below.
    lifecycle.handle_signals()
    try:
        engine.start()  # loads the model (and starts the workers) on the engine thread
        metrics.watch(engine.snapshot, engine.oldest_work_age_s)
        app = build_app(engine, config, metrics)
        role = "" if args.role is None else f", {args.role} role, KV port {engine.llm.engine.kv_port}"
        print(f"moeflow: serving {config.model_name!r} (mode {args.mode}, context {engine.max_model_len}{role}) "
              f"on http://{config.host}:{config.port}", file=sys.stderr, flush=True)
        http.append(uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=args.log_level,
                                                  lifespan="off", timeout_graceful_shutdown=5)))
        if not gave_up:  # it may have given up already, before there was a server to stop
            http[0].run()
    except KeyboardInterrupt:
        return 130
    finally:
        engine.shutdown()
    if gave_up:
        print(f"moeflow: the deployment could not be brought back ({gave_up[0]}); exiting with status "
              f"{GAVE_UP_EXIT} for a supervisor to restart the server (--keep-alive-on-failure keeps it "
              f"answering 503)", file=sys.stderr, flush=True)
        return GAVE_UP_EXIT
    return 0
