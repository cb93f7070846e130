"""An experimental few-row NVFP4 GEMM written in Gluon (Triton's explicit-layout dialect). Slower than Marlin per 7B
decode step on an H100 (docs/benchmarks.md §4r: 2.481 vs 2.360 ms at 8 rows, 6.668 vs 3.893 at 64), faster on the
q/k/v and o projections at 8 rows. The engines use its wgmma version only on the opt-in ``gluon+lora`` path
(:mod:`vllm_ext.nvfp4_gluon_lora`, §4av).

Why: §4o's tensor-core kernel in Triton (``nvfp4_small_gemm(mma=True)``) moves every decoded weight operand through
shared memory, because Triton chooses the register layouts itself. In Gluon the layouts are stated: the packed bytes
are loaded in the layout from which Triton's E2M1 upcast (``gl.fp4_to_fp``) yields ``mma.sync``'s weight operand (a
dot operand with 8 consecutive K values per thread), the FP8 group scales in that same layout, ``x`` in the other
operand's layout, and ``mma_v2`` takes both from registers. Compiled for sm_90 the kernel's loop uses no shared memory.

Options (``nvfp4_gluon_gemm``): ``nrep`` row blocks of 16 per warp; ``split_k`` (one launch, the last program of a
block sums the float32 partials in a fixed order); ``prefetch`` (the next tile loaded first); ``wide`` (the operands'
K order permuted within a tile so that each thread loads one contiguous quarter of each row: 16-byte loads); ``bits``
(E2M1 decoded by moving bits, the value times 2^-126, made up by 2^118 in the scales and 2^8 in the epilogue);
``wgmma`` (Hopper: warpgroup MMA with the decoded weight as its register operand and ``x`` in shared memory; 8 rows
2.34 ms and 64 rows 4.21 ms per 7B step on an H100, §4r calls 6-7). The wgmma version on the tensors vLLM's Marlin
holds is :mod:`vllm_ext.nvfp4_gluon_marlin`; the kernels' output side (split-K, bias, the LoRA's expand) is
:mod:`vllm_ext.nvfp4_gluon_epilogue`.

Numerics: the E2M1 value times its E4M3 scale is exact in bfloat16 (at most 6 significant bits, within range), the
dots sum in float32, and ``1 / global_scale`` multiplies the sums once, so the result is within the bf16 output's
rounding of the exact product, as for the other kernels here. Gluon does not run under the Triton interpreter, so its
numerics tests are GPU tests (tests/vllm_ext/test_nvfp4_gluon.py); the CPU tests check the refusals, the compiled
kernel's resources and loads, and the bit decode's arithmetic. ``scripts/gpu/sweep_mma.py --kernel gluon`` times it
against Marlin.

Layout: compressed-tensors' ``weight_packed`` uint8 ``[N, K/2]`` (element 2i in the low nibble of byte i, as
``fp4_to_fp`` reads it), ``weight_scale`` float8_e4m3fn ``[N, K/16]``, ``weight_global_scale`` float32 ``[1]`` (the
divisor).
"""

from __future__ import annotations

import torch

from vllm_ext.triton_support import GLUON_IMPORT_ERROR, fence_async_shared, gl, gluon, mma_v2, triton, warpgroup_mma

__all__ = ["GLUON_IMPORT_ERROR", "MAX_TOKENS", "call_problems", "nvfp4_gluon_gemm", "split_k_buffers", "tile_problems"]

MAX_TOKENS = 64

