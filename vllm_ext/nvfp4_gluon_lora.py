"""A few-row NVFP4 linear and its single adapter's LoRA in two launches, as :mod:`vllm_ext.nvfp4_gemv_lora` does for
one row: a shrink kernel for up to 64 tokens, then the Gluon kernel's Hopper version
(:func:`vllm_ext.nvfp4_gluon._wgmma_kernel` with ``LORA``) with the LoRA's expand in its epilogue. Experimental and
opt-in: the overlap LoRA mode sends calls of 2 to 8 tokens here when ``QERL_FEW_ROW_LORA=1`` and the layer has
decode_gemv's copy of the checkpoint layout (:mod:`vllm_ext.lora_dense_wrapper`'s ``gluon+lora`` path;
docs/benchmarks.md §4av). ``qerl bench kernels`` times it (column ``gluon_lora``) against Marlin with qerl's LoRA
kernel beside it (``overlap_fused``, the default at batch 8).

Why: at 8 rows the LoRA costs a 7B decode step about as much beside Marlin as after it (docs/benchmarks.md §4ar:
0.555 ms over Marlin on an H200), because Marlin's blocks hold each SM's whole shared memory. In the one-row path
the expand runs in the GEMM's own epilogue and costs 0.351 ms over the GEMM instead of 0.897 (§4m). This is the
same for a few rows, on the Gluon kernel (level with Marlin at 8 rows on an H100, §4r); design.md sketches it.

* :func:`_shrink_rows_kernel`, grid ``(chunks, slices)``: program ``(c, s)`` writes the float32 partial ``x[:, chunk
  c] @ A_s[:, chunk c]^T`` (``[tokens, R]``, on the tensor cores) to ``hp[s, c]``; at most :data:`MAX_CHUNKS`
  chunks of a multiple of 256 input features (:func:`vllm_ext.nvfp4_gemv_lora.chunking`).
* the GEMM's finishing program of each output block (the last split-K arrival) rounds the base result, sums its
  slice's partials in a fixed order, applies ``scale`` and each token's slot, rounds ``h``, takes ``B_s h`` on the
  tensor cores in float32, rounds, adds in float32 and stores once. On Hopper it is a programmatic dependent launch
  that waits for the shrink only before reading the partials; the shrink itself waits for the kernel before it
  and only then lets the GEMM start (as in :mod:`vllm_ext.nvfp4_gemv_lora` since §4p).

The arithmetic is punica's (base rounded, ``h`` summed in float32 then scaled and rounded, the update summed in
float32 and rounded, added in float32), with its float32 sums in other orders, and the same bits on every launch.
CUDA only (Gluon has no interpreter; the shrink alone runs under it).
"""

from __future__ import annotations

import torch

from vllm_ext import lora_fused
from vllm_ext.nvfp4_gemv_lora import MAX_CHUNKS, SUB_K, chunking, first_slice_sizes, pdl_choice, ragged_slices
from vllm_ext.nvfp4_gluon import GLUON_IMPORT_ERROR, MAX_TOKENS, split_k_buffers, tile_problems
from vllm_ext.triton_support import interpreting, tl, triton

__all__ = ["MAX_TOKENS", "TILES_7B", "gluon_lora_gemm", "launch_supported", "shrink_rows", "supports", "tile_for"]

# The wgmma version's best tiles on the 7B linears from §4r's sweeps (H100; calls 6 and 7 agree): (n, k) -> rows ->
# (block_k, warps, nrep, split_k). Other shapes get the 8-row tile of q/k/v.
TILES_7B = {
    (4608, 3584): {8: (256, 4, 1, 8), 64: (128, 4, 1, 4)},  # q/k/v
    (3584, 3584): {8: (256, 4, 1, 8), 64: (256, 4, 1, 4)},  # o
    (37888, 3584): {8: (256, 4, 1, 2), 64: (64, 4, 1, 1)},  # gate/up
    (3584, 18944): {8: (256, 4, 1, 8), 64: (128, 8, 1, 8)},  # down
}


