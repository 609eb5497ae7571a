"""The opt-in switches of the plugin's overrides: an environment variable set to a true word, and
an install that never stops the server."""
from __future__ import annotations

import os
from typing import Callable

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})


def env_requested(var: str, environ=None) -> bool:
    """Whether $var (in `environ`, default os.environ) is "1", "true", "yes" or "on"."""
    return env_value(var, environ).lower() in TRUE_WORDS


def env_value(var: str, environ=None) -> str:
    """$var in `environ` (default os.environ), stripped; "" where unset."""
    return (environ if environ is not None else os.environ).get(var, "").strip()


def install_or_warn(install: Callable[[], bool], logger, what: str) -> bool:
    """`install()`, whose failure is logged as "sm120_workbook: <what> failed: <error>" and never
    raised: the server runs unpatched rather than not at all. True if it installed."""
    try:
        return install()
    except Exception as e:  # noqa: BLE001 - see the docstring
        logger.warning("sm120_workbook: %s failed: %r", what, e)
        return False
