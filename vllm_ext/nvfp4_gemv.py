"""A Triton W4A16 NVFP4 GEMM for decode-sized inputs, straight from the compressed-tensors layout. Experimental and
not used by any engine. On the H100 it is correct but 4-7.5x slower than vLLM's Marlin FP4 GEMM
(``qerl bench kernels`` columns ``gemv``/``gemv_sk4``, docs/benchmarks.md §4h, third lease): a starting point,
not a backend.

Why: §4h of docs/benchmarks.md profiles a 7B decode step at batch 1 and finds vLLM's Marlin FP4 GEMMs at 2.38 ms
of 4.64, while the 4-bit weights and FP8 scales of those linears (~3.7 GB) need ~1.1 ms at the H100's bandwidth;
the small q/k/v and o projections are slower in Marlin than in BF16 (§4b). A GEMM that reads the checkpoint's
own layout (``weight_packed`` uint8 ``[N, K/2]``, even column in the low nibble; ``weight_scale`` float8_e4m3fn
``[N, K/16]``; ``weight_global_scale`` float32 ``[1]``, the divisor) can also take the adapter's LoRA in the same
launch later, which Marlin's permuted layout makes hard.

How: each program owns ``BLOCK_N`` output features and a share of the K tiles (``SPLIT_K`` programs per feature
block, fp32 partials summed with atomics into an fp32 output). Per tile it loads ``BLOCK_K / 2`` bytes per row and
``BLOCK_K / 16`` scales, decodes both nibbles to fp32 (E2M1 value times ``scale / global_scale``, the codec's own
order of operations, so the dequantized weight is the one :func:`qerl_plugin.nvfp4.dequantize` gives), rounds to
the activation dtype and multiplies with ``tl.dot`` against the even and odd columns of ``x`` (rows padded to 16).
Under ``TRITON_INTERPRET=1`` the dots run in float32 (Triton 3.6's interpreter gets bfloat16 dots wrong).
"""

from __future__ import annotations

import torch

from vllm_ext.triton_support import TRITON_IMPORT_ERROR as _TRITON_IMPORT_ERROR
from vllm_ext.triton_support import interpreting as _interpreting
from vllm_ext.triton_support import tl, triton

__all__ = ["MAX_TOKENS", "nvfp4_small_gemm"]

MAX_TOKENS = 64  # rows per call; larger inputs belong to a GEMM with real M tiles
GROUP = 16


