"""The actor under ``quantization: nvfp4``: frozen NVFP4 base, PEFT LoRA on top, gradients only in LoRA.

Three wrappers (:mod:`verl_ext.patches`) put the NVFP4 base into verl's FSDP actor build: ``init_model``
parses this worker's qerl settings (the engine sees no rollout config); ``FSDPEngine._build_module`` loads an
NVFP4 checkpoint's bytes into :class:`~verl_ext.nvfp4_linear.NVFP4Linear` layers of a meta-device model
(:func:`build_from_nvfp4_checkpoint`); ``FSDPEngine._build_lora_module`` quantizes a BF16 checkpoint's
projections the way vLLM does before PEFT wraps them, and then (for any LoRA actor, NVFP4 or not) lets the last
``custom.qerl.actor.no_recompute_layers`` decoder layers keep their activations (:mod:`verl_ext.recompute`).
Design: docs/design.md, "The actor's NVFP4 base".
"""

from __future__ import annotations

import logging

from verl_ext.settings import activate, current, settings_of

logger = logging.getLogger("qerl.verl.actor")


def wrap_init_model(original, target: str):
    def init_model(self, *args, **kwargs):
        cfg = getattr(self, "config", None)
        rollout = cfg.get("rollout") if cfg is not None and hasattr(cfg, "get") else None
        model = cfg.get("model") if cfg is not None and hasattr(cfg, "get") else None
        settings = settings_of(self, rollout, model) if rollout is not None else None
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


def build_from_nvfp4_checkpoint(engine):
    """verl's ``FSDPEngine._build_module`` for an NVFP4 checkpoint, without ever materialising dense weights.

    The HF model is built from its config with parameters on the meta device (buffers such as rotary
    ``inv_freq`` are real), :func:`~verl_ext.nvfp4_checkpoint.load_nvfp4_checkpoint_into` swaps each quantized
    projection for an NVFP4Linear with the checkpoint's bytes and loads every other tensor; then the steps
    verl's build applies after ``from_pretrained``: its model monkey patches, the cast to the training dtype
    (NVFP4 buffers keep their dtypes), gradient checkpointing. (Calling verl's build instead would allocate a
    random dense fp32 copy of every projection first: 128 GB of host memory for a 32B model.)
    """
    import torch
    from accelerate import init_empty_weights
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils.model import get_hf_auto_model_class
    from verl.utils.torch_dtypes import PrecisionType

    from verl_ext.nvfp4_checkpoint import load_nvfp4_checkpoint_into

    mc, ec = engine.model_config, engine.engine_config
    if mc.model_type != "language_model":
        raise NotImplementedError(f"quantization=nvfp4 supports language models, got model_type={mc.model_type!r}")
    torch_dtype = ec.model_dtype
    if torch_dtype is None:
        torch_dtype = torch.float32 if not ec.forward_only else torch.bfloat16
    torch_dtype = PrecisionType.to_dtype(torch_dtype)
    hf_config = mc.hf_config
    had = hasattr(hf_config, "quantization_config")
    saved = getattr(hf_config, "quantization_config", None)
    if had:  # transformers must build plain nn.Linear layers, not compressed-tensors' modules
        delattr(hf_config, "quantization_config")
    try:
        auto_class = get_hf_auto_model_class(hf_config=hf_config)
        with init_empty_weights(include_buffers=False):
            module = auto_class.from_config(hf_config, torch_dtype=torch_dtype, trust_remote_code=mc.trust_remote_code)
    finally:
        if had:
            hf_config.quantization_config = saved
    path = getattr(mc, "local_path", None) or mc.path
    report = load_nvfp4_checkpoint_into(module, path, device="cpu")
    if report.meta_left:
        raise RuntimeError(f"NVFP4 checkpoint {path} left tensors on the meta device: {report.meta_left[:5]}")
    fko = mc.fused_kernel_options
    apply_monkey_patch(
        model=module,
        use_remove_padding=engine.use_remove_padding,
        ulysses_sp_size=engine.ulysses_sequence_parallel_size,
        use_fused_kernels=mc.use_fused_kernels,
        fused_kernels_backend=fko.get("impl_backend", None) if fko is not None else None,
    )
    module.to(torch_dtype)
    if mc.enable_gradient_checkpointing:
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    logger.info("qerl: actor base loaded from the NVFP4 checkpoint %s: %s", path, report.summary())
    return module


def wrap_build_module(original, target: str):
    def _build_module(self):
        s = current()
        if not (s.nvfp4 and s.nvfp4_checkpoint):
            return original(self)
        if getattr(self.model_config, "use_liger", False):
            raise NotImplementedError("quantization=nvfp4 with an NVFP4 checkpoint does not support model.use_liger")
        return build_from_nvfp4_checkpoint(self)

    return _build_module


def wrap_build_lora_module(original, target: str):
    def _build_lora_module(self, module):
        s = current()
        if not s.nvfp4:
            return _keep_activations(original(self, module), s)
        from verl_ext.nvfp4_replace import nvfp4_modules, replace_linears_with_nvfp4

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
        return _keep_activations(module, s)

    return _build_lora_module


def _keep_activations(module, s):
    """The last ``actor.no_recompute_layers`` decoder layers of the LoRA actor stop recomputing (verl_ext.recompute);
    verl enabled gradient checkpointing on every layer before this, in ``_build_module``."""
    if not s.no_recompute_layers:
        return module
    from verl_ext.config import NO_RECOMPUTE_KEY, QerlConfigError
    from verl_ext.recompute import keep_activations

    try:
        names = keep_activations(module, s.no_recompute_layers, key=NO_RECOMPUTE_KEY)
    except ValueError as e:
        raise QerlConfigError(str(e)) from None
    # printed, as the AQN hook's lines are: the worker's stdout reaches the driver's log, its loggers do not
    short = ", ".join(".".join(n.split(".")[-2:]) for n in names)
    print(f"[qerl] actor: {len(names)} decoder layers keep their activations instead of recomputing them "
          f"({NO_RECOMPUTE_KEY}): {short}", flush=True)
    return module


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
