"""What the worker fork server imports once, so that no worker pays for it (``launch.spawn``).

Workers start from multiprocessing's fork server: a process started with the first worker of an
engine process, which imports this module and then forks every worker of every deployment of that
engine. Started by ``spawn`` instead, each worker imported torch and the model code itself: about
3 s of CPU per worker on the development machines, at every start and every restart.

Imported only in the fork server, never by the engine: it makes that process ignore a hang-up of
its process group (so the workers it forked, which die with it, stay the engine's to stop, as
they ignore the hang-up themselves). It neither computes nor touches a device: a fork after CUDA
initialisation would be unusable, and no thread of a computation may be mid-way at a fork.
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
