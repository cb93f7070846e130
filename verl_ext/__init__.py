"""verl side of qerl-plugin, loaded through the ``verl.plugins`` entry point (``qerl = "verl_ext"``).

verl's loader (``verl/__init__.py``) imports this module on every ``import verl`` (driver, Ray workers, vLLM
server actors) and never calls anything in it; it hides import errors at DEBUG. So importing this module is
the registration: it must not fail and must stay cheap. It imports nothing from verl, vLLM or torch; it only
installs :mod:`verl_ext.patches`' import hook, which patches verl's modules as they get imported.

The data path, one concern per module:

* :mod:`verl_ext.config`           ``rollout.quantization: nvfp4`` and ``rollout.custom.qerl``: the driver's checks
                                    (errors name the key and the fix), normalisation; ``qerl train --check``
* :mod:`verl_ext.settings`         those keys parsed once per process into ``QerlSettings``
* :mod:`verl_ext.patches`          applies the verl wrappers of :mod:`qerl_plugin.upstream` on import, idempotent
* :mod:`verl_ext.rollout`          vLLM server: route ``nvfp4`` to vLLM, engine options (additional_config),
                                    qerl's worker extension
* :mod:`verl_ext.worker_extension` inside vLLM: verl's extension + qerl's RPCs, adapter-only sync checks
* :mod:`verl_ext.adapter_sync`     actor -> vLLM adapter: extraction by name (the FSDP1 fix), key checks
* :mod:`verl_ext.actor`            actor build: NVFP4 base (:mod:`verl_ext.nvfp4_linear`) under PEFT LoRA
* :mod:`verl_ext.nvfp4_linear`     the actor's frozen NVFP4 base linear: decoded per call, input gradient only
* :mod:`verl_ext.recompute`        ``actor.no_recompute_layers``: the last N decoder layers keep their activations
* :mod:`verl_ext.nvfp4_replace`    which linears go NVFP4; quantize them in place (the rollout's bytes)
* :mod:`verl_ext.nvfp4_checkpoint` load an NVFP4 checkpoint's bytes into a model built from its config
* :mod:`verl_ext.kernels`          the actor's NVFP4 decode: Triton kernel on CUDA, the torch codec elsewhere
* :mod:`verl_ext.logprobs`         verl's per-token log-probabilities (no flash-attn) in blocks of rows
* :mod:`verl_ext.replay`           verl's replay buffer polls for finished rollouts every 0.1 s
* :mod:`verl_ext.aqn_hook`         per-step AQN noise RPC next to the weight sync; sigma/stage metrics
* :mod:`verl_ext.train`            ``qerl train <yaml> [overrides]``
* :mod:`verl_ext.export`           ``qerl export``: a verl checkpoint's LoRA adapter as a PEFT adapter directory
* :mod:`verl_ext.lora_checkpoint`  reading that adapter out of verl's FSDP rank files
* :mod:`verl_ext.data`             training data in verl's row format: GSM8K, synthetic arithmetic
* :mod:`verl_ext.reward`           verl custom reward ``compute_score``: data-source routing, scores
* :mod:`verl_ext.answers`          the final answer in a response and in a ground truth, normalised
* :mod:`verl_ext.verify`           answer equivalence (math-verify) under deadlines that work in threads
"""

from __future__ import annotations

import logging

from verl_ext import patches as _patches

logger = logging.getLogger("qerl.verl")

#: True once this module ran (the registration marker tests check after ``import verl``).
REGISTERED = False
#: Whether the patch hook is installed (False when ``QERL_VERL_PATCHES=0``).
PATCHES_INSTALLED = False

try:
    PATCHES_INSTALLED = _patches.install()
except Exception as _e:  # pragma: no cover - install() guards itself; never break ``import verl``
    logger.warning("qerl-plugin: could not install its verl patches: %s: %s", type(_e).__name__, _e)
REGISTERED = True
from qerl_plugin import sampler as _sampler  # noqa: E402 - standard library only

_sampler.start_from_env()  # QERL_PROFILE_DIR: a wall-clock sampling profile of every verl process
logger.debug("qerl-plugin verl extension loaded (patches installed: %s)", PATCHES_INSTALLED)
