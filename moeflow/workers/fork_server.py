"""What the worker fork server imports once, so that no worker pays for it (``launch.spawn``, ``entry.worker_main``).

Workers start from multiprocessing's fork server: a process started with the first worker of an
engine process, which imports this module and then forks every worker of every deployment of that
engine. Started by ``spawn`` instead, each worker imported torch and the model code itself: about
3 s of CPU per worker on the development machines, at every start and every restart.

Imported only in the fork server (and so present in every worker), never by the engine: it makes
that process ignore a hang-up of its process group (so the workers it forked, which die with it,
stay the engine's to stop, as they ignore the hang-up themselves). It neither computes nor touches
a device: a fork after CUDA initialisation would be unusable, and no thread of a computation may
be mid-way at a fork.

NOTE: what a worker inherits from the server rather than from the engine now: its CPU affinity
until it pins itself, and what libraries read from the environment at import (``become_worker``
re-applies moeflow's own logging level, and takes the engine's current stdout and stderr).
Killing the server kills every worker of the engine at once, as killing the engine does.
"""
from __future__ import annotations

import multiprocessing.forkserver
import os
import signal

signal.signal(signal.SIGHUP, signal.SIG_IGN)  # SIGINT: the fork server ignores it already

import torch  # noqa: E402,F401

import moeflow.comm  # noqa: E402,F401
import moeflow.hardware.device  # noqa: E402,F401
import moeflow.workers.launch  # noqa: E402,F401
import moeflow.workers.roles  # noqa: E402,F401
import moeflow.workers.world  # noqa: E402,F401

from moeflow.logs import refresh_level  # noqa: E402


def become_worker(environ: dict[str, str], stdio) -> None:
    """First steps of a worker the fork server just forked: let go of the server's "alive" pipe,
    and take the engine's environment and stdout/stderr (``environ``, ``stdio``: a
    ``workers.stdio.Stdio``, as they are at the worker's start).

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
