"""Loading an ``nvfp4`` layer: per-layer bookkeeping, checks of every arriving tensor, and the NVFP4 triple
from either source (checkpoint tensors checked, or BF16 weights quantized with :mod:`qerl_plugin.nvfp4`).

Errors name the tensor (``model.layers.0.self_attn.k_proj.weight_scale``) and the fix, because a wrong
checkpoint otherwise shows up as garbage output much later.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
)
from vllm.model_executor.parameter import ModelWeightParameter

from qerl_plugin import nvfp4
from qerl_plugin.nvfp4 import GROUP_SIZE, NVFP4Error

__all__ = [
    "LayerInfo",
    "bound",
    "check_loaded",
    "checked_loader",
    "checkpoint_tensors",
    "covered",
    "new_layer_info",
    "part_label",
    "quantize_layer_weight",
]


@dataclass
class LayerInfo:
    """What the method knows about one layer, kept as ``layer.qerl_nvfp4``."""

    prefix: str
    source: str  # "bf16" | "checkpoint"
    shard_ids: list[Any]  # ["q", "k", "v"] | [0, 1] | [None]
    part_names: list[str]
    tp_reduce: bool  # the weight is split over tensor-parallel ranks: all-reduce the amax
    dummy: bool  # load_format=dummy: values are random, skip value checks
    loader: Callable[..., Any] | None  # the layer's own weight-loader function (unbound)
    loaded_parts: set[Any] = field(default_factory=set)  # parts whose weight arrived since the last process
    staged: ModelWeightParameter | None = None
    staged_parts: set[Any] = field(default_factory=set)
    raw_bias: torch.Tensor | None = None


def _shard_ids(layer: torch.nn.Module) -> list[Any]:
    if isinstance(layer, QKVParallelLinear):
        return ["q", "k", "v"]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(range(len(layer.output_sizes)))
    return [None]


def _part_names(layer: torch.nn.Module, prefix: str, shard_ids: list[Any], mapping: dict[str, list[str]]) -> list[str]:
    head, _, last = prefix.rpartition(".")
    parts = mapping.get(last)
    if parts and len(parts) == len(shard_ids):
        return [f"{head}.{p}" if head else p for p in parts]
    if shard_ids == [None]:
        return [prefix]
    return [f"{prefix}[{s}]" for s in shard_ids]


def _expected_rows(layer: torch.nn.Module, shard_id: Any) -> int | None:
    """Rows of the full (unsharded) checkpoint tensor for ``shard_id``; ``None`` when unknown."""
    if isinstance(layer, QKVParallelLinear):
        q = layer.total_num_heads * layer.head_size
        k = layer.total_num_kv_heads * layer.head_size
        v = layer.total_num_kv_heads * layer.v_head_size
        return {"q": q, "k": k, "v": v, None: q + k + v}.get(shard_id)
    if isinstance(layer, MergedColumnParallelLinear):
        if shard_id is None:
            return sum(layer.output_sizes)
        if isinstance(shard_id, tuple):
            return sum(layer.output_sizes[i] for i in shard_id)
        return layer.output_sizes[shard_id]
    return layer.output_size


def covered(info: LayerInfo, shard_id: Any) -> set[Any]:
    """The parts that a load with ``shard_id`` writes (``None``: all of them)."""
    if shard_id is None:
        return set(info.shard_ids)
    if isinstance(shard_id, tuple):
        return set(shard_id)
    return {shard_id}


def part_label(info: LayerInfo, shard_id: Any) -> str:
    """The checkpoint name(s) of the part(s) ``shard_id`` refers to, for messages."""
    if shard_id is None or info.shard_ids == [None]:
        return info.prefix
    if isinstance(shard_id, tuple):
        return ", ".join(part_label(info, s) for s in shard_id)
    return info.part_names[info.shard_ids.index(shard_id)]


def bound(layer: torch.nn.Module, fn: Callable[..., Any]) -> types.MethodType:
    """``fn(layer, ...)`` bound to ``layer`` as a method, so vLLM's reload bookkeeping (which rebinds weight
    loaders whose ``__self__`` is the layer) does not keep layers alive through a closure."""
    return types.MethodType(fn, layer)


def _is_dummy_load() -> bool:
    try:
        from vllm.config import get_current_vllm_config

        return str(get_current_vllm_config().load_config.load_format) == "dummy"
    except Exception:  # no current config (direct layer construction in tests)
        return False


def new_layer_info(
    layer: torch.nn.Module, prefix: str, source: str, output_partition_sizes: list[int], weight_loader: Any
) -> LayerInfo:
    """The bookkeeping of a layer being created (``create_weights``): its parts, names and loader."""
    shard_ids = _shard_ids(layer)
    if len(shard_ids) != len(output_partition_sizes):
        shard_ids = [None] if len(output_partition_sizes) == 1 else list(range(len(output_partition_sizes)))
    quant_config = getattr(layer, "quant_config", None)
    mapping = getattr(quant_config, "packed_modules_mapping", {}) or {}
    func = getattr(weight_loader, "__func__", None) if getattr(weight_loader, "__self__", None) is layer else None
    return LayerInfo(
        prefix=prefix,
        source=source,
        shard_ids=shard_ids,
        part_names=_part_names(layer, prefix, shard_ids, mapping),
        tp_reduce=getattr(layer, "tp_size", 1) > 1 and not isinstance(layer, ReplicatedLinear),
        dummy=_is_dummy_load(),
        loader=func,
    )


# ---------------------------------------------------------------------------------------------------
# checks of the tensors as they arrive


def checked_loader(layer: torch.nn.Module, loader: Callable[..., Any] | None, name: str) -> Callable[..., Any]:
    """Wrap the layer's weight loader with a check of dtype and shape that names the tensor and the fix."""
    if loader is None:
        raise NVFP4Error(f"{getattr(layer, 'prefix', '?')}: no weight_loader passed to create_weights")
    if getattr(loader, "__self__", None) is layer:
        # keep the unbound function: a closure over the bound method would keep the layer alive
        func, other = loader.__func__, None
    else:
        func, other = None, loader

    def weight_loader(self: torch.nn.Module, param: torch.Tensor, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any):
        shard_id = args[0] if args else kwargs.get("loaded_shard_id")
        check_loaded(self, name, loaded_weight, shard_id)
        if name in ("weight", "weight_packed"):
            info = self.qerl_nvfp4
            info.loaded_parts |= covered(info, shard_id)
        if func is not None:
            return func(self, param, loaded_weight, *args, **kwargs)
        return other(param, loaded_weight, *args, **kwargs)

    return bound(layer, weight_loader)


