"""The few-row wgmma NVFP4 GEMM of :mod:`vllm_ext.nvfp4_gluon` on the tensors vLLM's Marlin holds
(``nvfp4_gluon_marlin_gemm``), so that a layer would need no copy of its weights in the checkpoint's layout.
Experimental, and used by nothing.

Marlin's words already hold the wgmma register operand of one thread each: word ``16 h + 4 a + j`` of a 64-output
chunk holds rows ``h`` and ``h + 8`` of block ``j`` at inputs ``2a``, ``2a + 1``, ``2a + 8`` and ``2a + 9`` of one
group of 16 (the layout :mod:`vllm_ext.nvfp4_marlin_row` states). So each thread loads its own words, and ``x`` keeps
its K order; the loop's ``x`` step is :mod:`vllm_ext.nvfp4_gluon`'s and the epilogue
:mod:`vllm_ext.nvfp4_gluon_epilogue`'s.

Measured (docs/benchmarks.md §4ay, an H200): the first loop was correct (no tile refused, 18/18 GPU tests) and 19.5 %
slower per 7B step at 8 rows than the checkpoint-layout kernel (2.681 against 2.243 ms). The loop since (bytes paired
before the decode, the scale made from its bits) has run neither the GPU tests nor a timing (§4az).
"""

from __future__ import annotations

import torch

from vllm_ext.nvfp4_gluon import GLUON_IMPORT_ERROR, call_problems, split_k_buffers
from vllm_ext.nvfp4_marlin_row import shared_layout
from vllm_ext.triton_support import gl, gluon, triton

__all__ = ["marlin_problems", "nvfp4_gluon_marlin_gemm"]

