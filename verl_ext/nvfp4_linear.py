"""The actor's frozen NVFP4 base linear, trained through LoRA: :class:`NVFP4Linear`.

The base weight stays on the device as compressed-tensors' NVFP4 tensors (about 0.56 bytes per weight); each
forward decodes a transient dense weight with :func:`verl_ext.kernels.dequantize` and runs one matmul, and
the backward returns a gradient for the input only. The backward reuses the forward's decoded weight while the
decoded weights kept for backward, all layers together, stay within a budget (``QERL_ACTOR_SAVED_WEIGHT_MIB``,
default 1024 MiB; 0 keeps none): then the forward is the decode and torch's own matmul, whose autograd keeps the
weight and runs the backward without Python. Past the budget a custom autograd function keeps only the 4-bit
buffers and decodes the weight again in backward. Under gradient checkpointing (verl's
non-reentrant one) a kept weight lives only from a layer's recomputation to its backward, so the budget is one
decoder layer's weights at a time and each layer is decoded twice per micro-batch instead of three times; without
checkpointing the budget caps how many layers keep theirs. It subclasses ``nn.Linear`` (with
``weight = None``) so that PEFT wraps it in its ordinary ``lora.Linear``. Not supported: merging an adapter
into the base, DoRA, and adapter inits that read the base weight (PiSSA/OLoRA). Under FSDP keep
``mixed_precision.buffer_dtype`` at fp32 (verl's default). Models are converted by
:mod:`verl_ext.nvfp4_replace` (quantize a bf16 model) or :mod:`verl_ext.nvfp4_checkpoint` (load an NVFP4
checkpoint).
"""

from __future__ import annotations

import os
import threading
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from qerl_plugin import format as fmt
from qerl_plugin import nvfp4
from qerl_plugin.nvfp4 import GROUP_SIZE, NVFP4Error
from verl_ext import kernels

__all__ = ["NVFP4Linear", "SAVED_WEIGHT_ENV", "saved_weight_budget", "saved_weight_bytes"]

# compressed-tensors' names of a layer's three NVFP4 tensors, NVFP4Linear's buffers of the same names
PACKED_BUFFERS = fmt.PARAM_NAMES
_BUFFER_DTYPES = {"weight_packed": torch.uint8, "weight_scale": torch.float8_e4m3fn, "weight_global_scale": torch.float32}


# ---------------------------------------------------------------------------------------------------------
# autograd


SAVED_WEIGHT_ENV = "QERL_ACTOR_SAVED_WEIGHT_MIB"
DEFAULT_SAVED_WEIGHT_MIB = 1024


class _KeptWeights:
    """Bytes of decoded weights that forwards keep for their backward, alive right now (all layers together).

    A kept weight is counted from its forward until its storage is freed (its backward ran, or a checkpoint's
    saved-tensor hook dropped it): a ``weakref.finalize`` returns its bytes. Backward runs on autograd's own
    thread, hence the lock.
    """

    lock = threading.Lock()
    live = 0

    @classmethod
    def reserve(cls, n: int, budget: int) -> bool:
        """Count ``n`` more bytes if the total stays within ``budget``; :meth:`attach` the tensor then."""
        with cls.lock:
            if cls.live + n > budget:
                return False
            cls.live += n
        return True

    @classmethod
    def attach(cls, w: torch.Tensor, n: int) -> None:
        # on the storage: autograd saves a transposed view of w, which outlives w's own tensor object
        weakref.finalize(w.untyped_storage(), cls.release, n)

    @classmethod
    def release(cls, n: int) -> None:
        with cls.lock:
            cls.live -= n


def saved_weight_budget() -> int:
    """The budget in bytes for decoded weights kept from forward to backward (``QERL_ACTOR_SAVED_WEIGHT_MIB``)."""
    raw = os.environ.get(SAVED_WEIGHT_ENV, "").strip()
    if not raw:
        return DEFAULT_SAVED_WEIGHT_MIB << 20
    try:
        mib = float(raw)
    except ValueError:
        mib = -1.0
    if not mib >= 0:  # also NaN
        raise NVFP4Error(
            f"{SAVED_WEIGHT_ENV}={raw!r}: give the MiB of decoded weights the actor may keep for backward, a number "
            f">= 0 (0 decodes again in every backward; default {DEFAULT_SAVED_WEIGHT_MIB})"
        )
    return int(mib * (1 << 20))


def saved_weight_bytes() -> int:
    """Bytes of decoded weights kept for backward right now (for tests and memory reports)."""
    return _KeptWeights.live


