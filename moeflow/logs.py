"""moeflow's loggers: one "moeflow" root with a stderr handler, as vLLM does for "vllm".

The level comes from settings (MOEFLOW_LOGGING_LEVEL, default INFO); a program that configures
logging itself can set the "moeflow" logger's handlers and level and this leaves them alone.
"""
from __future__ import annotations

import logging
import sys

from moeflow.settings import logging_level

_configured = False
_ours = False  # the handler is ours, not a program's own configuration


def get_logger(name: str) -> logging.Logger:
    global _configured, _ours
    root = logging.getLogger("moeflow")
    if not _configured:
        _configured = True
        if not root.handlers:
            _ours = True
            h = logging.StreamHandler(sys.stderr)
            h.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
            root.addHandler(h)
            root.setLevel(logging_level())
            root.propagate = False
    return logging.getLogger(name)


def refresh_level() -> None:
    """Our level from the environment again: a worker's environment is the engine's, given at its
    start, while its logger was set up in the fork server from that server's own."""
    if _ours:
        logging.getLogger("moeflow").setLevel(logging_level())
