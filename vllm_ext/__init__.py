"""vLLM side of qerl-plugin, loaded through the ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` in every process it starts (front end, engine core, workers); it must stay
cheap and idempotent, so this module imports neither torch nor vllm at the top. The data path:

* ``vllm_ext.quant``             the ``nvfp4`` quantization method: config, checkpoint detection, registration
* ``vllm_ext.nvfp4_linear``      its linear layers: load/quantize (BF16 or NVFP4A16 source), Marlin repack, reloads
* ``vllm_ext.noisy_norm``        the out-of-tree RMSNorm that carries AQN noise
* ``vllm_ext.worker_extension``  RPCs the trainer calls through ``collective_rpc``
* ``vllm_ext.bench``             ``qerl bench rollout`` (decode throughput/memory of BF16/NVFP4 x LoRA x AQN)
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
    from vllm_ext import noisy_norm, quant

    quant.register()
    noisy_norm.register()
    _registered = True
    logger.debug("qerl-plugin vLLM extension registered")
