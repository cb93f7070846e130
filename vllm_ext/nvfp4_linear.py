"""Linear layers of the ``nvfp4`` quantization method: which layers get it, and the method itself.

``QerlNVFP4LinearMethod`` creates the checkpoint-format tensors (a BF16 ``weight`` on the meta device, or the
compressed-tensors NVFP4A16 triple), turns them into the NVFP4 triple after loading (:mod:`vllm_ext.nvfp4_load`),
has its backend install the kernel tensors (:mod:`vllm_ext.nvfp4_backends`) and attaches the loaders that
let base weights be reloaded into the same buffers (:mod:`vllm_ext.nvfp4_reload`).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.parameter import (
    GroupQuantScaleParameter,
    ModelWeightParameter,
    PerTensorScaleParameter,
)

from qerl_plugin.nvfp4 import GROUP_SIZE, NVFP4Error
from vllm_ext.nvfp4_backends import Backend, is_nvfp4_layer, select_backend, warn_once
from vllm_ext.nvfp4_load import LayerInfo, checked_loader, checkpoint_tensors, new_layer_info, quantize_layer_weight
from vllm_ext.nvfp4_reload import attach_reload_loaders
from vllm_ext.quant import NVFP4Config

__all__ = ["QerlNVFP4LinearMethod", "get_quant_method"]


def get_quant_method(config: NVFP4Config, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
    """``NVFP4Config.get_quant_method``: our method for NVFP4 linear layers, vLLM's for everything else."""
    ct = config.ct_config
    if isinstance(layer, LinearBase):
        if ct is not None:
            scheme = ct.get_scheme_dict(layer, layer_name=prefix)
            if not scheme or scheme.get("weights") is None:
                return UnquantizedLinearMethod()
            return QerlNVFP4LinearMethod(source="checkpoint", prefix=prefix)
        if _ignored(config, prefix):
            return UnquantizedLinearMethod()
        k_part = getattr(layer, "input_size_per_partition", layer.input_size)
        if k_part % GROUP_SIZE:
            warn_once(
                prefix,
                "nvfp4: %s keeps BF16 weights: its input size per partition (%d) is not a multiple of the "
                "NVFP4 group size %d",
                prefix,
                k_part,
                GROUP_SIZE,
            )
            return UnquantizedLinearMethod()
        return QerlNVFP4LinearMethod(source="bf16", prefix=prefix)
    if ct is not None:
        if isinstance(layer, Attention) and not ct.kv_cache_scheme:
            # no KV-cache quantization: plain attention (vLLM's CT method would add k/v scales of 1.0
            # whose processing deletes them, which breaks a second process_weights_after_loading)
            return None
        # FP8 KV cache, MoE experts, quantized lm_head/embeddings: vLLM's compressed-tensors methods.
        return ct.get_quant_method(layer, prefix)
    if type(layer).__name__ == "RoutedExperts":
        warn_once("moe", "nvfp4: MoE experts are not quantized while loading; they stay in BF16 (%s)", prefix)
    return None


def _ignored(config: NVFP4Config, prefix: str) -> bool:
    if not config.ignore:
        return False
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer

    return should_ignore_layer(prefix, ignore=config.ignore, fused_mapping=config.packed_modules_mapping)


# ---------------------------------------------------------------------------------------------------
# the method