def tile_for(n: int, k: int, rows: int) -> tuple[int, int, int, int]:
    """``(block_k, warps, nrep, split_k)`` for an ``[n, k]`` weight at ``rows`` tokens: §4r's 8-row tile up to 16
    rows, its 64-row tile above (the 7B shapes), else the q/k/v 8-row tile with ``block_k`` cut to divide K."""
    by_rows = TILES_7B.get((n, k))
    if by_rows is not None:
        return by_rows[8 if rows <= 16 else 64]
    block_k = 256 if k % 256 == 0 else 128 if k % 128 == 0 else 64
    return block_k, 4, 1, 8


if triton is not None:
    from vllm_ext.nvfp4_gemv_lora import _shrink_program

    @triton.jit
    def _shrink_rows_kernel(x_ptr, sxm, a0, a1, a2, hp_ptr, M, K, CH, R: tl.constexpr, SUB: tl.constexpr,
                            BLOCK_M: tl.constexpr, KS_PAD: tl.constexpr, PDL: tl.constexpr, WAIT: tl.constexpr,
                            F32_DOT: tl.constexpr):
        """``hp[s, c] = x[:, chunk c] @ A_s[:, chunk c]^T`` in float32 (``[BLOCK_M, R]``; products of 16-bit values,
        exact in float32; rows past ``M`` are zeros). ``WAIT``: this grid is itself a programmatic dependent launch
        and waits for the kernel before it (which wrote ``x``) before anything else, and only then lets the GEMM
        start. ``PDL``: let the GEMM start now (it waits for this grid before reading ``hp``). ``F32_DOT``: the dot on
        float32 copies of the tiles (the interpreter's bf16 ``tl.dot`` is wrong: :func:`interpreting`)."""
        c, s, a_ptr = _shrink_program(a0, a1, a2, PDL, WAIT)
        offs_m = tl.arange(0, BLOCK_M)
        offs_r = tl.arange(0, R)
        m_ok = offs_m < M
        acc = tl.zeros((BLOCK_M, R), dtype=tl.float32)
        for k0 in range(c * CH, tl.minimum(c * CH + CH, K), SUB):
            offs_k = k0 + tl.arange(0, SUB)
            k_ok = offs_k < K
            xv = tl.load(x_ptr + offs_m[:, None] * sxm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                         other=0.0)
            av = tl.load(a_ptr + offs_r[:, None] * K + offs_k[None, :], mask=k_ok[None, :], other=0.0)
            if F32_DOT:
                acc = tl.dot(xv.to(tl.float32), tl.trans(av).to(tl.float32), acc)
            else:
                acc = tl.dot(xv, tl.trans(av), acc)
        tl.store(hp_ptr + ((s * KS_PAD + c) * BLOCK_M + offs_m[:, None]) * R + offs_r[None, :], acc)


def _shrink_block_m(rows: int) -> int:
    """The shrink's token block: a power of two, at least 16 (``tl.dot``'s smallest)."""
    return max(16, triton.next_power_of_2(rows))


