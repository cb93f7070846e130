"""NVFP4 weight codec, bit-compatible with compressed-tensors' ``nvfp4-pack-quantized`` format.

A weight ``W [out, in]`` is stored as ``weight_packed`` (uint8 ``[out, in/2]``, two E2M1 codes per byte, the
even column in the low nibble), ``weight_scale`` (float8_e4m3fn ``[out, in/16]``) and ``weight_global_scale``
(float32 ``[1]``, ``448 * 6 / amax``, shared by fused projections) and decodes as
``W[r, c] = E2M1[code[r, c]] * weight_scale[r, c // 16] / weight_global_scale``. Every step follows
compressed-tensors' arithmetic op for op, so a bf16 checkpoint quantizes to llmcompressor's bytes on CPU or
GPU; vLLM's load-time quantization and the trainer's frozen base use this module too. Imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

__all__ = [
    "E2M1_VALUES",
    "FP4_MAX",
    "FP8_E4M3_MAX",
    "GROUP_SIZE",
    "NVFP4Error",
    "NVFP4Weight",
    "check_finite",
    "check_weight",
    "dequantize",
    "e2m1_codes",
    "global_scale",
    "group_scales",
    "pack_codes",
    "quantize",
    "quantize_fused",
    "unpack_codes",
]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_MAX = 6.0
FP8_E4M3_MAX = 448.0
GROUP_SIZE = 16
# compressed-tensors replaces a zero FP8 group scale by this value (its eps for float8_e4m3fn).
ZERO_SCALE_REPLACEMENT = 0.125
# Rows processed at once when quantizing; bounds the float32 temporaries to ~ROW_CHUNK * in * 12 bytes.
ROW_CHUNK = 2048
# Elements checked at once for NaN/Inf (bounds the float8 upcast to 64 MB).
FINITE_CHUNK = 1 << 24


class NVFP4Error(ValueError):
    """A tensor that cannot be stored as NVFP4; the message names it and says what to do."""


@dataclass(frozen=True)
class NVFP4Weight:
    """One quantized weight as compressed-tensors stores it."""

    packed: torch.Tensor  # uint8 [out, in/2]
    scale: torch.Tensor  # float8_e4m3fn [out, in/16]
    global_scale: torch.Tensor  # float32 [1]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 2)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize(self.packed, self.scale, self.global_scale, dtype=dtype)

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The checkpoint entries for module ``prefix`` (e.g. ``model.layers.0.mlp.up_proj``)."""
        return {
            f"{prefix}.weight_packed": self.packed,
            f"{prefix}.weight_scale": self.scale,
            f"{prefix}.weight_global_scale": self.global_scale,
        }

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.global_scale))


def check_weight(weight: torch.Tensor, name: str = "weight") -> None:
    """Raise :class:`NVFP4Error` unless ``weight`` is a finite floating 2-D tensor with ``in % 16 == 0``."""
    if not isinstance(weight, torch.Tensor):
        raise NVFP4Error(f"{name}: expected a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise NVFP4Error(
            f"{name}: NVFP4 quantizes 2-D [out, in] weights, this one has shape {tuple(weight.shape)}; "
            "add the module to the ignore list to keep it unquantized"
        )
    if not weight.is_floating_point() or weight.element_size() == 1:
        raise NVFP4Error(f"{name}: expected a bf16/fp16/fp32 weight, got {weight.dtype}; is it already quantized?")
    cols = weight.shape[1]
    if cols % GROUP_SIZE != 0:
        raise NVFP4Error(
            f"{name}: input dimension {cols} is not divisible by the NVFP4 group size {GROUP_SIZE}; "
            "add the module to the ignore list (e.g. --ignore '<module name>') to keep it unquantized"
        )
    check_finite(weight, name)


def check_finite(tensor: torch.Tensor, name: str = "tensor", note: str = "") -> None:
    """Raise :class:`NVFP4Error` if the floating ``tensor`` holds NaN or Inf, naming the first one (and ``note``).

    A min/max reduction per chunk (NaN propagates through it) finds a bad chunk without temporaries; only that
    chunk is searched for the index.
    """
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    flat = tensor.reshape(-1)
    for start in range(0, flat.numel(), FINITE_CHUNK):
        chunk = flat[start : start + FINITE_CHUNK]
        if chunk.element_size() == 1:  # torch has no min/max or isfinite for float8
            chunk = chunk.float()
        lo, hi = torch.aminmax(chunk)
        if bool(torch.isfinite(lo) & torch.isfinite(hi)):
            continue
        first = start + int((~torch.isfinite(chunk)).nonzero()[0])
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), tensor.shape))
        noted = f" ({note})" if note else ""
        raise NVFP4Error(
            f"{name}: contains NaN/Inf (first at index {index}){noted}; the source checkpoint is corrupt or "
            "was saved after a diverged update: re-export it from a healthy state"
        )


def _abs_max(weight: torch.Tensor) -> torch.Tensor:
    """max |w| in the weight's dtype, as compressed-tensors' min/max observers compute it."""
    if weight.numel() == 0:
        return torch.zeros((), dtype=weight.dtype, device=weight.device)
    return weight.abs().amax()