if triton is not None:

    @triton.jit
    def _e2m1(code):
        """fp32 value of 4-bit E2M1 codes (sign bit 3, exponent bits 2-1, mantissa bit 0)."""
        e = (code >> 1) & 3
        m = (code & 1).to(tl.float32)
        pow2 = (1 << e).to(tl.float32) * 0.5  # 2^(e-1) for e >= 1
        mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * pow2)
        return tl.where(code >= 8, -mag, mag)

    @triton.jit
    def _nvfp4_small_gemm_kernel(
        x_ptr, sxm, w_ptr, s_ptr, g_ptr, y_ptr, sym, M, N, K,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        UPCAST: tl.constexpr,
    ):  # fmt: skip
        HALF: tl.constexpr = BLOCK_K // 2
        GROUPS: tl.constexpr = BLOCK_K // 16
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rb = tl.arange(0, HALF)
        rg = tl.arange(0, GROUPS)
        n_ok = rn < N
        m_ok = rm < M
        gscale = tl.load(g_ptr)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for t in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
            k0 = t * BLOCK_K
            cols = k0 // 2 + rb  # byte columns of this tile
            c_ok = cols < K // 2
            wb = tl.load(w_ptr + rn[:, None] * (K // 2) + cols[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0)
            wb = wb.to(tl.int32)
            g_ok = (k0 // 16 + rg) < K // 16
            sc = tl.load(s_ptr + rn[:, None] * (K // 16) + (k0 // 16 + rg)[None, :],
                         mask=n_ok[:, None] & g_ok[None, :], other=0.0).to(tl.float32) / gscale
            w_lo = tl.reshape(tl.reshape(_e2m1(wb & 15), (BLOCK_N, GROUPS, 8)) * sc[:, :, None], (BLOCK_N, HALF))
            w_hi = tl.reshape(tl.reshape(_e2m1(wb >> 4), (BLOCK_N, GROUPS, 8)) * sc[:, :, None], (BLOCK_N, HALF))
            xe = tl.load(x_ptr + rm[:, None] * sxm + (k0 + 2 * rb)[None, :], mask=m_ok[:, None] & c_ok[None, :], other=0.0)
            xo = tl.load(x_ptr + rm[:, None] * sxm + (k0 + 2 * rb + 1)[None, :], mask=m_ok[:, None] & c_ok[None, :],
                         other=0.0)
            # the dequantized weight rounded to the activation dtype, as the reference's dequantize(dtype=...)
            w_lo = w_lo.to(xe.dtype)
            w_hi = w_hi.to(xe.dtype)
            if UPCAST:
                acc += tl.dot(xe.to(tl.float32), tl.trans(w_lo.to(tl.float32)))
                acc += tl.dot(xo.to(tl.float32), tl.trans(w_hi.to(tl.float32)))
            else:
                acc += tl.dot(xe, tl.trans(w_lo))
                acc += tl.dot(xo, tl.trans(w_hi))
        ptrs = y_ptr + rm[:, None] * sym + rn[None, :]
        ok = m_ok[:, None] & n_ok[None, :]
        if SPLIT_K == 1:
            tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=ok)
        else:
            tl.atomic_add(ptrs, acc, mask=ok)


def nvfp4_small_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     block_n: int = 64, block_k: int = 128, split_k: int = 1, num_warps: int = 4) -> torch.Tensor:
    """``x @ W.T`` for ``x`` ``[..., K]`` (bfloat16/float16, at most :data:`MAX_TOKENS` rows) and ``W`` given as
    the NVFP4 triple (``packed`` uint8 ``[N, K/2]``, ``scale`` float8_e4m3fn ``[N, K/16]``, ``global_scale`` the
    float32 divisor ``[1]``); returns ``[..., N]`` in ``x``'s dtype. ``split_k`` > 1 sums fp32 partials with
    atomics (not bit-reproducible run to run) and casts at the end."""
    if triton is None:
        raise RuntimeError(f"nvfp4_small_gemm needs Triton ({_TRITON_IMPORT_ERROR})")
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    n = packed.shape[0]
    problems = []
    if x.dtype not in (torch.bfloat16, torch.float16):
        problems.append(f"activations in {x.dtype} (bfloat16/float16 supported)")
    if m > MAX_TOKENS:
        problems.append(f"{m} rows > {MAX_TOKENS}")
    if k % block_k or block_k % 32:
        problems.append(f"K={k} is not a multiple of block_k={block_k} (itself a multiple of 32)")
    if tuple(packed.shape) != (n, k // 2) or packed.dtype != torch.uint8:
        problems.append(f"packed {packed.dtype} {tuple(packed.shape)}, expected uint8 ({n}, {k // 2})")
    if tuple(scale.shape) != (n, k // GROUP) or scale.dtype != torch.float8_e4m3fn:
        problems.append(f"scale {scale.dtype} {tuple(scale.shape)}, expected float8_e4m3fn ({n}, {k // GROUP})")
    if global_scale.numel() != 1:
        problems.append(f"global_scale has {global_scale.numel()} values, expected 1")
    if problems:
        raise ValueError("nvfp4_small_gemm: " + "; ".join(problems))
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    packed, scale = packed.contiguous(), scale.contiguous()
    g = global_scale.reshape(1).to(torch.float32)
    block_m = max(16, triton.next_power_of_2(m))
    out = torch.zeros(m, n, device=x.device, dtype=torch.float32) if split_k > 1 else torch.empty(m, n, device=x.device,
                                                                                                    dtype=x.dtype)
    grid = (triton.cdiv(n, block_n), split_k)
    _nvfp4_small_gemm_kernel[grid](
        x2, x2.stride(0), packed, scale, g, out, out.stride(0), m, n, k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, UPCAST=_interpreting(),
        num_warps=num_warps,
    )  # fmt: skip
    if split_k > 1:
        out = out.to(x.dtype)
    return out.reshape(*x.shape[:-1], n)
