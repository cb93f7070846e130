"""The actor's frozen NVFP4 base linear, trained through LoRA: :class:`NVFP4Linear`.

The base weight lives on the device only as NVFP4 (compressed-tensors' three tensors, as buffers of the
same names: ``weight_packed`` uint8 ``[out, in/2]``, ``weight_scale`` float8_e4m3fn ``[out, in/16]`` (kept as
its bytes, see :attr:`NVFP4Linear.weight_scale`), ``weight_global_scale`` float32 ``[1]``; plus an optional
frozen ``bias``), about 0.56 bytes per weight
instead of 2 (bf16) or 4 (fp32). Each forward decodes it into a transient dense weight of the input's dtype
(:func:`verl_ext.kernels.dequantize`: a Triton kernel on CUDA, bit-identical to the torch codec) and runs
one dense matmul; the backward decodes it again rather than keeping it, and returns a gradient only for the
input (``grad_input = grad_out @ W``): the base never gets a gradient, so the only trainable parameters
are LoRA's (and whatever else the caller unfreezes, e.g. norms).

The bytes are the rollout's bytes. :func:`replace_linears_with_nvfp4` quantizes like ``qerl quantize`` and
vLLM load-time quantization (:func:`qerl_plugin.nvfp4.quantize`, q/k/v and gate/up sharing the global scale
of their fused group, in the checkpoint's dtype); :func:`load_nvfp4_checkpoint_into` loads an NVFP4
checkpoint's tensors as they are. Either way the actor decodes exactly what vLLM's Marlin kernel runs.

PEFT: :class:`NVFP4Linear` subclasses ``nn.Linear`` (with ``weight = None``) so that PEFT's default
dispatcher wraps it in its ordinary ``lora.Linear``, which calls ``base_layer(x)`` and adds the LoRA path;
verl's ``get_peft_model(module, LoraConfig(...))`` works unchanged. ``qweight`` (an alias of
``weight_packed``, GPTQ's name) is how PEFT finds the base layer's device for the adapter. Not supported:
merging an adapter into the base (``merge_adapter``/``merge_and_unload``: the base is 4-bit; sync or save
the adapter unmerged), DoRA, and PiSSA/OLoRA-style inits that read the base weight.

Under FSDP the NVFP4 tensors are buffers: they are not sharded (every rank holds the whole 4-bit base).
FSDP1's ``MixedPrecision`` casts floating buffers to ``buffer_dtype``: the packed codes and the FP8 scale
bytes are uint8 and stay as they are; the global scale must stay fp32, so keep ``buffer_dtype`` at fp32
(verl's default; anything else is an error at the first forward). ``.to(dtype)`` on the module leaves all
three alone (see :meth:`NVFP4Linear._apply`).

    model = AutoModelForCausalLM.from_config(cfg)          # or from_pretrained(bf16 checkpoint)
    replace_linears_with_nvfp4(model)                      # or load_nvfp4_checkpoint_into(model, nvfp4_dir)
    model = get_peft_model(model, LoraConfig(r=32, target_modules="all-linear"))
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from qerl_plugin import nvfp4
from qerl_plugin.nvfp4 import GROUP_SIZE, NVFP4Error
from verl_ext import kernels

__all__ = [
    "DEFAULT_FUSED_GROUPS",
    "NVFP4Linear",
    "ReplaceReport",
    "load_nvfp4_checkpoint_into",
    "nvfp4_modules",
    "replace_linears_with_nvfp4",
]

logger = logging.getLogger("qerl.verl.nvfp4_linear")

# Projections that vLLM fuses (qkv_proj, gate_up_proj) and that therefore share one global scale; the same
# table as qerl_plugin.format.FUSED_GROUPS (a test checks they agree).
DEFAULT_FUSED_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# Which nn.Linear modules are quantized: the ``*_proj`` linears of the decoder layers, as ``qerl quantize``.
_LAYER_RE = re.compile(r"(?:^|\.)layers\.\d+\.")
_LORA_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
_PACKED_BUFFERS = ("weight_packed", "weight_scale", "weight_global_scale")
_BUFFER_DTYPES = {"weight_packed": torch.uint8, "weight_scale": torch.float8_e4m3fn, "weight_global_scale": torch.float32}


# ---------------------------------------------------------------------------------------------------------
# autograd


class _NVFP4MatmulFn(torch.autograd.Function):
    """``y = x @ dequant(W).T + b`` with a recomputed weight in backward and no gradient for the base."""

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
            x = x.to(torch.get_autocast_dtype(device_type))
            with torch.autocast(device_type=device_type, enabled=False):
                return _NVFP4MatmulFn.apply(x, self.weight_packed, self._scale_bytes(), self.weight_global_scale, self.bias)
        return _NVFP4MatmulFn.apply(x, self.weight_packed, self._scale_bytes(), self.weight_global_scale, self.bias)

    def _scale_bytes(self) -> torch.Tensor:
        s = self._buffers["weight_scale"]
        return s if s.dtype == torch.uint8 else self._scale_fp8()

    # -- keep the bytes --------------------------------------------------------------------------------

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        """Let ``.to(device)`` move the NVFP4 buffers but never change their dtype (``.to(bf16)`` would
        round the global scale and turn the FP8 scales into bf16)."""
        before = {k: self._buffers.get(k) for k in _PACKED_BUFFERS}
        result = super()._apply(fn, recurse)
        for key, old in before.items():
            new = self._buffers.get(key)
            if old is not None and new is not None and new.dtype != old.dtype:
                self._buffers[key] = old.to(device=new.device)
        return result

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, format=nvfp4"


# ---------------------------------------------------------------------------------------------------------
# model surgery


def _in_quant_dtype(weight: torch.Tensor, quant_dtype: torch.dtype | None, name: str) -> torch.Tensor:
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


def _is_target(name: str, module: nn.Module) -> bool:
    if not isinstance(module, nn.Linear) or isinstance(module, NVFP4Linear):
        return False
    if any(p in _LORA_PARTS for p in name.split(".")) or not _LAYER_RE.search(name):
        return False
    return _leaf(name).endswith("_proj")


def _matches(name: str, patterns: Sequence[str]) -> bool:
    """compressed-tensors-style ignore entries: ``re:<regex>`` (search), an exact name, or a name's last part(s)."""
    for p in patterns:
        if p.startswith("re:"):
            if re.search(p[3:], name):
                return True
        elif name == p or name.endswith("." + p):
            return True
    return False


