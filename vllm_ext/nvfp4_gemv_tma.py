"""The one-row NVFP4 kernel with its weights brought in by the Tensor Memory Accelerator (TMA, Hopper): an experiment
on why decode_gemv's row kernel streams at only ~2 TB/s (docs/benchmarks.md §4ba). Nothing in the engine uses it.

Why. At batch 1 the row kernel (:func:`vllm_ext.nvfp4_gemv._nvfp4_row_kernel`) reads the 7B linears' 3.67 GB of codes
and scales at 1.95 TB/s on an H100 (58 % of 3.35 TB/s, §4n) and at 2.1 TB/s on an H200 (44 % of 4.8 TB/s, §4al): the
faster memory barely helps, so the kernel is bound by how many bytes it keeps in flight, not by bandwidth. Its
pipelined loop copies the next tiles with ``cp.async``, one 16-byte request per thread, and each of those bytes holds
registers and warps; Nsight Compute found it limited by registers (44 % occupancy, §4o). A TMA copy is one request
per tile, issued by one thread, landing in shared memory and counted on an mbarrier: the bytes in flight then depend
on the shared memory the stages take, not on the warps.

How. The same arithmetic as the row kernel with ``xvec`` (:func:`vllm_ext.nvfp4_gemv._xvec_sum`): the codes read as
int32 words of 8, decoded as :func:`vllm_ext.nvfp4_decode.decode_mode` picks (through FP8 on sm_89 and later: the
E2M1 value times 2^-6, exact), times ``x`` in float32, each word's sum times its group's FP8 scale, the decode's power
of two and ``1 / global_scale`` once at the end, split-K partials summed in a fixed
order by the last program to arrive (:func:`vllm_ext.nvfp4_gemv._finish`). Only the weight's and scales' loads differ:
``w_desc.load`` / ``s_desc.load`` on tensor descriptors (``[N, K/8]`` int32 words, ``[N, K/16]`` scale bytes), which
Triton software-pipelines ``stages`` deep with TMA on Hopper. Rows past N come back as zeros (the TMA's fill), and
their outputs are not stored.

Tiles: ``block_k`` 256 to 2048 (a TMA box is at most 256 elements wide and its rows at least 16 bytes: block_k / 8
words, block_k / 16 scale bytes), ``block_n`` a power of two up to 256.
"""

from __future__ import annotations

import torch

from vllm_ext.nvfp4_decode import decode_mode
from vllm_ext.nvfp4_gemv import GROUP, _counters
from vllm_ext.triton_support import TRITON_IMPORT_ERROR as _TRITON_IMPORT_ERROR
from vllm_ext.triton_support import tl, triton

__all__ = ["nvfp4_gemv_row_tma", "tma_problems"]

BLOCK_KS = (256, 512, 1024, 2048)

