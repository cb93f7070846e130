"""The output side of vllm_ext.nvfp4_gluon's few-row GEMMs (their register and wgmma versions, and
:mod:`vllm_ext.nvfp4_gluon_marlin`): split-K's fixed-order sum of the float32 partials, the scaling by the global scale,
the rounding and store, and, for :mod:`vllm_ext.nvfp4_gluon_lora`, a bias, one adapter's expand (the LoRA's ``B h`` on
the tensor cores, as punica rounds it) and the overlap op's zeros, all in the block's finishing program."""

from __future__ import annotations

from vllm_ext.triton_support import gl, gluon, mma_v2

__all__ = ["epilogue", "finish", "gdc_wait", "lora_update"]

if gluon is not None:

    @gluon.jit
    def gdc_wait():
        """``griddepcontrol.wait``: wait until the grids this programmatic dependent launch depends on have finished
        and their writes are visible (Triton's ``gdc_wait``, which is not exported to Gluon)."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def lora_update(pid, M, N, lora, out_ty: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                     WARPS: gl.constexpr, R: gl.constexpr, HP_M: gl.constexpr, KS_PAD: gl.constexpr,
                     PDL: gl.constexpr):
        """The adapter's update for output block ``pid``, ``[BLOCK_N, BLOCK_M]`` in ``out_ty``, as punica computes
        it: ``h`` = the shrink's float32 partials of this block's slice summed in a fixed order, times ``lscale``,
        zero for a token whose slot is not 0, rounded to ``out_ty``; then ``B_s h`` summed in float32 on the tensor
        cores (mma.sync) and rounded. ``lora`` = ``(hp_ptr, idx_ptr, b0, b1, b2, n0, n1, KS, lscale)``: the partials
        ``[slices, KS_PAD, HP_M, R]``, the tokens' slots, each slice's ``B`` ``[n_s, R]``, the first two slice sizes
        and the partials per slice (then the bias and the zeros' output, used by :func:`finish` and
        :func:`epilogue`). A block never straddles two slices (the launch checks). ``PDL``: wait for the shrink's
        grid before reading its partials."""
        hp_ptr, idx_ptr, b0, b1, b2, n0, n1, KS, lscale, _bias, _z = lora
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
        # k_width 2, mma.sync's own operand layout for 16-bit values (with 8, as the GEMM's loop uses, a rank of 16,
        # half of the 32 K that 8 per thread span, gave wrong sums on an H200: §4au)
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        bl: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (R // 8), R // 8], [WARPS, 1], [1, 0])  # R: 16 ... 128
        hl: gl.constexpr = gl.BlockedLayout([1, 1], [32 // BLOCK_M if BLOCK_M < 32 else 1,
                                                     BLOCK_M if BLOCK_M < 32 else 32], [WARPS, 1], [1, 0])
        row0 = pid * BLOCK_N
        rn = row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, bl))
        rr = gl.arange(0, R, layout=gl.SliceLayout(0, bl))
        n_ok = (rn < N)[:, None]
        # the slice of the block's first row, as nvfp4_gemv_lora._lora_rows finds it (a Gluon kernel cannot call a
        # triton.jit function, so the few lines are repeated here)
        if row0 >= n0 + n1:
            bt = gl.load(b2 + (rn - n0 - n1)[:, None] * R + rr[None, :], mask=n_ok, other=0.0)
            hs = 2
        elif row0 >= n0:
            bt = gl.load(b1 + (rn - n0)[:, None] * R + rr[None, :], mask=n_ok, other=0.0)
            hs = 1
        else:
            bt = gl.load(b0 + rn[:, None] * R + rr[None, :], mask=n_ok, other=0.0)
            hs = 0
        r2 = gl.arange(0, R, layout=gl.SliceLayout(1, hl))
        m2 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, hl))
        m_ok = m2 < M
        if PDL:
            gdc_wait()
        h_ptrs = hp_ptr + (hs * KS_PAD * HP_M + m2[None, :]) * R + r2[:, None]
        tot = gl.zeros([R, BLOCK_M], gl.float32, hl)
        for c in range(KS):  # a fixed order
            tot += gl.load(h_ptrs + c * (HP_M * R), mask=m_ok[None, :], other=0.0)
        slot = gl.load(idx_ptr + m2, mask=m_ok, other=-1)
        h = gl.where((slot == 0)[None, :], tot * lscale, 0.0).to(out_ty)  # punica's intermediate, rounded
        up = mma_v2(gl.convert_layout(bt, a_l), gl.convert_layout(h, b_l),
                    gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma))
        return up.to(out_ty)

    @gluon.jit
    def finish(tot, gmul, pid, M, N, y_ptrs, sym, rm_o, rn_o, ok, lora, acc_l: gl.constexpr, BLOCK_N: gl.constexpr,
                BLOCK_M: gl.constexpr, LORA: gl.constexpr, WARPS: gl.constexpr, R: gl.constexpr, HP_M: gl.constexpr,
                KS_PAD: gl.constexpr, PDL: gl.constexpr, HAS_BIAS: gl.constexpr, ZEROS: gl.constexpr):
        """Stores the output block at ``y_ptrs`` (rows ``rm_o`` of ``y``, columns ``rn_o``, where ``ok``): ``tot *
        gmul`` (plus the bias in float32 with ``HAS_BIAS``, the ``lora`` tuple's) rounded to ``y``'s dtype; with
        ``LORA`` the adapter's rounded update (:func:`lora_update`) added in float32 and rounded again, as a base GEMM
        followed by punica's expand. ``ZEROS``: the same block of the ``lora`` tuple's last tensor (shaped like ``y``)
        is set to zero too (the overlap op's split add, whose model adds it: no launch of its own)."""
        out_ty: gl.constexpr = y_ptrs.dtype.element_ty
        base = tot * gmul
        if HAS_BIAS:
            rn = pid * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_l))
            base = base + gl.load(lora[9] + rn, mask=rn < N, other=0.0).to(gl.float32)[:, None]
        base = base.to(out_ty)
        if LORA:
            up = lora_update(pid, M, N, lora, out_ty, BLOCK_N, BLOCK_M, WARPS, R, HP_M, KS_PAD, PDL)
            base = (base.to(gl.float32) + gl.convert_layout(up, acc_l).to(gl.float32)).to(out_ty)
        gl.store(y_ptrs, base, mask=ok)
        if ZEROS:
            gl.store(lora[10] + rm_o[None, :] * sym + rn_o[:, None], gl.zeros([BLOCK_N, BLOCK_M], out_ty, acc_l),
                     mask=ok)

    @gluon.jit
    def epilogue(acc, gmul, y_ptr, sym, ws_ptr, cnt_ptr, pid, pid_k, M, N, acc_l: gl.constexpr, BLOCK_N: gl.constexpr,
                  BLOCK_M: gl.constexpr, SPLIT_K: gl.constexpr, lora=None, LORA: gl.constexpr = False,
                  WARPS: gl.constexpr = 4, R: gl.constexpr = 16, HP_M: gl.constexpr = 16, KS_PAD: gl.constexpr = 16,
                  PDL: gl.constexpr = False, HAS_BIAS: gl.constexpr = False, ZEROS: gl.constexpr = False):
        """``y^T`` block ``pid`` = ``acc * gmul`` in ``y``'s dtype (with ``LORA``, ``HAS_BIAS`` and ``ZEROS``, as
        :func:`finish` says). With split-K each program stores its float32 partial in the workspace ``[SPLIT_K,
        BLOCK_M, N]`` and counts itself in at ``cnt_ptr[pid]``; the last to arrive sums the partials in a fixed order
        (bit-reproducible), stores the output and resets the counter."""
        rn_o = pid * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_l))
        rm_o = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_l))
        ok = (rn_o < N)[:, None] & (rm_o < M)[None, :]
        y_ptrs = y_ptr + rm_o[None, :] * sym + rn_o[:, None]
        if SPLIT_K == 1:
            finish(acc, gmul, pid, M, N, y_ptrs, sym, rm_o, rn_o, ok, lora, acc_l, BLOCK_N, BLOCK_M, LORA, WARPS, R,
                    HP_M, KS_PAD, PDL, HAS_BIAS, ZEROS)
        else:
            ws_ptrs = ws_ptr + rm_o[None, :] * N + rn_o[:, None]
            gl.store(ws_ptrs + pid_k * (BLOCK_M * N), acc, mask=ok)
            gl.thread_barrier()  # every warp's partial is stored before the one arrival below releases them
            arrived = gl.atomic_add(cnt_ptr + pid, 1)  # acq_rel at GPU scope
            if arrived == SPLIT_K - 1:
                tot = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_l)
                for s in gl.static_range(SPLIT_K):  # a fixed order, whatever order the programs arrived in
                    tot += gl.load(ws_ptrs + s * (BLOCK_M * N), mask=ok, other=0.0, cache_modifier=".cg")
                finish(tot, gmul, pid, M, N, y_ptrs, sym, rm_o, rn_o, ok, lora, acc_l, BLOCK_N, BLOCK_M, LORA, WARPS,
                        R, HP_M, KS_PAD, PDL, HAS_BIAS, ZEROS)
                gl.atomic_xchg(cnt_ptr + pid, 0)  # ready for the next call (and the next CUDA-graph replay)