def _fused_key(name: str, groups: Sequence[Sequence[str]]) -> tuple[str, tuple[str, ...]] | None:
    parts = name.split(".")
    leaf = _leaf(name)
    prefix = ".".join(parts[:-2] if parts[-1] == "base_layer" else parts[:-1])
    for g in groups:
        if leaf in g:
            return prefix, tuple(g)
    return None


def _dense_bytes(linear: nn.Linear) -> int:
    return sum(t.numel() * t.element_size() for t in (linear.weight, linear.bias) if t is not None)


def _leaf(name: str) -> str:
    parts = name.split(".")
    return parts[-2] if parts[-1] == "base_layer" and len(parts) > 1 else parts[-1]


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


@dataclass
class ReplaceReport:
    """What :func:`replace_linears_with_nvfp4` / :func:`load_nvfp4_checkpoint_into` changed."""

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
    fused_groups: Sequence[Sequence[str]] = DEFAULT_FUSED_GROUPS,
    quant_dtype: torch.dtype | None = torch.bfloat16,
    device: torch.device | str | None = None,
) -> ReplaceReport:
    """Swap the decoder's ``*_proj`` ``nn.Linear`` layers for :class:`NVFP4Linear`, in place.

    Targets: ``nn.Linear`` modules inside ``layers.<i>.`` whose name ends in ``_proj`` (HF Qwen2/Qwen3/Llama/
    Mistral naming; also ``<proj>.base_layer`` under an existing PEFT wrapper, never LoRA's own linears),
    minus ``ignore`` (exact names, trailing name parts, or ``re:<regex>``). An ignored member of a fused
    group (q/k/v, gate/up) takes its whole group with it, as vLLM quantizes fused layers together. Each
    fused group is quantized with one shared global scale, in ``quant_dtype`` (see
    :meth:`NVFP4Linear.from_linear`). Quantization runs where the weight is (or on ``device``); the dense
    weights are dropped as each layer is replaced. Meta-device layers become empty meta NVFP4Linears (for
    FSDP's ``sync_module_states``). Returns a :class:`ReplaceReport`.
    """
    ignore = tuple(ignore)
    targets = {n: m for n, m in model.named_modules() if _is_target(n, m)}
    ignored = {n for n in targets if _matches(n, ignore)}
    # grow ignores to whole fused groups
    groups: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for n in targets:
        key = _fused_key(n, fused_groups)
        if key is not None:
            groups.setdefault(key, []).append(n)
    for members in groups.values():
        if any(m in ignored for m in members):
            pulled = [m for m in members if m not in ignored]
            if pulled:
                logger.info("NVFP4: also keeping %s unquantized (fused with an ignored module)", ", ".join(pulled))
            ignored.update(members)

    report = ReplaceReport(ignored=sorted(ignored))
    for name in list(targets):  # named_modules order: layer by layer, one group's dense weights at a time
        if name in ignored or name not in targets:
            continue
        key = _fused_key(name, fused_groups)
        members = [name]
        if key is not None:
            order = {leaf: i for i, leaf in enumerate(key[1])}
            members = sorted(groups[key], key=lambda n: order[_leaf(n)])
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