if triton is not None:
    from triton.language.extra.cuda import gdc_wait
    from triton.tools.tensor_descriptor import TensorDescriptor

    from vllm_ext.nvfp4_decode import _decode8, _decode_up
    from vllm_ext.nvfp4_gemv import _finish, _xvec_sum

    @triton.jit
    def _tma_row_kernel(
        x_ptr, w_desc, s_desc, g_ptr, y_ptr, ws_ptr, cnt_ptr, b_ptr, N, K,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, ASM: tl.constexpr,
        HAS_BIAS: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """``y[n] = sum_k x[k] W[n, k]`` for one row of ``x``, as ``_nvfp4_row_kernel`` with ``xvec``, the weight's
        tiles loaded through the descriptors ``w_desc`` (int32 words, box ``[BLOCK_N, BLOCK_K / 8]``) and ``s_desc``
        (scale bytes, box ``[BLOCK_N, BLOCK_K / 16]``)."""
        if PDL:
            gdc_wait()
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        WORDS: tl.constexpr = BLOCK_K // 8
        n0 = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        for t in tl.range(pid_k, K // BLOCK_K, SPLIT_K, num_stages=STAGES):
            wv = w_desc.load([n0, t * WORDS])
            sg = s_desc.load([n0, t * (WORDS // 2)]).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            sc = tl.reshape(tl.join(sg, sg), (BLOCK_N, WORDS))  # a word's 8 codes share one group (2 words)
            cw = t * WORDS + tl.arange(0, WORDS)
            acc += _xvec_sum(_decode8(wv, ASM), x_ptr, cw, BLOCK_N, WORDS) * sc
        rn = n0 + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        # workspace [SPLIT_K, N] float32 for split-K's partials
        _finish(y_ptr + rn, ws_ptr + rn, N, tl.sum(acc, axis=1), n_ok, _decode_up(ASM) / tl.load(g_ptr),
                cnt_ptr + pid_n, pid_k, SPLIT_K, b_ptr + rn, HAS_BIAS)


def tma_problems(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                 block_n: int, block_k: int, split_k: int, stages: int) -> list[str]:
    """What :func:`nvfp4_gemv_row_tma` refuses in these inputs and this tile, each with its fix (empty: none)."""
    k = x.shape[-1]
    n = packed.shape[0]
    rows = x.numel() // k if k else 0
    problems = []
    if x.dtype not in (torch.bfloat16, torch.float16):
        problems.append(f"activations in {x.dtype}: pass bfloat16 or float16")
    if rows != 1:
        problems.append(f"{rows} rows of x: this kernel takes one (nvfp4_small_gemm takes up to 64)")
    if block_k not in BLOCK_KS:
        problems.append(f"block_k={block_k}: use one of {BLOCK_KS} (a TMA box holds 16 to 256 words and scale bytes)")
    elif k % block_k:
        problems.append(f"K={k} is not a multiple of block_k={block_k}: take a block_k that divides it")
    if block_n < 1 or block_n > 256 or block_n & (block_n - 1):
        problems.append(f"block_n={block_n}: use a power of two up to 256")
    if split_k < 1:
        problems.append(f"split_k={split_k}: use 1 or more")
    if stages < 1:
        problems.append(f"stages={stages}: use 1 or more (the depth of the TMA pipeline)")
    if tuple(packed.shape) != (n, k // 2) or packed.dtype != torch.uint8:
        problems.append(f"packed {packed.dtype} {tuple(packed.shape)}: expected uint8 ({n}, {k // 2})")
    if tuple(scale.shape) != (n, k // GROUP) or scale.dtype != torch.float8_e4m3fn:
        problems.append(f"scale {scale.dtype} {tuple(scale.shape)}: expected float8_e4m3fn ({n}, {k // GROUP})")
    if global_scale.numel() != 1:
        problems.append(f"global_scale has {global_scale.numel()} values: expected 1")
    for name, t in (("packed", packed), ("scale", scale), ("global_scale", global_scale)):
        if t.device != x.device:
            problems.append(f"{name} on {t.device}, x on {x.device}: move them to one device")
    for name, t in (("packed", packed), ("scale", scale)):
        if t.is_contiguous() and t.data_ptr() % 16:
            problems.append(f"{name} starts at an address not 16-byte aligned (TMA needs it): pass a fresh copy")
    return problems


def nvfp4_gemv_row_tma(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                       block_n: int = 16, block_k: int = 512, split_k: int = 1, num_warps: int = 4, stages: int = 4,
                       bias: torch.Tensor | None = None, pdl: bool = False, asm: bool | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for one row of ``x`` (``[..., K]`` bfloat16/float16) and ``W`` as the NVFP4 triple of
    :func:`vllm_ext.nvfp4_gemv.nvfp4_small_gemm` (``packed`` uint8 ``[N, K/2]``, ``scale`` float8_e4m3fn
    ``[N, K/16]``, ``global_scale`` the float32 divisor); returns ``[..., N]`` in ``x``'s dtype. The tile:
    ``block_n`` outputs per program, ``block_k`` inputs per loop step, ``split_k`` programs per output block,
    ``stages`` TMA copies in flight per program. ``pdl``: a programmatic dependent launch (Hopper). ``asm``: the PTX
    decode (default: on the GPU, not under the interpreter; which one: :func:`vllm_ext.nvfp4_decode.decode_mode`)."""
    if triton is None:
        raise RuntimeError(f"nvfp4_gemv_row_tma needs Triton ({_TRITON_IMPORT_ERROR})")
    problems = tma_problems(x, packed, scale, global_scale, block_n, block_k, split_k, stages)
    if bias is not None and (bias.shape != (packed.shape[0],) or bias.device != x.device):
        problems.append(f"bias {tuple(bias.shape)} on {bias.device}: expected ({packed.shape[0]},) on {x.device}")
    if problems:
        raise ValueError("nvfp4_gemv_row_tma: " + "; ".join(problems))
    k = x.shape[-1]
    n = packed.shape[0]
    x1 = x.reshape(k).contiguous()
    packed, scale = packed.contiguous(), scale.contiguous()
    words = packed.view(torch.int32)
    w_desc = TensorDescriptor(words, [n, k // 8], [k // 8, 1], [block_n, block_k // 8])
    s_desc = TensorDescriptor(scale.view(torch.uint8), [n, k // GROUP], [k // GROUP, 1], [block_n, block_k // GROUP])
    blocks = triton.cdiv(n, block_n)
    split_k = min(split_k, k // block_k)
    out = torch.empty(n, device=x.device, dtype=x.dtype)
    if split_k > 1:
        ws, cnt = torch.empty(split_k, n, device=x.device, dtype=torch.float32), _counters(x.device, blocks)
    else:
        ws, cnt = out, out  # unused
    b = out if bias is None else bias.contiguous()  # unused without a bias
    _tma_row_kernel[(blocks, split_k)](
        x1, w_desc, s_desc, global_scale.reshape(1).to(torch.float32), out, ws, cnt, b, n, k,
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, ASM=decode_mode(x.device, asm),
        HAS_BIAS=bias is not None, STAGES=stages, PDL=pdl, num_warps=num_warps, launch_pdl=pdl,
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)
