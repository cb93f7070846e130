"""The vLLM server side (verl's ``vLLMHttpServer``, one Ray actor per rollout replica node).

verl 0.9.1 builds the ``vllm serve`` arguments in ``vLLMHttpServer.launch_server``; three of its hooks are
wrapped (:mod:`verl_ext.patches`), all reading the server's settings, parsed once per server:

* ``_apply_quantization``: ``quantization: nvfp4`` becomes ``--quantization nvfp4`` (verl raises on it);
* ``_preprocess_engine_kwargs``: the run's engine options go into ``additional_config`` (``qerl_aqn`` when AQN
  is on), so the engine builds its noisy norms before CUDA-graph capture and keys its compile cache on them;
* ``_get_worker_extension_cls``: qerl's worker extension when qerl is on, verl's otherwise.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping

from qerl_plugin import options

logger = logging.getLogger("qerl.verl.rollout")


def server_settings(server):
    """The qerl settings of a vLLMHttpServer, parsed from its (already converted) configs on first use."""
    from verl_ext.settings import settings_of

    return settings_of(server, server.config, getattr(server, "model_config", None))


def wrap_apply_quantization(original, target: str):
    def _apply_quantization(self):
        settings = server_settings(self)
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
            options.METHOD,
            settings.model_quant,
            settings.model_path,
            ", AQN on" if settings.aqn_enabled else "",
        )
        return options.METHOD, {}

    return _apply_quantization


def merged_additional_config(given: Any, ours: Mapping[str, Any]) -> dict[str, Any]:
    """``engine_kwargs.vllm.additional_config`` from the user's YAML (a mapping or its JSON text) plus ``ours``;
    a key the user set to a different value is an error."""
    if given is None:
        given = {}
    elif isinstance(given, str):
        given = json.loads(given) if given.strip() else {}
    else:
        from verl_ext.config import to_plain

        given = to_plain(given)
    if not isinstance(given, Mapping):
        raise ValueError(f"engine_kwargs.vllm.additional_config must be a mapping, got {given!r}")
    clash = {k: given[k] for k in ours if k in given and given[k] != ours[k]}
    if clash:
        raise ValueError(
            f"engine_kwargs.vllm.additional_config sets {clash}, but this run's qerl settings need {dict(ours)}; "
            "remove those keys (qerl sets them from actor_rollout_ref.rollout.custom.qerl)"
        )
    return {**given, **ours}


def wrap_preprocess_engine_kwargs(original, target: str):
    def _preprocess_engine_kwargs(self, engine_kwargs):
        result = original(self, engine_kwargs)
        ours = server_settings(self).engine_config()
        if ours:
            engine_kwargs["additional_config"] = merged_additional_config(engine_kwargs.get("additional_config"), ours)
            logger.info("qerl: vLLM additional_config %s", engine_kwargs["additional_config"])
        return result

    return _preprocess_engine_kwargs


def wrap_get_worker_extension_cls(original, target: str):
    def _get_worker_extension_cls(self):
        settings = server_settings(self)
        if not settings.active:
            return original(self)
        return options.VERL_WORKER_EXTENSION

    return _get_worker_extension_cls