def check_loaded(layer: torch.nn.Module, name: str, t: torch.Tensor, shard_id: Any) -> None:
    """Refuse a tensor ``name`` (part ``shard_id``) whose dtype or shape cannot belong to this layer."""
    info: LayerInfo = layer.qerl_nvfp4
    what = f"{part_label(info, shard_id)}.{name}"
    if not isinstance(shard_id, (str, int, tuple, type(None))):
        return
    rows = _expected_rows(layer, shard_id)
    k = layer.input_size
    if name == "weight_global_scale":
        if not t.is_floating_point() or t.element_size() == 1:
            raise NVFP4Error(f"{what}: expected a float32 global scale, got {t.dtype}; the checkpoint is not NVFP4A16")
        if t.numel() != 1:
            raise NVFP4Error(
                f"{what}: expected one global scale per weight (shape [1]), got shape {tuple(t.shape)}; "
                "the checkpoint is not in compressed-tensors nvfp4-pack-quantized format"
            )
        return
    if name == "weight":  # BF16 source
        if not t.is_floating_point() or t.element_size() == 1:
            raise NVFP4Error(
                f"{what}: expected a bf16/fp16/fp32 weight to quantize, got {t.dtype}; `--quantization nvfp4` "
                "quantizes BF16 checkpoints while loading and reads NVFP4A16 checkpoints as stored - this "
                "checkpoint is neither"
            )
        expected = (rows, k)
    elif name == "weight_packed":
        if t.dtype != torch.uint8:
            raise NVFP4Error(
                f"{what}: expected uint8 (two E2M1 codes per byte), got {t.dtype}; re-export the checkpoint "
                "with `qerl quantize` (compressed-tensors nvfp4-pack-quantized)"
            )
        expected = (rows, k // 2)
    elif name == "weight_scale":
        if t.dtype != torch.float8_e4m3fn:
            raise NVFP4Error(
                f"{what}: expected float8_e4m3fn group scales, got {t.dtype} (a cast would change the bits); "
                "re-export the checkpoint with `qerl quantize`"
            )
        expected = (rows, k // GROUP_SIZE)
    else:
        return
    if t.dim() == 2 and _shape_fits(layer, info, shard_id, tuple(t.shape), expected):
        return
    per = {"weight": "[out, in]", "weight_packed": "[out, in/2]", "weight_scale": "[out, in/16]"}[name]
    raise NVFP4Error(
        f"{what}: shape {tuple(t.shape)} does not fit this layer (in={k}"
        + (f", out={rows}" if rows is not None else "")
        + f"): expected {per} = {expected}. The checkpoint does not match the model config "
        "(wrong architecture/config.json, or a truncated or mis-packed NVFP4 export)"
    )


def _shape_fits(layer: torch.nn.Module, info: LayerInfo, shard_id: Any, shape: tuple[int, ...], expected: tuple) -> bool:
    rows, cols = expected
    if shape == expected or (rows is None and shape[1] == cols):
        return True
    # already-sharded tensors (e.g. sharded_state checkpoints): this rank's partition
    per_in = cols * layer.input_size_per_partition // layer.input_size
    if shard_id is None or info.shard_ids == [None]:
        part_rows = layer.output_size_per_partition
    else:
        ids = shard_id if isinstance(shard_id, tuple) else (shard_id,)
        part_rows = sum(layer.logical_widths[info.shard_ids.index(i)] for i in ids if i in info.shard_ids)
    return shape in ((part_rows, cols), (rows, per_in), (part_rows, per_in))


def checkpoint_tensors(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loaded compressed-tensors triple, checked; global scale returned as fp32 [1]."""
    info: LayerInfo = layer.qerl_nvfp4
    packed = layer.weight_packed.data
    scale = layer.weight_scale.data
    gscale = layer.weight_global_scale.data.to(torch.float32)
    if info.dummy:
        return packed, scale, gscale.abs().amax().clamp_min(1e-12).reshape(1)
    names = info.part_names
    missing = [names[i] for i in range(gscale.numel()) if bool(torch.isnan(gscale[i]))]
    if missing:
        raise NVFP4Error(
            f"{info.prefix}: the checkpoint has no weight_global_scale for {missing}; an NVFP4A16 checkpoint "
            "stores weight_packed, weight_scale and weight_global_scale for every quantized module - "
            "re-export it with `qerl quantize`"
        )
    if not bool(torch.isfinite(gscale).all()) or bool((gscale <= 0).any()):
        raise NVFP4Error(f"{info.prefix}: weight_global_scale {gscale.tolist()} must be finite and > 0; the checkpoint is corrupt")
    if gscale.numel() > 1 and not bool((gscale == gscale[0]).all()):
        raise NVFP4Error(
            f"{info.prefix}: the fused parts {names} have different weight_global_scale values "
            f"{gscale.tolist()}; the Marlin kernel applies one global scale per fused layer, so this checkpoint "
            "would decode to wrong weights. Fix: re-quantize with `qerl quantize` (shares the scale across "
            "q/k/v and gate/up, as llmcompressor does), or serve it without --quantization nvfp4"
        )
    s32 = scale.to(torch.float32)
    if bool(torch.isnan(s32).any()):
        rows = torch.isnan(s32).any(dim=1).nonzero().flatten()
        raise NVFP4Error(
            f"{info.prefix}: weight_scale is missing or NaN for {rows.numel()} output rows (first row "
            f"{int(rows[0])}); the checkpoint lacks weight_scale for a part or is corrupt - re-export it"
        )
    if bool((s32 < 0).any()):
        raise NVFP4Error(
            f"{info.prefix}: weight_scale has negative values; NVFP4 group scales are amax/6 >= 0 and the "
            "Marlin kernel relies on it. The checkpoint was not produced by an NVFP4 quantizer - re-export it"
        )
    return packed, scale, gscale[:1].clone()


# ---------------------------------------------------------------------------------------------------
# BF16 source: quantization while loading


def quantize_layer_weight(
    layer: torch.nn.Module, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 triple of this rank's ``weight`` [N, K]: the bytes of ``quantize_fused`` on the unsharded parts.

    The fused parts share ``global_scale(max amax)``; the amax is all-reduced over the tensor-parallel group
    when the weight is split across ranks, so sharded and unsharded loads give the same bits.
    """
    info: LayerInfo = layer.qerl_nvfp4
    parts = torch.split(weight, list(layer.logical_widths), dim=0)
    for part, name in zip(parts, info.part_names):
        nvfp4.check_weight(part, name)
    amax = torch.stack([part.abs().amax() for part in parts]).amax().reshape(1)  # in the weight's dtype
    if info.tp_reduce:
        from vllm.distributed import get_tp_group

        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=get_tp_group().device_group)
    gscale = nvfp4.global_scale(amax)  # == global_scale(*unsharded parts)
    q = nvfp4.quantize(weight, gscale, name=info.prefix)
    return q.packed, q.scale, q.global_scale