# ---------------------------------------------------------------------------------------------------------
# checkpoint loading


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise NVFP4Error(f"{path}: no *.safetensors files; pass the directory of an NVFP4 checkpoint (qerl quantize output)")
    return files


def _check_quant_config(path: Path) -> None:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        return
    qc = json.loads(cfg_file.read_text()).get("quantization_config")
    if qc is None:
        raise NVFP4Error(f"{path}: config.json has no quantization_config; quantize it first with `qerl quantize`")
    formats = {qc.get("format")} | {g.get("format") for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)}
    formats.discard(None)
    if formats and formats != {"nvfp4-pack-quantized"}:
        raise NVFP4Error(f"{path}: quantization format {sorted(formats)}, expected nvfp4-pack-quantized (NVFP4A16)")


def load_nvfp4_checkpoint_into(
    model: nn.Module,
    path: str | Path,
    device: torch.device | str | None = None,
    strict: bool = True,
) -> ReplaceReport:
    """Load an NVFP4 (compressed-tensors ``nvfp4-pack-quantized``) checkpoint directory into ``model``.

    Every ``<module>.weight_packed`` / ``weight_scale`` / ``weight_global_scale`` triple replaces
    ``<module>`` (an ``nn.Linear``, possibly on the meta device, or an NVFP4Linear) by an
    :class:`NVFP4Linear` holding those exact bytes; every other tensor (embeddings, norms, biases,
    ``lm_head``) is copied into the model's parameter or buffer of that name, cast to its dtype. Tensors go
    to ``device`` (default: where the model's tensor is; CPU for meta tensors). With ``strict``, checkpoint
    tensors the model lacks and model tensors the checkpoint lacks are errors (tied weights count once).
    The model never materialises a dense copy of a quantized weight.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_dir():
        raise NVFP4Error(f"{path}: not a directory; pass an NVFP4 checkpoint directory")
    _check_quant_config(path)
    files = _checkpoint_files(path)

    keys: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                keys[k] = f
    quantized = sorted({k[: -len(".weight_packed")] for k in keys if k.endswith(".weight_packed")})
    if not quantized:
        raise NVFP4Error(f"{path}: no *.weight_packed tensors; this is not an NVFP4 checkpoint")

    def read(key: str) -> torch.Tensor:
        with safe_open(str(keys[key]), framework="pt") as fh:
            return fh.get_tensor(key)

    report = ReplaceReport()
    modules = dict(model.named_modules())
    for mod_name in quantized:
        for suffix in _PACKED_BUFFERS:
            if f"{mod_name}.{suffix}" not in keys:
                raise NVFP4Error(f"{path}: {mod_name}.{suffix} is missing (the other NVFP4 tensors of {mod_name} are there)")
        old = modules.pop(mod_name, None)
        if old is None or not isinstance(old, nn.Linear):
            if strict:
                raise NVFP4Error(
                    f"{path}: the checkpoint quantizes {mod_name}, which is not an nn.Linear of the model "
                    f"(found {type(old).__name__ if old is not None else 'nothing'}); build the model from this "
                    "checkpoint's config"
                )
            continue
        ref = old.weight_packed if isinstance(old, NVFP4Linear) else old.weight
        target = torch.device(device) if device is not None else (torch.device("cpu") if ref.is_meta else ref.device)
        tensors = [read(f"{mod_name}.{s}").to(target) for s in _PACKED_BUFFERS]
        new = NVFP4Linear.from_packed(*tensors, bias=None, name=mod_name)
        if (new.in_features, new.out_features) != (old.in_features, old.out_features):
            raise NVFP4Error(
                f"{path}: {mod_name} is {new.in_features}->{new.out_features} in the checkpoint but "
                f"{old.in_features}->{old.out_features} in the model; the model was built from another config"
            )
        if old.bias is not None:  # filled from "<mod>.bias" below
            new.bias = nn.Parameter(torch.zeros(old.out_features, dtype=old.bias.dtype, device=target), requires_grad=False)
        if not isinstance(old, NVFP4Linear):
            report.dense_bytes += _dense_bytes(old)
        _set_submodule(model, mod_name, new)
        report.replaced.append(mod_name)
        report.nvfp4_bytes += new.nbytes()

    # everything else, by name, into the (possibly just replaced) model
    packed_keys = {f"{m}.{s}" for m in quantized for s in _PACKED_BUFFERS}
    del modules
    # name -> (module, attr, is_param); tensors shared by several names (tied weights) are swapped everywhere
    state: dict[str, tuple[nn.Module, str, bool]] = {}
    places: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for pname, p in list(module._parameters.items()) + list(module._buffers.items()):
            if p is None:
                continue
            full = f"{mod_name}.{pname}" if mod_name else pname
            if full in packed_keys:
                continue
            is_param = pname in module._parameters
            state[full] = (module, pname, is_param)
            places.setdefault(id(p), []).append((module, pname, is_param))

    loaded_ids: set[int] = set()
    unexpected = []
    for key in sorted(keys):
        if key in packed_keys:
            continue
        if key not in state:
            unexpected.append(key)
            continue
        module, pname, is_param = state[key]
        current = module._parameters[pname] if is_param else module._buffers[pname]
        target = torch.device(device) if device is not None else (torch.device("cpu") if current.is_meta else current.device)
        value = read(key)
        if tuple(value.shape) != tuple(current.shape):
            raise NVFP4Error(
                f"{path}: {key} has shape {tuple(value.shape)} in the checkpoint, {tuple(current.shape)} in the model"
            )
        value = value.to(device=target, dtype=current.dtype)
        if is_param:
            value = nn.Parameter(value, requires_grad=current.requires_grad)
        for mod, attr, param in places.pop(id(current), [(module, pname, is_param)]):
            (mod._parameters if param else mod._buffers)[attr] = value  # a meta tensor cannot take .data
        loaded_ids.add(id(value))
        report.loaded.append(key)

    persistent_missing = []
    for full, (module, pname, is_param) in state.items():
        t = module._parameters[pname] if is_param else module._buffers[pname]
        if id(t) in loaded_ids:
            continue
        if not is_param and pname in getattr(module, "_non_persistent_buffers_set", set()):
            continue  # e.g. rotary inv_freq: computed, not stored
        persistent_missing.append(full)
    if strict and (unexpected or persistent_missing):

        def few(names: list[str]) -> str:
            return f"{names[:8]}{' ...' if len(names) > 8 else ''}"

        parts = []
        if unexpected:
            parts.append(f"checkpoint tensors the model lacks: {few(unexpected)}")
        if persistent_missing:
            parts.append(f"model tensors the checkpoint lacks: {few(persistent_missing)}")
        raise NVFP4Error(
            f"{path} does not match the model: {'; '.join(parts)} "
            "(build the model from this checkpoint's config.json, or pass strict=False)"
        )
    report.meta_left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if report.meta_left:
        logger.warning(
            "NVFP4: %d tensors are still on the meta device after loading %s (e.g. %s): they are not stored in "
            "checkpoints (non-persistent buffers such as rotary inv_freq); re-create them, or build the model on CPU",
            len(report.meta_left), path, report.meta_left[:3],
        )
    logger.info("NVFP4: loaded %s from %s", report.summary(), path)
    return report
