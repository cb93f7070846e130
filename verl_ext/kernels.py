"""NVFP4 dequantization for the trainer: a Triton kernel on CUDA, the torch codec elsewhere.

:func:`dequantize_nvfp4_triton` decodes the NVFP4 triple into a dense ``[out, in]`` tensor bit for bit equal to
:func:`qerl_plugin.nvfp4.dequantize` (every step exact integer work or one correctly rounded fp32 operation;
docs/design.md, "The actor's NVFP4 base"). :func:`dequantize` picks the backend: the kernel for CUDA tensors
when Triton imports (the torch codec, with one warning, if it fails to build or run), the torch codec
otherwise or with ``QERL_DEQUANT_BACKEND=torch``. Imports no verl or vLLM.
"""

from __future__ import annotations

import logging
import os
from typing import Literal

import torch

from qerl_plugin import nvfp4
from qerl_plugin.nvfp4 import GROUP_SIZE, NVFP4Error

__all__ = ["dequantize", "dequantize_nvfp4_triton", "triton_available", "triton_interpreting"]

logger = logging.getLogger("qerl.verl.kernels")
Backend = Literal["auto", "triton", "torch"]
_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# runs of 4 packed bytes per program, and warps per program (docs/benchmarks.md §4k: 82.9 % of the H100's HBM
# bandwidth on the 7B gate/down weights; the [rows, groups] tile kernel it replaced reached 76 %)
QUADS = 512
NUM_WARPS = 4
# E2M1 decoded by moving its bits into a float16 (True) or by the earlier integer decode (False, kept for same-run
# timing); bfloat16 rounded by the GPU's conversion instruction (True) or by integer work (False; always under the
# interpreter). Every combination gives the same bits.
SHIFT_DECODE = True
HW_BF16 = True
_WIDE_FROM = 2**31  # tensors from this many elements/words on use 64-bit offsets (tests lower it to cover that path)

try:  # Triton ships with CUDA builds of torch; CPU-only installs may lack it
    import triton
    import triton.language as tl

    _TRITON_IMPORT_ERROR: Exception | None = None
except Exception as exc:  # pragma: no cover - depends on the install
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    _TRITON_IMPORT_ERROR = exc


