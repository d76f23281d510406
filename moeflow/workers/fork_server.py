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
until it pins itself, and what libraries read from the environment at import (``entry.become_worker``
re-applies moeflow's own logging level, and takes the engine's current stdout and stderr).
Killing the server kills every worker of the engine at once, as killing the engine does.
"""
from __future__ import annotations

import signal

signal.signal(signal.SIGHUP, signal.SIG_IGN)  # SIGINT: the fork server ignores it already

import torch  # noqa: E402,F401

import moeflow.comm  # noqa: E402,F401
import moeflow.hardware.device  # noqa: E402,F401
import moeflow.workers.launch  # noqa: E402,F401
import moeflow.workers.roles  # noqa: E402,F401
import moeflow.workers.world  # noqa: E402,F401