if gluon is not None:
    from vllm_ext.nvfp4_gluon_epilogue import epilogue

    @gluon.constexpr_function
    def _scale3_layout(k8, warps, nrep):
        """``[16 * warps * nrep, k8, 8]``: the scales of 8 consecutive K (``[:, j, :]`` share one) laid out as
        mma.sync's weight operand ``[16 * warps * nrep, 8 * k8]`` with 8 consecutive K per thread: those 8 in
        registers; K/8 bits 0-1 in the lane's low bits and the rest in registers; row bits 0-2 in the lane's high
        bits, bit 3 in a register, the warps' bits next, and the ``nrep`` repeats of the warps' rows in registers last
        (the order Triton's ``to_linear_layout`` gives the operand). Sliced along its last dimension it holds each
        scale once per thread."""
        regs = [[0, 0, 1], [0, 0, 2], [0, 0, 4], [8, 0, 0]] + [[0, 1 << b, 0] for b in range(2, k8.bit_length() - 1)]
        regs += [[(16 * warps) << b, 0, 0] for b in range(nrep.bit_length() - 1)]
        lanes = [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
        warp_bases = [[16 << b, 0, 0] for b in range(warps.bit_length() - 1)]
        return gl.DistributedLinearLayout(regs, lanes, warp_bases, [], [16 * warps * nrep, k8, 8])

    @gluon.constexpr_function
    def _wide_w_layout(block_k, warps, nrep):
        """``[16 * warps * nrep, 4, block_k / 8]`` packed bytes, loaded wide: lane bits 0-1 pick one of four
        contiguous quarters of the tile's bytes in a row, the thread's registers hold that quarter (``block_k / 8``
        contiguous bytes, so 8- or 16-byte loads). Viewed as ``[rows, 4, block_k / 32, 4]``, permuted to ``[rows,
        block_k / 32, 4, 4]`` and flattened, it is the weight operand's byte layout with its registers reordered: the
        operand's K positions are a fixed permutation of the tile's, which ``x`` is loaded with too."""
        c = block_k // 8
        regs = [[0, 0, 1 << b] for b in range(c.bit_length() - 1)] + [[8, 0, 0]]
        regs += [[(16 * warps) << b, 0, 0] for b in range(nrep.bit_length() - 1)]
        lanes = [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
        warp_bases = [[16 << b, 0, 0] for b in range(warps.bit_length() - 1)]
        return gl.DistributedLinearLayout(regs, lanes, warp_bases, [], [16 * warps * nrep, 4, c])

    @gluon.constexpr_function
    def _wide_x_layout(block_k, block_m, warps):
        """``[4, block_k / 4, block_m]`` of ``x^T`` for the wide weight load: the thread whose lane bits 0-1 are ``j``
        holds ``x``'s K range ``j * block_k / 4 ...`` (contiguous, 16-byte loads) for the columns of its lane's high
        bits (and registers past 8); every warp holds all of it."""
        regs = [[0, 1 << b, 0] for b in range((block_k // 4).bit_length() - 1)]
        regs += [[0, 0, 8 << b] for b in range(max(block_m // 8, 1).bit_length() - 1)]
        lanes = [[1, 0, 0], [2, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]]
        warp_bases = [[0, 0, 0] for _ in range(warps.bit_length() - 1)]
        return gl.DistributedLinearLayout(regs, lanes, warp_bases, [], [4, block_k // 4, block_m])

    @gluon.constexpr_function
    def _wide_s_layout(block_k, warps, nrep):
        """``[16 * warps * nrep, 4, block_k / 64, 2]``: the FP8 scales for the wide weight load. The thread whose lane
        bits 0-1 are ``j`` holds the ``block_k / 64`` contiguous groups of its quarter of the tile; the last dimension
        (in a register) is a broadcast, since two operand chunks of 8 K share each group of 16."""
        g = max(block_k // 64, 1)
        regs = [[0, 0, 1 << b, 0] for b in range(g.bit_length() - 1)] + [[0, 0, 0, 1], [8, 0, 0, 0]]
        regs += [[(16 * warps) << b, 0, 0, 0] for b in range(nrep.bit_length() - 1)]
        lanes = [[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]]
        warp_bases = [[16 << b, 0, 0, 0] for b in range(warps.bit_length() - 1)]
        return gl.DistributedLinearLayout(regs, lanes, warp_bases, [], [16 * warps * nrep, 4, g, 2])

    @gluon.jit
    def _quarter_scales(s_ptr, N, KS, k0, n0, ok, s3_l: gl.constexpr, BLOCK_N: gl.constexpr, G: gl.constexpr,
                        MASKED: gl.constexpr):
        """The FP8 group scales of the K tile at ``k0`` for the wide loads, ``[BLOCK_N, 4, G]`` in layout ``s3_l``:
        for row ``n0 + r`` and quarter ``j`` of the tile, its ``G`` contiguous groups (the tile's groups ``j * G +
        g``). ``MASKED``: rows past ``N``, and everything where ``ok`` is false, read as 0."""
        rn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, s3_l)))
        rj = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, s3_l)))
        rg = gl.arange(0, G, layout=gl.SliceLayout(0, gl.SliceLayout(1, s3_l)))
        ptrs = s_ptr + rn[:, None, None] * KS + (k0 // 16 + rj[None, :, None] * G + rg[None, None, :])
        if MASKED:
            return gl.load(ptrs, mask=(rn < N)[:, None, None] & ok, other=0.0)
        else:
            return gl.load(ptrs)

    @gluon.jit
    def _load_tile_wide(x_ptr, sxm, w_ptr, s_ptr, M, N, KB, KS, k0, n0, ok, p_l: gl.constexpr, b_l: gl.constexpr,
                        s_l: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_M: gl.constexpr,
                        WARPS: gl.constexpr, NREP: gl.constexpr, MASK_W: gl.constexpr):
        """One K tile as :func:`_load_tile` gives it, read with wide loads: the operands' K positions ``c_hi * 32 + j
        * 8 + k_lo`` (``j``: the lane's bits 0-1) come from the tile's K ``j * block_k / 4 + c_hi * 8 + k_lo``, the
        same permutation for the weight's codes, its scales and ``x``, so the dot product is unchanged. Each thread
        loads one contiguous quarter of each operand row (16-byte loads from ``block_k`` = 128). Without ``MASK_W``
        (N a multiple of the block, no prefetch past the end) the weight's loads carry no mask."""
        w3_l: gl.constexpr = _wide_w_layout(BLOCK_K, WARPS, NREP)
        rn_w = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, w3_l)))
        rj_w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, w3_l)))
        rc_w = gl.arange(0, BLOCK_K // 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, w3_l)))
        w_ptrs = w_ptr + rn_w[:, None, None] * KB + (k0 // 2 + rj_w[None, :, None] * (BLOCK_K // 8)
                                                     + rc_w[None, None, :])
        if MASK_W:
            wq = gl.load(w_ptrs, mask=(rn_w < N)[:, None, None] & ok, other=0)
        else:
            wq = gl.load(w_ptrs)
        wq = gl.reshape(gl.permute(gl.reshape(wq, [BLOCK_N, 4, BLOCK_K // 32, 4]), [0, 2, 1, 3]),
                        [BLOCK_N, BLOCK_K // 2])
        wb = gl.convert_layout(wq, p_l)
        # operand chunk kk (8 K) = c_hi * 4 + j comes from the tile's K j * block_k / 4 + c_hi * 8, in group j * G +
        # c_hi // 2 (G = block_k / 64 groups per quarter): each thread loads its G contiguous groups and repeats each
        s4_l: gl.constexpr = _wide_s_layout(BLOCK_K, WARPS, NREP)
        G: gl.constexpr = BLOCK_K // 64
        sg = _quarter_scales(s_ptr, N, KS, k0, n0, ok, gl.SliceLayout(3, s4_l), BLOCK_N, G, MASK_W).to(gl.bfloat16)
        sg = gl.expand_dims(sg, 3) + gl.full([BLOCK_N, 4, G, 2], 0, gl.bfloat16, s4_l)
        sg = gl.reshape(gl.permute(gl.reshape(sg, [BLOCK_N, 4, 2 * G]), [0, 2, 1]), [BLOCK_N, BLOCK_K // 8])
        sc8 = gl.convert_layout(sg, s_l)
        x3_l: gl.constexpr = _wide_x_layout(BLOCK_K, BLOCK_M, WARPS)
        rj_x = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, x3_l)))
        rc_x = gl.arange(0, BLOCK_K // 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, x3_l)))
        rm_x = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, gl.SliceLayout(1, x3_l)))
        xq = gl.load(x_ptr + rm_x[None, None, :] * sxm + (k0 + rj_x[:, None, None] * (BLOCK_K // 4)
                                                         + rc_x[None, :, None]),
                     mask=(rm_x < M)[None, None, :] & ok, other=0.0)
        xq = gl.reshape(gl.permute(gl.reshape(xq, [4, BLOCK_K // 32, 8, BLOCK_M]), [1, 0, 2, 3]), [BLOCK_K, BLOCK_M])
        xb = gl.convert_layout(xq, b_l)
        return wb, sc8, xb

    @gluon.jit
    def _load_tile(x_ptr, sxm, w_ptr, s_ptr, KB, KS, k0, rn_p, n_ok_p, rb_p, rn_s, n_ok_s, rk_s, rm_b, m_ok_b, rk_b,
                   ok):
        """One K tile's packed codes, FP8 scales and ``x^T``, each in the layout its use takes (nothing is loaded
        where ``ok`` is false: the prefetch past the last tile)."""
        wb = gl.load(w_ptr + rn_p[:, None] * KB + (k0 // 2 + rb_p)[None, :], mask=n_ok_p & ok, other=0)
        sc8 = gl.load(s_ptr + rn_s[:, None] * KS + (k0 // 16 + rk_s // 2)[None, :], mask=n_ok_s & ok,
                      other=0.0)
        xb = gl.load(x_ptr + rm_b[None, :] * sxm + (k0 + rk_b)[:, None], mask=m_ok_b & ok, other=0.0)
        return wb, sc8, xb

    @gluon.jit
    def _load_either(x_ptr, sxm, w_ptr, s_ptr, M, N, KB, KS, k0, n0, ok, rn_p, n_ok_p, rb_p, rn_s, n_ok_s, rk_s, rm_b,
                     m_ok_b, rk_b, p_l: gl.constexpr, b_l: gl.constexpr, s_l: gl.constexpr, BLOCK_N: gl.constexpr,
                     BLOCK_K: gl.constexpr, BLOCK_M: gl.constexpr, WARPS: gl.constexpr, NREP: gl.constexpr,
                     MASK_W: gl.constexpr, WIDE: gl.constexpr):
        """:func:`_load_tile_wide` or :func:`_load_tile`, as ``WIDE`` says."""
        if WIDE:
            return _load_tile_wide(x_ptr, sxm, w_ptr, s_ptr, M, N, KB, KS, k0, n0, ok, p_l, b_l, s_l, BLOCK_N, BLOCK_K,
                                   BLOCK_M, WARPS, NREP, MASK_W)
        else:
            return _load_tile(x_ptr, sxm, w_ptr, s_ptr, KB, KS, k0, rn_p, n_ok_p, rb_p, rn_s, n_ok_s, rk_s, rm_b,
                              m_ok_b, rk_b, ok)

    # E2M1 to bfloat16 by moving bits, four packed bytes (eight codes) at a time: the code's sign to the bf16 sign, its
    # two exponent bits and one mantissa bit to the lowest exponent bits and the top mantissa bit. That is the value
    # times 2^-126 (the code 0.5 becomes the subnormal 2^-127), which the scales make up. Outputs: the low nibbles of
    # bytes (0, 1) and (2, 3), then the high nibbles likewise, each pair one bf16x2 register.
    def _decode_word_asm(sel: str, lo: str, hi: str) -> str:
        """Two bytes of ``$4`` (``prmt`` selector ``sel``) into the bf16x2 registers ``lo`` (their low nibbles) and
        ``hi`` (their high nibbles): a nibble at bits 12-15 / 28-31 goes to bf16's bits 6-8 / 22-24 and its sign to 15
        / 31."""
        return f"""
    prmt.b32 t, $4, 0, {sel};
    shl.b32 u, t, 4;
    and.b32 v, u, 0x70007000;
    shr.b32 v, v, 6;
    and.b32 u, u, 0x80008000;
    or.b32 {lo}, u, v;
    and.b32 v, t, 0x70007000;
    shr.b32 v, v, 6;
    and.b32 u, t, 0x80008000;
    or.b32 {hi}, u, v;"""

    _DECODE_ASM = gl.constexpr("{\n    .reg .b32 t, u, v;" + _decode_word_asm("0x1404", "$0", "$2")
                               + _decode_word_asm("0x3424", "$1", "$3") + "\n    }")
    # the bit decode's 2^-126 made up: 2^118 in the bf16 scales (exact, 2^109 to 2^126.8; the scaled weights normal and
    # exact, 2^-18 to 10.5), the last 2^8 in the epilogue's float32
    _SCALE_UP = gl.constexpr(2.0**118)
    _EPILOGUE_UP = gl.constexpr(2.0**8)

    @gluon.jit
    def _mma_tile(wb, sc8, xb, acc, a_l: gl.constexpr, b_l: gl.constexpr, s3_l: gl.constexpr, BLOCK_N: gl.constexpr,
                  BLOCK_K: gl.constexpr, BITS: gl.constexpr):
        """``acc += W_tile x_tile^T`` on the tensor cores, both operands from registers. ``BITS``: decode by moving
        bits (:data:`_DECODE_ASM`), which orders each thread's 8 operand K as the low nibbles of its 4 bytes, then the
        high ones; ``x`` is permuted alike here. The decoded values are 2^-126 of the codes'; the scales carry 2^118 of
        that and the kernel's epilogue the last 2^8."""
        if BITS:
            lo, hi = gl.inline_asm_elementwise(_DECODE_ASM, "=r,=r,=r,=r,r", [wb], dtype=(gl.bfloat16, gl.bfloat16),
                                               is_pure=True, pack=4)
            a = gl.reshape(gl.permute(gl.reshape(gl.join(lo, hi), [BLOCK_N, BLOCK_K // 8, 4, 2]), [0, 1, 3, 2]),
                           [BLOCK_N, BLOCK_K])
            a = gl.convert_layout(a, a_l)
            bm: gl.constexpr = xb.shape[1]
            xb = gl.reshape(gl.permute(gl.reshape(xb, [BLOCK_K // 8, 4, 2, bm]), [0, 2, 1, 3]), [BLOCK_K, bm])
            xb = gl.convert_layout(xb, b_l)
        else:
            a = gl.convert_layout(gl.fp4_to_fp(wb, gl.bfloat16, 1), a_l)  # E2M1 values, exact
        # one scale per thread per 8 consecutive K (they share a group), broadcast into the operand's 8-wide dimension
        sc = sc8.to(gl.float32)
        if BITS:
            sc = sc * _SCALE_UP
        sc = sc.to(gl.bfloat16)
        sc = gl.reshape(gl.expand_dims(sc, 2) + gl.full([BLOCK_N, BLOCK_K // 8, 8], 0, gl.bfloat16, s3_l),
                        [BLOCK_N, BLOCK_K])
        a = a * gl.convert_layout(sc, a_l)  # exact: at most 6 significant bits
        return mma_v2(a, xb.to(gl.bfloat16), acc)

    @gluon.jit
    def _gluon_kernel(x_ptr, sxm, w_ptr, s_ptr, g_ptr, y_ptr, sym, ws_ptr, cnt_ptr, M, N, K, KB, KS,
                      BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, WARPS: gl.constexpr, NREP: gl.constexpr,
                      SPLIT_K: gl.constexpr, PREFETCH: gl.constexpr, WIDE: gl.constexpr, BITS: gl.constexpr,
                      EVEN_N: gl.constexpr):
        """``y^T[n, m] = sum_k W[n, k] x[m, k]`` for ``16 * WARPS * NREP`` rows of W per program, over K tiles
        ``pid_k, pid_k + SPLIT_K, ...``; with ``PREFETCH`` the next tile's loads are issued before this tile's
        tensor-core work (two tiles in flight per warp). With split-K each program stores its float32 partial in the
        workspace ``[SPLIT_K, BLOCK_M, N]`` and counts itself in at ``cnt_ptr[pid_n]``; the last to arrive sums the
        partials in a fixed order (bit-reproducible), stores the output and resets the counter."""
        BLOCK_N: gl.constexpr = 16 * WARPS * NREP
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)  # the decoded weight
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)  # its packed bytes
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)  # x^T
        s3_l: gl.constexpr = _scale3_layout(BLOCK_K // 8, WARPS, NREP)
        s_l: gl.constexpr = gl.SliceLayout(2, s3_l)
        pid = gl.program_id(0)
        pid_k = gl.program_id(1)
        rn_p = pid * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, p_l))
        rb_p = gl.arange(0, BLOCK_K // 2, layout=gl.SliceLayout(0, p_l))
        rn_s = pid * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_l))
        rk_s = gl.arange(0, BLOCK_K // 8, layout=gl.SliceLayout(0, s_l))
        rk_b = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, b_l))
        rm_b = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, b_l))
        n_ok_p = (rn_p < N)[:, None]
        n_ok_s = (rn_s < N)[:, None]
        m_ok_b = (rm_b < M)[None, :]
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
        n_tiles = K // BLOCK_K
        MASK_W: gl.constexpr = PREFETCH or not EVEN_N
        if PREFETCH:
            wb, sc8, xb = _load_either(x_ptr, sxm, w_ptr, s_ptr, M, N, KB, KS, pid_k * BLOCK_K, pid * BLOCK_N, True,
                                       rn_p, n_ok_p, rb_p, rn_s, n_ok_s, rk_s, rm_b, m_ok_b, rk_b, p_l, b_l, s_l,
                                       BLOCK_N, BLOCK_K, BLOCK_M, WARPS, NREP, MASK_W, WIDE)
            for t in range(pid_k + SPLIT_K, n_tiles + SPLIT_K, SPLIT_K):
                wb2, sc2, xb2 = _load_either(x_ptr, sxm, w_ptr, s_ptr, M, N, KB, KS, t * BLOCK_K, pid * BLOCK_N,
                                             t < n_tiles, rn_p, n_ok_p, rb_p, rn_s, n_ok_s, rk_s, rm_b, m_ok_b, rk_b,
                                             p_l, b_l, s_l, BLOCK_N, BLOCK_K, BLOCK_M, WARPS, NREP, MASK_W, WIDE)
                acc = _mma_tile(wb, sc8, xb, acc, a_l, b_l, s3_l, BLOCK_N, BLOCK_K, BITS)
                wb = wb2
                sc8 = sc2
                xb = xb2
        else:
            for t in range(pid_k, n_tiles, SPLIT_K):
                wb, sc8, xb = _load_either(x_ptr, sxm, w_ptr, s_ptr, M, N, KB, KS, t * BLOCK_K, pid * BLOCK_N, True,
                                           rn_p, n_ok_p, rb_p, rn_s, n_ok_s, rk_s, rm_b, m_ok_b, rk_b, p_l, b_l, s_l,
                                           BLOCK_N, BLOCK_K, BLOCK_M, WARPS, NREP, MASK_W, WIDE)
                acc = _mma_tile(wb, sc8, xb, acc, a_l, b_l, s3_l, BLOCK_N, BLOCK_K, BITS)
        gmul = (_EPILOGUE_UP if BITS else 1.0) / gl.load(g_ptr)
        epilogue(acc, gmul, y_ptr, sym, ws_ptr, cnt_ptr, pid, pid_k, M, N, mma, BLOCK_N, BLOCK_M, SPLIT_K)

    @gluon.constexpr_function
    def _x_smem_layout(block_m, block_k):
        return gl.NVMMASharedLayout.get_default_for([block_m, block_k], gl.bfloat16)

    @gluon.constexpr_function
    def _x_load_layout(block_k, warps):
        """``[rows, block_k]`` of ``x``: 8 contiguous K per thread (16-byte loads), a warp across K first."""
        tk = min(32, block_k // 8)
        return gl.BlockedLayout([1, 8], [32 // tk, tk], [warps, 1], [1, 0])

    @gluon.jit
    def _wg_load(x_ptr, w_ptr, s_ptr, N, KS, k0, n0, w_offs, w_ok, x_offs, x_ok, BLOCK_N: gl.constexpr,
                 BLOCK_K: gl.constexpr, EVEN_N: gl.constexpr):
        """One K tile for :func:`_wgmma_kernel`: the weight read wide, decoded by moving bits and scaled, as ``[rows, j,
        g, c % 8, h]`` (the tile's K ``j * block_k / 4 + 16 g + 2 (c % 8) + h``), and ``x``'s tile in its own order."""
        G: gl.constexpr = BLOCK_K // 64
        if EVEN_N:
            wq = gl.load(w_ptr + w_offs + k0 // 2)
        else:
            wq = gl.load(w_ptr + w_offs + k0 // 2, mask=w_ok, other=0)
        lo, hi = gl.inline_asm_elementwise(_DECODE_ASM, "=r,=r,=r,=r,r", [wq], dtype=(gl.bfloat16, gl.bfloat16),
                                           is_pure=True, pack=4)
        w5 = gl.reshape(gl.join(lo, hi), [BLOCK_N, 4, G, 8, 2])
        l5: gl.constexpr = w5.type.layout
        s3_l: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, l5))
        sg = _quarter_scales(s_ptr, N, KS, k0, n0, True, s3_l, BLOCK_N, G, not EVEN_N)
        sg = (sg.to(gl.float32) * _SCALE_UP).to(gl.bfloat16)
        w5 = w5 * gl.expand_dims(gl.expand_dims(sg, 3), 4)
        return w5, gl.load(x_ptr + x_offs + k0, mask=x_ok, other=0.0)

    @gluon.constexpr_function
    def wgmma_acc_layout(block_m, warps):
        """The wgmma kernels' accumulator ``[16 * warps * nrep, block_m]``: one or two warpgroups along the outputs."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, block_m, 16])

    @gluon.jit
    def x_tile_offsets(sxm, M, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, WARPS: gl.constexpr):
        """``x``'s ``[BLOCK_M, BLOCK_K]`` tile for the wgmma loops: its offsets from the tile's first input and its
        rows' mask, in :func:`_x_load_layout`."""
        x_l: gl.constexpr = _x_load_layout(BLOCK_K, WARPS)
        rm_x = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_l))
        rk_x = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, x_l))
        return rm_x[:, None] * sxm + rk_x[None, :], (rm_x < M)[:, None]

    @gluon.jit
    def wgmma_step(a, xr, x_smem, acc):
        """One K tile of the wgmma loops: ``x``'s tile ``xr`` into shared memory, once every warpgroup's last wgmma has
        read the one before, then ``acc + a @ xr^T``."""
        gl.thread_barrier()
        x_smem.store(xr)
        fence_async_shared()
        gl.thread_barrier()
        return warpgroup_mma(a, x_smem.permute((1, 0)), acc)

    @gluon.jit
    def _wgmma_acc(x_ptr, sxm, w_ptr, s_ptr, M, N, K, KB, KS, pid, pid_k, acc_l: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_K: gl.constexpr, WARPS: gl.constexpr, NREP: gl.constexpr, SPLIT_K: gl.constexpr,
                   EVEN_N: gl.constexpr):
        """The Hopper version: ``warpgroup_mma`` (wgmma) with the decoded weight in registers and ``x`` in shared
        memory, ``16 * WARPS * NREP`` weight rows per program (4 or 8 warps: one or two warpgroups). The weight is
        read wide and decoded by moving bits as in :func:`_gluon_kernel`; its registers are then renamed into wgmma's
        register operand (pairs of consecutive K): operand K ``g * 64 + cb * 32 + h * 16 + c1 * 8 + j * 2 + c0``
        holds the tile's code ``j * block_k / 4 + 16 g + 8 cb + 4 c1 + 2 c0 + h`` (j: the lane's bits 0-1), and ``x``
        is stored into shared memory in that order. Returns program ``(pid, pid_k)``'s float32 sums in ``acc_l``
        (wgmma's accumulator layout). (A version with the decoded weight in shared memory too, two buffers and one
        wgmma in flight, was 15-46 % slower on every 7B linear at 8 and 64 rows, §4s results, and is removed.)"""
        BLOCK_N: gl.constexpr = 16 * WARPS * NREP
        G: gl.constexpr = BLOCK_K // 64
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
        w3_l: gl.constexpr = _wide_w_layout(BLOCK_K, WARPS, NREP)
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_K], _x_smem_layout(BLOCK_M, BLOCK_K))
        n0 = pid * BLOCK_N
        rn_w = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, w3_l)))
        rj_w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, w3_l)))
        rc_w = gl.arange(0, BLOCK_K // 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, w3_l)))
        w_offs = rn_w[:, None, None] * KB + rj_w[None, :, None] * (BLOCK_K // 8) + rc_w[None, None, :]
        w_ok = (rn_w < N)[:, None, None]
        x_offs, x_ok = x_tile_offsets(sxm, M, BLOCK_M, BLOCK_K, WARPS)
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_l)
        for t in range(pid_k, K // BLOCK_K, SPLIT_K):
            w5, xr = _wg_load(x_ptr, w_ptr, s_ptr, N, KS, t * BLOCK_K, n0, w_offs, w_ok, x_offs, x_ok, BLOCK_N,
                              BLOCK_K, EVEN_N)
            a = gl.reshape(gl.permute(gl.reshape(w5, [BLOCK_N, 4, G, 2, 2, 2, 2]), [0, 2, 3, 6, 4, 1, 5]),
                           [BLOCK_N, BLOCK_K])
            a = gl.convert_layout(a, a_l)
            xr = gl.reshape(gl.permute(gl.reshape(xr, [BLOCK_M, 4, G, 2, 2, 2, 2]), [0, 2, 3, 6, 4, 1, 5]),
                            [BLOCK_M, BLOCK_K])
            acc = wgmma_step(a, xr, x_smem, acc)
        return acc

    @gluon.jit
    def _wgmma_kernel(x_ptr, sxm, w_ptr, s_ptr, g_ptr, y_ptr, sym, ws_ptr, cnt_ptr, M, N, K, KB, KS,
                      hp_ptr, idx_ptr, b0, b1, b2, n0, n1, LKS, lscale, bias_ptr, z_ptr,
                      BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, WARPS: gl.constexpr, NREP: gl.constexpr,
                      SPLIT_K: gl.constexpr, EVEN_N: gl.constexpr, LORA: gl.constexpr, R: gl.constexpr,
                      HP_M: gl.constexpr, KS_PAD: gl.constexpr, PDL: gl.constexpr, HAS_BIAS: gl.constexpr,
                      ZEROS: gl.constexpr):
        """The Hopper version (:func:`_wgmma_acc`'s loop), then split-K and the epilogue as in :func:`_gluon_kernel`.
        With ``LORA`` (:mod:`vllm_ext.nvfp4_gluon_lora`) one adapter's expand runs in the epilogue of each output
        block's finishing program (:func:`vllm_ext.nvfp4_gluon_epilogue.lora_update`; ``hp_ptr`` ... ``lscale`` as
        there, ``LKS`` its partials per slice), the bias ``[N]`` is added in float32 before the base is rounded
        (``HAS_BIAS``), and ``z`` (like ``y``) is zeroed (``ZEROS``); without it those arguments are not read."""
        acc_l: gl.constexpr = wgmma_acc_layout(BLOCK_M, WARPS)
        pid = gl.program_id(0)
        pid_k = gl.program_id(1)
        acc = _wgmma_acc(x_ptr, sxm, w_ptr, s_ptr, M, N, K, KB, KS, pid, pid_k, acc_l, BLOCK_M, BLOCK_K, WARPS, NREP,
                         SPLIT_K, EVEN_N)
        lora = (hp_ptr, idx_ptr, b0, b1, b2, n0, n1, LKS, lscale, bias_ptr, z_ptr)
        epilogue(acc, _EPILOGUE_UP / gl.load(g_ptr), y_ptr, sym, ws_ptr, cnt_ptr, pid, pid_k, M, N, acc_l,
                  16 * WARPS * NREP, BLOCK_M, SPLIT_K, lora, LORA, WARPS, R, HP_M, KS_PAD, PDL, HAS_BIAS, ZEROS)


def tile_problems(k: int, block_k: int, warps: int, nrep: int, split_k: int, wgmma: bool) -> list[str]:
    """What is wrong with a tile for input size ``k`` (empty: nothing), each a phrase naming the value and the rule."""
    problems = []
    if block_k % 64 or k % block_k:
        problems.append(f"K={k} and block_k={block_k}: block_k must be a multiple of 64 that divides K")
    if warps not in ((4, 8) if wgmma else (1, 2, 4, 8)):
        problems.append(f"warps={warps} (4 or 8 with wgmma: one or two warpgroups)" if wgmma
                        else f"warps={warps} (1, 2, 4 or 8)")
    if nrep not in (1, 2, 4):
        problems.append(f"nrep={nrep} (1, 2 or 4)")
    if not 1 <= split_k <= 16:
        problems.append(f"split_k={split_k} (1 to 16)")
    return problems


def call_problems(x: torch.Tensor, block_k: int, warps: int, nrep: int, split_k: int, wgmma: bool) -> list[str]:
    """What both launchers refuse in ``x`` and the tile (empty: nothing): bfloat16 activations, 1 to
    :data:`MAX_TOKENS` rows, and :func:`tile_problems`."""
    k = x.shape[-1]
    m = x.numel() // max(k, 1)
    problems = []
    if x.dtype != torch.bfloat16:
        problems.append(f"activations in {x.dtype} (bfloat16 supported)")
    if not 1 <= m <= MAX_TOKENS:
        problems.append(f"{m} rows (1 to {MAX_TOKENS})")
    return problems + tile_problems(k, block_k, warps, nrep, split_k, wgmma)


def split_k_buffers(x: torch.Tensor, m: int, n: int, blocks: int, split_k: int,
                    out: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``(block_m, workspace, counters)`` for a launch over ``m`` tokens and ``n`` outputs in ``blocks`` output
    blocks: with split-K the float32 partials ``[split_k, block_m, N]`` and the blocks' arrival counters, else
    ``out`` for both (not read)."""
    block_m = max(8, triton.next_power_of_2(m))
    if split_k == 1:
        return block_m, out, out
    from vllm_ext.nvfp4_gemv import _counters

    return block_m, torch.empty(split_k, block_m, n, device=x.device, dtype=torch.float32), _counters(x.device, blocks)


def nvfp4_gluon_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     block_k: int = 128, warps: int = 1, nrep: int = 1, split_k: int = 1,
                     prefetch: bool = False, wide: bool = False, bits: bool = False,
                     wgmma: bool = False) -> torch.Tensor:
    """``x @ W.T`` for bfloat16 ``x`` ``[..., K]`` (at most :data:`MAX_TOKENS` rows) and ``W`` as the NVFP4 triple
    (``packed`` uint8 ``[N, K/2]``, ``scale`` float8_e4m3fn ``[N, K/16]``, ``global_scale`` the float32 divisor);
    returns ``[..., N]`` in bfloat16. ``block_k``: input features per step (a multiple of 64 dividing K); ``warps``:
    warps per program, 16 output features each, ``nrep`` times (one program per ``16 * warps * nrep`` features);
    ``split_k``: programs per output block over disjoint K tiles (one launch; the last to finish sums the partials in
    a fixed order); ``prefetch``: load the next K tile before this one's tensor-core work; ``wide``: each thread
    loads contiguous quarters of the tile's rows (16-byte loads; the operands' K order is permuted alike); ``bits``:
    decode E2M1 by moving bits (about 4 instructions per two values instead of table lookups), the scales carrying
    the power of two that makes the values up; ``wgmma``: Hopper's warpgroup MMA with ``x`` in shared memory (4 or 8
    warps; always wide and bit-decoded; ``prefetch`` is refused with it). CUDA only (Gluon has no interpreter)."""
    if GLUON_IMPORT_ERROR is not None:
        raise RuntimeError(f"nvfp4_gluon_gemm needs Triton's Gluon ({GLUON_IMPORT_ERROR})")
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], packed.shape[0]
    problems = call_problems(x, block_k, warps, nrep, split_k, wgmma)
    if tuple(packed.shape) != (n, k // 2) or packed.dtype != torch.uint8:
        problems.append(f"packed {packed.dtype} {tuple(packed.shape)}, expected uint8 ({n}, {k // 2})")
    if tuple(scale.shape) != (n, k // 16) or scale.dtype != torch.float8_e4m3fn:
        problems.append(f"scale {scale.dtype} {tuple(scale.shape)}, expected float8_e4m3fn ({n}, {k // 16})")
    if global_scale.numel() != 1:
        problems.append(f"global_scale has {global_scale.numel()} values, expected 1")
    if wgmma and prefetch:
        problems.append("prefetch=True with wgmma=True (the wgmma version has no prefetch; it is always wide and "
                        "bit-decoded): drop prefetch")
    if x.device.type != "cuda":
        problems.append(f"x on {x.device} (the kernel runs on CUDA only: Gluon has no interpreter)")
    if problems:
        raise ValueError("nvfp4_gluon_gemm: " + "; ".join(problems))
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(m, n, device=x.device, dtype=torch.bfloat16)
    blocks = triton.cdiv(n, 16 * warps * nrep)
    split_k = min(split_k, k // block_k)
    block_m, ws, cnt = split_k_buffers(x, m, n, blocks, split_k, out)
    kernel, options = ((_wgmma_kernel, dict(  # no adapter: the LoRA's arguments are not read
        hp_ptr=ws, idx_ptr=cnt, b0=x2, b1=x2, b2=x2, n0=0, n1=0, LKS=0, lscale=0.0, bias_ptr=out, z_ptr=out,
        LORA=False, R=16, HP_M=16, KS_PAD=16, PDL=False, HAS_BIAS=False, ZEROS=False)) if wgmma else
                       (_gluon_kernel, dict(PREFETCH=bool(prefetch), WIDE=bool(wide), BITS=bool(bits))))
    kernel[(blocks, split_k)](
        x2, x2.stride(0), packed.contiguous(), scale.contiguous(), global_scale.reshape(1).to(torch.float32), out,
        out.stride(0), ws, cnt, m, n, k, k // 2, k // 16, BLOCK_M=block_m, BLOCK_K=block_k, WARPS=warps, NREP=nrep,
        SPLIT_K=split_k, EVEN_N=n % (16 * warps * nrep) == 0, num_warps=warps, **options,
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)
