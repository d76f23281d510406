"""The one place environment variables are read."""
from __future__ import annotations

import os


def cache_dir() -> str:
    """Where generated artifacts (the embedded model) are kept: $MOEFLOW_CACHE_DIR or ~/.cache/moeflow."""
    return os.environ.get("MOEFLOW_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "moeflow")