@register_weight_loader_v2_supported_method
class QerlNVFP4LinearMethod(LinearMethodBase):
    """NVFP4 weights (E2M1 + FP8 group scales + FP32 global scale), BF16/FP16 activations."""

    def __init__(self, source: str, prefix: str = "", backend: Backend | None = None):
        if source not in ("bf16", "checkpoint"):
            raise ValueError(f"source must be 'bf16' or 'checkpoint', got {source!r}")
        self.source = source
        self.prefix = prefix
        self.backend = backend if backend is not None else select_backend()
        # BF16 checkpoints: weights are created on the meta device and processed layer by layer as they
        # load (vLLM's online-quantization path, like its online FP8 methods).
        self.uses_meta_device = source == "bf16"

    # -- create -------------------------------------------------------------------------------------

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        prefix = self.prefix or getattr(layer, "prefix", "") or type(layer).__name__
        k = input_size_per_partition
        n = sum(output_partition_sizes)
        if k % GROUP_SIZE:
            raise NVFP4Error(
                f"{prefix}: input size per partition {k} (input size {input_size}) is not divisible by the "
                f"NVFP4 group size {GROUP_SIZE}, so it cannot hold NVFP4 weights. Fix: add the module to the "
                "checkpoint's quantization_config 'ignore' list (re-run `qerl quantize --ignore ...`), or use a "
                "tensor-parallel size that splits the input dimension into multiples of 16."
            )
        if params_dtype not in (torch.bfloat16, torch.float16):
            raise NVFP4Error(
                f"{prefix}: nvfp4 runs BF16/FP16 activations, the model dtype is {params_dtype}; "
                "start vLLM with --dtype bfloat16"
            )
        weight_loader = extra_weight_attrs.get("weight_loader")
        layer.logical_widths = list(output_partition_sizes)
        layer.input_size_per_partition = k
        layer.output_size_per_partition = n
        layer.qerl_nvfp4 = new_layer_info(layer, prefix, self.source, output_partition_sizes, weight_loader)

        if self.source == "bf16":
            weight = ModelWeightParameter(
                data=torch.empty(n, k, dtype=params_dtype, device="meta"),
                input_dim=1,
                output_dim=0,
                weight_loader=checked_loader(layer, weight_loader, "weight"),
            )
            layer.register_parameter("weight", weight)
            from vllm.model_executor.model_loader.reload.layerwise import initialize_online_processing

            initialize_online_processing(layer)
            return

        packed = ModelWeightParameter(
            data=torch.empty(n, k // 2, dtype=torch.uint8),
            input_dim=1,
            output_dim=0,
            weight_loader=checked_loader(layer, weight_loader, "weight_packed"),
        )
        # NaN until loaded: a tensor missing from the checkpoint is reported, not silently used.
        scale = GroupQuantScaleParameter(
            data=torch.full((n, k // GROUP_SIZE), float("nan"), dtype=torch.float8_e4m3fn),
            input_dim=1,
            output_dim=0,
            weight_loader=checked_loader(layer, weight_loader, "weight_scale"),
        )
        gscale = PerTensorScaleParameter(
            data=torch.full((len(output_partition_sizes),), float("nan"), dtype=torch.float32),
            weight_loader=checked_loader(layer, weight_loader, "weight_global_scale"),
        )
        layer.register_parameter("weight_packed", packed)
        layer.register_parameter("weight_scale", scale)
        layer.register_parameter("weight_global_scale", gscale)

    # -- process ------------------------------------------------------------------------------------

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        info: LayerInfo = layer.qerl_nvfp4
        if is_nvfp4_layer(layer):
            if info.staged is not None:
                missing = [info.part_names[info.shard_ids.index(s)] for s in info.shard_ids if s not in info.staged_parts]
                raise NVFP4Error(
                    f"{info.prefix}: a base-weight reload sent only part of this fused layer (missing "
                    f"{missing}); its NVFP4 parts share one global scale, so send every part "
                    f"({info.part_names}) before processing"
                )
            return
        missing = [info.part_names[info.shard_ids.index(s)] for s in info.shard_ids if s not in info.loaded_parts]
        info.loaded_parts = set()
        name = "weight" if self.source == "bf16" else "weight_packed"
        if missing and not info.dummy:
            raise NVFP4Error(
                f"{info.prefix}: the checkpoint has no {name} for {missing}; check that the checkpoint matches "
                "the model architecture (config.json) and is complete"
            )
        if self.source == "bf16":
            weight = layer.weight
            if weight.is_meta:
                raise NVFP4Error(f"{info.prefix}.weight was never materialized; the checkpoint has no tensor for it")
            packed, scale, gscale = quantize_layer_weight(layer, weight.data)
        else:
            packed, scale, gscale = checkpoint_tensors(layer)
        bias = getattr(layer, "bias", None)
        info.raw_bias = None if bias is None else bias.data.detach().clone()
        for name in ("weight_packed",):
            if name in layer._parameters:
                delattr(layer, name)
        self.backend.install(layer, packed, scale, gscale, info.raw_bias)
        attach_reload_loaders(layer)

    # -- apply --------------------------------------------------------------------------------------

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.backend.apply(layer, x, bias)