def shrink_rows(x: torch.Tensor, lora_a: tuple[torch.Tensor, ...], pdl: bool = False,
                wait: bool = False) -> torch.Tensor:
    """The shrink's float32 partials ``[slices, MAX_CHUNKS, block_m, R]`` for ``x`` ``[rows, K]`` and each slice's
    ``A`` ``[1, 1, R, K]``: chunk ``c`` of slice ``s`` holds ``x[:, chunk] @ A_s[:, chunk]^T`` (rows past ``rows``
    zero; chunks past :func:`~vllm_ext.nvfp4_gemv_lora.chunking`'s count unwritten). Runs under the Triton
    interpreter too. ``pdl``/``wait``: as in :func:`_shrink_rows_kernel`."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows, rank = x2.shape[0], lora_a[0].shape[-2]
    per, ks = chunking(k)
    block_m = _shrink_block_m(rows)
    hp = torch.empty(len(lora_a), MAX_CHUNKS, block_m, rank, device=x.device, dtype=torch.float32)
    _shrink_rows_kernel[(ks, len(lora_a))](x2, x2.stride(0), *lora_fused.slice_a(lora_a, rank, k), hp, rows, k, per,
                                           R=rank, SUB=SUB_K, BLOCK_M=block_m, KS_PAD=MAX_CHUNKS, PDL=pdl, WAIT=wait,
                                           F32_DOT=interpreting(), num_warps=4, launch_pdl=wait)
    return hp


def supports(x: torch.Tensor, packed: torch.Tensor, lora_a: tuple[torch.Tensor, ...],
             lora_b: tuple[torch.Tensor, ...], output_slices: tuple[int, ...],
             tile: tuple[int, int, int, int] | None = None) -> str | None:
    """``None`` when :func:`gluon_lora_gemm` runs this call, else why not (a sentence). The call's shapes are judged
    first and the device last, so that a refusal names what no GPU would change."""
    if GLUON_IMPORT_ERROR is not None:
        return f"Triton's Gluon is not importable ({GLUON_IMPORT_ERROR})"
    k = x.shape[-1]
    rows = x.numel() // k
    if not 1 <= rows <= MAX_TOKENS:
        return f"{rows} rows (1 to {MAX_TOKENS})"
    why = lora_fused.weights_supported(x.dtype, k, lora_a, lora_b, output_slices)
    if why is not None:
        return why
    if x.dtype != torch.bfloat16:
        return f"activations in {x.dtype} (bfloat16 supported)"
    rank = lora_a[0].shape[-2]
    if rank > 128:
        return f"rank {rank} (at most 128)"
    n = packed.shape[0]
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (sum(output_slices), k // 2):
        return (f"weight {packed.dtype} {tuple(packed.shape)} is not the checkpoint layout for input {k} and slices "
                f"{tuple(output_slices)}")
    block_k, warps, nrep, split_k = tile or tile_for(n, k, rows)
    problems = tile_problems(k, block_k, warps, nrep, split_k, wgmma=True)
    if problems:
        return "tile " + "; ".join(problems)
    ragged = ragged_slices(tuple(output_slices), 16 * warps * nrep)
    if ragged:
        return f"slice sizes {ragged} are not multiples of the kernel's {16 * warps * nrep} rows per block"
    if x.device.type != "cuda" or torch.cuda.get_device_capability(x.device)[0] != 9:
        return f"x on {x.device}: the kernel needs a Hopper GPU (wgmma; Gluon has no interpreter)"
    return None


def gluon_lora_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                    lora_a: tuple[torch.Tensor, ...], lora_b: tuple[torch.Tensor, ...], lora_scale: float,
                    output_slices: tuple[int, ...], token_lora_indices: torch.Tensor,
                    tile: tuple[int, int, int, int] | None = None, pdl: bool | None = None,
                    pdl_first: bool | None = None, bias: torch.Tensor | None = None,
                    zeros: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x @ W.T + B_s @ (lora_scale * A_s @ x)`` per slice for the tokens of ``x`` ``[..., K]`` (at most
    :data:`MAX_TOKENS`) whose slot in ``token_lora_indices`` is 0 (any other slot: no update); returns ``[..., N]``
    in bfloat16. ``W``: the NVFP4 triple in the checkpoint layout (``packed`` uint8 ``[N, K/2]``, ``scale``
    float8_e4m3fn ``[N, K/16]``, ``global_scale`` the float32 divisor); ``lora_a[s]`` ``[1, 1, R, K]``,
    ``lora_b[s]`` ``[1, 1, n_s, R]``. ``tile``: ``(block_k, warps, nrep, split_k)``, default :func:`tile_for`.
    ``pdl``, ``pdl_first``: :func:`~vllm_ext.nvfp4_gemv_lora.pdl_choice` (the GEMM, and the shrink, as programmatic
    dependent launches). Raises :class:`~vllm_ext.lora_fused.FusedLoRAUnsupported` where :func:`supports` says no.
    ``bias`` ``[N]``: added to the base in float32 before it is rounded. ``zeros``: returns ``(output, zeros)``, the
    second a tensor like the output that the kernel fills with zeros (the overlap op's split add: no launch of its
    own for the zeros)."""
    why = supports(x, packed, lora_a, lora_b, tuple(output_slices), tile)
    if why is not None:
        raise lora_fused.FusedLoRAUnsupported(why)
    return launch_supported(x, packed, scale, global_scale, lora_a, lora_b, lora_scale, output_slices,
                            token_lora_indices, tile, pdl, pdl_first, bias, zeros)


