"""The one place environment variables are read."""
from __future__ import annotations

import os


def cache_dir() -> str:
    """Where generated artifacts (the embedded model) are kept: $MOEFLOW_CACHE_DIR or ~/.cache/moeflow."""
    return os.environ.get("MOEFLOW_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "moeflow")


def logging_level() -> str:
    """Level of moeflow's own log lines: $MOEFLOW_LOGGING_LEVEL (DEBUG, INFO, WARNING, ...), default INFO."""
    return os.environ.get("MOEFLOW_LOGGING_LEVEL", "INFO").upper()


def hf_hub_offline() -> bool:
    """$HF_HUB_OFFLINE: resolve hub model names from the local cache only (huggingface_hub's own switch)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hf_hub_cache() -> str | None:
    """$HF_HUB_CACHE (huggingface_hub's cache of downloaded repositories), None: its default."""
    return os.environ.get("HF_HUB_CACHE") or None
