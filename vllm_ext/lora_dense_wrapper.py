"""The punica wrapper that :func:`vllm_ext.lora_dense.register` names: vLLM's GPU one, with qerl's single-adapter
paths (``additional_config={"qerl_lora": "overlap" | "fused" | "dense"}``; ``overlap`` is the default).

Imported by vLLM when it builds the LoRA manager of an engine (it subclasses vLLM's GPU punica wrapper, whose
import loads vLLM's LoRA layers), never at plugin registration.

vLLM 0.24's packed column-parallel LoRA layers (q/k/v and gate/up: ``MergedQKVParallelLinearWithLoRA``,
``MergedColumnParallelLinearWithLoRA``) do not call the wrapper's ``add_lora_linear``: their ``apply`` runs
``column_parallel_linear._mcp_apply``, which calls ``add_shrink`` and ``add_expand`` (the route fully sharded
LoRA and tensor parallelism need). On one GPU without sharded LoRA that is the base GEMM plus ``add_lora_linear``
with scale 1, so :func:`route_merged_layers` sends those layers there when their wrapper runs a qerl mode (until
2026-11-24's eighth session it did not, and only o_proj and down_proj took the qerl paths).

The ``fused`` path goes through one torch op, ``qerl::lora_linear_fused``, because vLLM compiles the model with
torch.compile and a symbolic token count: a Python ``if tokens <= 64`` in the wrapper would be decided once,
when the model is traced (with thousands of tokens), and bake punica into every graph. The op decides per
call instead, when it runs (eagerly, or while vLLM captures a CUDA graph for one batch size): at most
:data:`vllm_ext.lora_fused.MAX_TOKENS` tokens take the one-launch kernel, more take punica.

The ``overlap`` path (``additional_config={"qerl_lora": "overlap"}``) runs the same kernel on a second CUDA stream,
beside the layer's base GEMM instead of after it: one op, ``qerl::linear_lora_overlap``, computes the base GEMM
on the current stream while the kernel writes the update into a scratch tensor on the side stream, joins, and
adds (``y + round(update)``: the bits ``fused`` gives). By default (``QERL_LORA_SPLIT_ADD``, unset or 1; §4ag,
§4ah) the add is the model's for o, down and gate/up: ``qerl::linear_lora_overlap_split`` returns ``(y, update)``
and the traced ``y + update`` is fused by torch.compile into the kernel that reads the output next, instead of an
add kernel per linear (112 per 7B step, 0.14 ms at batch 8 on an H200); the 7B engine decoded 2.1-2.6 % faster at
batch 1, 8 and 64 (one H200 run, §4ah). ``QERL_LORA_SPLIT_ADD=0`` keeps every add inside the op. At decode the
kernel is latency-bound (5-7 us per linear, §4v) and the 4-bit GEMM bandwidth-bound, so the two can share the GPU.
Calls of more than 64 tokens run the base GEMM and punica one after the other, as ``fused`` does. vLLM's own
``VLLM_LORA_ENABLE_DUAL_STREAM`` does the same with punica's three launches (and a zero-filled buffer) for every
call size; it is a process-wide switch.
In an engine with ``decode_gemv`` on, one-row calls take neither: :mod:`vllm_ext.nvfp4_gemv_lora` runs a small
shrink kernel, then the one-row NVFP4 kernel with the LoRA expand in its epilogue, as a programmatic dependent
launch on Hopper (the ``row+lora`` path; §4m on an H200: 2.229 against 2.774 ms per 7B step for the LoRA kernel
after the row kernel, which is itself faster than beside it; +16.2 % batch-1 decode in the engine).
With ``QERL_FEW_ROW_LORA=1`` (experimental, default off), calls of 2 to 8 tokens of layers with decode_gemv's copy run
the ``gluon+lora`` path instead: :mod:`vllm_ext.nvfp4_gluon_lora`, the Gluon few-row GEMM with the expand in its
epilogue (+2.5 % at 7B batch 8 on an H200, docs/benchmarks.md §4av).
The op finds its layer by the layer's name (``base_layer.prefix``), registered when the LoRA manager hands the
layer its wrapper (:func:`route_merged_layers` wraps ``BaseLayerWithLoRA.set_mapping``): a name, unlike an
``id()``, means the same layer in the process that loads vLLM's AOT-compiled graph from its cache. Two engines in
one process register the same names, so the op also takes the layer's first LoRA-A tensor, which the compiled
graph passes in from the calling engine's own module, and picks the registered layer that holds that tensor.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref

import torch
from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU
from vllm.model_executor.layers.linear import QKVParallelLinear

from qerl_plugin import notices
from qerl_plugin.options import FEW_ROW_LORA_ENV, FEW_ROW_LORA_MAX_TOKENS, LORA_SPLIT_ADD_ENV, parse_bool
from vllm_ext import lora_fused, nvfp4_gemv_lora, nvfp4_gluon_lora
from vllm_ext.lora_dense import dense_lora_linear, requested_mode
from vllm_ext.triton_support import interpreting as _interpreting

__all__ = ["FUSED_OP", "LINEAR_APPLY_TARGET", "MERGED_APPLY_TARGET", "OVERLAP_OP", "OVERLAP_SPLIT_OP",
           "SET_MAPPING_TARGET", "QerlPunicaWrapper", "few_row_lora", "route_merged_layers", "split_add"]

logger = logging.getLogger("qerl.vllm.lora_dense")

FUSED_OP = "qerl::lora_linear_fused"
_WRAPPERS: "weakref.WeakValueDictionary[int, QerlPunicaWrapper]" = weakref.WeakValueDictionary()
_LOGGED: set[tuple[str, int]] = set()
ROW_REFUSAL_KEY = "lora/row refusal/"  # qerl_plugin.notices: why a one-row call could not take row+lora, once each
GLUON_REFUSAL_KEY = "lora/gluon refusal/"  # the same for gluon+lora
MERGED_APPLY_TARGET = "vllm.lora.layers.column_parallel_linear:_mcp_apply"  # what route_merged_layers wraps
# ... and, for the overlap path, o_proj/down_proj's apply and the method that hands a layer its wrapper
LINEAR_APPLY_TARGET = "vllm.lora.layers.base_linear:BaseLinearLayerWithLoRA.apply"
SET_MAPPING_TARGET = "vllm.lora.layers.base:BaseLayerWithLoRA.set_mapping"
OVERLAP_OP = "qerl::linear_lora_overlap"
OVERLAP_SPLIT_OP = "qerl::linear_lora_overlap_split"  # the same, returning the base output and the update apart
OVERLAP_MODE = "overlap"
ROW_PATH = "row+lora"  # the overlap op's path for one-row calls of decode_gemv engines (vllm_ext.nvfp4_gemv_lora)
GLUON_PATH = "gluon+lora"  # its path for calls of 2-8 tokens with QERL_FEW_ROW_LORA on (vllm_ext.nvfp4_gluon_lora)
# name -> the live LoRA layers registered under it: one per engine that this process builds
_LAYERS: "dict[str, weakref.WeakSet[torch.nn.Module]]" = {}
_PUNICA_SIZES_LOGGED = 4  # eager engines see every prefill length: name the first few, then say so once


def _log_path(path: str, tokens: int, why: str | None) -> None:
    """One line per path and token count (which path each captured CUDA-graph size took): every fused size
    (at most MAX_TOKENS of them) and the first few punica sizes."""
    if (path, tokens) in _LOGGED:
        return
    punica_sizes = sum(1 for p, _ in _LOGGED if p == "punica")
    if path == "punica" and punica_sizes >= _PUNICA_SIZES_LOGGED:
        if punica_sizes == _PUNICA_SIZES_LOGGED:
            _LOGGED.add((path, -1))
            logger.warning("qerl: further LoRA call sizes on the punica path are not logged")
        return
    _LOGGED.add((path, tokens))
    logger.warning("qerl: LoRA call with %d tokens on the %s path%s", tokens, path, "" if why is None else f" ({why})")


@torch.library.custom_op(FUSED_OP, mutates_args=("y",))
def lora_linear_fused(y: torch.Tensor, x: torch.Tensor, lora_a_stacked: list[torch.Tensor],
                      lora_b_stacked: list[torch.Tensor], scale: float, output_slices: list[int],
                      token_lora_indices: torch.Tensor, wrapper_id: int) -> None:
    """``y += LoRA(x)`` for one adapter: the one-launch kernel when it supports the call (at most
    :data:`~vllm_ext.lora_fused.MAX_TOKENS` tokens), else the punica path of wrapper ``wrapper_id``. The
    kernel's state (counters, workspace) is the wrapper's and is not an argument: the compiled graph sees only
    ``y`` change, so it has nothing else to copy back."""
    a, b, slices = tuple(lora_a_stacked), tuple(lora_b_stacked), tuple(output_slices)
    why = lora_fused.supports(x, a, b, slices)
    tokens = x.numel() // x.shape[-1]
    path = "fused" if why is None else "punica"
    _log_path(path, tokens, why)
    wrapper = _wrapper(wrapper_id)
    if why is None:
        state = wrapper._qerl_sync if wrapper is not None else _standalone_state(x.device)
        lora_fused.launch(y, x, a, b, scale, slices, token_lora_indices, state)  # supports() said yes above
        return
    if wrapper is None:
        raise RuntimeError(f"{FUSED_OP}: {why}, and no punica wrapper {wrapper_id} to fall back on")
    PunicaWrapperGPU.add_lora_linear(wrapper, y, x, a, b, scale, slices)


@lora_linear_fused.register_fake
def _lora_linear_fused_fake(y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, token_lora_indices,
                            wrapper_id) -> None:
    return None


def _wrapper(wrapper_id: int) -> "QerlPunicaWrapper | None":
    """The wrapper ``wrapper_id`` names, else the process's only live one. vLLM 0.24 loads an AOT-compiled model
    from its cache in a later process (``VLLM_USE_AOT_COMPILE``, on by default with torch >= 2.10), and the
    ``id()`` baked into that graph names a wrapper of the process that compiled it."""
    wrapper = _WRAPPERS.get(wrapper_id)
    if wrapper is None and wrapper_id != -1:
        live = list(_WRAPPERS.values())
        if len(live) == 1:
            wrapper = live[0]
    return wrapper


_STANDALONE: dict[str, torch.Tensor] = {}


def _standalone_state(device: torch.device) -> torch.Tensor:
    """Kernel state for calls without a wrapper (``wrapper_id`` -1: tests, benchmarks), one per device."""
    key = str(device)
    if key not in _STANDALONE:
        _STANDALONE[key] = lora_fused.new_sync(device)
    return _STANDALONE[key]


def _routed(layer: torch.nn.Module) -> bool:
    """Whether a merged column-parallel LoRA layer takes the base GEMM + ``add_lora_linear`` route: its wrapper
    runs a qerl mode, one tensor-parallel rank, LoRA not fully sharded."""
    wrapper = getattr(layer, "punica_wrapper", None)
    return (
        isinstance(wrapper, QerlPunicaWrapper)
        and wrapper.qerl_mode != "punica"
        and getattr(layer, "tp_size", 1) == 1
        and "Sharded" not in type(layer).__name__
        and not getattr(getattr(layer, "lora_config", None), "fully_sharded_loras", False)
    )


def _prefix(layer: torch.nn.Module) -> str:
    """A LoRA layer's base layer's prefix (``model.layers.3.mlp.down_proj``), or ``""``."""
    return getattr(getattr(layer, "base_layer", None), "prefix", "") or ""


def _layer_name(layer: torch.nn.Module) -> str:
    """The name the overlap op finds ``layer`` by: its base layer's prefix."""
    name = _prefix(layer)
    if not name:
        raise RuntimeError(f"{OVERLAP_OP}: {type(layer).__name__} has no base_layer.prefix to be found by; run "
                           f"this engine with additional_config={{'qerl_lora': 'fused'}} instead")
    return name