def triton_interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1`` was set before this module was imported (kernels run on CPU)."""
    return triton is not None and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available() -> bool:
    """Whether :func:`dequantize_nvfp4_triton` can run here (CUDA + Triton, or the Triton interpreter)."""
    return triton is not None and (torch.cuda.is_available() or triton_interpreting())


if triton is not None:

    @triton.jit
    def _nvfp4_dequant_kernel(
        packed_ptr,  # uint8, contiguous [rows, cols/2], read as one flat run of bytes
        scale_ptr,  # uint8, contiguous [rows, cols/16]: the float8_e4m3fn bytes
        gscale_ptr,  # float32 [1]
        out_ptr,  # contiguous output storage as one word per packed byte: int32 (bf16/fp16), int64 (fp32)
        n_quads,  # packed bytes / 4 (a whole number: a row holds cols/2 bytes, a multiple of 8)
        OUT_KIND: tl.constexpr,  # 0 float32, 1 bfloat16, 2 float16
        QUADS: tl.constexpr,  # runs of 4 packed bytes per program
        WIDE: tl.constexpr,  # 64-bit offsets (tensors of 2**31 or more bytes)
        HW_BF16: tl.constexpr,  # bfloat16 by the GPU's conversion (the interpreter's cast does not round to nearest even)
        SHIFT_DECODE: tl.constexpr,  # E2M1 through float16 bits (default); False: the earlier integer decode, for timing
    ):
        # With contiguous tensors the layout is flat: packed byte b of the whole tensor holds codes 2b and 2b+1 of
        # the row-major values, its scale is byte b // 8 of the scales (a row's cols/2 bytes are cols/16 groups of
        # 8), and its two decoded values are output word b. A program decodes QUADS runs of 4 bytes as a
        # [QUADS, 4] tile: each thread loads 4 bytes in one 32-bit load, decodes their half group with one scale
        # and stores the 4 words in one 16-byte store (bf16/fp16). Load, scale and store share one register layout,
        # so nothing passes through shared memory (the earlier [rows, groups, 8] tile kernel converted its layout
        # there and was bound by its L1 traffic: §4j lease 6, §4k).
        pid = tl.program_id(0)
        if WIDE:
            pid = pid.to(tl.int64)
        q = pid * QUADS + tl.arange(0, QUADS)
        qmask = q < n_quads
        sb = tl.load(scale_ptr + q // 2, mask=qmask, other=0).to(tl.int32)
        step = _group_step(sb, gscale_ptr)[:, None]
        b = q[:, None] * 4 + tl.arange(0, 4)[None, :]
        mask = qmask[:, None]
        byte = tl.load(packed_ptr + b, mask=mask, other=0).to(tl.int32)
        word = _decode_byte(byte, step, OUT_KIND, HW_BF16, SHIFT_DECODE)
        tl.store(out_ptr + b, word, mask=mask)

    @triton.jit
    def _group_step(sb, gscale_ptr):
        """The group's decode step from its FP8-E4M3 (fn) scale byte ``sb`` (int32): scale / global scale, by IEEE
        division as torch does."""
        s_exp = (sb >> 3) & 15
        s_man = sb & 7
        s_normal = (((s_exp + 120) << 23) | (s_man << 20)).to(tl.float32, bitcast=True)
        s_sub = s_man.to(tl.float32) * 0.001953125  # M * 2**-9, exact
        s_abs = tl.where(s_exp == 0, s_sub, s_normal)
        s_abs = tl.where((s_exp == 15) & (s_man == 7), float("nan"), s_abs)
        # the sign as a bit (negation would be 0 - x, turning -0.0 into +0.0)
        scale = (s_abs.to(tl.int32, bitcast=True) | ((sb >> 7) << 31)).to(tl.float32, bitcast=True)
        return tl.math.div_rn(scale, tl.load(gscale_ptr))

    @triton.jit
    def _decode_byte(byte, step, OUT_KIND: tl.constexpr, HW_BF16: tl.constexpr, SHIFT_DECODE: tl.constexpr):
        """One packed byte (int32) -> its two values times ``step`` as one output word: int32 holding two bf16/fp16
        (low half = the low nibble's column), int64 holding two float32."""
        # E2M1 -> float16 by moving bits: sign to bit 15, the three magnitude bits to 11..9 (exponent's low two bits,
        # mantissa's top bit). The float16 so formed is the E2M1 value times 2**-14 for every code (code 1 lands on
        # the subnormal 2**-15), so times 16384.0 it is the value exactly; one rounding follows, the product with
        # the step, as in the codec. Five integer operations per value instead of the table-free decode's dozen.
        if SHIFT_DECODE:
            lo16 = (((byte & 0x08) << 12) | ((byte & 0x07) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
            hi16 = (((byte & 0x80) << 8) | ((byte & 0x70) << 5)).to(tl.int16).to(tl.float16, bitcast=True)
            lo = (lo16.to(tl.float32) * 16384.0) * step
            hi = (hi16.to(tl.float32) * 16384.0) * step
        else:
            lo = _e2m1_value(byte & 15) * step
            hi = _e2m1_value(byte >> 4) * step
        if OUT_KIND == 0:
            word = (_f32_bits(lo).to(tl.uint64) | (_f32_bits(hi).to(tl.uint64) << 32)).to(tl.int64, bitcast=True)
        else:
            if OUT_KIND == 1 and HW_BF16:
                # the GPU's round-to-nearest-even conversion (cvt.rn.bf16): one instruction instead of six integer
                # ones; a NaN stays NaN, though its payload bits may differ from torch's 0x7FC0 (the tests compare
                # where the NaNs are and every other value's bits)
                lo_bits = lo.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
                hi_bits = hi.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
            elif OUT_KIND == 1:
                lo_bits = _bf16_bits(lo)
                hi_bits = _bf16_bits(hi)
            else:
                lo_bits = lo.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
                hi_bits = hi.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
            word = (lo_bits | (hi_bits << 16)).to(tl.int32, bitcast=True)
        return word

    @triton.jit
    def _e2m1_value(code):
        """float32 value of a 4-bit E2M1 code (int32 0..15) by integer work; code 8 gives -0.0, as the codec's table."""
        mag = code & 7
        e = mag >> 1
        m = mag & 1
        bits = tl.where(mag == 0, 0, tl.where(e == 0, 126 << 23, ((e + 126) << 23) | (m << 22)))
        return (bits | ((code >> 3) << 31)).to(tl.float32, bitcast=True)

    @triton.jit
    def _f32_bits(x):
        return x.to(tl.uint32, bitcast=True)

    @triton.jit
    def _bf16_bits(x):
        """bfloat16 bits of float32 ``x`` (round to nearest even; NaN to the canonical 0x7FC0), as uint32."""
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return tl.where(x != x, 0x7FC0, rounded)


def _check_inputs(packed: torch.Tensor, scale: torch.Tensor, gscale: torch.Tensor, dtype: torch.dtype) -> tuple[int, int]:
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 2:
        raise NVFP4Error(
            f"weight_packed must be a 2-D uint8 tensor [out, in/2], got "
            f"{getattr(packed, 'dtype', type(packed).__name__)} {tuple(getattr(packed, 'shape', ()))}"
        )
    rows, cols = packed.shape[0], packed.shape[1] * 2
    if cols % GROUP_SIZE:
        raise NVFP4Error(f"weight_packed has {cols} columns once unpacked, not a multiple of {GROUP_SIZE}")
    if scale.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise NVFP4Error(
            f"weight_scale must be float8_e4m3fn (or its uint8 bytes), got {scale.dtype}; a scale cast to another "
            "dtype (e.g. by a module.to(dtype)) can be restored with .to(torch.float8_e4m3fn)"
        )
    if tuple(scale.shape) != (rows, cols // GROUP_SIZE):
        raise NVFP4Error(
            f"weight_scale has shape {tuple(scale.shape)}, expected {(rows, cols // GROUP_SIZE)} for weight_packed "
            f"{tuple(packed.shape)} (one scale per {GROUP_SIZE} inputs)"
        )
    if gscale.numel() != 1 or gscale.dtype != torch.float32:
        raise NVFP4Error(f"weight_global_scale must be one float32 value, got {gscale.dtype} {tuple(gscale.shape)}")
    if dtype not in _OUT_KIND:
        raise NVFP4Error(f"dequantize to float32, bfloat16 or float16, not {dtype}")
    return rows, cols


def dequantize_nvfp4_triton(
    packed: torch.Tensor,
    scale: torch.Tensor,
    gscale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton NVFP4 -> ``dtype`` decode, bit-identical to :func:`qerl_plugin.nvfp4.dequantize`.

    Inputs on one CUDA device (or CPU under ``TRITON_INTERPRET=1``). ``out`` (contiguous ``[out, in]`` of
    ``dtype``) is written in place when given, e.g. a reused scratch buffer.
    """
    if triton is None:
        raise RuntimeError(f"Triton is not importable here ({_TRITON_IMPORT_ERROR}); use backend='torch'")
    rows, cols = _check_inputs(packed, scale, gscale, dtype)
    device = packed.device
    interpreting = triton_interpreting()
    if device.type != "cuda" and not interpreting:
        raise NVFP4Error(f"the Triton dequant kernel needs CUDA tensors, got {device}; use the torch codec on CPU")
    if scale.device != device or gscale.device != device:
        raise NVFP4Error(
            f"weight_packed ({device}), weight_scale ({scale.device}) and weight_global_scale ({gscale.device}) "
            "must be on one device"
        )
    if out is None:
        out = torch.empty((rows, cols), dtype=dtype, device=device)
    elif (out.shape != (rows, cols) or out.dtype != dtype or not out.is_contiguous() or out.device != device
          or out.storage_offset() % 2):
        raise NVFP4Error(
            f"out must be a contiguous {dtype} tensor of shape {(rows, cols)} on {device}, starting at an even element "
            "(the kernel writes two values per store)"
        )
    if rows == 0 or cols == 0:
        return out
    packed = packed.contiguous()
    scale_bytes = scale.contiguous().view(torch.uint8)
    gscale = gscale.reshape(1).contiguous()
    kind = _OUT_KIND[dtype]
    # one word per packed byte: int32 holds two bf16/fp16 values, int64 two fp32 values
    words = out.view(torch.int64 if kind == 0 else torch.int32)
    wide = packed.numel() >= _WIDE_FROM  # the largest offset: one output word per packed byte, fewer scale bytes
    n_quads = packed.numel() // 4  # rows * cols/2 bytes, cols a multiple of 16
    # plain integer ceil-division: triton.cdiv goes through Triton's constexpr-function machinery (~5 µs a call)
    _nvfp4_dequant_kernel[(-(-n_quads // QUADS),)](
        packed, scale_bytes, gscale, words, n_quads,
        OUT_KIND=kind, QUADS=QUADS, WIDE=wide, HW_BF16=HW_BF16 and not interpreting, SHIFT_DECODE=SHIFT_DECODE,
        num_warps=NUM_WARPS,
    )
    return out


_triton_failure: Exception | None = None  # set once if the kernel cannot compile/run here (auto mode then uses torch)


def _backend_from_env() -> str:
    value = os.environ.get("QERL_DEQUANT_BACKEND", "auto").strip().lower()
    if value not in ("auto", "triton", "torch"):
        raise ValueError(f"QERL_DEQUANT_BACKEND={value!r}: use auto, triton or torch")
    return value


def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    gscale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Decode with the Triton kernel on CUDA (when Triton imports) and the torch codec otherwise.

    Both give the same bits. ``backend`` (default: ``QERL_DEQUANT_BACKEND`` or ``auto``) forces one.
    """
    global _triton_failure
    backend = backend or _backend_from_env()
    if backend == "triton":
        return dequantize_nvfp4_triton(packed, scale, gscale, dtype)
    if backend == "auto" and packed.device.type == "cuda" and triton is not None and _triton_failure is None:
        try:
            return dequantize_nvfp4_triton(packed, scale, gscale, dtype)
        except NVFP4Error:
            raise  # bad input: the torch codec would reject it too
        except Exception as exc:  # the kernel does not build or run on this GPU: same bits from torch
            _triton_failure = exc
            logger.warning("NVFP4 Triton dequant kernel unavailable (%s: %s); using the torch codec",
                           type(exc).__name__, exc)
    if backend not in ("auto", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    _check_inputs(packed, scale, gscale, dtype)
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e4m3fn)
    return nvfp4.dequantize(packed, scale, gscale, dtype=dtype)
