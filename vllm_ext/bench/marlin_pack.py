"""An NVFP4 weight in the layout vLLM's Marlin holds it, built in plain torch on any device, so that the kernels which
read Marlin's tensors can be tested and timed where vLLM is not installed (a bare GPU machine). The layout is the one
:mod:`vllm_ext.nvfp4_marlin_row` states; tests/vllm_ext/test_marlin_pack.py checks the words against vLLM's own
pure-torch repack and the weight they give against the checkpoint's.

What differs from vLLM: Marlin's scale bytes are ``scale * 2^7 * sf`` as float16 (its top 8 bits after the sign), with
``sf`` a power of two vLLM picks per layer and bytes below 2 zeroed; here ``sf`` is 1 and nothing is zeroed, so the
weight is exactly the checkpoint's (an E4M3 scale times 2^7 is a float16 normal with at most 4 significant bits).
"""

from __future__ import annotations

import torch

__all__ = ["marlin_pack"]


def marlin_pack(packed: torch.Tensor, scale: torch.Tensor,
                global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(qweight, scale, divisor)`` for the compressed-tensors NVFP4 triple (``packed`` uint8 ``[N, K/2]``, even input
    in the low nibble; ``scale`` float8_e4m3fn ``[N, K/16]``; ``global_scale`` the float32 divisor): Marlin's int32
    ``[K/16, 2N]`` words, its float8_e4m3fn-typed scale bytes ``[K/16, N]``, and the float32 ``[1]`` divisor the
    kernels take (:func:`vllm_ext.nvfp4_marlin_row.marlin_divisor` for vLLM's tensors; here ``2^7 * global_scale``,
    exact, where vLLM's goes through a float32 reciprocal). Refuses the shapes vLLM pads for Marlin."""
    from vllm_ext.nvfp4_marlin_row import marlin_unpadded

    n, k = packed.shape[0], packed.shape[1] * 2
    if (packed.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (n, k // 16)
            or not marlin_unpadded(n, k)):
        raise ValueError(f"marlin_pack: packed {packed.dtype} {tuple(packed.shape)} / scale {scale.dtype} "
                         f"{tuple(scale.shape)}: expected uint8 [N, K/2] and float8_e4m3fn [N, K/16] of a weight vLLM "
                         "keeps unpadded for Marlin (N a multiple of 64 and K of 128, or N of 128 and K of 64)")
    dev = packed.device
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(n, k).to(torch.int64)
    t, c = k // 16, n // 64
    ar = lambda size: torch.arange(size, device=dev)  # noqa: E731
    # word 16 h + 4 a + j of chunk c in row t; its nibble q: output 64 c + 16 j + 8 b + h, input 16 t + r with
    # (b, r) = (0, 2a), (0, 2a + 8), (1, 2a), (1, 2a + 8), (0, 2a + 1), (0, 2a + 9), (1, 2a + 1), (1, 2a + 9)
    q = ar(8)
    b_q, r_hi, r_lo = (q >> 1) & 1, q & 1, q >> 2
    tt, cc, hh, aa, jj = (v.reshape(shape) for v, shape in (
        (ar(t), (t, 1, 1, 1, 1, 1)), (ar(c), (1, c, 1, 1, 1, 1)), (ar(8), (1, 1, 8, 1, 1, 1)),
        (ar(4), (1, 1, 1, 4, 1, 1)), (ar(4), (1, 1, 1, 1, 4, 1))))
    out = 64 * cc + 16 * jj + 8 * b_q + hh
    inp = 16 * tt + 2 * aa + r_lo + 8 * r_hi
    nib = codes[out, inp]  # [t, c, 8, 4, 4, 8]
    words = (nib << (4 * q)).sum(dim=-1)  # below 2^32: nibbles in disjoint bits
    qweight = torch.where(words >= 2**31, words - 2**32, words).reshape(t, 2 * n).to(torch.int32)  # the same bits
    # scale byte 8 h + 4 j1 + 2 b + j0 of chunk c in row t: output 64 c + 16 (2 j1 + j0) + 8 b + h
    hh, j1, bb, j0 = (v.reshape(shape) for v, shape in (
        (ar(8), (1, 1, 8, 1, 1, 1)), (ar(2), (1, 1, 1, 2, 1, 1)), (ar(2), (1, 1, 1, 1, 2, 1)),
        (ar(2), (1, 1, 1, 1, 1, 2))))
    out = 64 * ar(c).reshape(1, c, 1, 1, 1, 1) + 16 * (2 * j1 + j0) + 8 * bb + hh
    grp = ar(t).reshape(t, 1, 1, 1, 1, 1)
    half = (scale.to(torch.float32) * 2.0**7).to(torch.float16)  # exact: E4M3 values times 2^7
    bits = (half.view(torch.int16).to(torch.int32) >> 7) & 255
    sbytes = bits[out, grp].reshape(t, n).to(torch.uint8).view(torch.float8_e4m3fn)
    divisor = (global_scale.reshape(-1)[:1].to(torch.float64) * 2.0**7).to(torch.float32)
    return qweight.contiguous(), sbytes.contiguous(), divisor
