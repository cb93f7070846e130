"""Linear layers of the ``nvfp4`` quantization method: load, quantize, repack for Marlin, reload.

Life of one layer (``QerlNVFP4LinearMethod``):

1. ``create_weights`` registers the checkpoint-format tensors with validating loaders:
   a BF16 checkpoint gets a ``weight`` [N, K] on the meta device (vLLM's online-quantization path: the layer
   is materialized and processed as soon as all its shards have loaded, so at most one BF16 layer is
   resident); a compressed-tensors NVFP4A16 checkpoint gets ``weight_packed`` uint8 [N, K/2],
   ``weight_scale`` fp8 [N, K/16], ``weight_global_scale`` fp32 [parts] (NaN until loaded, so a missing
   tensor is reported instead of used).
2. ``process_weights_after_loading`` turns them into the NVFP4 triple (BF16: ``qerl_plugin.nvfp4``, one
   global scale per fused layer from the per-part amax, all-reduced over tensor-parallel ranks so every rank
   holds the bits of the unsharded ``quantize_fused``), then the backend installs its kernel tensors
   (``weight``, ``weight_scale``, ``weight_global_scale``, permuted ``bias``; flagged ``_qerl_kernel``).
   Running it again on an installed layer is a no-op.
3. Reloads keep every kernel tensor at its address (CUDA graphs stay valid):

   * vLLM's layerwise reload (``reload_weights``, weight-transfer engines with ``is_checkpoint_format``)
     restores the checkpoint-format tensors of step 1, loads, calls step 2 and copies the result into the
     kernel tensors; this works in the format the engine was started from.
   * ``model.load_weights(bf16 HF tensors)`` on an installed layer (verl's base sync) goes through the
     kernel ``weight``'s loader: the shards are staged in BF16 and, once every part of the fused layer has
     arrived, quantized and copied into the installed buffers (``bias`` likewise). This works for engines
     started from either checkpoint format.

Backends: ``marlin`` (CUDA, capability >= 7.5: vLLM's ``prepare_fp4_layer_for_marlin`` layout and
``apply_fp4_marlin_linear``) and ``emulation`` (dequantize + ``F.linear``; used where there is no CUDA, i.e.
CPU tests, or forced with ``QERL_NVFP4_BACKEND=emulation`` to debug). Its kernel ``weight`` is the
compressed-tensors packed uint8 tensor, so tests can read the bytes back.

Options, read when the layer is built, from vLLM's ``additional_config={"qerl_nvfp4": {...}}`` (part of
vLLM's compile-cache key, so prefer it) or else the environment:

* ``backend`` / ``QERL_NVFP4_BACKEND``: auto | marlin | emulation;
* ``fp32_reduce`` / ``QERL_NVFP4_FP32_REDUCE``: true (default, vLLM's choice) | false (Marlin reduces split-K
  partials in BF16). The value is baked into compiled graphs: when changing the environment variable,
  also set ``VLLM_DISABLE_COMPILE_CACHE=1`` (the ``additional_config`` key needs no such care).
"""

from __future__ import annotations

import logging
import os
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn import Parameter
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.parameter import (
    GroupQuantScaleParameter,
    ModelWeightParameter,
    PerTensorScaleParameter,
)
from vllm.platforms import current_platform

from qerl_plugin import nvfp4
from qerl_plugin.nvfp4 import GROUP_SIZE, NVFP4Error
from vllm_ext.quant import MIN_CAPABILITY, NVFP4Config

__all__ = [
    "EmulationBackend",
    "MarlinBackend",
    "QerlNVFP4LinearMethod",
    "get_quant_method",
    "is_nvfp4_layer",
    "kernel_tensors",
    "quantize_layer_weight",
]

logger = logging.getLogger("qerl.vllm.nvfp4")

BACKEND_ENV = "QERL_NVFP4_BACKEND"
FP32_REDUCE_ENV = "QERL_NVFP4_FP32_REDUCE"
KERNEL_FLAG = "_qerl_kernel"
_warned: set[str] = set()


def _warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


