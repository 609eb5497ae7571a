"""The opt-in switches of the plugin's overrides: an environment variable set to a true word."""
from __future__ import annotations

import os

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})


def env_requested(var: str, environ=None) -> bool:
    """Whether $var (in `environ`, default os.environ) is "1", "true", "yes" or "on"."""
    value = (environ if environ is not None else os.environ).get(var, "")
    return value.strip().lower() in TRUE_WORDS