def global_scale(*weights: torch.Tensor) -> torch.Tensor:
    """The float32 ``[1]`` global scale shared by ``weights`` (one weight, or the parts of a fused layer).

    ``448 * 6 / amax`` with ``amax`` the largest |value| of all parts, computed in the weights' dtype as
    compressed-tensors' ``generate_gparam`` does; an all-zero input gets 1.0.
    """
    if not weights:
        raise NVFP4Error("global_scale needs at least one weight")
    dtypes = {w.dtype for w in weights}
    if len(dtypes) != 1:
        raise NVFP4Error(f"fused weights must share one dtype, got {sorted(map(str, dtypes))}")
    amax = torch.stack([_abs_max(w).to(weights[0].device) for w in weights]).amax()
    amax = torch.clamp(amax, min=torch.finfo(amax.dtype).tiny)
    # ``2688.0 / tensor`` is ``tensor.reciprocal() * 2688.0`` in torch (Tensor.__rtruediv__), each rounded
    # to the weight dtype: the same expression as compressed-tensors' generate_gparam, on every device.
    gs = (FP8_E4M3_MAX * FP4_MAX) / amax
    gs = torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0)
    return gs.to(torch.float32).reshape(1)


def group_scales(weight: torch.Tensor, gscale: torch.Tensor) -> torch.Tensor:
    """Per-16-group FP8 scales ``[out, in/16]`` (float32 values, exactly representable in float8_e4m3fn)."""
    rows, cols = weight.shape
    amax = weight.reshape(rows, cols // GROUP_SIZE, GROUP_SIZE).abs().amax(dim=-1)  # weight dtype
    # amax / 6 in the weight dtype, as calculate_qparams. The divisor is a 0-dim tensor because CUDA
    # divides by a Python scalar as a multiply by its reciprocal, which could differ from the CPU in fp32.
    six = torch.tensor(FP4_MAX, dtype=amax.dtype, device=amax.device)
    scales = gscale.to(weight.device) * (amax / six)  # float32
    scales = torch.clamp(scales, -FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return torch.where(scales == 0, torch.full_like(scales, ZERO_SCALE_REPLACEMENT), scales)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round float32 ``x`` (already divided by its scale) to 4-bit E2M1 codes, as uint8 in ``[0, 16)``.

    Values beyond +-6 saturate. Ties go to the even code, as compressed-tensors' ``cast_to_fp4``.
    A negative input that rounds to zero keeps its sign bit (code 8), as compressed-tensors packs it.
    """
    a = x.abs()
    mag = (a > 0.25).to(torch.uint8)
    mag += a >= 0.75
    mag += a > 1.25
    mag += a >= 1.75
    mag += a > 2.5
    mag += a >= 3.5
    mag += a > 5.0
    return mag | ((x < 0).to(torch.uint8) << 3)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """``[rows, cols]`` uint8 codes -> ``[rows, cols/2]`` bytes, even column in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_codes`."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise NVFP4Error(f"weight_packed must be a 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def _e2m1_table(device: torch.device) -> torch.Tensor:
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def quantize(weight: torch.Tensor, gscale: torch.Tensor | None = None, name: str = "weight") -> NVFP4Weight:
    """Quantize one ``[out, in]`` weight; ``gscale`` is the (shared) global scale, computed if omitted."""
    check_weight(weight, name)
    if gscale is None:
        gscale = global_scale(weight)
    gscale = gscale.to(device=weight.device, dtype=torch.float32).reshape(1)
    rows, cols = weight.shape
    packed = torch.empty((rows, cols // 2), dtype=torch.uint8, device=weight.device)
    scale = torch.empty((rows, cols // GROUP_SIZE), dtype=torch.float8_e4m3fn, device=weight.device)
    for r0 in range(0, rows, ROW_CHUNK):
        w = weight[r0 : r0 + ROW_CHUNK]
        s = group_scales(w, gscale)
        # compressed-tensors: x / (scale / global_scale), in float32, then clamp to the FP4 range
        step = (s / gscale).repeat_interleave(GROUP_SIZE, dim=1)
        q = torch.clamp(w / step, -FP4_MAX, FP4_MAX)
        packed[r0 : r0 + ROW_CHUNK] = pack_codes(e2m1_codes(q))
        scale[r0 : r0 + ROW_CHUNK] = s.to(torch.float8_e4m3fn)
    return NVFP4Weight(packed=packed, scale=scale, global_scale=gscale.clone())


def quantize_fused(weights: Sequence[torch.Tensor], names: Iterable[str] | None = None) -> list[NVFP4Weight]:
    """Quantize the parts of one fused layer (q/k/v or gate/up) with one shared global scale."""
    names = list(names) if names is not None else [f"weight[{i}]" for i in range(len(weights))]
    for w, n in zip(weights, names):
        check_weight(w, n)
    gs = global_scale(*weights)
    return [quantize(w, gs, n) for w, n in zip(weights, names)]


def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    gscale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Decode to ``dtype``: ``E2M1[code] * (scale / global_scale)`` in float32, then cast."""
    codes = unpack_codes(packed)
    rows, cols = codes.shape
    if scale.shape != (rows, cols // GROUP_SIZE):
        raise NVFP4Error(
            f"weight_scale has shape {tuple(scale.shape)}, expected {(rows, cols // GROUP_SIZE)} for a packed "
            f"weight of {tuple(packed.shape)} (one scale per {GROUP_SIZE} inputs)"
        )
    if gscale.numel() != 1:
        raise NVFP4Error(f"weight_global_scale must hold one value, got shape {tuple(gscale.shape)}")
    step = scale.to(torch.float32) / gscale.to(device=scale.device, dtype=torch.float32).reshape(1)
    values = _e2m1_table(packed.device)[codes.long()]
    out = values.reshape(rows, cols // GROUP_SIZE, GROUP_SIZE) * step.unsqueeze(-1)
    return out.reshape(rows, cols).to(dtype)