class _NVFP4MatmulFn(torch.autograd.Function):
    """``y = x @ dequant(W).T + b`` that saves only the 4-bit buffers and decodes the weight again in backward (for
    the input gradient only): the path past the kept-weight budget."""

    @staticmethod
    def forward(ctx, x, packed, scale, gscale, bias):  # type: ignore[override]
        w = kernels.dequantize(packed, scale, gscale, dtype=x.dtype)
        y = F.linear(x, w, None if bias is None else bias.to(x.dtype))
        del w
        ctx.save_for_backward(packed, scale, gscale)  # the 4-bit buffers themselves: no extra memory
        ctx.bias_needs_grad = bias is not None and ctx.needs_input_grad[4]
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        packed, scale, gscale = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            w = kernels.dequantize(packed, scale, gscale, dtype=grad_out.dtype)
            grad_x = grad_out @ w  # [..., out] @ [out, in]
            del w
        if ctx.bias_needs_grad:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0).to(ctx.bias_dtype)
        return grad_x, None, None, None, grad_bias


# ---------------------------------------------------------------------------------------------------------
# module


class NVFP4Linear(nn.Linear):
    """A frozen linear layer stored as NVFP4 and decoded per call (see the module docstring).

    Build it with :meth:`from_linear` / :meth:`from_weight` (quantize a dense layer or weight) or
    :meth:`from_packed` (a checkpoint's tensors); the constructor makes an empty (zero) layer of the given
    shape for loading a state dict into.
    """

    weight_packed: torch.Tensor
    weight_global_scale: torch.Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        device: torch.device | str | None = None,
        bias_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: no dense weight is ever allocated
        if not isinstance(in_features, int) or not isinstance(out_features, int) or in_features <= 0 or out_features <= 0:
            raise NVFP4Error(f"NVFP4Linear needs positive integer sizes, got in={in_features!r} out={out_features!r}")
        if in_features % GROUP_SIZE:
            raise NVFP4Error(
                f"NVFP4Linear: in_features={in_features} is not divisible by the NVFP4 group size {GROUP_SIZE}; "
                "keep this layer unquantized (add it to ignore)"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.register_parameter("weight", None)  # PEFT / HF see an nn.Linear without a dense weight
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        # the FP8 scales are stored as their bytes (uint8): see the ``weight_scale`` property
        self._buffers["weight_scale"] = torch.zeros(out_features, in_features // GROUP_SIZE, dtype=torch.uint8, device=device)
        self.register_buffer("weight_global_scale", torch.ones(1, dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    # -- construction ------------------------------------------------------------------------------------

    @classmethod
    def from_packed(
        cls,
        weight_packed: torch.Tensor,
        weight_scale: torch.Tensor,
        weight_global_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        name: str = "linear",
    ) -> "NVFP4Linear":
        """Wrap a compressed-tensors checkpoint's three tensors (kept as given, no copy when already right)."""
        given = {"weight_packed": weight_packed, "weight_scale": weight_scale, "weight_global_scale": weight_global_scale}
        for key, t in given.items():
            if not isinstance(t, torch.Tensor) or t.dtype != _BUFFER_DTYPES[key]:
                raise NVFP4Error(
                    f"{name}.{key}: expected {_BUFFER_DTYPES[key]}, got {getattr(t, 'dtype', type(t).__name__)}; is this "
                    "an nvfp4-pack-quantized (NVFP4A16) checkpoint?"
                )
        if weight_packed.dim() != 2:
            raise NVFP4Error(f"{name}.weight_packed must be 2-D [out, in/2], got shape {tuple(weight_packed.shape)}")
        out_f, in_f = weight_packed.shape[0], weight_packed.shape[1] * 2
        if tuple(weight_scale.shape) != (out_f, in_f // GROUP_SIZE):
            raise NVFP4Error(
                f"{name}.weight_scale has shape {tuple(weight_scale.shape)}, expected {(out_f, in_f // GROUP_SIZE)} for "
                f"weight_packed {tuple(weight_packed.shape)}"
            )
        if weight_global_scale.numel() != 1:
            raise NVFP4Error(f"{name}.weight_global_scale must hold one value, got shape {tuple(weight_global_scale.shape)}")
        if bias is not None and tuple(bias.shape) != (out_f,):
            raise NVFP4Error(f"{name}.bias has shape {tuple(bias.shape)}, expected ({out_f},)")
        device = weight_packed.device
        if weight_scale.device != device or weight_global_scale.device != device:
            raise NVFP4Error(f"{name}: weight_packed, weight_scale and weight_global_scale must be on one device")
        layer = cls(in_f, out_f, bias=False, device="meta")  # sizes checked there; meta: nothing allocated
        layer._buffers["weight_packed"] = weight_packed.contiguous()
        layer._buffers["weight_scale"] = weight_scale.contiguous().view(torch.uint8)
        layer._buffers["weight_global_scale"] = weight_global_scale.reshape(1).contiguous()
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().to(device), requires_grad=False)
        return layer

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        global_scale: torch.Tensor | None = None,
        quant_dtype: torch.dtype | None = torch.bfloat16,
        name: str = "linear",
    ) -> "NVFP4Linear":
        """Quantize ``linear`` (weight and bias) with :meth:`from_weight`."""
        if isinstance(linear, NVFP4Linear):
            raise NVFP4Error(f"{name} is already an NVFP4Linear")
        if not isinstance(linear, nn.Linear) or linear.weight is None:
            raise NVFP4Error(f"{name}: expected an nn.Linear with a weight, got {type(linear).__name__}")
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls.from_weight(linear.weight.detach(), bias, global_scale=global_scale, quant_dtype=quant_dtype, name=name)

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        global_scale: torch.Tensor | None = None,
        quant_dtype: torch.dtype | None = torch.bfloat16,
        name: str = "linear",
    ) -> "NVFP4Linear":
        """Quantize a dense ``[out, in]`` weight with :func:`qerl_plugin.nvfp4.quantize`, where it is.

        ``global_scale``: the shared scale of the layer's fused group (:func:`qerl_plugin.nvfp4.global_scale`
        over the group's weights in ``quant_dtype``); computed from this weight alone when omitted.
        ``quant_dtype``: the dtype of the checkpoint the rollout quantizes (bf16 for Qwen2.5/Llama). An actor
        loaded in fp32 holds the checkpoint's bf16 values exactly, and quantizing them in bf16 gives the
        rollout's bytes; quantizing in fp32 would round the scales differently. ``None`` uses the weight's
        own dtype. A weight that does not round-trip through ``quant_dtype`` is an error. A meta weight
        gives an empty meta layer (to be filled by a state-dict load or FSDP's ``sync_module_states``).
        """
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise NVFP4Error(f"{name}: expected a 2-D [out, in] weight, got {tuple(getattr(weight, 'shape', ()))}")
        out_f, in_f = weight.shape
        if weight.is_meta:
            return cls(in_f, out_f, bias=bias is not None, device="meta",
                       bias_dtype=bias.dtype if bias is not None else torch.bfloat16)
        q = nvfp4.quantize(_in_quant_dtype(weight, quant_dtype, name), global_scale, name=name)
        return cls.from_packed(q.packed, q.scale, q.global_scale, bias=bias, name=name)

    def reset_parameters(self) -> None:  # nn.Linear API; the base is data, not initialised
        pass

    # -- views -------------------------------------------------------------------------------------------

    @property
    def weight_scale(self) -> torch.Tensor:
        """float8_e4m3fn ``[out, in/16]``: a view of the stored bytes.

        The buffer named ``weight_scale`` holds the FP8 bytes as uint8, because FSDP1's ``MixedPrecision``
        casts every floating buffer to ``buffer_dtype`` (fp32 in verl) in place and would quadruple the scales'
        memory; integer buffers are only moved. ``state_dict()`` still gives (and loading takes) float8_e4m3fn,
        as compressed-tensors writes it.
        """
        return self._scale_fp8()

    @property
    def qweight(self) -> torch.Tensor:
        """``weight_packed`` under GPTQ's name: PEFT reads the base layer's device from it."""
        return self.weight_packed

    def dequantize_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The dense ``[out, in]`` weight the forward uses (a new tensor)."""
        return kernels.dequantize(self.weight_packed, self._buffers["weight_scale"], self.weight_global_scale, dtype=dtype)

    def nbytes(self) -> int:
        """Bytes of the stored base (packed + scales + global scale + bias)."""
        tensors = [self.weight_packed, self._buffers["weight_scale"], self.weight_global_scale]
        if self.bias is not None:
            tensors.append(self.bias)
        return sum(t.numel() * t.element_size() for t in tensors)

    def _scale_fp8(self) -> torch.Tensor:
        s = self._buffers["weight_scale"]
        if s.dtype == torch.uint8:
            return s.view(torch.float8_e4m3fn)
        if s.dtype == torch.float8_e4m3fn:
            return s
        # Someone assigned wider floats (FP8 values are exact in fp32/bf16/fp16): converting back restores the bytes.
        return s.to(torch.float8_e4m3fn)

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[override]
        super()._save_to_state_dict(destination, prefix, keep_vars)
        key = prefix + "weight_scale"
        if key in destination:
            destination[key] = self._scale_fp8() if keep_vars else self._scale_fp8().detach()

    def _load_from_state_dict(self, state_dict, prefix, *args):  # type: ignore[override]
        """Take ``weight_scale`` as float8_e4m3fn (the checkpoint's dtype), its uint8 bytes, or FP8 values in a wider
        float; store the bytes. ``args``: nn.Module's (local_metadata, strict, missing, unexpected, error_msgs)."""
        error_msgs = args[-1]
        key = prefix + "weight_scale"
        original = state_dict.get(key)
        if isinstance(original, torch.Tensor) and original.dtype != torch.uint8:
            if original.dtype != torch.float8_e4m3fn:
                original_fp8 = original.to(torch.float8_e4m3fn)
                if not torch.equal(original_fp8.float(), original.float()):
                    error_msgs.append(
                        f"{key}: {original.dtype} values that are not FP8-E4M3; expected the checkpoint's float8_e4m3fn scales"
                    )
                    return
            else:
                original_fp8 = original
            state_dict[key] = original_fp8.view(torch.uint8)
            try:
                super()._load_from_state_dict(state_dict, prefix, *args)
            finally:
                state_dict[key] = original  # the caller's dict is left as it was
            return
        super()._load_from_state_dict(state_dict, prefix, *args)

    # -- forward -----------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise NVFP4Error(
                f"NVFP4Linear({self.in_features} -> {self.out_features}) got an input with last dimension {x.shape[-1]}"
            )
        if not x.is_floating_point() or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise NVFP4Error(f"NVFP4Linear takes float32/bfloat16/float16 inputs, got {x.dtype}")
        if self.weight_global_scale.dtype != torch.float32:
            raise NVFP4Error(
                f"weight_global_scale was cast to {self.weight_global_scale.dtype}, which changes the decoded weight; "
                "keep buffers in fp32 (FSDP mixed_precision.buffer_dtype: fp32)"
            )
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            # compute in the autocast dtype: the weight is decoded in x's dtype, so the matmul's own autocast cast is
            # a no-op (cheaper on the host than leaving autocast around the call)
            x = x.to(torch.get_autocast_dtype(device_type))
        packed, scale, gscale = self.weight_packed, self._scale_bytes(), self.weight_global_scale
        if torch.is_grad_enabled() and x.requires_grad:
            # the input gradient needs the weight: keep the decoded one (autograd's own matmul saves it) while the
            # budget allows, else the 4-bit buffers only and a second decode in backward
            n = self.out_features * self.in_features * x.element_size()
            if not _KeptWeights.reserve(n, saved_weight_budget()):
                return _NVFP4MatmulFn.apply(x, packed, scale, gscale, self.bias)
            try:
                w = kernels.dequantize(packed, scale, gscale, dtype=x.dtype)
            except BaseException:
                _KeptWeights.release(n)  # nothing was kept: the budget must not shrink
                raise
            _KeptWeights.attach(w, n)
        else:  # no gradient through the weight (no_grad, or a frozen input): decode and multiply, nothing kept
            w = kernels.dequantize(packed, scale, gscale, dtype=x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def _scale_bytes(self) -> torch.Tensor:
        s = self._buffers["weight_scale"]
        return s if s.dtype == torch.uint8 else self._scale_fp8()

    # -- keep the bytes --------------------------------------------------------------------------------

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        """Let ``.to(device)`` move the NVFP4 buffers but never change their dtype (``.to(bf16)`` would
        round the global scale and turn the FP8 scales into bf16)."""
        before = {k: self._buffers.get(k) for k in PACKED_BUFFERS}
        result = super()._apply(fn, recurse)
        for key, old in before.items():
            new = self._buffers.get(key)
            if old is not None and new is not None and new.dtype != old.dtype:
                self._buffers[key] = old.to(device=new.device)
        return result

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, format=nvfp4"


def _in_quant_dtype(weight: torch.Tensor, quant_dtype: torch.dtype | None, name: str) -> torch.Tensor:
    """``weight`` in ``quant_dtype`` (the checkpoint's dtype, which the rollout quantizes in); an error when the
    values do not round-trip through it. ``None`` keeps the weight's dtype."""
    nvfp4.check_weight(weight, name)  # shape, dtype and finiteness first: the clearer error
    if quant_dtype is None or weight.dtype == quant_dtype:
        return weight
    cast = weight.to(quant_dtype)
    if not torch.equal(cast.to(weight.dtype), weight):
        raise NVFP4Error(
            f"{name}: the {weight.dtype} weight is not exactly representable in {quant_dtype}, so it was not loaded "
            f"from a {quant_dtype} checkpoint; pass quant_dtype=None (quantize in {weight.dtype}) or the checkpoint's "
            "dtype, so the actor's bytes match the rollout's"
        )
    return cast
