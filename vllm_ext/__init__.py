"""vLLM side of qerl-plugin, loaded through the ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` in every process it starts (front end, engine core, workers); it must stay
cheap and idempotent, so this module imports neither torch nor vllm at the top. The data path:

* ``vllm_ext.quant``             the ``nvfp4`` quantization method: config, checkpoint detection, registration
* ``vllm_ext.nvfp4_linear``      its linear method and which layers get it
* ``vllm_ext.nvfp4_load``        tensor checks while loading; the NVFP4 triple from a BF16 or NVFP4A16 source
* ``vllm_ext.nvfp4_backends``    how a layer's NVFP4 weight is run: Marlin FP4 or emulation, and the choice
* ``vllm_ext.nvfp4_reload``      base-weight reloads into the installed kernel buffers (verl's weight sync)
* ``vllm_ext.noisy_norm``        the out-of-tree RMSNorm that carries AQN noise
* ``vllm_ext.worker_extension``  RPCs the trainer calls through ``collective_rpc``
* ``vllm_ext.lora_dense``        one adapter as two dense GEMMs per slice (``additional_config={"qerl_lora": "dense"}``)
* ``vllm_ext.lora_dense_wrapper`` the punica wrapper that runs it (vLLM imports it for a LoRA engine)
* ``vllm_ext.evaluate``          ``qerl eval --backend vllm``: ``vllm.LLM`` arguments, the adapter's request
* ``vllm_ext.bench``             ``qerl bench rollout|kernels``: shapes, matrix (configs x variants), runner and
  child (one engine per process), report, kernels (per-layer microbenchmark), lora_configs (Triton configs)
"""

from __future__ import annotations

import logging

logger = logging.getLogger("qerl.vllm")
_registered = False


def register_compile_env() -> None:
    """Make qerl's variables that change the traced model (``qerl_plugin.options.COMPILE_ENV``) factors of vLLM's
    compile cache key: vLLM hashes every entry of ``vllm.envs.environment_variables`` into it
    (``vllm.envs.compile_factors``), and names only its own there. Entries already present are left alone."""
    import os

    import vllm.envs as envs

    from qerl_plugin.options import COMPILE_ENV

    for name in COMPILE_ENV:
        envs.environment_variables.setdefault(name, lambda name=name: os.environ.get(name))


def register() -> None:
    """Entry point for ``vllm.general_plugins``; safe to call any number of times."""
    global _registered
    if _registered:
        return
    from qerl_plugin import sampler

    sampler.start_from_env()  # QERL_PROFILE_DIR: a wall-clock sampling profile of every vLLM process
    from vllm_ext import noisy_norm, quant

    quant.register()
    noisy_norm.register()
    register_compile_env()
    from vllm.platforms import current_platform

    if current_platform.is_cuda():  # the dense LoRA wrapper subclasses vLLM's GPU punica wrapper
        from vllm_ext import lora_dense

        lora_dense.register()
    _registered = True
    logger.debug("qerl-plugin vLLM extension registered")