def _overlapped(layer: torch.nn.Module) -> bool:
    return _routed(layer) and layer.punica_wrapper.qerl_mode == OVERLAP_MODE


def split_add(layer: torch.nn.Module) -> bool:
    """Whether the overlap mode returns this layer's base output and LoRA update apart, for the model to add:
    ``QERL_LORA_SPLIT_ADD`` (a bool, default on since §4ah's same-run comparison), except on q/k/v layers. q/k/v: in
    §4ag's profile the add after o, down and gate/up fused into the residual-add-RMSNorm and SiLU kernels (0.108 ms
    of add kernels per 7B b8 step gone for 0.036 ms more in those kernels), but after q/k/v it made two new kernels
    per layer around the rotary embedding (0.071 ms for the 0.036 ms of adds it removed). Layers with a one-row path
    (decode_gemv) split too since §4ai: their one-row calls add inside the row+lora kernel, which then also writes the
    zero "update" (until then they kept every add inside the op, and their engines lost at b8 and b64 what the split
    add gains there; §4aj's H200 run measured the change: shared equal to off at b8 and b64, +16.6 % at b1).
    Decided when the model is traced; the variable is one
    of vLLM's compile factors (``vllm_ext.register_compile_env``)."""
    if not parse_bool(os.environ.get(LORA_SPLIT_ADD_ENV, "1") or "1", LORA_SPLIT_ADD_ENV):
        return False
    return not isinstance(layer.base_layer, QKVParallelLinear)


