"""Base-weight reloads through ``model.load_weights`` into an installed ``nvfp4`` layer (verl's weight sync).

The installed kernel tensors get these loaders: BF16 parts of the fused layer are staged and, once every part
has arrived, quantized and copied into the same buffers (CUDA graphs stay valid); the bias likewise. Packed
or kernel-layout tensors are refused: they go through vLLM's layerwise ``reload_weights`` instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Parameter
from vllm.model_executor.parameter import ModelWeightParameter

from qerl_plugin.nvfp4 import NVFP4Error
from vllm_ext.nvfp4_load import LayerInfo, bound, check_loaded, covered, part_label, quantize_layer_weight

__all__ = ["attach_reload_loaders"]


def attach_reload_loaders(layer: torch.nn.Module) -> None:
    """Give the installed kernel tensors of ``layer`` the loaders of a base-weight reload."""
    layer.weight.weight_loader = bound(layer, _stage_weight)
    for name in ("weight_scale", "weight_global_scale"):
        getattr(layer, name).weight_loader = bound(layer, _refuse_kernel_load)
    if getattr(layer, "bias", None) is not None:
        layer.bias.weight_loader = bound(layer, _reload_bias)


def _stage_weight(layer: torch.nn.Module, param: torch.Tensor, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """Collect BF16 parts of this (installed) layer; re-quantize into the same buffers once all arrived."""
    info: LayerInfo = layer.qerl_nvfp4
    shard_id = args[0] if args else kwargs.get("loaded_shard_id")
    if loaded_weight.dtype == torch.uint8:
        raise NVFP4Error(
            f"{part_label(info, shard_id)}: got packed NVFP4 bytes for a base-weight reload into a running "
            "engine; send BF16 weights (they are quantized here), or reload NVFP4A16 checkpoint tensors through "
            "vLLM's reload_weights (layerwise reload)"
        )
    check_loaded(layer, "weight", loaded_weight, shard_id)
    if info.staged is None:
        n, k = layer.output_size_per_partition, layer.input_size_per_partition
        staged = ModelWeightParameter(
            data=torch.empty(n, k, dtype=layer.params_dtype, device=param.device),
            input_dim=1,
            output_dim=0,
            weight_loader=_refuse_kernel_load,
        )
        staged.tp_rank, staged.tp_size = layer.tp_rank, layer.tp_size
        info.staged, info.staged_parts = staged, set()
    if info.loader is None:
        raise NVFP4Error(f"{info.prefix}: cannot reload base weights: the layer's weight loader is unknown")
    info.loader(layer, info.staged, loaded_weight, *args, **kwargs)
    info.staged_parts |= covered(info, shard_id)
    if info.staged_parts >= set(info.shard_ids):
        staged, info.staged, info.staged_parts = info.staged, None, set()
        packed, scale, gscale = quantize_layer_weight(layer, staged.data)
        del staged
        layer.quant_method.backend.install(layer, packed, scale, gscale, info.raw_bias)


def _reload_bias(layer: torch.nn.Module, param: torch.Tensor, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """Load a (part of a) BF16 bias into the raw copy, then refresh the kernel's (permuted) bias."""
    info: LayerInfo = layer.qerl_nvfp4
    raw = Parameter(info.raw_bias, requires_grad=False)
    raw.output_dim = 0
    type(layer).weight_loader(layer, raw, loaded_weight, *args, **kwargs)
    layer.quant_method.backend.refresh_bias(layer, info.raw_bias)


def _refuse_kernel_load(layer: Any, *args: Any, **kwargs: Any) -> None:
    prefix = getattr(getattr(layer, "qerl_nvfp4", None), "prefix", "an nvfp4 layer")
    raise NVFP4Error(
        f"{prefix}: its NVFP4 tensors are in Marlin kernel layout and cannot be overwritten by "
        "model.load_weights; reload BF16 weights (quantized on arrival) or use vLLM's reload_weights"
    )
