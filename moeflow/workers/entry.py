"""The first and last steps of every worker process: ``worker_main``, the target the fork server
runs (``launch.spawn``): die with the parent, take the engine's environment, pin, build the role's
worker on its device, report ready (or the traceback), serve, then exit without the interpreter's
teardown.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import logging
import multiprocessing as mp
import multiprocessing.forkserver
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from moeflow import lifecycle
from moeflow.logs import refresh_level
from moeflow.messages import WorkerFailed, WorkerReady, WorkerSetup
from moeflow.workers.stdio import Stdio


def worker_main(setup: WorkerSetup, conn: Connection, environ: dict[str, str], stdio: Stdio) -> None:
    """Entry point of every worker process; ``environ``, ``stdio``: the engine's at the worker's start."""
    server = os.getppid()
    lifecycle.die_with_parent()
    faulthandler.enable()  # a crash in native code (a kernel, a signal) still leaves its Python stack on stderr
    parent = mp.parent_process()  # the engine process
    if os.getppid() != server or (parent is not None and not parent.is_alive()):  # either died before the prctl
        os._exit(1)
    become_worker(environ, stdio)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    if setup.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {setup.cpu % (os.cpu_count() or 1)})  # the engine counted node 0's CPUs
    import torch

    torch.set_num_threads(setup.engine.num_threads)
    from moeflow.comm import make_transport
    from moeflow.hardware.device import worker_device
    from moeflow.workers.roles import build_worker
    from moeflow.workers.world import close_world, init_world

    worker = None
    try:
        device = worker_device(setup.engine.device, setup.world_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        setup = dataclasses.replace(setup, device=str(device))  # every tensor of this process is made there
        if setup.comm is not None:  # payloads are copied out of the shared buffers onto it
            setup = dataclasses.replace(setup, comm=dataclasses.replace(setup.comm, compute_device=setup.device))
        tp = init_world(setup)
        worker = build_worker(setup, make_transport(setup.comm), tp)
        conn.send(WorkerReady(setup.role, setup.index, os.getpid(), worker.memory(), worker.kv_region))
        worker.serve(conn)
    except BaseException:
        try:
            conn.send(WorkerFailed(setup.role, setup.index, traceback.format_exc()))
        except OSError:
            pass
        raise
    finally:
        if worker is not None:
            worker.close()
        close_world()
    # Everything above is released (the engine unlinks what a worker could not): skip the interpreter's
    # teardown of torch and the weights, ~0.5 s per worker here, at every shutdown and restart.
    lifecycle.release_all()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def become_worker(environ: dict[str, str], stdio: Stdio) -> None:
    """First steps of a worker the fork server just forked: let go of the server's "alive" pipe,
    and take the engine's environment and stdout/stderr (``environ``, ``stdio``: as they are at
    the worker's start).

    NOTE: the fork server exits once every holder of that pipe's write end has closed it, and each
    forked child inherits a copy: a worker that kept it and never reads its control pipe again (one
    stopped, or waiting without a timeout) would keep the server, and with it itself
    (PR_SET_PDEATHSIG is the server's death), alive after the engine was killed.
    """
    stdio.adopt()
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    os.environ.clear()
    os.environ.update(environ)
    refresh_level()  # the loggers were set up in the fork server, from its own environment
