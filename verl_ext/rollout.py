"""The vLLM server side (verl's ``vLLMHttpServer``, one Ray actor per rollout replica node).

verl 0.9.1 builds the ``vllm serve`` arguments in ``vLLMHttpServer.launch_server``; two of its hooks are
wrapped (:mod:`verl_ext.patches`):

``_apply_quantization``
    verl accepts only ``fp8``, ``torchao`` and ``ascend`` (``_SUPPORTED_QUANTIZATION``) and raises on
    anything else. With ``quantization: nvfp4`` the wrapper returns ``("nvfp4", {})``: vLLM gets
    ``--quantization nvfp4``, qerl's quantization method (registered in every vLLM process by the
    ``vllm.general_plugins`` entry point ``vllm_ext:register``). The same method serves a BF16 checkpoint
    (quantized while loading) and an NVFP4 (compressed-tensors ``nvfp4-pack-quantized``) checkpoint. No
    ``hf_overrides``: the format is the method's business. When AQN is enabled it also sets
    ``QERL_AQN=1`` in this process's environment, which the vLLM engine processes it starts inherit:
    ``vllm_ext.noisy_norm`` then builds every RMSNorm with its fp32 noise buffer (fixed per engine, before
    CUDA-graph capture).

``_get_worker_extension_cls``
    When qerl is on, vLLM's workers are built with :class:`verl_ext.worker_extension.QerlVerlWorkerExtension`
    (verl's own extension plus qerl's ``qerl_set_noise`` / ``qerl_clear_noise`` / adapter RPCs and the
    adapter checks). Otherwise verl's class, untouched.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("qerl.verl.rollout")

WORKER_EXTENSION_CLS = "verl_ext.worker_extension.QerlVerlWorkerExtension"
AQN_ENV = "QERL_AQN"  # read by vllm_ext.noisy_norm in the engine's worker processes
QUANT_METHOD = "nvfp4"  # vllm_ext.quant's registered name


def server_settings(server):
    """qerl settings from a vLLMHttpServer's (already converted) configs."""
    from verl_ext.config import settings_from

    return settings_from(server.config, getattr(server, "model_config", None))


def wrap_apply_quantization(original, target: str):
    def _apply_quantization(self):
        settings = server_settings(self)
        if settings.aqn_enabled:
            os.environ[AQN_ENV] = "1"
        if not settings.nvfp4:
            return original(self)
        qat = getattr(self.config, "qat", None) or {}
        if qat.get("enable", False):
            raise ValueError(
                "actor_rollout_ref.rollout.qat.enable=true with quantization=nvfp4: verl's QAT and qerl's NVFP4 "
                "are two different paths; disable QAT"
            )
        logger.info(
            "qerl: vLLM rollout quantization=%s (%s checkpoint at %s)%s",
            QUANT_METHOD,
            settings.model_quant,
            settings.model_path,
            ", AQN on" if settings.aqn_enabled else "",
        )
        return QUANT_METHOD, {}

    return _apply_quantization


def wrap_get_worker_extension_cls(original, target: str):
    def _get_worker_extension_cls(self):
        settings = server_settings(self)
        if not settings.active:
            return original(self)
        return WORKER_EXTENSION_CLS

    return _get_worker_extension_cls
