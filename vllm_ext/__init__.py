"""vLLM side of qerl-plugin, loaded through the ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` in every process it starts; it must stay cheap and idempotent, so this
module imports neither torch nor vllm at the top.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("qerl.vllm")
_registered = False


def register() -> None:
    """Entry point for ``vllm.general_plugins``; safe to call any number of times."""
    global _registered
    if _registered:
        return
    _registered = True
    logger.debug("qerl-plugin vLLM extension loaded")
