"""Which of a model's linears the actor keeps in NVFP4, and their in-place swap for NVFP4Linear.

:func:`replace_linears_with_nvfp4` quantizes the decoder's ``*_proj`` layers as ``qerl quantize`` and vLLM's
load-time quantization do (q/k/v and gate/up sharing the global scale of their fused group, in the
checkpoint's dtype), so the actor decodes exactly the bytes the rollout runs.

    model = AutoModelForCausalLM.from_config(cfg)          # or from_pretrained(bf16 checkpoint)
    replace_linears_with_nvfp4(model)                      # or nvfp4_checkpoint.load_nvfp4_checkpoint_into
    model = get_peft_model(model, LoraConfig(r=32, target_modules="all-linear"))
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
import torch.nn as nn

from qerl_plugin import format as fmt
from qerl_plugin import nvfp4
from qerl_plugin.aqn import normalize_module_name
from verl_ext.adapter_sync import LORA_PARTS
from verl_ext.nvfp4_linear import NVFP4Linear, _in_quant_dtype

__all__ = ["ReplaceReport", "nvfp4_modules", "replace_linears_with_nvfp4"]

logger = logging.getLogger("qerl.verl.nvfp4_replace")

# Which nn.Linear modules are quantized: the ``*_proj`` linears of the decoder layers, as ``qerl quantize``.
_LAYER_RE = re.compile(r"(?:^|\.)layers\.\d+\.")
_PEFT_PARTS = LORA_PARTS + ("lora_magnitude_vector",)


def _is_target(name: str, module: nn.Module) -> bool:
    if not isinstance(module, nn.Linear) or isinstance(module, NVFP4Linear):
        return False
    if any(p in _PEFT_PARTS for p in name.split(".")) or not _LAYER_RE.search(name):
        return False
    return _hf_name(name).endswith("_proj")


def _hf_name(name: str) -> str:
    """The Hugging Face module name of a linear (PEFT's ``base_model.model.`` and ``.base_layer`` removed)."""
    return normalize_module_name(name.removesuffix(".base_layer"))


def _dense_bytes(linear: nn.Linear) -> int:
    return sum(t.numel() * t.element_size() for t in (linear.weight, linear.bias) if t is not None)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


@dataclass
class ReplaceReport:
    """What :func:`replace_linears_with_nvfp4` or
    :func:`~verl_ext.nvfp4_checkpoint.load_nvfp4_checkpoint_into` changed."""

    replaced: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    fused_groups: list[tuple[str, ...]] = field(default_factory=list)
    dense_bytes: int = 0  # bytes the replaced dense layers held (weights and biases)
    nvfp4_bytes: int = 0  # bytes of the NVFP4 buffers (and biases) that replaced them
    loaded: list[str] = field(default_factory=list)  # non-quantized tensors copied from a checkpoint
    meta_left: list[str] = field(default_factory=list)  # tensors still on the meta device after a load

    def summary(self) -> str:
        return (
            f"{len(self.replaced)} linears -> NVFP4 ({len(self.fused_groups)} fused groups, {len(self.ignored)} ignored): "
            f"{self.dense_bytes / 2**20:.1f} MiB dense -> {self.nvfp4_bytes / 2**20:.1f} MiB NVFP4"
        )


def replace_linears_with_nvfp4(
    model: nn.Module,
    ignore: Iterable[str] = ("lm_head",),
    fused_groups: Sequence[Sequence[str]] = fmt.FUSED_GROUPS,
    quant_dtype: torch.dtype | None = torch.bfloat16,
    device: torch.device | str | None = None,
) -> ReplaceReport:
    """Swap the decoder's ``*_proj`` ``nn.Linear`` layers for :class:`NVFP4Linear`, in place.

    Targets: ``nn.Linear`` modules inside ``layers.<i>.`` whose name ends in ``_proj`` (HF Qwen2/Qwen3/Llama/
    Mistral naming; also ``<proj>.base_layer`` under an existing PEFT wrapper, never LoRA's own linears),
    minus ``ignore``: compressed-tensors' entries (a Hugging Face module name, or ``re:<regex>`` that
    ``re.match``-es it), as in a checkpoint's ``quantization_config``. An ignored member of a fused
    group (q/k/v, gate/up) takes its whole group with it, as vLLM quantizes fused layers together. Each
    fused group is quantized with one shared global scale, in ``quant_dtype`` (see
    :meth:`NVFP4Linear.from_linear`). Quantization runs where the weight is (or on ``device``); the dense
    weights are dropped as each layer is replaced. Meta-device layers become empty meta NVFP4Linears (for
    FSDP's ``sync_module_states``). Returns a :class:`ReplaceReport`.
    """
    ignore = fmt.validate_ignore_entries(ignore)
    targets = {n: m for n, m in model.named_modules() if _is_target(n, m)}
    module_of = {_hf_name(n): n for n in targets}  # HF name -> this model's module name
    ignored_hf = {h for h in module_of if fmt.is_ignored(h, ignore)}
    ignored_hf, pulled = fmt.expand_fused_ignores(ignored_hf, module_of, fused_groups)
    if pulled:
        logger.info("NVFP4: also keeping %s unquantized (fused with an ignored module)", ", ".join(sorted(pulled)))
    ignored = {module_of[h] for h in ignored_hf}

    report = ReplaceReport(ignored=sorted(ignored))
    for name in list(targets):  # named_modules order: layer by layer, one group's dense weights at a time
        if name in ignored or name not in targets:
            continue
        parts = fmt.fused_partners(_hf_name(name), fused_groups)
        members = [module_of[h] for h in parts if h in module_of]
        mods = [targets.pop(m) for m in members]  # drop our references: the dense weights die with the swap
        weights = []
        for member, mod in zip(members, mods):
            report.dense_bytes += _dense_bytes(mod)
            w = mod.weight.detach()
            w = w.to(device) if device is not None and not w.is_meta else w
            weights.append(w if w.is_meta else _in_quant_dtype(w, quant_dtype, member))
        gs = None
        if len(members) > 1 and not any(w.is_meta for w in weights):
            gs = nvfp4.global_scale(*weights)
            report.fused_groups.append(tuple(members))
        for i, (member, mod) in enumerate(zip(members, mods)):
            bias = None if mod.bias is None else mod.bias.detach().to(weights[i].device)
            new = NVFP4Linear.from_weight(weights[i], bias, global_scale=gs, quant_dtype=None, name=member)
            weights[i] = None  # type: ignore[call-overload]
            _set_submodule(model, member, new)
            report.nvfp4_bytes += new.nbytes()
            report.replaced.append(member)
        del mods, weights
    logger.info("NVFP4: %s", report.summary())
    return report


def nvfp4_modules(model: nn.Module) -> dict[str, NVFP4Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
