"""Warnings logged once per process: one set of keys shared by qerl's vLLM and verl extensions.

vLLM builds hundreds of layers and verl scores thousands of answers per step; a condition worth a warning is
usually the same for all of them, so each is logged the first time its key is seen. Callers prefix their keys with
their own area (``nvfp4/``, ``quant/``, ``verify/``) so that two modules never silence each other. Imports only the
standard library.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["forget", "warn_once"]

_SEEN: set[str] = set()


def warn_once(logger: logging.Logger, key: str, msg: str, *args: Any) -> bool:
    """``logger.warning(msg, *args)`` the first time this process sees ``key``; whether it logged."""
    if key in _SEEN:
        return False
    _SEEN.add(key)
    logger.warning(msg, *args)
    return True


def forget(prefix: str) -> None:
    """Let the keys that start with ``prefix`` be logged again (tests that check a warning after other tests)."""
    _SEEN.difference_update({k for k in _SEEN if k.startswith(prefix)})
