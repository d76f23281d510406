"""``moeflow router``'s command line: its flags, and the start that checks the servers, then serves.

Imports no web package until it runs (the command line parses, and a GPU box without fastapi runs
every other command); the app itself is ``router.py``.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

from moeflow import lifecycle, settings


def add_parser(sub) -> None:
    p = sub.add_parser("router", help="an OpenAI-compatible front over prefill and decode servers "
                                      "(moeflow serve --role prefill|decode)")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill servers' base URLs")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode servers' base URLs")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' from clients (default: "
                   "$MOEFLOW_API_KEY, else $VLLM_API_KEY); the same header goes on to the servers")
    p.add_argument("--wait-s", type=float, default=120.0, help="how long to wait at start for servers still loading")
    p.add_argument("--timeout-s", type=float, default=600.0, help="one request's longest time at a server")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_router)


def cmd_router(args: argparse.Namespace) -> int:
    import httpx
    import uvicorn

    from moeflow.server.backends import Backends
    from moeflow.server.router import build_router

    api_key = args.api_key or settings.api_key()
    lifecycle.handle_signals()

    async def main() -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout_s), limits=limits) as client:
            backends = Backends(args.prefill, args.decode, client)
            t0 = time.monotonic()
            await backends.check(args.wait_s)
            backends.start()
            app = build_router(backends, args.timeout_s, api_key)
            print(f"moeflow: routing {backends.model_name!r} over {len(backends.prefill)} prefill and "
                  f"{len(backends.decode)} decode servers (checked in {time.monotonic() - t0:.1f} s) on "
                  f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
            server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                                   lifespan="off", timeout_graceful_shutdown=5))
            try:
                await server.serve()
            finally:
                await backends.stop()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        return 130
    return 0
