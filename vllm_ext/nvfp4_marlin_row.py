"""decode_gemv's one-row NVFP4 kernel reading vLLM's Marlin layout, so that a layer needs no second copy of its weights
(``decode_gemv: "shared"``).

Why: the one-row kernel of :mod:`vllm_ext.nvfp4_gemv` made the 7B engine's batch-1 decode 16-23 % faster
(docs/benchmarks.md §4k, §4p, §4af), but it reads the checkpoint's layout, so every layer kept that copy next to
Marlin's: +3.4 GiB at 7B and +16.4 GiB at 32B, taken from the KV cache. That is why it stayed opt-in. This kernel
reads the tensors Marlin already holds (``prepare_fp4_layer_for_marlin``), so the only extra bytes are a float32
divisor per layer (and a natural-order copy of a fused bias).

Marlin's layout, as vLLM 0.24 builds it (``gptq_marlin_repack`` on the codes, 4 bits; ``marlin_permute_scales`` and
``nvfp4_marlin_process_scales`` on the FP8 scales; vLLM's own pure-torch reference of the repack is
``marlin_utils_test.marlin_weights``, which the tests use):

- ``qweight`` int32 ``[K/16, 2N]``: row ``t`` holds the 16 inputs ``16t .. 16t + 15`` (one scale group) of every
  output, in chunks of 128 words per 64 outputs. In chunk ``c``, word ``u = 16 h + 4 a + j`` (``h``, ``a``, ``j``:
  0-7, 0-3, 0-3) holds in its nibble ``q`` the code of output ``64 c + 16 j + 8 b + h`` and input ``16 t + r`` with
  ``(b, r)`` = (0, 2a), (0, 2a + 8), (1, 2a), (1, 2a + 8), (0, 2a + 1), (0, 2a + 9), (1, 2a + 1), (1, 2a + 9) for
  ``q`` = 0 .. 7. So a program that takes ``h`` in ``[h0, h0 + HB)`` reads ``16 HB`` consecutive words per group.
- ``scale`` FP8 bytes ``[K/16, N]``: in chunk ``c`` of group row ``t``, byte ``8 h + 4 (j // 2) + (j % 2) + 2 b`` is
  the scale of output ``64 c + 16 j + 8 b + h``: ``8 HB`` consecutive bytes per program and group. Each byte is
  Marlin's S0E5M3 form: the top 8 bits (after the sign) of the float16 ``scale * 2^7 * sf`` (``sf`` a power of two
  vLLM picks per layer, divided out of its global scale), so ``float16(byte << 7)`` gives it back exactly. Marlin
  zeroes the bytes of scales whose ``scale * 2^7 * sf`` is below 2; reading its bytes, this kernel computes with
  exactly Marlin's weight.
- The weight is ``code * scale_byte_value * g / 2^e``, ``g`` Marlin's float32 global scale and ``2^e`` 2^7 times
  the factor ``nvfp4_marlin_process_global_scale`` put in it (2^126 for bfloat16, 2^14 for float16): the kernel takes
  the divisor ``2^e / g`` (:func:`marlin_divisor`).

How: per group row, each word's 8 codes are decoded as in :mod:`vllm_ext.nvfp4_decode` (PTX, each code times 2^-6
through FP8 on sm_89 and later, else 2^-14; exact in float32) and meet ``x`` at the word's four inputs, two outputs per
word: two float32 sums of products per word, each times its output's group scale, accumulated over the program's
groups and summed over ``a`` once at the end (``asum``: over ``a`` first, then one scale per output and group;
``asum`` 2 with ``a`` unrolled, so the sum stays in a thread's registers). ``T`` groups per loop step (one 16-byte
load per thread of four words), ``HB`` eighths of a 64-output chunk per program (8 or more: whole chunks), split-K
as in :mod:`vllm_ext.nvfp4_gemv` (fixed-order sum of float32 partials: the same bits every call).

Measured (docs/benchmarks.md §4ah-§4aj; one H200 per session): correct (vLLM's CUDA repack gives exactly the reference's
tensors; every tile within Marlin's error plus one bf16 step of the exact product). Per 7B decode step at one row: 2.70
ms with §4ah's tiles, 1.98 with §4ai's (programs of whole chunks, split-K 4-16, the ``asum`` forms), 1.94 with §4aj's
(``asum`` 3 the fastest form on seven of the eight 7B and 32B linears), against 1.74 for the checkpoint-layout kernel
and 2.29 for Marlin; per 32B step 7.70 ms against 7.20 and 8.40. Nsight Compute (§4ai) put the 7B gate/up call at 62 %
issue slots with the L1 at 79 % of its throughput and 44 % of stalls waiting on it; compiled, every form issues about 40
instructions per word against the row kernel's 41-58 (``scripts/cpu/kernel_sass.py``): the loads bind, not the
arithmetic. ``asum`` 3 halves form 2's loads of ``x``: on the 7B down call the L1 went from 88 to 79 % and its share of
stalls from 61 to 47 % (§4aj). In the 7B engine with LoRA and the split add on every layer (§4aj, the sweep's form-3
tiles), batch 1 decoded 16.6 % faster than with ``decode_gemv`` off, b8 and b64 equal. §2's engine check with one
prompt failed there (teacher-forced max 0.3418 against 0.3319), as the default engine did on that prompt with the same
number (the check's teacher-forcing is a prefill, where both run Marlin). ``asum`` 4 reads each group's ``x`` as two
16-byte runs, split into form 3's pairs in registers: compiled, 0.44-0.5 loads per word against form 3's 0.88. §4al
(one H200): form 4 was the best tile on all eight linears and beat the tile shipped before on seven (7B down level;
1.882 ms per 7B step, 7.418 per 32B, against 1.945 and 7.700 for the tiles shipped before; Nsight Compute on the 7B
down call: L1 at 74 % of its throughput, 44.5 % of stalls waiting on it, against form 3's 79 and 47 %); §2's check
(four prompts, each decoded alone) passed 11/11, and on the tiles shipped before that sweep batch 1 decoded 12.3 %
faster than off, b8 and b64 equal, so ``shared`` is the default on Hopper with one GPU per engine
(:func:`qerl_plugin.options.decode_gemv_default`).
"""