# ---------------------------------------------------------------------------------------------------
# dispatch


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
            _warn_once(
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
        _warn_once("moe", "nvfp4: MoE experts are not quantized while loading; they stay in BF16 (%s)", prefix)
    return None


def _ignored(config: NVFP4Config, prefix: str) -> bool:
    if not config.ignore:
        return False
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer

    return should_ignore_layer(prefix, ignore=config.ignore, fused_mapping=config.packed_modules_mapping)


CONFIG_KEY = "qerl_nvfp4"


def _option(name: str, env: str, default: str) -> str:
    """``additional_config["qerl_nvfp4"][name]`` of the current vLLM config, else ``$env``, else default."""
    try:
        from vllm.config import get_current_vllm_config

        extra = get_current_vllm_config().additional_config
    except Exception:  # no current config (layers built directly, e.g. in tests)
        extra = None
    opts = extra.get(CONFIG_KEY) if isinstance(extra, dict) else None
    if isinstance(opts, dict) and name in opts:
        return str(opts[name]).strip().lower()
    return os.environ.get(env, default).strip().lower()


def _select_backend() -> Backend:
    choice = _option("backend", BACKEND_ENV, "auto")
    if choice not in ("auto", "marlin", "emulation"):
        raise NVFP4Error(f"nvfp4 option backend={choice!r} ({BACKEND_ENV} or additional_config): expected auto, marlin or emulation")
    if choice == "emulation":
        return EmulationBackend()
    if choice == "auto" and not current_platform.is_cuda():
        _warn_once(
            "emulation",
            "nvfp4: no CUDA device; NVFP4 layers run in emulation (dequantize + BF16 matmul on every call) "
            "- fine for tests, far too slow to serve"
        )
        return EmulationBackend()
    return MarlinBackend()


# ---------------------------------------------------------------------------------------------------
# per-layer bookkeeping


@dataclass
class _LayerInfo:
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


def _covered(info: _LayerInfo, shard_id: Any) -> set[Any]:
    if shard_id is None:
        return set(info.shard_ids)
    if isinstance(shard_id, tuple):
        return set(shard_id)
    return {shard_id}


def _part_label(info: _LayerInfo, shard_id: Any) -> str:
    if shard_id is None or info.shard_ids == [None]:
        return info.prefix
    if isinstance(shard_id, tuple):
        return ", ".join(_part_label(info, s) for s in shard_id)
    return info.part_names[info.shard_ids.index(shard_id)]


def _bound(layer: torch.nn.Module, fn: Callable[..., Any]) -> types.MethodType:
    """``fn(layer, ...)`` bound to ``layer`` as a method, so vLLM's reload bookkeeping (which rebinds weight
    loaders whose ``__self__`` is the layer) does not keep layers alive through a closure."""
    return types.MethodType(fn, layer)


def _is_dummy_load() -> bool:
    try:
        from vllm.config import get_current_vllm_config

        return str(get_current_vllm_config().load_config.load_format) == "dummy"
    except Exception:  # no current config (direct layer construction in tests)
        return False


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
        self.backend = backend if backend is not None else _select_backend()
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
        shard_ids = _shard_ids(layer)
        if len(shard_ids) != len(output_partition_sizes):
            shard_ids = [None] if len(output_partition_sizes) == 1 else list(range(len(output_partition_sizes)))
        quant_config = getattr(layer, "quant_config", None)
        mapping = getattr(quant_config, "packed_modules_mapping", {}) or {}
        func = getattr(weight_loader, "__func__", None) if getattr(weight_loader, "__self__", None) is layer else None
        layer.qerl_nvfp4 = _LayerInfo(
            prefix=prefix,
            source=self.source,
            shard_ids=shard_ids,
            part_names=_part_names(layer, prefix, shard_ids, mapping),
            tp_reduce=getattr(layer, "tp_size", 1) > 1 and not isinstance(layer, ReplicatedLinear),
            dummy=_is_dummy_load(),
            loader=func,
        )

        if self.source == "bf16":
            weight = ModelWeightParameter(
                data=torch.empty(n, k, dtype=params_dtype, device="meta"),
                input_dim=1,
                output_dim=0,
                weight_loader=_checked_loader(layer, weight_loader, "weight"),
            )
            layer.register_parameter("weight", weight)
            from vllm.model_executor.model_loader.reload.layerwise import initialize_online_processing

            initialize_online_processing(layer)
            return

        packed = ModelWeightParameter(
            data=torch.empty(n, k // 2, dtype=torch.uint8),
            input_dim=1,
            output_dim=0,
            weight_loader=_checked_loader(layer, weight_loader, "weight_packed"),
        )
        # NaN until loaded: a tensor missing from the checkpoint is reported, not silently used.
        scale = GroupQuantScaleParameter(
            data=torch.full((n, k // GROUP_SIZE), float("nan"), dtype=torch.float8_e4m3fn),
            input_dim=1,
            output_dim=0,
            weight_loader=_checked_loader(layer, weight_loader, "weight_scale"),
        )
        gscale = PerTensorScaleParameter(
            data=torch.full((len(output_partition_sizes),), float("nan"), dtype=torch.float32),
            weight_loader=_checked_loader(layer, weight_loader, "weight_global_scale"),
        )
        layer.register_parameter("weight_packed", packed)
        layer.register_parameter("weight_scale", scale)
        layer.register_parameter("weight_global_scale", gscale)

    # -- process ------------------------------------------------------------------------------------

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        info: _LayerInfo = layer.qerl_nvfp4
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
            packed, scale, gscale = _checkpoint_tensors(layer)
        bias = getattr(layer, "bias", None)
        info.raw_bias = None if bias is None else bias.data.detach().clone()
        for name in ("weight_packed",):
            if name in layer._parameters:
                delattr(layer, name)
        self.backend.install(layer, packed, scale, gscale, info.raw_bias)
        _attach_reload_loaders(layer)

    # -- apply --------------------------------------------------------------------------------------

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.backend.apply(layer, x, bias)


# ---------------------------------------------------------------------------------------------------
# loading: validation of checkpoint tensors


def _checked_loader(layer: torch.nn.Module, loader: Callable[..., Any] | None, name: str) -> Callable[..., Any]:
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
        _check_loaded(self, name, loaded_weight, shard_id)
        if name in ("weight", "weight_packed"):
            info = self.qerl_nvfp4
            info.loaded_parts |= _covered(info, shard_id)
        if func is not None:
            return func(self, param, loaded_weight, *args, **kwargs)
        return other(param, loaded_weight, *args, **kwargs)

    return _bound(layer, weight_loader)


def _check_loaded(layer: torch.nn.Module, name: str, t: torch.Tensor, shard_id: Any) -> None:
    info: _LayerInfo = layer.qerl_nvfp4
    what = f"{_part_label(info, shard_id)}.{name}"
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


def _shape_fits(layer: torch.nn.Module, info: _LayerInfo, shard_id: Any, shape: tuple[int, ...], expected: tuple) -> bool:
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


def _checkpoint_tensors(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loaded compressed-tensors triple, checked; global scale returned as fp32 [1]."""
    info: _LayerInfo = layer.qerl_nvfp4
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
# quantization while loading (BF16 source)


def quantize_layer_weight(
    layer: torch.nn.Module, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 triple of this rank's ``weight`` [N, K]: the bytes of ``quantize_fused`` on the unsharded parts.

    The fused parts share ``global_scale(max amax)``; the amax is all-reduced over the tensor-parallel group
    when the weight is split across ranks, so sharded and unsharded loads give the same bits.
    """
    info: _LayerInfo = layer.qerl_nvfp4
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


# ---------------------------------------------------------------------------------------------------
# kernel tensors


def is_nvfp4_layer(layer: torch.nn.Module) -> bool:
    """True when ``layer`` holds installed NVFP4 kernel tensors."""
    return bool(getattr(layer._parameters.get("weight"), KERNEL_FLAG, False)) if hasattr(layer, "_parameters") else False


def kernel_tensors(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The installed kernel tensors of an NVFP4 layer (``weight``, ``weight_scale``, ... and ``bias``)."""
    return {n: p for n, p in layer._parameters.items() if p is not None and getattr(p, KERNEL_FLAG, False)}


def _set_kernel(layer: torch.nn.Module, name: str, value: torch.Tensor) -> Parameter:
    """Install ``value`` as kernel tensor ``name``: copied into the existing buffer when there is one."""
    current = layer._parameters.get(name)
    if current is not None and getattr(current, KERNEL_FLAG, False):
        if current.shape != value.shape or current.dtype != value.dtype:
            raise NVFP4Error(
                f"{layer.qerl_nvfp4.prefix}.{name}: the reloaded weights give a {value.dtype} "
                f"{tuple(value.shape)} kernel tensor, the running one is {current.dtype} {tuple(current.shape)}; "
                "CUDA graphs hold the old buffer, so shapes cannot change - restart the engine"
            )
        current.data.copy_(value)
        return current
    if name in layer._parameters:
        delattr(layer, name)
    param = Parameter(value, requires_grad=False)
    setattr(param, KERNEL_FLAG, True)
    layer.register_parameter(name, param)
    return param


class Backend:
    name = "?"

    def install(self, layer, packed, scale, gscale, raw_bias) -> None:  # noqa: ANN001
        raise NotImplementedError

    def refresh_bias(self, layer: torch.nn.Module, raw_bias: torch.Tensor) -> None:
        raise NotImplementedError

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class EmulationBackend(Backend):
    """Kernel tensors = the compressed-tensors triple (``weight`` = packed uint8); dequantize per call."""

    name = "emulation"

    def install(self, layer, packed, scale, gscale, raw_bias) -> None:  # noqa: ANN001
        _set_kernel(layer, "weight", packed)
        _set_kernel(layer, "weight_scale", scale)
        _set_kernel(layer, "weight_global_scale", gscale.reshape(1).to(torch.float32))
        if raw_bias is not None:
            _set_kernel(layer, "bias", raw_bias)

    def refresh_bias(self, layer: torch.nn.Module, raw_bias: torch.Tensor) -> None:
        _set_kernel(layer, "bias", raw_bias)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = nvfp4.dequantize(layer.weight, layer.weight_scale, layer.weight_global_scale, dtype=x.dtype)
        return F.linear(x, w.to(x.device), bias)


class MarlinBackend(Backend):
    """vLLM's Marlin FP4 layout (``prepare_fp4_layer_for_marlin``) and GEMM (``apply_fp4_marlin_linear``)."""

    name = "marlin"

    def __init__(self, fp32_reduce: bool | None = None):
        if not current_platform.is_cuda():
            raise NVFP4Error(
                "nvfp4's Marlin FP4 kernel needs an NVIDIA GPU (compute capability >= 7.5); this platform is "
                f"{getattr(current_platform, 'device_name', '?')!r}. Serve the BF16 checkpoint without "
                f"--quantization, or set {BACKEND_ENV}=emulation for a (slow) functional check"
            )
        cap = current_platform.get_device_capability()
        if cap is not None and cap.to_int() < MIN_CAPABILITY:
            raise NVFP4Error(
                f"nvfp4's Marlin FP4 kernel needs compute capability >= {MIN_CAPABILITY / 10:.1f} (Turing or "
                f"newer, tuned for Hopper); this GPU is {cap.major}.{cap.minor}. Serve the BF16 checkpoint "
                "without --quantization on this GPU"
            )
        if fp32_reduce is None:
            value = _option("fp32_reduce", FP32_REDUCE_ENV, "1")
            if value not in ("1", "0", "true", "false"):
                raise NVFP4Error(f"nvfp4 option fp32_reduce={value!r}: expected true/false (or 1/0)")
            fp32_reduce = value in ("1", "true")
        self.fp32_reduce = fp32_reduce

    @staticmethod
    def _marlin(layer, packed, scale, gscale, raw_bias) -> torch.nn.Module:  # noqa: ANN001
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import prepare_fp4_layer_for_marlin

        scratch = torch.nn.Module()
        scratch.weight = Parameter(packed, requires_grad=False)
        scratch.weight_scale = Parameter(scale, requires_grad=False)
        # compressed-tensors stores the divisor 448*6/amax; Marlin takes its inverse (as vLLM's CT scheme).
        scratch.weight_global_scale = Parameter(1.0 / gscale.max().to(torch.float32), requires_grad=False)
        scratch.bias = None if raw_bias is None else Parameter(raw_bias.clone(), requires_grad=False)
        scratch.params_dtype = layer.params_dtype
        scratch.output_size_per_partition = layer.output_size_per_partition
        scratch.input_size_per_partition = layer.input_size_per_partition
        prepare_fp4_layer_for_marlin(scratch)
        return scratch

    @staticmethod
    def _fused_bias(layer: torch.nn.Module) -> bool:
        # Marlin adds a bias in its own (permuted) order. A layer with skip_bias_add returns its bias to the
        # caller, who adds it in natural order: keep that one raw and out of the GEMM.
        return not getattr(layer, "skip_bias_add", False)

    def install(self, layer, packed, scale, gscale, raw_bias) -> None:  # noqa: ANN001
        fused = raw_bias is not None and self._fused_bias(layer)
        m = self._marlin(layer, packed, scale, gscale, raw_bias if fused else None)
        _set_kernel(layer, "weight", m.weight.data)
        _set_kernel(layer, "weight_scale", m.weight_scale.data)
        _set_kernel(layer, "weight_global_scale", m.weight_global_scale.data)
        if raw_bias is not None:
            _set_kernel(layer, "bias", m.bias.data if fused else raw_bias)
        if getattr(layer, "workspace", None) is None:
            layer.workspace = m.workspace  # plain attribute: kept (not re-created) across reloads

    def refresh_bias(self, layer: torch.nn.Module, raw_bias: torch.Tensor) -> None:
        from vllm.model_executor.layers.quantization.utils.marlin_utils import (
            marlin_pad_dim,
            marlin_padded_nk,
            marlin_permute_bias,
        )

        if not self._fused_bias(layer):
            _set_kernel(layer, "bias", raw_bias)
            return
        n = layer.output_size_per_partition
        padded_n, _ = marlin_padded_nk(n, layer.input_size_per_partition, GROUP_SIZE)
        _set_kernel(layer, "bias", marlin_permute_bias(marlin_pad_dim(raw_bias, n, padded_n)))

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import apply_fp4_marlin_linear

        return apply_fp4_marlin_linear(
            input=x,
            weight=layer.weight,
            weight_scale=layer.weight_scale,
            weight_global_scale=layer.weight_global_scale,
            workspace=layer.workspace,
            size_n=layer.output_size_per_partition,
            size_k=layer.input_size_per_partition,
            bias=bias,
            use_fp32_reduce=self.fp32_reduce,
        )


# ---------------------------------------------------------------------------------------------------
# reload through model.load_weights on an installed layer (verl's base-weight sync)


def _attach_reload_loaders(layer: torch.nn.Module) -> None:
    layer.weight.weight_loader = _bound(layer, _stage_weight)
    for name in ("weight_scale", "weight_global_scale"):
        getattr(layer, name).weight_loader = _bound(layer, _refuse_kernel_load)
    if getattr(layer, "bias", None) is not None:
        layer.bias.weight_loader = _bound(layer, _reload_bias)


def _stage_weight(layer: torch.nn.Module, param: torch.Tensor, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """Collect BF16 parts of this (installed) layer; re-quantize into the same buffers once all arrived."""
    info: _LayerInfo = layer.qerl_nvfp4
    shard_id = args[0] if args else kwargs.get("loaded_shard_id")
    if loaded_weight.dtype == torch.uint8:
        raise NVFP4Error(
            f"{_part_label(info, shard_id)}: got packed NVFP4 bytes for a base-weight reload into a running "
            "engine; send BF16 weights (they are quantized here), or reload NVFP4A16 checkpoint tensors through "
            "vLLM's reload_weights (layerwise reload)"
        )
    _check_loaded(layer, "weight", loaded_weight, shard_id)
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
    info.staged_parts |= _covered(info, shard_id)
    if info.staged_parts >= set(info.shard_ids):
        staged, info.staged, info.staged_parts = info.staged, None, set()
        packed, scale, gscale = quantize_layer_weight(layer, staged.data)
        del staged
        layer.quant_method.backend.install(layer, packed, scale, gscale, info.raw_bias)


def _reload_bias(layer: torch.nn.Module, param: torch.Tensor, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """Load a (part of a) BF16 bias into the raw copy, then refresh the kernel's (permuted) bias."""
    info: _LayerInfo = layer.qerl_nvfp4
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
