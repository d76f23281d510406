"""The error every configuration check raises, below every config module (``config.py`` and
``eplb_config.py`` beside it both raise it, so neither needs the other for it)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type, or out of range."""


def require(cond: bool, msg: str) -> None:
    """Raise ``ConfigError(msg)`` unless ``cond``: a config's ``__post_init__`` checks, one line each."""
    if not cond:
        raise ConfigError(msg)
