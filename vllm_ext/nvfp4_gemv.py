"""A Triton W4A16 NVFP4 GEMM for decode-sized inputs (at most 64 rows), straight from the compressed-tensors layout.
Experimental: engines use it only with ``additional_config={"qerl_nvfp4": {"decode_gemv": true}}`` (or ``"small"``:
q/k/v and o only, :func:`small_linear`; one-row calls,
:func:`nvfp4_gemv_row`, chosen per call by ``vllm_ext.nvfp4_backends``' op); ``qerl bench kernels`` and
``scripts/gpu/check_gemv.py`` time it against vLLM's Marlin FP4 GEMM (docs/benchmarks.md §4h, §4j, §4k). On the H100
the one-row path (``words=True``, PTX decode, ``xvec``) is 18 % faster than Marlin per 7B decode step at batch 1
standalone (1.93 vs 2.37 ms, §4j) and makes the engine's 7B b1 decode 12 % faster (§4k); at 32B it is only 3 %
faster than Marlin (8.50 vs 8.77 ms per step; the engine's +1.6 % is inside the spread). With its loop
software-pipelined and the tiles swept again (``stages``, §4n) it is 1.883 ms per 7B step and 7.500 ms per 32B step
(the unpipelined kernel 1.934 and 8.014, same H100 run). The tensor-core path is 4-5x slower than Marlin at 8 and 64
rows; ``mma=True``, a tensor-core kernel on the int32 words (one dot per code position, pipelined), is 2.4x slower
(5.83 vs 2.38 ms per 7B step at 8 rows, 9.45 vs 3.91 at 64; §4o), bound by its own instructions and shared memory:
the decoded operand passes through shared memory, which Triton's layouts do not let it avoid.

Why: §4h profiles a 7B decode step and finds vLLM's Marlin FP4 GEMMs at 2.38 ms of 4.64 at batch 1 and at 4.15 of
7.44 ms at batch 64, while the 4-bit weights and FP8 scales of those linears (~3.7 GB) need ~1.1 ms at the H100's
bandwidth. Marlin reads as few bytes as BF16 cuBLAS at b64 but takes 0.8x its time (so it is not bound by memory
there), and it is slower than BF16 on the small q/k/v and o projections at b1 (§4b). A GEMM on the checkpoint's own
layout (``weight_packed`` uint8 ``[N, K/2]``, even column in the low nibble; ``weight_scale`` float8_e4m3fn
``[N, K/16]``; ``weight_global_scale`` float32 ``[1]``, the divisor) could also take the adapter's LoRA in the same
launch later, which Marlin's permuted layout makes hard.

How (the second version; the first, 4-7.5x slower than Marlin, decoded in float32 with selects and multiplied
``x`` by the weight):

- The output is computed transposed, ``y^T = W @ x^T``: the weight tile is the dot's left operand (``BLOCK_N`` rows,
  a tensor-core M dimension of 64 or 128) and the few activation rows, padded to 16, are the right one.
- Each packed byte gives two float16 values with three integer operations each: the code's sign bit goes to bit 15
  and its three magnitude bits to bits 11-9. That float16 is the E2M1 value times 2^-14 for every code (subnormal
  for code 1, which float16 holds exactly).
- Times the group's FP8 scale in float16, that is ``value * scale * 2^-14`` **exactly**: the product has at most 6
  significant bits and is a multiple of 2^-24 (E2M1 steps of 1/2 times E4M3 steps of 2^-9 times 2^-14), which
  float16 represents down to its smallest subnormal. With bfloat16 activations it is converted to bfloat16, also
  exact. The low and high nibbles meet the even and odd columns of ``x`` in two dots.
- The dots accumulate in float32; ``2^14 / global_scale`` is applied once to the sums. So the weight is never
  rounded; the codec's ``dequantize(dtype=...)`` rounds ``value * (scale / global_scale)`` to the activation dtype,
  hence results within the dtype's rounding of that reference, not bit-equal to it.
- ``split_k`` > 1 gives each output block that many programs over disjoint K tiles. Each writes its float32 partial
  tile to a workspace and counts itself in a per-block counter; the last to arrive sums the partials in a fixed
  order, writes the output and resets the counter. One launch, and bit-reproducible.

Under ``TRITON_INTERPRET=1`` the dots run in float32 on the same 16-bit operands (Triton 3.6's interpreter gets
bfloat16 dots wrong); the products are exact either way.
"""