def _overlap_call(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What a routed layer's ``apply`` returns in the overlap mode: the op, which finds the layer by name and by
    its first LoRA-A tensor. Where :func:`split_add`, the op returns ``(base output, update)`` and the sum is
    left in the traced model: torch.compile fuses it into the kernel that reads the output next (the residual add
    and RMSNorm after o and down, SiLU-and-multiply after gate/up) instead of one add kernel per linear (§4ag)."""
    if split_add(layer):
        out, update = torch.ops.qerl.linear_lora_overlap_split(x, bias, layer.lora_a_stacked[0], _layer_name(layer),
                                                               sum(layer.output_slices))
        return out + update
    return torch.ops.qerl.linear_lora_overlap(x, bias, layer.lora_a_stacked[0], _layer_name(layer),
                                              sum(layer.output_slices))


def _register(layer: torch.nn.Module) -> None:
    name = _prefix(layer)
    if name:
        _LAYERS.setdefault(name, weakref.WeakSet()).add(layer)


def _registered(layer_name: str, lora_a0: torch.Tensor) -> torch.nn.Module:
    """The live layer registered as ``layer_name`` that the call belongs to: the one whose first LoRA-A tensor is
    ``lora_a0`` (same storage); else, if only one is registered, that one (a compiler may pass a copy); else the
    only one whose tensor equals it."""
    live = list(_LAYERS.get(layer_name, ()))
    for layer in live:
        a0 = layer.lora_a_stacked[0]
        if a0 is lora_a0 or (a0.device == lora_a0.device and a0.data_ptr() == lora_a0.data_ptr()):
            return layer
    if len(live) == 1:
        return live[0]
    if not live:
        raise RuntimeError(f"{OVERLAP_OP}: no LoRA layer named {layer_name!r} in this process (names known: "
                           f"{len(_LAYERS)}); it is registered when vLLM's LoRA manager sets the layer's wrapper")
    equal = [layer for layer in live if layer.lora_a_stacked[0].shape == lora_a0.shape
             and torch.equal(layer.lora_a_stacked[0], lora_a0.to(layer.lora_a_stacked[0].device))]
    if len(equal) == 1:
        return equal[0]
    raise RuntimeError(f"{OVERLAP_OP}: {len(live)} LoRA layers named {layer_name!r} in this process (one per engine), "
                       f"and {len(equal)} hold the LoRA-A values this call passed, so the call's own cannot be told "
                       f"apart; run these engines with additional_config={{'qerl_lora': 'fused'}}")


@torch.library.custom_op(OVERLAP_OP, mutates_args=())
def linear_lora_overlap(x: torch.Tensor, bias: torch.Tensor | None, lora_a0: torch.Tensor, layer_name: str,
                        out_features: int) -> torch.Tensor:
    """``base(x) + LoRA(x)`` of the LoRA layer named ``layer_name`` that holds ``lora_a0`` (its first LoRA-A
    tensor): the base GEMM on the current stream and, for calls the one-launch kernel takes, the kernel on the
    wrapper's side stream at the same time; larger calls run the base GEMM and punica in order. The result is a
    new tensor ``[..., out_features]``."""
    return _apply_overlapped(_registered(layer_name, lora_a0), x, bias)


@linear_lora_overlap.register_fake
def _linear_lora_overlap_fake(x, bias, lora_a0, layer_name, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op(OVERLAP_SPLIT_OP, mutates_args=())
def linear_lora_overlap_split(x: torch.Tensor, bias: torch.Tensor | None, lora_a0: torch.Tensor, layer_name: str,
                              out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`linear_lora_overlap` without its last add: ``(base(x), LoRA(x))``, both ``[..., out_features]``,
    whose sum is the layer's output. Calls that run in order (more than 64 tokens, or a call the kernel refuses)
    return the whole output and zeros, as their add happens inside punica's kernel."""
    return _apply_overlapped(_registered(layer_name, lora_a0), x, bias, split=True)


@linear_lora_overlap_split.register_fake
def _linear_lora_overlap_split_fake(x, bias, lora_a0, layer_name, out_features):
    shape = (*x.shape[:-1], out_features)
    return x.new_empty(shape), x.new_empty(shape)


def few_row_lora() -> bool:
    """Whether calls of 2 to 8 tokens try the gluon+lora path: ``QERL_FEW_ROW_LORA`` (a bool, default off)."""
    return parse_bool(os.environ.get(FEW_ROW_LORA_ENV, "0") or "0", FEW_ROW_LORA_ENV)


def _row_weights(layer: torch.nn.Module, base, bias: torch.Tensor | None) -> tuple | None:  # noqa: ANN001
    """The layer's weight in the one-row kernel's layout (its backend's ``row_weights``: decode_gemv's copy, or
    Marlin's own tensors with ``shared``), or None."""
    backend = getattr(base, "backend", None)
    return backend.row_weights(layer.base_layer, bias) if backend is not None else None


def _apply_overlapped(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None, split: bool = False):
    wrapper = layer.punica_wrapper
    a, b = tuple(layer.lora_a_stacked), tuple(layer.lora_b_stacked)
    slices = tuple(layer.output_slices)
    x2 = x.reshape(-1, x.shape[-1])
    tokens = x2.shape[0]
    base = layer._get_quant_method()
    if tokens == 1 and (x.is_cuda or _interpreting()):
        # decode_gemv's one-row kernel with the LoRA expand in its epilogue, after a small shrink kernel
        # (vllm_ext.nvfp4_gemv_lora): faster than the LoRA kernel after or beside the row kernel (§4m)
        row = _row_weights(layer, base, bias)
        if row is not None:
            why = nvfp4_gemv_lora.supports(x2, row[0], a, b, slices)
            if why is None:
                _log_path(ROW_PATH, tokens, None)
                # split: the kernel also writes the zero "update" the model adds (no zeros_like launch per call)
                return nvfp4_gemv_lora.launch_supported(x, *row, a, b, 1.0, slices, wrapper._token_lora_indices,
                                                        zeros=split)
            notices.warn_once(logger, ROW_REFUSAL_KEY + why, "qerl: a one-row LoRA call of %s stays off the row+lora "
                              "path (%s); it runs the base GEMM and the LoRA kernel",  # once per reason
                              _prefix(layer) or type(layer).__name__, why)
    if 2 <= tokens <= FEW_ROW_LORA_MAX_TOKENS and few_row_lora():
        # experimental (§4au, §4av): the Gluon GEMM on decode_gemv's copy with the LoRA expand in its epilogue
        row = _row_weights(layer, base, bias)
        no_copy = row is None or row[0].dtype != torch.uint8  # none, or Marlin's own tensors (decode_gemv "shared")
        why = ("the layer has no copy of the checkpoint layout (decode_gemv \"all\" or \"small\" keeps one)"
               if no_copy else nvfp4_gluon_lora.supports(x2, row[0], a, b, slices))
        if why is None:
            _log_path(GLUON_PATH, tokens, None)
            return nvfp4_gluon_lora.launch_supported(x, *row[:3], a, b, 1.0, slices, wrapper._token_lora_indices,
                                                     bias=row[3], zeros=split)
        notices.warn_once(logger, GLUON_REFUSAL_KEY + why, "qerl: a LoRA call of %s stays off the gluon+lora path "
                          "(%s); it runs the base GEMM and the LoRA kernel", _prefix(layer) or type(layer).__name__,
                          why)
    if not x.is_cuda or lora_fused.supports(x2, a, b, slices) is not None:
        # in order, on this stream, as the fused mode runs: the base GEMM, then vLLM's own step that has the wrapper
        # add the update (the one-launch kernel where it takes the call, punica for more than 64 tokens)
        y = layer._apply_lora_to_output(x, base.apply(layer.base_layer, x, bias))
        return (y, torch.zeros_like(y)) if split else y
    _log_path(OVERLAP_MODE, tokens, None)
    update = torch.empty((tokens, sum(slices)), dtype=x.dtype, device=x.device)  # every element gets written
    got = lora_fused.launch_beside(lambda: base.apply(layer.base_layer, x, bias), update, x2, a, b, 1.0, slices,
                                   wrapper._token_lora_indices, wrapper._qerl_sync,
                                   *wrapper._qerl_side_stream(x.device), add=not split)
    if split:
        out, update = got
        return out, update.view(out.shape)
    return got


def route_merged_layers() -> None:
    """Wrap ``column_parallel_linear._mcp_apply`` (:data:`MERGED_APPLY_TARGET`) so that merged column-parallel
    LoRA layers whose wrapper runs a qerl mode compute ``base(x) + add_lora_linear`` (see the module docstring);
    every other layer keeps vLLM's function. For the overlap mode, also wrap ``BaseLinearLayerWithLoRA.apply``
    (:data:`LINEAR_APPLY_TARGET`: o_proj, down_proj) and ``BaseLayerWithLoRA.set_mapping``
    (:data:`SET_MAPPING_TARGET`: registers each layer by name), so that routed layers run
    ``qerl::linear_lora_overlap``. Idempotent."""
    import vllm.lora.layers.base as lbase
    import vllm.lora.layers.base_linear as blin
    import vllm.lora.layers.column_parallel_linear as cpl

    def mcp_apply(original):
        def _mcp_apply(x: torch.Tensor, bias: torch.Tensor | None, layer: torch.nn.Module) -> torch.Tensor:
            if _routed(layer):
                if layer.punica_wrapper.qerl_mode == OVERLAP_MODE:
                    return _overlap_call(layer, x, bias)
                output = layer._get_quant_method().apply(layer.base_layer, x, bias)
                return layer._apply_lora_to_output(x, output)
            return original(x, bias, layer)

        return _mcp_apply

    def linear_apply(original):
        def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            if _overlapped(self):
                return _overlap_call(self, x, bias)
            return original(self, x, bias)

        return apply

    def set_mapping(original):
        def _set_mapping(self, punica_wrapper):
            original(self, punica_wrapper)
            if isinstance(punica_wrapper, QerlPunicaWrapper) and punica_wrapper.qerl_mode == OVERLAP_MODE:
                _register(self)

        return _set_mapping

    if _wrap_once(cpl, "_mcp_apply", mcp_apply):
        logger.warning("qerl: merged q/k/v and gate/up LoRA layers take the wrapper's add_lora_linear (one GPU, "
                       "LoRA not fully sharded); others keep vLLM's add_shrink/add_expand route")
    _wrap_once(blin.BaseLinearLayerWithLoRA, "apply", linear_apply)
    _wrap_once(lbase.BaseLayerWithLoRA, "set_mapping", set_mapping)


def _wrap_once(owner, name: str, make) -> bool:
    """Replace ``owner.name`` by ``make(original)`` (flagged ``__qerl_patch__``, ``__wrapped__`` = the original)
    unless it is already qerl's; whether it replaced it."""
    original = getattr(owner, name)
    if getattr(original, "__qerl_patch__", False):
        return False
    wrapper = functools.wraps(original)(make(original))
    wrapper.__qerl_patch__ = True
    setattr(owner, name, wrapper)
    return True


class QerlPunicaWrapper(PunicaWrapperGPU):
    """vLLM's GPU punica wrapper. With one adapter slot (``max_loras=1``) its linear layers take
    :func:`~vllm_ext.lora_dense.dense_lora_linear` (mode ``dense``) or the ``qerl::lora_linear_fused`` op (mode
    ``fused``: the kernel of :mod:`vllm_ext.lora_fused` for calls of at most 64 tokens, punica for larger ones,
    decided per call), or, in mode ``overlap``, ``qerl::linear_lora_overlap`` (the same kernel on a side stream
    beside the base GEMM); everything else runs punica. Merged column-parallel layers (q/k/v, gate/up) reach
    ``add_lora_linear`` through :func:`route_merged_layers`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        mode = requested_mode()
        self.qerl_mode = mode if self.max_loras == 1 else "punica"
        self._qerl_sync = None
        self._qerl_side: tuple[torch.cuda.Stream, torch.cuda.Event, torch.cuda.Event] | None = None
        self._qerl_static_fallbacks: set[str] = set()
        if self.qerl_mode in ("fused", OVERLAP_MODE):
            self._qerl_sync = lora_fused.new_sync(self.device, max(16, self.lora_config.max_lora_rank))
            _WRAPPERS[id(self)] = self
        if self.qerl_mode != "punica":
            route_merged_layers()  # q/k/v and gate/up too, not only o_proj and down_proj
        # in the engine's log, so that a benchmark shows which path its LoRA layers took
        logger.warning("qerl: LoRA linears on the %s path (asked: %s, max_loras=%d)", self.qerl_mode, mode,
                       self.max_loras)

    def _qerl_side_stream(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Event, torch.cuda.Event]:
        """The overlap path's side stream and its two events (fork, join), made on first use. One of each is
        enough: every overlapped call joins before the next one forks."""
        if self._qerl_side is None:
            self._qerl_side = (torch.cuda.Stream(device=device), torch.cuda.Event(), torch.cuda.Event())
        return self._qerl_side

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None, **kwargs):
        if self.qerl_mode == "dense":
            dense_lora_linear(
                y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, self._token_lora_indices,
                add_inputs=kwargs.get("add_inputs", True),
            )  # fmt: skip
            return None
        # overlap: layers that reach add_lora_linear outside the overlap op (not routed) run fused, on this stream
        if self.qerl_mode in ("fused", OVERLAP_MODE) and buffer is None and kwargs.get("add_inputs", True):
            # decided when the model is traced: nothing here depends on the token count
            why = lora_fused.weights_supported(x.dtype, x.shape[-1], lora_a_stacked, lora_b_stacked, output_slices)
            if why is None:
                torch.ops.qerl.lora_linear_fused(y, x, list(lora_a_stacked), list(lora_b_stacked), float(scale),
                                                 list(output_slices), self._token_lora_indices, id(self))
                return None
            if why not in self._qerl_static_fallbacks:
                self._qerl_static_fallbacks.add(why)
                logger.warning("qerl: fused LoRA not used for a linear with %s; it runs punica", why)
        return super().add_lora_linear(y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, buffer=buffer,
                                       **kwargs)
