"""The actor under ``quantization: nvfp4``: frozen NVFP4 base, PEFT LoRA on top, gradients only in LoRA.

Where verl 0.9.1 builds the actor (``verl/workers/engine/fsdp/transformer_impl.py``,
``FSDPEngine._build_model_optimizer``)::

    module = self._build_module()            # HF from_pretrained, verl's monkey patches, .to(fp32 for training)
    module = self._build_lora_module(module) # enable_input_require_grads + get_peft_model(LoraConfig(...))
    module = self._build_fsdp_module(module) # FSDP1 (strategy fsdp) or FSDP2 fully_shard (fsdp2)

Three wrappers (:mod:`verl_ext.patches`) put the NVFP4 base in between:

``ActorRolloutRefWorker.init_model``
    reads this worker's ``rollout.quantization`` and ``rollout.custom.qerl`` before anything is built and
    makes them the process's settings (:func:`verl_ext.config.activate`); the engine has no rollout config.
``FSDPEngine._build_module``
    BF16 checkpoint: verl's own build. NVFP4 checkpoint (compressed-tensors ``nvfp4-pack-quantized``):
    verl's build with ``quantization_config`` hidden from transformers (so it builds plain ``nn.Linear``
    layers instead of compressed-tensors' own modules; the packed tensors are skipped as unexpected
    keys), then :func:`verl_ext.nvfp4_linear.load_nvfp4_checkpoint_into` swaps every quantized projection
    for an :class:`~verl_ext.nvfp4_linear.NVFP4Linear` holding the checkpoint's bytes and reloads the rest.
``FSDPEngine._build_lora_module``
    BF16 checkpoint: :func:`~verl_ext.nvfp4_linear.replace_linears_with_nvfp4` quantizes the decoder's
    ``*_proj`` layers (on the GPU when there is one) exactly as vLLM's load-time quantization does, so the
    actor decodes the bytes the rollout runs; then verl's PEFT step wraps those NVFP4Linear layers with
    ordinary ``lora.Linear`` (NVFP4Linear subclasses ``nn.Linear``, so ``target_modules: all-linear``
    finds them). Afterwards it checks that every NVFP4 layer got a LoRA adapter and that no base tensor
    requires grad.

FSDP: the NVFP4 tensors are buffers, so neither FSDP1 nor FSDP2 shards them (each rank holds the whole
4-bit base: 5.5 GiB for a 7B model) and neither optimizer sees them. FSDP1's ``MixedPrecision(buffer_dtype=
fp32)`` casts the FP8 scales to fp32 (exact; NVFP4Linear casts them back per call), FSDP2 leaves buffers
alone. verl's QAT (``verl/utils/qat``) is a different path and is rejected at config time.
"""

from __future__ import annotations

import logging

from verl_ext.config import activate, current, settings_from

logger = logging.getLogger("qerl.verl.actor")


def wrap_init_model(original, target: str):
    def init_model(self, *args, **kwargs):
        cfg = getattr(self, "config", None)
        rollout = cfg.get("rollout") if cfg is not None and hasattr(cfg, "get") else None
        model = cfg.get("model") if cfg is not None and hasattr(cfg, "get") else None
        settings = settings_from(rollout, model) if rollout is not None else None
        activate(settings)
        if settings is not None and settings.active:
            logger.info(
                "qerl: worker role %s, quantization=%s (%s checkpoint), AQN %s",
                getattr(self, "role", "?"),
                settings.quantization,
                settings.model_quant,
                "on" if settings.aqn_enabled else "off",
            )
        return original(self, *args, **kwargs)

    return init_model


def _quant_device():
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def wrap_build_module(original, target: str):
    def _build_module(self):
        s = current()
        if not (s.nvfp4 and s.nvfp4_checkpoint):
            return original(self)
        from verl_ext.nvfp4_linear import load_nvfp4_checkpoint_into

        hf_config = self.model_config.hf_config
        had = hasattr(hf_config, "quantization_config")
        saved = getattr(hf_config, "quantization_config", None)
        if had:
            delattr(hf_config, "quantization_config")
        try:
            module = original(self)
        finally:
            if had:
                hf_config.quantization_config = saved
        path = getattr(self.model_config, "local_path", None) or self.model_config.path
        report = load_nvfp4_checkpoint_into(module, path, device=_quant_device())
        logger.info("qerl: actor base loaded from the NVFP4 checkpoint %s: %s", path, report.summary())
        return module

    return _build_module


def wrap_build_lora_module(original, target: str):
    def _build_lora_module(self, module):
        s = current()
        if not s.nvfp4:
            return original(self, module)
        from verl_ext.nvfp4_linear import nvfp4_modules, replace_linears_with_nvfp4

        if not nvfp4_modules(module):
            report = replace_linears_with_nvfp4(module, device=_quant_device())
            logger.info("qerl: actor base quantized to NVFP4: %s", report.summary())
        n_base = len(nvfp4_modules(module))
        if n_base == 0:
            raise RuntimeError(
                "quantization=nvfp4 found no decoder *_proj nn.Linear layers to put in NVFP4 in "
                f"{type(module).__name__}; qerl supports Qwen2/Qwen2.5/Qwen3/Llama/Mistral-style decoders"
            )
        module = original(self, module)
        check_lora_on_nvfp4(module)
        return module

    return _build_lora_module


def check_lora_on_nvfp4(module) -> dict:
    """Every NVFP4Linear sits under a PEFT LoRA layer, and nothing but LoRA (and norms/embeddings the user
    unfroze on purpose) requires grad. Returns counts; raises RuntimeError naming what is wrong."""
    from verl_ext.nvfp4_linear import NVFP4Linear

    bare, wrapped = [], 0
    for name, mod in module.named_modules():
        base = getattr(mod, "base_layer", None)
        if isinstance(base, NVFP4Linear) and hasattr(mod, "lora_A"):
            wrapped += 1
    total = sum(1 for _, m in module.named_modules() if isinstance(m, NVFP4Linear))
    if wrapped < total:
        for name, mod in module.named_modules():
            if isinstance(mod, NVFP4Linear) and not name.endswith(".base_layer"):
                bare.append(name)
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    lora = [n for n in trainable if ".lora_" in n]
    if not lora:
        raise RuntimeError("quantization=nvfp4: PEFT left no trainable LoRA parameters; check model.target_modules")
    if bare:
        logger.warning(
            "qerl: %d NVFP4 layers have no LoRA adapter (target_modules excludes them), e.g. %s; they stay frozen",
            len(bare),
            bare[:3],
        )
    other = [n for n in trainable if ".lora_" not in n]
    if other:
        logger.warning("qerl: trainable non-LoRA parameters next to the NVFP4 base: %s", other[:5])
    counts = {"nvfp4_layers": total, "lora_wrapped": wrapped, "lora_params": len(lora), "other_trainable": len(other)}
    logger.info("qerl: NVFP4 + LoRA actor: %s", counts)
    return counts