from __future__ import annotations

import os

import torch

from qerl_plugin.options import parse_bool
from vllm_ext.nvfp4_decode import decode_mode
from vllm_ext.triton_support import TRITON_IMPORT_ERROR as _TRITON_IMPORT_ERROR
from vllm_ext.triton_support import interpreting as _interpreting
from vllm_ext.triton_support import tl, triton

__all__ = ["MAX_TOKENS", "NO_PDL_ENV", "PDL_FIRST_ENV", "ROW_OP", "SMALL_MAX_K", "SMALL_MAX_N",
           "decode_tile", "nvfp4_gemv_row", "nvfp4_small_gemm", "pdl_first_allowed", "pdl_supported",
           "small_linear"]

MAX_TOKENS = 64  # rows per call; larger inputs belong to a GEMM with real M tiles
GROUP = 16
_COUNTERS: dict[torch.device, torch.Tensor] = {}
LAST_COMPILED = None  # the last launch's compiled kernel (registers, spills, shared memory: scripts/gpu/check_gemv.py)
NO_PDL_ENV = "QERL_NO_PDL"
PDL_FIRST_ENV = "QERL_PDL_FIRST"
_PDL: dict[str, bool] = {}


def pdl_first_allowed() -> bool:
    """Whether the first launch of a ``decode_gemv`` linear (the one-row kernel alone, or the shrink of
    :mod:`vllm_ext.nvfp4_gemv_lora`) may be a programmatic dependent launch too, where :func:`pdl_supported`:
    ``QERL_PDL_FIRST`` (a bool, default on; off gives §4n's launches)."""
    return parse_bool(os.environ.get(PDL_FIRST_ENV, "1") or "1", PDL_FIRST_ENV)


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` may use programmatic dependent launch: CUDA compute capability >= 9.0 (Hopper),
    not under the Triton interpreter, and not turned off by ``QERL_NO_PDL`` (a bool: 1/true/yes/on)."""
    if parse_bool(os.environ.get(NO_PDL_ENV, "0") or "0", NO_PDL_ENV):
        return False
    if device.type != "cuda" or _interpreting():
        return False
    key = str(device)
    if key not in _PDL:
        _PDL[key] = torch.cuda.get_device_capability(device)[0] >= 9
    return _PDL[key]


if triton is not None:
    from triton.language.extra.cuda import gdc_wait

    @triton.jit
    def _finish(y_ptrs, ws_ptrs, ws_step, part, ok, gmul, cnt_ptr, pid_k, SPLIT_K: tl.constexpr, b_ptrs,
                HAS_BIAS: tl.constexpr):
        """Store ``part * gmul`` (plus the bias at ``b_ptrs``, added in float32) at ``y_ptrs``; with split-K, store
        this program's float32 partial at ``ws_ptrs + pid_k * ws_step`` and count it in at ``cnt_ptr`` (one counter
        per output block): the last program to arrive sums all the partials in a fixed order, stores the result
        and resets the counter."""
        if SPLIT_K == 1:
            tl.store(y_ptrs, _scaled(part, gmul, b_ptrs, ok, HAS_BIAS).to(y_ptrs.dtype.element_ty), mask=ok)
        else:
            tl.store(ws_ptrs + pid_k * ws_step, part, mask=ok)
            arrived = tl.atomic_add(cnt_ptr, 1)  # acq_rel at GPU scope: the partials above are visible
            if arrived == SPLIT_K - 1:
                tot = _sum_partials(ws_ptrs, ws_step, ok, part, SPLIT_K)
                tl.store(y_ptrs, _scaled(tot, gmul, b_ptrs, ok, HAS_BIAS).to(y_ptrs.dtype.element_ty), mask=ok)
                tl.atomic_xchg(cnt_ptr, 0)  # ready for the next call (and the next CUDA-graph replay)

    @triton.jit
    def _sum_partials(ws_ptrs, ws_step, ok, part, SPLIT_K: tl.constexpr):
        """The ``SPLIT_K`` float32 partials at ``ws_ptrs + s * ws_step`` (shaped like ``part``), summed in a fixed
        order: the result does not depend on the order the programs arrived in. Shared with
        :mod:`vllm_ext.nvfp4_gemv_lora`'s kernel."""
        tot = tl.zeros_like(part)
        for s in tl.static_range(SPLIT_K):
            tot += tl.load(ws_ptrs + s * ws_step, mask=ok, other=0.0, cache_modifier=".cg")
        return tot

    @triton.jit
    def _scaled(part, gmul, b_ptrs, ok, HAS_BIAS: tl.constexpr):
        out = part * gmul
        if HAS_BIAS:
            out += tl.load(b_ptrs, mask=ok, other=0.0).to(tl.float32)
        return out

    @triton.jit
    def _w4a16_kernel(
        x_ptr, sxm, w_ptr, s_ptr, g_ptr, y_ptr, sym, ws_ptr, cnt_ptr, b_ptr, M, N, K,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        DOT_F32: tl.constexpr, FMA: tl.constexpr, GROUP_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr,
    ):  # fmt: skip
        HALF: tl.constexpr = BLOCK_K // 2
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rb = tl.arange(0, HALF)
        n_ok = rn < N
        m_ok = rm < M
        kb = K // 2
        kg = K // 16
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_N, HALF), dtype=tl.float32)  # FMA: one row, products summed per column
        for t in range(pid_k, K // BLOCK_K, SPLIT_K):
            cb = t * HALF + rb  # this tile's byte columns
            wb = tl.load(w_ptr + rn[:, None] * kb + cb[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
            if GROUP_SCALES:  # one load per group, repeated over its 8 bytes in registers
                rg = t * (HALF // 8) + tl.arange(0, HALF // 8)
                sg = tl.load(s_ptr + rn[:, None] * kg + rg[None, :], mask=n_ok[:, None], other=0.0).to(tl.float16)
                sc = tl.reshape(tl.broadcast_to(sg[:, :, None], (BLOCK_N, HALF // 8, 8)), (BLOCK_N, HALF))
            else:  # each byte's group scale (8 bytes per group: repeated addresses, served by the cache)
                sc = tl.load(s_ptr + rn[:, None] * kg + (cb // 8)[None, :], mask=n_ok[:, None], other=0.0)
                sc = sc.to(tl.float16)
            lo = (((wb & 7) << 9) | ((wb & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True) * sc
            hi = (((wb & 0x70) << 5) | ((wb & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True) * sc
            if FMA:  # one row: products on the CUDA cores, no tensor-core padding or operand layout change
                xe1 = tl.load(x_ptr + 2 * cb).to(tl.float32)
                xo1 = tl.load(x_ptr + 2 * cb + 1).to(tl.float32)
                acc1 += lo.to(tl.float32) * xe1[None, :] + hi.to(tl.float32) * xo1[None, :]
            else:
                xe = tl.load(x_ptr + rm[None, :] * sxm + (2 * cb)[:, None], mask=m_ok[None, :], other=0.0)
                xo = tl.load(x_ptr + rm[None, :] * sxm + (2 * cb + 1)[:, None], mask=m_ok[None, :], other=0.0)
                lo = lo.to(xe.dtype)  # exact: value * scale * 2^-14 has <= 6 significant bits, >= 2^-24
                hi = hi.to(xe.dtype)
                if DOT_F32:
                    acc += tl.dot(lo.to(tl.float32), xe.to(tl.float32))
                    acc += tl.dot(hi.to(tl.float32), xo.to(tl.float32))
                else:
                    acc = tl.dot(lo, xe, acc)
                    acc = tl.dot(hi, xo, acc)
        if FMA:
            acc = tl.where(rm[None, :] == 0, tl.sum(acc1, axis=1)[:, None], 0.0)
        # workspace [SPLIT_K, BLOCK_M, N] float32 for split-K's partials
        _finish(y_ptr + rm[None, :] * sym + rn[:, None], ws_ptr + rm[None, :] * N + rn[:, None], BLOCK_M * N, acc,
                n_ok[:, None] & m_ok[None, :], 16384.0 / tl.load(g_ptr), cnt_ptr + pid_n, pid_k, SPLIT_K,
                b_ptr + rn[:, None], HAS_BIAS)


if triton is not None:
    from vllm_ext.nvfp4_decode import _decode8, _decode_up

    @triton.jit
    def _xvec_sum(codes, x_ptr, cw, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
        """``[BLOCK_N, WORDS]`` float32: each word's 8 decoded ``codes`` (:func:`vllm_ext.nvfp4_decode._decode8`)
        times the 8 values of ``x`` it meets (word ``cw`` meets ``x[8 cw .. 8 cw + 7]``, read as one 16-byte run),
        summed. Shared with :mod:`vllm_ext.nvfp4_gemv_tma`'s kernel."""
        # codes[L] in natural order along a new last axis: nested joins put code 4k + 2j + i at [k, j, i]
        c8 = tl.join(tl.join(tl.join(codes[0], codes[4]), tl.join(codes[2], codes[6])),
                     tl.join(tl.join(codes[1], codes[5]), tl.join(codes[3], codes[7])))
        c8 = tl.reshape(c8, (BLOCK_N, WORDS, 8))
        xv = tl.load(x_ptr + 8 * cw[:, None] + tl.arange(0, 8)[None, :]).to(tl.float32)  # [WORDS, 8]
        return tl.sum(c8 * xv[None, :, :], axis=2)

    @triton.jit
    def _row_tile(x_ptr, w_ptr, s_ptr, rn, n_ok, t, kw, kg, BLOCK_N: tl.constexpr, WORDS: tl.constexpr,
                  ASM: tl.constexpr, XVEC: tl.constexpr):
        """K tile ``t`` of :func:`_row_dot`: ``[BLOCK_N, WORDS]`` float32 sums of each word's 8 products, times its
        group's scale."""
        cw = t * WORDS + tl.arange(0, WORDS)  # this tile's words: codes 8*cw .. 8*cw + 7, code j in bits 4j .. 4j + 3
        wv = tl.load(w_ptr + rn[:, None] * kw + cw[None, :], mask=n_ok[:, None], other=0)
        if XVEC:  # one load per group, its two words take it from registers
            cg = t * (WORDS // 2) + tl.arange(0, WORDS // 2)
            sg = tl.load(s_ptr + rn[:, None] * kg + cg[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32)
            sc = tl.reshape(tl.join(sg, sg), (BLOCK_N, WORDS))
        else:
            sc = tl.load(s_ptr + rn[:, None] * kg + (cw // 2)[None, :], mask=n_ok[:, None], other=0.0)
            sc = sc.to(tl.float32)
        part = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        codes = _decode8(wv, ASM)
        if XVEC:
            part = _xvec_sum(codes, x_ptr, cw, BLOCK_N, WORDS)
        else:
            for j in tl.static_range(8):
                part += codes[j] * tl.load(x_ptr + 8 * cw + j).to(tl.float32)[None, :]
        return part * sc  # a word's 8 codes share one group (16 codes = 2 words)

    @triton.jit
    def _row_dot(x_ptr, w_ptr, s_ptr, rn, n_ok, pid_k, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, ASM: tl.constexpr, XVEC: tl.constexpr, STAGES: tl.constexpr):
        """The one-row kernel's main loop: ``sum_k x[k] W[n, k]`` in float32 for the rows ``rn`` (``n_ok``: inside
        N) over K tiles ``pid_k, pid_k + SPLIT_K, ...``, before the global scale. Shared with
        :mod:`vllm_ext.nvfp4_gemv_lora`'s kernel.

        ``STAGES`` > 0 (for K a multiple of 128 only): the loop is software-pipelined that many stages deep (Triton
        copies the next tiles' words and ``x`` to shared memory with ``cp.async`` while this one is summed), and the
        rows' strides are declared multiples of 16 words and 8 scale bytes, so those copies can be wide. With 0 (the
        kernel measured in §4j-§4m) each tile's loads wait a full memory round trip before its sums: a 7B q/k/v or o
        call is seven such round trips one after the other. On the H100 (§4n) the pipelined loop made 7B o and
        gate/up and every 32B linear faster, but not 7B q/k/v or down. The same products are summed in the same
        order along K either way; only how a tile's words are split between threads for the final sum may differ."""
        WORDS: tl.constexpr = BLOCK_K // 8
        acc = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        if STAGES > 0:
            kw = tl.multiple_of(K // 8, 16)
            kg = tl.multiple_of(K // 16, 8)
            for t in tl.range(pid_k, K // BLOCK_K, SPLIT_K, num_stages=STAGES):
                acc += _row_tile(x_ptr, w_ptr, s_ptr, rn, n_ok, t, kw, kg, BLOCK_N, WORDS, ASM, XVEC)
        else:
            for t in range(pid_k, K // BLOCK_K, SPLIT_K):
                acc += _row_tile(x_ptr, w_ptr, s_ptr, rn, n_ok, t, K // 8, K // 16, BLOCK_N, WORDS, ASM, XVEC)
        return tl.sum(acc, axis=1)

    @triton.jit
    def _nvfp4_row_kernel(
        x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, ws_ptr, cnt_ptr, b_ptr, N, K,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, ASM: tl.constexpr,
        XVEC: tl.constexpr, HAS_BIAS: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """One row: ``y[n] = sum_k x[k] W[n, k]`` on the CUDA cores, the weight read as int32 words of 8 codes.
        ``XVEC``: ``x`` loaded as one 16-byte run per word (8 values) and the 8 decoded codes joined in registers to
        meet it, instead of 8 strided 2-byte loads per word, and one scale load per group (Nsight Compute, §4j
        lease 6: the strided loads kept the L1 86 % busy). ``PDL``: launched as a programmatic dependent launch, so
        its programs may be placed before the previous kernel has finished; they wait for it
        (``griddepcontrol.wait``) before any load or store."""
        if PDL:
            gdc_wait()
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        part = _row_dot(x_ptr, w_ptr, s_ptr, rn, n_ok, pid_k, K, BLOCK_N, BLOCK_K, SPLIT_K, ASM, XVEC, STAGES)
        # workspace [SPLIT_K, N] float32 for split-K's partials
        _finish(y_ptr + rn, ws_ptr + rn, N, part, n_ok, _decode_up(ASM) / tl.load(g_ptr), cnt_ptr + pid_n, pid_k,
                SPLIT_K, b_ptr + rn, HAS_BIAS)


if triton is not None:

    @triton.jit
    def _mma_tile(acc, x_ptr, sxm, w_ptr, s_ptr, rn, n_ok, rm, m_ok, t, kw, kg, WORDS: tl.constexpr,
                  DOT_F32: tl.constexpr):
        """K tile ``t`` of :func:`_mma_kernel`: ``acc += W_tile @ x_tile^T`` as eight dots, one per code position."""
        cw = t * WORDS + tl.arange(0, WORDS)  # this tile's words: codes 8*cw .. 8*cw + 7, code j in bits 4j .. 4j + 3
        wv = tl.load(w_ptr + rn[:, None] * kw + cw[None, :], mask=n_ok[:, None], other=0)
        sc = tl.load(s_ptr + rn[:, None] * kg + (cw // 2)[None, :], mask=n_ok[:, None], other=0.0).to(tl.float16)
        for j in tl.static_range(8):
            # code j of every word: magnitude bits to bits 11-9 of a float16, the sign to bit 15 (the E2M1 value
            # times 2^-14), times the group's scale in float16: exact (see the module docstring)
            h = (((wv >> (4 * j)) & 7) << 9) | (((wv >> (4 * j + 3)) & 1) << 15)
            xj = tl.load(x_ptr + rm[None, :] * sxm + (8 * cw + j)[:, None], mask=m_ok[None, :], other=0.0)
            a = (h.to(tl.int16).to(tl.float16, bitcast=True) * sc).to(xj.dtype)
            if DOT_F32:
                acc += tl.dot(a.to(tl.float32), xj.to(tl.float32))
            else:
                acc = tl.dot(a, xj, acc)
        return acc

    @triton.jit
    def _mma_kernel(
        x_ptr, sxm, w_ptr, s_ptr, g_ptr, y_ptr, sym, ws_ptr, cnt_ptr, b_ptr, M, N, K,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        STAGES: tl.constexpr, DOT_F32: tl.constexpr, HAS_BIAS: tl.constexpr,
    ):  # fmt: skip
        """A few rows (2-64) on the tensor cores, transposed (``y^T = W @ x^T``), the weight read as int32 words of 8
        codes like the one-row kernel. Code position j of a tile's words is one ``[BLOCK_N, BLOCK_K / 8]`` operand
        that meets the columns ``8 w + j`` of ``x``: eight dots per tile, no reordering of the decoded codes."""
        WORDS: tl.constexpr = BLOCK_K // 8
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        n_ok = rn < N
        m_ok = rm < M
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if STAGES > 0:
            kw = tl.multiple_of(K // 8, 16)
            kg = tl.multiple_of(K // 16, 8)
            for t in tl.range(pid_k, K // BLOCK_K, SPLIT_K, num_stages=STAGES):
                acc = _mma_tile(acc, x_ptr, sxm, w_ptr, s_ptr, rn, n_ok, rm, m_ok, t, kw, kg, WORDS, DOT_F32)
        else:
            for t in range(pid_k, K // BLOCK_K, SPLIT_K):
                acc = _mma_tile(acc, x_ptr, sxm, w_ptr, s_ptr, rn, n_ok, rm, m_ok, t, K // 8, K // 16, WORDS, DOT_F32)
        # workspace [SPLIT_K, BLOCK_M, N] float32 for split-K's partials
        _finish(y_ptr + rm[None, :] * sym + rn[:, None], ws_ptr + rm[None, :] * N + rn[:, None], BLOCK_M * N, acc,
                n_ok[:, None] & m_ok[None, :], 16384.0 / tl.load(g_ptr), cnt_ptr + pid_n, pid_k, SPLIT_K,
                b_ptr + rn[:, None], HAS_BIAS)


def one_row_buffers(x: torch.Tensor, n: int, split_k: int, blocks: int,
                    x_align: int = 1) -> tuple[torch.Tensor, ...]:
    """What a one-row kernel launch needs besides its weights: ``x`` as one contiguous row ``[1, K]`` (a copy where it
    does not start at a multiple of ``x_align`` bytes), the output ``[1, n]`` in ``x``'s dtype, and with ``split_k`` >
    1 the float32 partials ``[split_k, n]`` and ``blocks`` arrival counters (else the output stands in for both,
    unused)."""
    x2 = x.reshape(1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x_align > 1 and x2.data_ptr() % x_align:
        x2 = x2.clone()
    out = torch.empty(1, n, device=x.device, dtype=x.dtype)
    if split_k > 1:
        return x2, out, torch.empty(split_k, n, device=x.device, dtype=torch.float32), _counters(x.device, blocks)
    return x2, out, out, out


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for ``n`` output blocks, kept per device (they reset themselves after use)."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < n:
        have = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[device] = have
    return have


def nvfp4_small_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     block_n: int = 64, block_k: int = 128, split_k: int = 1, num_warps: int = 4,
                     num_stages: int | None = None, fma: bool = False, group_scales: bool = False,
                     words: bool = False, asm: bool | None = None, xvec: bool = False,
                     bias: torch.Tensor | None = None, stages: int = 0, mma: bool = False,
                     pdl: bool = False) -> torch.Tensor:
    """``x @ W.T`` for ``x`` ``[..., K]`` (bfloat16/float16, at most :data:`MAX_TOKENS` rows) and ``W`` given as
    the NVFP4 triple (``packed`` uint8 ``[N, K/2]``, ``scale`` float8_e4m3fn ``[N, K/16]``, ``global_scale`` the
    float32 divisor ``[1]``); returns ``[..., N]`` in ``x``'s dtype. ``block_n`` output features per program (16,
    32, 64 or 128), ``block_k`` input features per tile, ``split_k`` programs per output block (one launch; the
    last to finish sums the float32 partials in a fixed order). ``fma``: one row only, products on the CUDA cores
    instead of a tensor-core dot; ``group_scales``: one scale load per group instead of one per byte; ``words``:
    one row on the CUDA cores with the weight read as int32 words and two codes decoded per integer operation
    (:func:`_nvfp4_row_kernel`); ``asm``: that decode in PTX (default: on CUDA, not under the interpreter; through
    FP8 where :func:`vllm_ext.nvfp4_decode.decode_mode` picks it);
    ``xvec``: that kernel with ``x`` and the scales loaded once per word and group; ``bias`` ``[N]``: added to the
    float32 result in the epilogue, before the one rounding to ``x``'s dtype; ``stages``: with ``words``, the main
    loop software-pipelined that many stages deep (0: not pipelined; needs K a multiple of 128, see
    :func:`_row_dot`), or with ``mma``; ``mma``: the few-row tensor-core kernel on int32 words
    (:func:`_mma_kernel`; block_n 64 or 128, block_k a multiple of 128); ``pdl``: with ``words``, a programmatic
    dependent launch (Hopper, see :func:`pdl_supported`) whose programs wait for the previous kernel first."""
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
    if block_n not in ((4, 8, 16, 32, 64, 128) if words else (16, 32, 64, 128)):
        problems.append(f"block_n={block_n} (16, 32, 64 or 128; 4 and 8 also with words=True)")
    for flag, on in (("fma", fma), ("words", words)):
        if on and m != 1:
            problems.append(f"{flag}=True takes one row, got {m}")
    if split_k < 1:
        problems.append(f"split_k={split_k} (>= 1)")
    if pdl and not words:
        problems.append("pdl=True only with words=True")
    if mma and (words or fma):
        problems.append("mma=True is its own kernel: not with words or fma")
    if mma and (block_n not in (64, 128) or block_k % 128):
        problems.append(f"mma=True takes block_n 64 or 128 and block_k a multiple of 128, got {block_n} / {block_k}")
    if stages < 0 or (stages and not (words or mma)):
        problems.append(f"stages={stages} (>= 0, and only with words=True or mma=True)")
    elif stages and k % 128:
        problems.append(f"stages={stages} needs K a multiple of 128, got K={k}")
    if tuple(packed.shape) != (n, k // 2) or packed.dtype != torch.uint8:
        problems.append(f"packed {packed.dtype} {tuple(packed.shape)}, expected uint8 ({n}, {k // 2})")
    if tuple(scale.shape) != (n, k // GROUP) or scale.dtype != torch.float8_e4m3fn:
        problems.append(f"scale {scale.dtype} {tuple(scale.shape)}, expected float8_e4m3fn ({n}, {k // GROUP})")
    if global_scale.numel() != 1:
        problems.append(f"global_scale has {global_scale.numel()} values, expected 1")
    if bias is not None and (bias.shape != (n,) or bias.device != x.device):
        problems.append(f"bias {tuple(bias.shape)} on {bias.device}, expected ({n},) on {x.device}")
    mode = decode_mode(x.device, asm) if words else 0  # the one-row kernel's decode
    if problems:
        raise ValueError("nvfp4_small_gemm: " + "; ".join(problems))
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    packed, scale = packed.contiguous(), scale.contiguous()
    g = global_scale.reshape(1).to(torch.float32)
    block_m = max(16, triton.next_power_of_2(m))
    blocks = triton.cdiv(n, block_n)
    split_k = min(split_k, k // block_k)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if split_k > 1:  # float32 partials [split_k, rows, N] and the blocks' arrival counters
        ws = torch.empty(split_k, 1 if words else block_m, n, device=x.device, dtype=torch.float32)
        cnt = _counters(x.device, blocks)
    else:
        ws, cnt = out, out  # unused
    extra = {} if num_stages is None else {"num_stages": num_stages}
    b = out if bias is None else bias.contiguous()  # unused without a bias
    global LAST_COMPILED
    if words:
        LAST_COMPILED = _nvfp4_row_kernel[(blocks, split_k)](
            x2, packed.view(torch.int32), scale, g, out, ws, cnt, b, n, k,
            BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, ASM=mode,
            XVEC=xvec, HAS_BIAS=bias is not None, STAGES=stages, PDL=pdl,
            num_warps=num_warps, launch_pdl=pdl, **extra,
        )  # fmt: skip
        return out.reshape(*x.shape[:-1], n)
    if mma:
        LAST_COMPILED = _mma_kernel[(blocks, split_k)](
            x2, x2.stride(0), packed.view(torch.int32), scale, g, out, out.stride(0), ws, cnt, b, m, n, k,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, STAGES=stages,
            DOT_F32=_interpreting(), HAS_BIAS=bias is not None,
            num_warps=num_warps, **extra,
        )  # fmt: skip
        return out.reshape(*x.shape[:-1], n)
    LAST_COMPILED = _w4a16_kernel[(blocks, split_k)](
        x2, x2.stride(0), packed, scale, g, out, out.stride(0), ws, cnt, b, m, n, k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, DOT_F32=_interpreting(), FMA=fma,
        GROUP_SCALES=group_scales, HAS_BIAS=bias is not None,
        num_warps=num_warps, **extra,
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


def decode_tile(n: int, k: int, lora: bool = False) -> dict[str, int] | None:
    """The one-row kernel's tile for an ``[n, k]`` weight, from the sweeps on the H100 with the weights streamed from
    HBM: §4j lease 7 and §4k lease 5 (tiles), §4n lease 1 (tiles and the pipelined loop's ``stages``; a linear took
    the sweep's best tile only where it beat the §4m kernel by more than both spreads). block_k 512 throughout.

    - long K (down_proj): 8 rows, 2 warps, split-K 4, unpipelined (7B: the sweep's best was no faster); beyond K =
      20 480 (32B) 16 rows, split-K 4, 3 stages;
    - large N (gate/up, 7B and 32B): 8 rows, 1 warp, 3 stages;
    - else (q/k/v, o): up to K = 4 096 (7B) 4 rows and 4 warps unpipelined for q/k/v (no faster tile) and 1 warp with
      4 stages for a square weight (o); above it (32B) 8 rows with 3 stages, 1 warp for q/k/v (N > K) and 2 for o.

    ``lora``: the tile of :mod:`vllm_ext.nvfp4_gemv_lora`'s row kernel, the same except beyond K = 20 480, where it
    keeps §4m's tile (8 rows, split-K 8, unpipelined): with the adapter's expand in its split-K epilogue, the
    pipelined 32B down tile took 3.56 ms per step's 64 calls against 2.57 (§4n lease 2, H100).

    None where K is not a multiple of 128."""
    block_k = next((b for b in (512, 256, 128) if k % b == 0), None)
    if block_k is None:
        return None
    if k > 20480:
        if lora:
            return dict(block_n=8, block_k=block_k, split_k=8, num_warps=2)
        return dict(block_n=16, block_k=block_k, split_k=4, num_warps=2, stages=3)
    if k > 8192:
        return dict(block_n=8, block_k=block_k, split_k=4, num_warps=2)
    if n > 16384:
        return dict(block_n=8, block_k=block_k, split_k=1, num_warps=1, stages=3)
    if k > 4096:
        return dict(block_n=8, block_k=block_k, split_k=1, num_warps=1 if n > k else 2, stages=3)
    if n == k:
        return dict(block_n=4, block_k=block_k, split_k=1, num_warps=1, stages=4)
    return dict(block_n=4, block_k=block_k, split_k=1, num_warps=4)


SMALL_MAX_K = 8192
SMALL_MAX_N = 16384


def small_linear(n: int, k: int) -> bool:
    """Whether ``decode_gemv="small"`` gives an ``[n, k]`` weight the one-row kernel (and its second copy): K at most
    :data:`SMALL_MAX_K` and N at most :data:`SMALL_MAX_N`, :func:`decode_tile`'s third kind of linear (q/k/v and o of
    Qwen2.5 from 1.5B to 72B and Llama 3 8B and 70B, whose MLPs' gate/up and down are larger; every linear of
    Qwen2.5-0.5B), and a tile for it. Where its second copy
    buys the most: per MB of copy, the row kernel saved 0.41 (q/k/v) and 0.51 µs (o) per call against Marlin at one
    row on the H100, gate/up 0.042 and down 0.10 (7B, docs/benchmarks.md §4l lease 2); the 7B q/k/v and o are 12.6 %
    of the linears' bytes (0.43 GiB of the 3.4 GiB copy)."""
    return k <= SMALL_MAX_K and n <= SMALL_MAX_N and decode_tile(n, k) is not None


ROW_OP = "qerl::nvfp4_gemv_row"


@torch.library.custom_op(ROW_OP, mutates_args=())
def nvfp4_gemv_row(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for one row of ``x`` with the one-row kernel (PTX decode on CUDA, ``x`` once per word,
    the bias added in its epilogue) and :func:`decode_tile`'s tile, as one opaque op for torch.compile and CUDA
    graphs; a programmatic dependent launch where :func:`pdl_supported` and :func:`pdl_first_allowed`."""
    tile = decode_tile(packed.shape[0], x.shape[-1])
    if tile is None:
        raise ValueError(f"{ROW_OP}: K={x.shape[-1]} is not a multiple of 128")
    return nvfp4_small_gemm(x, packed, scale, global_scale, words=True, xvec=True, bias=bias,
                            pdl=pdl_supported(x.device) and pdl_first_allowed(), **tile)


@nvfp4_gemv_row.register_fake
def _nvfp4_gemv_row_fake(x, packed, scale, global_scale, bias=None):  # noqa: ANN001, ANN202
    return x.new_empty((*x.shape[:-1], packed.shape[0]))