from __future__ import annotations

import functools
import json
import os

import torch

from vllm_ext.nvfp4_decode import decode_mode
from vllm_ext.nvfp4_gemv import one_row_buffers, pdl_first_allowed, pdl_supported
from vllm_ext.triton_support import TRITON_IMPORT_ERROR as _TRITON_IMPORT_ERROR
from vllm_ext.triton_support import tl, triton

__all__ = ["ASUM_FORMS", "MARLIN_ROW_OP", "SWEPT_TILES", "TILES_ENV", "marlin_divisor", "marlin_row_gemm",
           "marlin_row_tile", "marlin_unpadded", "nvfp4_marlin_row", "shared_layout", "x_alignment"]

CHUNK = 64  # outputs per chunk of Marlin's layout; a program takes HB eighths of one (HB >= 8: whole chunks)
# a JSON file of tiles by weight shape, {"N,K": {"hb": ..., "t": ..., "split_k": ..., "num_warps": ..., "stages": ...,
# optionally "asum": 0-4}} (what scripts/gpu/sweep_marlin_row.py writes), taken before marlin_row_tile's
# rule for the shapes it names
TILES_ENV = "QERL_MARLIN_ROW_TILES"
TILE_KEYS = ("hb", "t", "split_k", "num_warps", "stages")
OPTIONAL_TILE_KEYS = {"asum": 0}  # may be left out of a tiles file
ASUM_FORMS = (0, 1, 2, 3, 4)  # the kernel's forms (marlin_row_gemm's asum)
# Tiles (hb, t, split_k, num_warps, stages, asum) that a sweep (H200, the best against what marlin_row_tile gave
# before it, in 5 interleaved timings) found faster by more than both spreads. §4al's sweep of forms 3 and 4 (60-72
# tiles per linear) against §4aj's entries (forms 1-3) and the rule: form 4 beat them on seven of the eight linears;
# on the 7B down linear it was level with §4aj's tile, which stays. §4ba swept forms 3 and 4 again with the decode
# through FP8 (the default on sm_89 and later since): only the two gate/up entries changed
SWEPT_TILES = {
    (4608, 3584): (16, 8, 16, 4, 0, 4),  # 7B q/k/v: 7.90 against §4aj's 8.33 us (§4al)
    (3584, 3584): (16, 8, 16, 4, 0, 4),  # 7B o: 7.28 against the rule's 8.00 us (§4al)
    (37888, 3584): (16, 8, 4, 4, 0, 3),  # 7B gate/up, FP8 decode: 30.26 against §4al's 32.81 us (§4ba)
    (3584, 18944): (8, 16, 16, 4, 0, 3),  # 7B down: 19.85 against the rule's 20.98 us (§4aj); form 4 equal (§4al)
    (7168, 5120): (16, 8, 16, 4, 0, 4),  # 32B q/k/v: 12.22 against §4aj's 12.73 us (§4al)
    (5120, 5120): (16, 8, 16, 4, 0, 4),  # 32B o: 9.93 against §4aj's 10.45 us (§4al)
    (55296, 5120): (16, 8, 4, 4, 0, 4),  # 32B gate/up, FP8 decode: 56.86 against §4al's 57.67 us (§4ba)
    (5120, 27648): (16, 8, 16, 4, 0, 4),  # 32B down: 34.61 against §4aj's 35.60 us (§4al)
}


