"""The worker fork server's context, and starting it before the engine needs it.

The fork server imports torch and the worker code once (``workers/fork_server.py``); started with
the first worker, that import (seconds of CPU) is on the path of every deployment's start. A
command that will start workers starts the server first (``start_early``), so that its import
runs beside the command's own on the other core. Torch-free, so that the command line can call
it before importing anything heavy.
"""
from __future__ import annotations

import multiprocessing as mp
from multiprocessing import forkserver

PRELOAD = ["moeflow.workers.fork_server"]


def context():
    """The multiprocessing context workers start from (the preload takes effect when the server starts)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_early() -> None:
    """Start the fork server now (without waiting for its import); idempotent."""
    context()
    forkserver.ensure_running()
