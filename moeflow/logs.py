"""moeflow's loggers: one "moeflow" root with a stderr handler, as vLLM does for "vllm".

The level comes from settings (MOEFLOW_LOGGING_LEVEL, default INFO); a program that configures
logging itself can set the "moeflow" logger's handlers and level and this leaves them alone.
"""
from __future__ import annotations

import logging
import sys

from moeflow.settings import logging_level

_configured = False


def get_logger(name: str) -> logging.Logger:
    global _configured
    root = logging.getLogger("moeflow")
    if not _configured:
        _configured = True
        if not root.handlers:
            h = logging.StreamHandler(sys.stderr)
            h.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
            root.addHandler(h)
            root.setLevel(logging_level())
            root.propagate = False
    return logging.getLogger(name)