@functools.lru_cache(maxsize=4)
def _swept_tiles(path: str) -> dict[tuple[int, int], dict[str, int]]:
    """The tiles of :data:`TILES_ENV`'s file, checked: an unreadable file or a bad entry is an error naming it."""
    try:
        raw = json.loads(open(path).read())
        tiles = {}
        for key, tile in raw.items():
            n, k = (int(v) for v in key.split(","))
            tile = {**OPTIONAL_TILE_KEYS, **tile}
            keys = (*TILE_KEYS, *OPTIONAL_TILE_KEYS)
            if set(tile) != set(keys) or not all(isinstance(tile[v], int) for v in keys):
                raise ValueError(f"entry {key!r}: expected the integer keys {', '.join(TILE_KEYS)} (and optionally "
                                 f"{', '.join(OPTIONAL_TILE_KEYS)}), got {tile}")
            tiles[(n, k)] = {v: tile[v] for v in keys}
        return tiles
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"{TILES_ENV}={path}: {exc} (write it with scripts/gpu/sweep_marlin_row.py, or unset "
                         "it)") from None


if triton is not None:
    from triton.language.extra.cuda import gdc_wait

    from vllm_ext.nvfp4_decode import _decode8, _decode_up
    from vllm_ext.nvfp4_gemv import _finish

    @triton.jit
    def _marlin_scale(b):
        """Marlin's S0E5M3 scale byte ``b`` (int32, 0-255) as float32: ``float16(b << 7)``."""
        return (b << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _marlin_origin(pid_n, HB: tl.constexpr):
        """Program ``pid_n``'s first chunk ``c`` and first ``h`` in it: ``HB`` < 8 takes ``HB`` eighths of one chunk,
        ``HB`` >= 8 takes ``HB / 8`` whole chunks (their words and scale bytes are contiguous too)."""
        if HB >= 8:
            c = pid_n * (HB // 8)
            h0 = 0
        else:
            c = pid_n // (8 // HB)
            h0 = (pid_n % (8 // HB)) * HB
        return c, h0

    @triton.jit
    def _marlin_rows(pid_n, HB: tl.constexpr):
        """The ``8 HB`` outputs of program ``pid_n``, in the order of :func:`_marlin_row_dot`'s sums: ``(h, j, b)``
        -> ``64 (c + h // 8) + 16 j + 8 b + h0 + h % 8``."""
        c, h0 = _marlin_origin(pid_n, HB)
        hv = tl.arange(0, HB)[:, None, None]
        jv = tl.arange(0, 4)[None, :, None]
        bv = tl.arange(0, 2)[None, None, :]
        return tl.reshape(64 * (c + hv // 8) + h0 + hv % 8 + 16 * jv + 8 * bv, (8 * HB,))

    @triton.jit
    def _word_sums(c, x0, x1, x2, x3):
        """A word's two outputs (``b`` = 0, 1), each its four products summed: :func:`_decode8`'s codes ``c`` met at the
        word's inputs ``2a, 2a + 1, 2a + 8, 2a + 9`` (``x0 .. x3``) as Marlin's repack placed them (nibble ``q`` to
        ``(b, r)`` in the module's docstring)."""
        return c[0] * x0 + c[4] * x1 + c[1] * x2 + c[5] * x3, c[2] * x0 + c[6] * x1 + c[3] * x2 + c[7] * x3

    @triton.jit
    def _marlin_words(x_ptr, w_ptr, wbase, t, N, HB: tl.constexpr, T: tl.constexpr, ASM: tl.constexpr):
        """Groups ``t T .. t T + T - 1`` of the program's outputs, before their scales: two ``[T, HB, 4, 4]`` float32
        tensors (``[group, h, a, j]``; outputs ``b`` = 0 and 1 of each word), each word's four products summed."""
        kt = (t * T + tl.arange(0, T))[:, None, None, None]
        hv = tl.arange(0, HB)[None, :, None, None]
        av = tl.arange(0, 4)[None, None, :, None]
        jv = tl.arange(0, 4)[None, None, None, :]
        c = _decode8(tl.load(w_ptr + wbase + kt * (2 * N) + hv * 16 + av * 4 + jv), ASM)
        xk = x_ptr + kt * 16 + 2 * av  # [T, 1, 4, 1]: inputs 2a, 2a + 1, 2a + 8, 2a + 9 of each group
        x0 = tl.load(xk).to(tl.float32)
        x1 = tl.load(xk + 1).to(tl.float32)
        x2 = tl.load(xk + 8).to(tl.float32)
        x3 = tl.load(xk + 9).to(tl.float32)
        return _word_sums(c, x0, x1, x2, x3)

    @triton.jit
    def _marlin_tile(x_ptr, w_ptr, s_ptr, wbase, sbase, t, N, HB: tl.constexpr, T: tl.constexpr, ASM: tl.constexpr):
        """:func:`_marlin_words`'s sums, each times its output's group scale (``asum`` 0)."""
        p0, p1 = _marlin_words(x_ptr, w_ptr, wbase, t, N, HB, T, ASM)
        kt = (t * T + tl.arange(0, T))[:, None, None, None]
        hv = tl.arange(0, HB)[None, :, None, None]
        jv = tl.arange(0, 4)[None, None, None, :]
        sw = tl.load(s_ptr + sbase + kt * (N // 4) + hv * 2 + jv // 2)  # [T, HB, 1, 4]: 4 scale bytes per int32
        sh = (jv % 2) * 8
        return p0 * _marlin_scale((sw >> sh) & 0xFF), p1 * _marlin_scale((sw >> (sh + 16)) & 0xFF)

    @triton.jit
    def _x_unpack(p, BF16: tl.constexpr):
        """The two inputs of ``x`` in the int32 ``p`` (one 4-byte pair), as float32."""
        if BF16:
            return (p << 16).to(tl.float32, bitcast=True), (p & -65536).to(tl.float32, bitcast=True)
        return (p.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32),
                (p >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32))

    @triton.jit
    def _x_pair(xw_ptr, i, BF16: tl.constexpr):
        """Inputs ``2i`` and ``2i + 1`` of ``x`` from one 4-byte load of the int32 view ``xw_ptr``, as float32."""
        return _x_unpack(tl.load(xw_ptr + i), BF16)

    @triton.jit
    def _marlin_tile_asum(x_ptr, w_ptr, s_ptr, wbase, sbase, t, N, HB: tl.constexpr, T: tl.constexpr,
                          ASM: tl.constexpr, ASUM: tl.constexpr):
        """The same groups with the four words ``a`` of an output and group summed first, then one scale per output
        and group: two ``[T, HB, 4]`` tensors (``[group, h, j]``). ``ASUM`` 1: :func:`_marlin_words`'s sums reduced
        over ``a``, which lies across threads (a shuffle per step). ``ASUM`` 2: ``a`` unrolled, one 16-byte load per
        ``a``, so that a thread holds all four words of its outputs and sums them in registers (half a scale decode
        per word). ``ASUM`` 3: form 2 with ``x``'s inputs ``2a, 2a + 1`` and ``2a + 8, 2a + 9`` read as two 4-byte
        pairs instead of four 2-byte loads (half the loads of ``x``; ``x`` must be 4-byte aligned). ``ASUM`` 4: form 3
        with each group's 16 inputs read as two 16-byte runs (``[T, 2, 4]`` int32: half, pair ``a``) and split into
        the pairs in registers (``x`` 16-byte aligned)."""
        k3 = (t * T + tl.arange(0, T))[:, None, None]
        h3 = tl.arange(0, HB)[None, :, None]
        j3 = tl.arange(0, 4)[None, None, :]
        if ASUM >= 2:
            BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
            xw = x_ptr.to(tl.pointer_type(tl.int32))  # forms 3 and 4: x as 4-byte pairs
            if ASUM == 4:
                xg = tl.load(xw + k3 * 8 + tl.arange(0, 2)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :])
                even, odd = tl.split(tl.reshape(xg, (T, 2, 2, 2)))  # [T, 2, 2]: half, a // 2
                x_a0, x_a2 = tl.split(even)  # [T, 2]: half
                x_a1, x_a3 = tl.split(odd)
            q0 = tl.zeros((T, HB, 4), dtype=tl.float32)
            q1 = tl.zeros((T, HB, 4), dtype=tl.float32)
            for a in tl.static_range(4):
                c = _decode8(tl.load(w_ptr + wbase + k3 * (2 * N) + h3 * 16 + a * 4 + j3), ASM)
                if ASUM == 4:
                    lo, hi = tl.split(x_a0 if a == 0 else (x_a1 if a == 1 else (x_a2 if a == 2 else x_a3)))
                    x0, x1 = _x_unpack(lo[:, None, None], BF16)
                    x2, x3 = _x_unpack(hi[:, None, None], BF16)
                elif ASUM == 3:  # [T, 1, 1] pairs a and a + 4 of each group's 8
                    x0, x1 = _x_pair(xw, k3 * 8 + a, BF16)
                    x2, x3 = _x_pair(xw, k3 * 8 + a + 4, BF16)
                else:
                    xa = x_ptr + k3 * 16 + 2 * a  # [T, 1, 1]: inputs 2a, 2a + 1, 2a + 8, 2a + 9 of each group
                    x0 = tl.load(xa).to(tl.float32)
                    x1 = tl.load(xa + 1).to(tl.float32)
                    x2 = tl.load(xa + 8).to(tl.float32)
                    x3 = tl.load(xa + 9).to(tl.float32)
                s0, s1 = _word_sums(c, x0, x1, x2, x3)
                q0 += s0
                q1 += s1
        else:
            p0, p1 = _marlin_words(x_ptr, w_ptr, wbase, t, N, HB, T, ASM)
            q0 = tl.sum(p0, axis=2)
            q1 = tl.sum(p1, axis=2)
        s3 = tl.load(s_ptr + sbase + k3 * (N // 4) + h3 * 2 + j3 // 2)  # [T, HB, 4]: 4 scale bytes per int32
        sh3 = (j3 % 2) * 8
        return q0 * _marlin_scale((s3 >> sh3) & 0xFF), q1 * _marlin_scale((s3 >> (sh3 + 16)) & 0xFF)

    @triton.jit
    def _marlin_row_dot(x_ptr, w_ptr, s_ptr, pid_n, pid_k, N, K, HB: tl.constexpr, T: tl.constexpr,
                        SPLIT_K: tl.constexpr, ASM: tl.constexpr, STAGES: tl.constexpr, ASUM: tl.constexpr):
        """``sum_k x[k] W[n, k]`` in float32, before the global scale, for the outputs :func:`_marlin_rows` names,
        over the loop steps ``pid_k, pid_k + SPLIT_K, ...`` (``T`` groups each). ``STAGES`` > 0: the loop
        software-pipelined that many stages deep; ``ASUM``: see :func:`_marlin_tile_asum`."""
        c, h0 = _marlin_origin(pid_n, HB)
        wbase = 128 * c + 16 * h0
        sbase = 16 * c + 2 * h0
        if ASUM > 0:
            acc0 = tl.zeros((T, HB, 4), dtype=tl.float32)
            acc1 = tl.zeros((T, HB, 4), dtype=tl.float32)
        else:
            acc0 = tl.zeros((T, HB, 4, 4), dtype=tl.float32)
            acc1 = tl.zeros((T, HB, 4, 4), dtype=tl.float32)
        steps = K // (16 * T)
        if STAGES > 0:
            for t in tl.range(pid_k, steps, SPLIT_K, num_stages=STAGES):
                if ASUM > 0:  # the forms' sums differ in shape: a constexpr branch (Triton wants one return type)
                    q0, q1 = _marlin_tile_asum(x_ptr, w_ptr, s_ptr, wbase, sbase, t, N, HB, T, ASM, ASUM)
                else:
                    q0, q1 = _marlin_tile(x_ptr, w_ptr, s_ptr, wbase, sbase, t, N, HB, T, ASM)
                acc0 += q0
                acc1 += q1
        else:
            for t in range(pid_k, steps, SPLIT_K):
                if ASUM > 0:
                    q0, q1 = _marlin_tile_asum(x_ptr, w_ptr, s_ptr, wbase, sbase, t, N, HB, T, ASM, ASUM)
                else:
                    q0, q1 = _marlin_tile(x_ptr, w_ptr, s_ptr, wbase, sbase, t, N, HB, T, ASM)
                acc0 += q0
                acc1 += q1
        if ASUM > 0:
            r0 = tl.sum(acc0, axis=0)  # [HB, 4]
            r1 = tl.sum(acc1, axis=0)
        else:
            r0 = tl.sum(tl.sum(acc0, axis=2), axis=0)
            r1 = tl.sum(tl.sum(acc1, axis=2), axis=0)
        return tl.reshape(tl.join(r0, r1), (8 * HB,))

    @triton.jit
    def _marlin_row_kernel(
        x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, ws_ptr, cnt_ptr, b_ptr, N, K,
        HB: tl.constexpr, T: tl.constexpr, SPLIT_K: tl.constexpr, ASM: tl.constexpr, HAS_BIAS: tl.constexpr,
        STAGES: tl.constexpr, PDL: tl.constexpr, ASUM: tl.constexpr,
    ):  # fmt: skip
        """One row on Marlin's tensors: ``y[n] = sum_k x[k] W[n, k] / divisor (+ bias[n])``. ``PDL``: launched as a
        programmatic dependent launch; its programs wait for the previous kernel before any load."""
        if PDL:
            gdc_wait()
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = _marlin_rows(pid_n, HB)
        n_ok = rn < N
        part = _marlin_row_dot(x_ptr, w_ptr, s_ptr, pid_n, pid_k, N, K, HB, T, SPLIT_K, ASM, STAGES, ASUM)
        _finish(y_ptr + rn, ws_ptr + rn, N, part, n_ok, _decode_up(ASM) / tl.load(g_ptr), cnt_ptr + pid_n, pid_k,
                SPLIT_K, b_ptr + rn, HAS_BIAS)


def x_alignment(asum: bool | int) -> int:
    """The byte alignment of ``x`` that form ``asum`` reads it with: 4 (form 3's pairs), 16 (form 4's runs), else 1;
    a launch copies an ``x`` that is not so aligned (:func:`vllm_ext.nvfp4_gemv.one_row_buffers`)."""
    return {3: 4, 4: 16}.get(int(asum), 1)


def shared_layout(qweight: torch.Tensor, scale: torch.Tensor, k: int) -> int | None:
    """``N`` when ``qweight``/``scale`` are Marlin's tensors of an unpadded ``[N, k]`` NVFP4 weight (int32
    ``[k/16, 2N]``, FP8 ``[k/16, N]``, with :func:`marlin_unpadded` ``N, k``), else None."""
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or scale.dim() != 2:
        return None
    n = scale.shape[1]
    if (not marlin_unpadded(n, k) or tuple(qweight.shape) != (k // 16, 2 * n) or tuple(scale.shape) != (k // 16, n)
            or scale.dtype != torch.float8_e4m3fn):
        return None
    return n


def marlin_unpadded(n: int, k: int) -> bool:
    """Whether vLLM keeps an ``[n, k]`` NVFP4 weight unpadded for Marlin: N a multiple of 64 and K of 128, or N of 128
    and K of 64, Marlin's two thread-tile families (``marlin_utils.marlin_padded_nk``, which pads every other shape).
    vLLM's pure-torch reference of its repack gives both the same layout (16-input rows, 64-output chunks), which the
    kernel reads (tests/vllm_ext/test_nvfp4_marlin_row.py); the second family holds e.g. SmolLM2's gate/up (N 2 x
    1536, K 576). Padded weights stay on Marlin."""
    return (n % CHUNK == 0 and k % 128 == 0) or (n % 128 == 0 and k % 64 == 0)


def _steps(k: int, t_max: int) -> int:
    """The largest power of two ``T`` <= ``t_max`` with ``16 T`` dividing ``k``."""
    t = t_max
    while t > 1 and (k // 16) % t:
        t //= 2
    return t


def marlin_row_tile(n: int, k: int, lora: bool = False) -> dict[str, int] | None:
    """The kernel's tile for an ``[n, k]`` weight: ``hb`` eighths of a 64-output chunk per program, ``t`` groups per
    loop step, ``split_k``, ``num_warps``, ``stages``, ``asum``. From :data:`TILES_ENV`'s file where it names the
    shape; else :data:`SWEPT_TILES` where it names it; else a rule from §4ai's sweep (H200, one row, weights streamed
    from HBM, 108 tiles of whole chunks in the three forms): the four words of an output summed before its scale
    (``asum`` 1), unpipelined, four warps; long K (down) one chunk per program, 16 groups per step, split-K 16; large N
    (gate/up) two chunks, 8 groups, split-K 4; q/k/v and o two chunks, 8 groups, split-K 16 (one chunk where N is not a
    multiple of 128). ``lora``: the same. None where vLLM pads the weight for Marlin (:func:`marlin_unpadded`)."""
    del lora  # same tiles for the row+lora kernel until a sweep says otherwise
    if not marlin_unpadded(n, k):
        return None
    path = os.environ.get(TILES_ENV)
    if path:
        swept = _swept_tiles(path).get((n, k))
        if swept is not None:
            return dict(swept)
    if (n, k) in SWEPT_TILES:
        return dict(zip((*TILE_KEYS, "asum"), SWEPT_TILES[(n, k)]))
    if k > 8192:
        hb, t_max, split_k = 8, 16, 16
    else:
        hb, t_max, split_k = (16 if n % 128 == 0 else 8), 8, (4 if n > 16384 else 16)
    t = _steps(k, t_max)
    return dict(hb=hb, t=t, split_k=max(1, min(split_k, k // (16 * t))), num_warps=4, stages=0, asum=1)


def marlin_divisor(marlin_global_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float32 ``[1]`` divisor the kernel takes for a layer whose Marlin global scale is
    ``marlin_global_scale`` and activations ``dtype``: ``2^e / g``, with ``2^e`` the factor vLLM's
    ``nvfp4_marlin_process_global_scale`` multiplies into ``g`` (its exponent-bias shift for ``dtype``, times the
    2^7 that Marlin's scale bytes carry)."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import nvfp4_marlin_process_global_scale

    one = torch.ones(1, dtype=torch.float64)
    factor = nvfp4_marlin_process_global_scale(one, dtype).item() * 2.0**7
    g = marlin_global_scale.reshape(-1)[:1].to(torch.float64)
    return (factor / g).to(torch.float32)


def marlin_row_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, divisor: torch.Tensor,
                    bias: torch.Tensor | None = None, hb: int = 1, t: int = 32, split_k: int = 1, num_warps: int = 4,
                    stages: int = 0, pdl: bool = False, asm: bool | None = None,
                    asum: bool | int = 0) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for one row ``x`` ``[..., K]`` (bfloat16/float16) with ``W`` as Marlin holds it
    (``qweight`` int32 ``[K/16, 2N]``, ``scale`` FP8 ``[K/16, N]``, :func:`marlin_divisor`'s ``divisor``); ``bias``
    ``[N]`` in natural order, added in float32 before the one rounding. ``hb`` (1, 2, 4, 8; 16, 32, 64): eighths of a
    64-output chunk per program (``8 hb`` outputs); ``t`` (a power of two, ``16 t`` dividing K): groups per loop step;
    ``split_k`` programs per output block; ``stages`` > 0: the pipelined loop; ``pdl``: a programmatic dependent
    launch (Hopper); ``asm``: the PTX decode (default: on CUDA, not under the interpreter; which one:
    :func:`vllm_ext.nvfp4_decode.decode_mode`); ``asum`` 1-4: each
    output's four words per group summed before its scale, across threads (1) or in registers (2)
    (:func:`_marlin_tile_asum`: 56 registers per thread against form 0's 158, §4ai); 3, form 2 with ``x`` read in
    4-byte pairs; 4, form 3 with a group's ``x`` read as two 16-byte runs (:func:`x_alignment`)."""
    if triton is None:
        raise RuntimeError(f"marlin_row_gemm needs Triton ({_TRITON_IMPORT_ERROR})")
    k = x.shape[-1]
    n = shared_layout(qweight, scale, k)
    problems = []
    if x.dtype not in (torch.bfloat16, torch.float16):
        problems.append(f"activations in {x.dtype} (bfloat16/float16 supported)")
    if x.numel() != k:
        problems.append(f"{x.numel() // max(k, 1)} rows (one supported)")
    if n is None:
        problems.append(f"qweight {qweight.dtype} {tuple(qweight.shape)} / scale {scale.dtype} {tuple(scale.shape)} "
                        f"are not Marlin's unpadded tensors for K={k} (int32 [K/16, 2N], float8_e4m3fn [K/16, N], "
                        "N a multiple of 64 and K of 128, or N of 128 and K of 64)")
    if hb not in (1, 2, 4, 8, 16, 32, 64) or (n is not None and n % (8 * hb)):
        problems.append(f"hb={hb} (1, 2, 4 or 8; 16, 32 or 64 where N is a multiple of 8 hb, here N={n})")
    if t < 1 or t & (t - 1) or k % (16 * t):
        problems.append(f"t={t} (a power of two with 16 t dividing K={k})")
    if int(asum) not in ASUM_FORMS:
        problems.append(f"asum={asum} ({', '.join(map(str, ASUM_FORMS[:-1]))} or {ASUM_FORMS[-1]})")
    if split_k < 1 or stages < 0:
        problems.append(f"split_k={split_k} (>= 1), stages={stages} (>= 0)")
    if divisor.numel() != 1:
        problems.append(f"divisor has {divisor.numel()} values, expected 1")
    if bias is not None and n is not None and tuple(bias.shape) != (n,):
        problems.append(f"bias {tuple(bias.shape)}, expected ({n},)")
    if problems:
        raise ValueError("marlin_row_gemm: " + "; ".join(problems))
    blocks = n // (8 * hb)
    split_k = min(split_k, k // (16 * t))
    x2, out, ws, cnt = one_row_buffers(x, n, split_k, blocks, x_align=x_alignment(asum))
    b = out if bias is None else bias.contiguous()
    _marlin_row_kernel[(blocks, split_k)](
        x2, qweight, scale.view(torch.int32), divisor.reshape(1).to(torch.float32), out, ws, cnt, b, n, k,
        HB=hb, T=t, SPLIT_K=split_k, ASM=decode_mode(x.device, asm), HAS_BIAS=bias is not None,
        STAGES=stages, PDL=pdl, ASUM=int(asum), num_warps=num_warps, launch_pdl=pdl,
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


MARLIN_ROW_OP = "qerl::nvfp4_marlin_row"


@torch.library.custom_op(MARLIN_ROW_OP, mutates_args=())
def nvfp4_marlin_row(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, divisor: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for one row on Marlin's own tensors, :func:`marlin_row_tile`'s tile, as one opaque op
    for torch.compile and CUDA graphs; a programmatic dependent launch where the row kernel's would be."""
    tile = marlin_row_tile(scale.shape[1], x.shape[-1])
    if tile is None:
        raise ValueError(f"{MARLIN_ROW_OP}: Marlin's layout of this weight is padded (N={scale.shape[1]}, "
                         f"K={x.shape[-1]})")
    return marlin_row_gemm(x, qweight, scale, divisor, bias, pdl=pdl_supported(x.device) and pdl_first_allowed(),
                           **tile)


@nvfp4_marlin_row.register_fake
def _nvfp4_marlin_row_fake(x, qweight, scale, divisor, bias=None):  # noqa: ANN001, ANN202
    return x.new_empty((*x.shape[:-1], scale.shape[1]))