def launch_supported(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     lora_a: tuple[torch.Tensor, ...], lora_b: tuple[torch.Tensor, ...], lora_scale: float,
                     output_slices: tuple[int, ...], token_lora_indices: torch.Tensor,
                     tile: tuple[int, int, int, int] | None = None, pdl: bool | None = None,
                     pdl_first: bool | None = None, bias: torch.Tensor | None = None,
                     zeros: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`gluon_lora_gemm` for a caller that has already had ``None`` from :func:`supports` for this call (the
    overlap op asks it to choose its path); still refuses a scale, bias or global scale of the wrong shape."""
    from vllm_ext.nvfp4_gluon import _wgmma_kernel

    slices = tuple(output_slices)
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], packed.shape[0]
    if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (n, k // 16):
        raise ValueError(f"scale {scale.dtype} {tuple(scale.shape)}, expected float8_e4m3fn ({n}, {k // 16})")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias {tuple(bias.shape)}, expected ({n},)")
    if global_scale.numel() != 1:
        raise ValueError(f"global_scale has {global_scale.numel()} values, expected 1")
    block_k, warps, nrep, split_k = tile or tile_for(n, k, m)
    split_k = min(split_k, k // block_k)
    pdl, pdl_first = pdl_choice(x.device, pdl, pdl_first)
    rank = lora_a[0].shape[-2]
    hp = shrink_rows(x2, lora_a, pdl=pdl, wait=pdl_first)
    _, b = lora_fused.slice_operands(lora_a, lora_b, rank, k)
    n_first = first_slice_sizes(slices, n)
    out = torch.empty(m, n, device=x.device, dtype=torch.bfloat16)
    z = torch.empty_like(out) if zeros else out  # every element gets written
    blocks = triton.cdiv(n, 16 * warps * nrep)
    block_m, ws, cnt = split_k_buffers(x2, m, n, blocks, split_k, out)
    _wgmma_kernel[(blocks, split_k)](
        x2, x2.stride(0), packed.contiguous(), scale.contiguous(), global_scale.reshape(1).to(torch.float32), out,
        out.stride(0), ws, cnt, m, n, k, k // 2, k // 16, hp, token_lora_indices, *b, n_first[0], n_first[1],
        chunking(k)[1], float(lora_scale), out if bias is None else bias.contiguous(), z, BLOCK_M=block_m,
        BLOCK_K=block_k, WARPS=warps, NREP=nrep, SPLIT_K=split_k, EVEN_N=n % (16 * warps * nrep) == 0, LORA=True,
        R=rank, HP_M=hp.shape[2], KS_PAD=MAX_CHUNKS, PDL=pdl, HAS_BIAS=bias is not None, ZEROS=zeros, num_warps=warps,
        launch_pdl=pdl,
    )  # fmt: skip
    if zeros:
        return out.reshape(*x.shape[:-1], n), z.reshape(*x.shape[:-1], n)
    return out.reshape(*x.shape[:-1], n)