if GLUON_IMPORT_ERROR is None:
    from vllm_ext.nvfp4_gluon import _DECODE_ASM, _x_smem_layout, wgmma_acc_layout, wgmma_step, x_tile_offsets
    from vllm_ext.nvfp4_gluon_epilogue import epilogue

    @gluon.constexpr_function
    def _dim_layout(layout, rank, d):
        """The 1-D layout of dimension ``d`` of a rank-``rank`` layout (every other dimension sliced away), for the
        ``arange`` of that dimension's indices."""
        for k in range(rank - 1, -1, -1):  # from the last, so that indexing with None expands them back in order
            if k != d:
                layout = gl.SliceLayout(k, layout)
        return layout

    @gluon.constexpr_function
    def _marlin_w_layout(t, warps, nrep, paired=False):
        """``[chunks, t, 8, 4, 16]`` bytes of Marlin's ``qweight`` for :func:`_wgmma_marlin_acc`: thread (warp ``w``,
        lane ``4 h + a``) holds, for each of the tile's ``t`` groups, the ``4 nrep`` contiguous bytes of words ``16 h
        + 4 a + j`` (``j = jh * nrep + r``, ``r`` its registers, ``jh`` the warp's low bits) of its chunk (the warp's
        high bits): 16-byte loads at ``nrep`` 4. Those words hold exactly its wgmma register operand: rows ``h`` and
        ``h + 8`` of block ``j``, inputs ``2 a``, ``2 a + 1``, ``2 a + 8``, ``2 a + 9`` of each group. ``paired``: the
        same bytes with each word's middle two swapped in registers (0, 2, 1, 3: the two inputs of one row together)."""
        jh = 4 // nrep
        chunks = warps * nrep // 4
        regs = [[0, 0, 0, 0, 2], [0, 0, 0, 0, 1]] if paired else [[0, 0, 0, 0, 1], [0, 0, 0, 0, 2]]
        regs += [[0, 0, 0, 0, 4 << b] for b in range(nrep.bit_length() - 1)]
        regs += [[0, 1 << b, 0, 0, 0] for b in range(t.bit_length() - 1)]
        lanes = [[0, 0, 0, 1, 0], [0, 0, 0, 2, 0], [0, 0, 1, 0, 0], [0, 0, 2, 0, 0], [0, 0, 4, 0, 0]]
        warp_bases = [[0, 0, 0, 0, (4 * nrep) << b] for b in range(jh.bit_length() - 1)]
        warp_bases += [[1 << b, 0, 0, 0, 0] for b in range(chunks.bit_length() - 1)]
        return gl.DistributedLinearLayout(regs, lanes, warp_bases, [], [chunks, t, 8, 4, 16])

    @gluon.constexpr_function
    def _marlin_s_layout(t, warps, nrep):
        """``[chunks, t, 8, 8]`` bytes of Marlin's scales for :func:`_wgmma_marlin_acc`: the thread of
        :func:`_marlin_w_layout` holds the scales of its rows, bytes ``4 (j // 2) + 2 b + j % 2`` of its ``h``'s eight
        (contiguous at ``nrep`` 4); the four lanes of one ``h`` hold the same bytes."""
        jbits = [[0, 0, 0, 1], [0, 0, 0, 4]]  # j's bits 0 and 1 as byte offsets
        low = nrep.bit_length() - 1
        chunks = warps * nrep // 4
        # in increasing offsets (contiguous registers make wide loads: 8 bytes at nrep 4)
        regs = sorted([[0, 0, 0, 2]] + jbits[:low], key=lambda v: v[3])
        regs += [[0, 1 << b, 0, 0] for b in range(t.bit_length() - 1)]
        lanes = [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]]
        warp_bases = jbits[low:] + [[1 << b, 0, 0, 0] for b in range(chunks.bit_length() - 1)]
        return gl.DistributedLinearLayout(regs, lanes, warp_bases, [], [chunks, t, 8, 8])

    # Marlin's scale bytes as float16 (byte << 7: below 2^16, or 0) times 2^15 in bfloat16 (2 to below 2^31 for the
    # float16 normals, exact: 4 significant bits); the scaled weights code * scale * 2^-111, normal and exact; the
    # epilogue's float32 makes up the 2^111
    _MARLIN_SCALE_UP = gl.constexpr(2.0**127)
    _MARLIN_EPILOGUE_UP = gl.constexpr(2.0**111)

    @gluon.jit
    def _wgmma_marlin_acc(x_ptr, sxm, w_ptr, s_ptr, M, N, K, KB, KS, pid, pid_k, acc_l: gl.constexpr,
                          BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, WARPS: gl.constexpr, NREP: gl.constexpr,
                          SPLIT_K: gl.constexpr, EVEN_N: gl.constexpr):
        """:func:`_wgmma_acc` on the tensors Marlin holds (``w_ptr``: ``qweight`` int32 ``[K/16, 2N]`` read as bytes,
        ``s_ptr``: its scale bytes ``[K/16, N]``; the layout in :mod:`vllm_ext.nvfp4_marlin_row`; ``KB`` = 8N and
        ``KS`` = N their bytes per row of 16 inputs, passed apart from ``N`` for their alignment). Program ``pid``
        takes the ``16 * WARPS * NREP / 64`` chunks of 64 outputs from ``pid * BLOCK_N``. Its accumulator's row
        ``16 (WARPS r + w) + i`` (``r`` < ``NREP``, ``w`` = ``c * 4 / NREP + jh``) is output ``64 c + 16 (jh * NREP +
        r) + i``; the rows are put in output order before returning (a no-op at ``NREP`` 1). ``x`` stays in its own K
        order."""
        BLOCK_N: gl.constexpr = 16 * WARPS * NREP
        T: gl.constexpr = BLOCK_K // 16
        CH: gl.constexpr = WARPS * NREP // 4
        JH: gl.constexpr = 4 // NREP
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
        w_l: gl.constexpr = _marlin_w_layout(T, WARPS, NREP)
        w2_l: gl.constexpr = _marlin_w_layout(T, WARPS, NREP, True)
        s_l: gl.constexpr = _marlin_s_layout(T, WARPS, NREP)
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_K], _x_smem_layout(BLOCK_M, BLOCK_K))
        c0 = pid * CH
        rc = c0 + gl.arange(0, CH, layout=_dim_layout(w_l, 5, 0))
        rt = gl.arange(0, T, layout=_dim_layout(w_l, 5, 1))
        rh = gl.arange(0, 8, layout=_dim_layout(w_l, 5, 2))
        ra = gl.arange(0, 4, layout=_dim_layout(w_l, 5, 3))
        rp = gl.arange(0, 16, layout=_dim_layout(w_l, 5, 4))
        w_offs = ((rc * 512)[:, None, None, None, None] + (rt * KB)[None, :, None, None, None]
                  + (rh * 64)[None, None, :, None, None] + (ra * 16)[None, None, None, :, None]
                  + rp[None, None, None, None, :])
        w_ok = (rc * 64 < N)[:, None, None, None, None]
        sc = c0 + gl.arange(0, CH, layout=_dim_layout(s_l, 4, 0))
        st = gl.arange(0, T, layout=_dim_layout(s_l, 4, 1))
        sh = gl.arange(0, 8, layout=_dim_layout(s_l, 4, 2))
        sb = gl.arange(0, 8, layout=_dim_layout(s_l, 4, 3))
        s_offs = ((sc * 64)[:, None, None, None] + (st * KS)[None, :, None, None] + (sh * 8)[None, None, :, None]
                  + sb[None, None, None, :])
        s_ok = (sc * 64 < N)[:, None, None, None]
        x_offs, x_ok = x_tile_offsets(sxm, M, BLOCK_M, BLOCK_K, WARPS)
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_l)
        for t in range(pid_k, K // BLOCK_K, SPLIT_K):
            if EVEN_N:
                wq = gl.load(w_ptr + w_offs + t * (T * KB))
                sq = gl.load(s_ptr + s_offs + t * (T * KS))
            else:
                wq = gl.load(w_ptr + w_offs + t * (T * KB), mask=w_ok, other=0)
                sq = gl.load(s_ptr + s_offs + t * (T * KS), mask=s_ok, other=0)
            xr = gl.load(x_ptr + x_offs + t * BLOCK_K, mask=x_ok, other=0.0)
            # byte 4 j + 2 e + b of a word's 16-byte run: output block j, row h + 8 b; inputs 2 a + e (low nibble) and
            # 2 a + e + 8 (high nibble) of the group. Each word's bytes are reordered in registers (0, 2, 1, 3), so that
            # the decode pairs the inputs 2a and 2a + 1 of one row, as the wgmma operand's registers hold them
            wq = gl.convert_layout(wq, w2_l)
            lo, hi = gl.inline_asm_elementwise(_DECODE_ASM, "=r,=r,=r,=r,r", [wq], dtype=(gl.bfloat16, gl.bfloat16),
                                               is_pure=True, pack=4)
            w9 = gl.reshape(gl.join(lo, hi), [CH, T, 8, 4, JH, NREP, 2, 2, 2])  # (c, t, h, a, jh, r, e, b, high)
            l9: gl.constexpr = w9.type.layout
            # the scale byte B's float16 value float16(B << 7) = 2^(B >> 3 - 15) (1 + (B & 7) / 8) times 2^15 in
            # bfloat16: B << 4 read as bfloat16 bits is that value times 2^-112 (a normal: bytes 1-7, the float16
            # subnormals, never occur; Marlin zeroes them and marlin_pack's are at least 104), then times 2^127, exact;
            # 0 stays 0
            sv = (sq.to(gl.int16) << 4).to(gl.bfloat16, bitcast=True) * _MARLIN_SCALE_UP
            # scale byte 4 j1 + 2 b + j0 of h's eight, j = 2 j1 + j0 = jh * NREP + r
            s6 = gl.reshape(gl.permute(gl.reshape(sv, [CH, T, 8, 2, 2, 2]), [0, 1, 2, 3, 5, 4]),
                            [CH, T, 8, JH, NREP, 2])
            s6 = gl.convert_layout(s6, gl.SliceLayout(3, gl.SliceLayout(6, gl.SliceLayout(8, l9))))
            w9 = w9 * gl.expand_dims(gl.expand_dims(gl.expand_dims(s6, 3), 6), 8)
            # rows (r, c, jh, b, h), inputs (t, high, a, e): the operand's row 16 (WARPS r + w) + 8 b + h, input k of
            # the tile
            a = gl.reshape(gl.permute(w9, [5, 0, 4, 7, 2, 1, 8, 3, 6]), [BLOCK_N, BLOCK_K])
            acc = wgmma_step(gl.convert_layout(a, a_l), xr, x_smem, acc)
        if NREP > 1:  # rows (r, c, jh, i) to the outputs' order (c, jh, r, i)
            acc = gl.reshape(gl.permute(gl.reshape(acc, [NREP, CH, JH, 16, BLOCK_M]), [1, 2, 0, 3, 4]),
                             [BLOCK_N, BLOCK_M])
            acc = gl.convert_layout(acc, acc_l)
        return acc

    @gluon.jit
    def _wgmma_marlin_kernel(x_ptr, sxm, w_ptr, s_ptr, g_ptr, y_ptr, sym, ws_ptr, cnt_ptr, M, N, K, KB, KS,
                             BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, WARPS: gl.constexpr, NREP: gl.constexpr,
                             SPLIT_K: gl.constexpr, EVEN_N: gl.constexpr):
        """:func:`_wgmma_marlin_acc`'s loop, then split-K and the epilogue of
        :func:`vllm_ext.nvfp4_gluon._wgmma_kernel` without an adapter; ``g_ptr``: the divisor."""
        acc_l: gl.constexpr = wgmma_acc_layout(BLOCK_M, WARPS)
        pid = gl.program_id(0)
        pid_k = gl.program_id(1)
        acc = _wgmma_marlin_acc(x_ptr, sxm, w_ptr, s_ptr, M, N, K, KB, KS, pid, pid_k, acc_l, BLOCK_M, BLOCK_K, WARPS,
                                NREP, SPLIT_K, EVEN_N)
        epilogue(acc, _MARLIN_EPILOGUE_UP / gl.load(g_ptr), y_ptr, sym, ws_ptr, cnt_ptr, pid, pid_k, M, N, acc_l,
                  16 * WARPS * NREP, BLOCK_M, SPLIT_K)


def marlin_problems(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, divisor: torch.Tensor, block_k: int,
                    warps: int, nrep: int, split_k: int) -> list[str]:
    """What :func:`nvfp4_gluon_marlin_gemm` refuses in a call (empty: nothing), each a phrase naming the value and
    the rule."""
    k = x.shape[-1]
    problems = call_problems(x, block_k, warps, nrep, split_k, True)
    if shared_layout(qweight, scale, k) is None:
        problems.append(f"qweight {qweight.dtype} {tuple(qweight.shape)} / scale {scale.dtype} {tuple(scale.shape)} "
                        f"are not Marlin's unpadded tensors for K={k} (int32 [K/16, 2N], float8_e4m3fn [K/16, N], "
                        "N a multiple of 64 and K of 128, or N of 128 and K of 64): pass the layer's Marlin tensors or "
                        "build them with vllm_ext.bench.marlin_pack (for the checkpoint's layout, nvfp4_gluon_gemm)")
    elsewhere = {str(t.device) for t in (qweight, scale, divisor)} - {str(x.device)}
    if elsewhere:
        problems.append(f"qweight/scale/divisor on {', '.join(sorted(elsewhere))}, x on {x.device}: move them to x's "
                        "device")
    if divisor.numel() != 1:
        problems.append(f"divisor has {divisor.numel()} values, expected 1")
    if x.device.type != "cuda":
        problems.append(f"x on {x.device} (the kernel runs on CUDA only: Gluon has no interpreter)")
    return problems


def nvfp4_gluon_marlin_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, divisor: torch.Tensor,
                            block_k: int = 256, warps: int = 4, nrep: int = 1, split_k: int = 8) -> torch.Tensor:
    """:func:`nvfp4_gluon_gemm`'s ``wgmma`` version on the tensors vLLM's Marlin holds for an unpadded NVFP4 layer
    (``qweight`` int32 ``[K/16, 2N]``, ``scale`` FP8 ``[K/16, N]`` in Marlin's S0E5M3 form, and
    :func:`vllm_ext.nvfp4_marlin_row.marlin_divisor`'s ``divisor``), so that a layer needs no copy in the
    checkpoint's layout: ``x @ W.T`` for bfloat16 ``x`` ``[..., K]`` (at most :data:`MAX_TOKENS` rows), ``[..., N]``
    in bfloat16. Marlin's words already hold the wgmma register operand of one thread each (rows ``h``, ``h + 8`` and
    inputs ``2a``, ``2a + 1``, ``2a + 8``, ``2a + 9`` of a group), so ``x`` keeps its own K order; ``nrep`` 4 makes
    the weight loads 16 bytes wide, at the price of putting the accumulator's rows in output order once per
    program. The tile options are :func:`nvfp4_gluon_gemm`'s. Experimental: on an H200 its first loop was correct and
    its best tiles 19.5 % slower per 7B step at 8 rows than the checkpoint layout's (docs/benchmarks.md §4ay); the
    leaner loop since has run neither the GPU tests nor a timing."""
    if GLUON_IMPORT_ERROR is not None:
        raise RuntimeError(f"nvfp4_gluon_marlin_gemm needs Triton's Gluon ({GLUON_IMPORT_ERROR})")
    problems = marlin_problems(x, qweight, scale, divisor, block_k, warps, nrep, split_k)
    if problems:
        raise ValueError("nvfp4_gluon_marlin_gemm: " + "; ".join(problems))
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], scale.shape[1]
    out = torch.empty(m, n, device=x.device, dtype=torch.bfloat16)
    blocks = triton.cdiv(n, 16 * warps * nrep)
    split_k = min(split_k, k // block_k)
    block_m, ws, cnt = split_k_buffers(x, m, n, blocks, split_k, out)
    _wgmma_marlin_kernel[(blocks, split_k)](
        x2, x2.stride(0), qweight.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8),
        divisor.reshape(1).to(torch.float32), out, out.stride(0), ws, cnt, m, n, k, 8 * n, n, BLOCK_M=block_m,
        BLOCK_K=block_k, WARPS=warps, NREP=nrep, SPLIT_K=split_k, EVEN_N=n % (16 * warps * nrep) == 0,
        num_warps=warps,
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)
