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
    a = sub.add_parser("router-admin", help="register or deregister a running router's prefill and decode servers")
    asub = a.add_subparsers(dest="action", required=True)
    listing = asub.add_parser("list", help="every server, its role, state and requests in flight")
    add = asub.add_parser("add", help="register a server (checked as at start)")
    rm = asub.add_parser("remove", help="deregister a server: it drains, then leaves")
    for x in (listing, add, rm):
        x.add_argument("--router", default="http://127.0.0.1:8000", help="the router's base URL")
        x.add_argument("--api-key", default=None, help="the router's key (default: $MOEFLOW_API_KEY, else "
                                                       "$VLLM_API_KEY)")
    add.add_argument("url")
    add.add_argument("--role", required=True, choices=["prefill", "decode"])
    add.add_argument("--wait-s", type=float, default=30.0, help="how long to wait for a server still loading")
    rm.add_argument("url")
    rm.add_argument("--wait", action="store_true", help="return once it has drained and left")
    rm.add_argument("--timeout-s", type=float, default=600.0, help="with --wait: the longest wait")
    a.set_defaults(func=cmd_router_admin)


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


def cmd_router_admin(args: argparse.Namespace) -> int:
    """One membership call; prints the router's answer (JSON) and fails with its reason."""
    import json

    import httpx

    key = args.api_key or settings.api_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    base = args.router.rstrip("/")
    with httpx.Client(headers=headers, timeout=max(60.0, getattr(args, "wait_s", 0) + 30)) as c:
        if args.action == "list":
            r = c.get(f"{base}/workers")
        elif args.action == "add":
            r = c.post(f"{base}/workers", json={"url": args.url, "worker_type": args.role, "wait_s": args.wait_s})
        else:
            r = c.delete(f"{base}/workers/{args.url.rstrip('/')}")
            deadline = time.monotonic() + args.timeout_s
            while args.wait and r.status_code == 202 and r.json().get("status") == "draining":
                if time.monotonic() > deadline:
                    print(f"moeflow router-admin: {args.url} still draining after {args.timeout_s:g} s", file=sys.stderr)
                    return 1
                time.sleep(0.2)
                left = [w for w in c.get(f"{base}/workers").json()["workers"] if w["url"] == args.url.rstrip("/")]
                if not left:
                    print(json.dumps({"status": "removed", "url": args.url.rstrip("/")}))
                    return 0
    if r.status_code >= 400:
        print(f"moeflow router-admin: {r.json().get('error', {}).get('message', r.text)}", file=sys.stderr)
        return 1
    print(json.dumps(r.json(), indent=1))
    return 0
