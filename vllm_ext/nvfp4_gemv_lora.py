"""A one-row NVFP4 linear and its single adapter's LoRA in two launches with no synchronisation between programs: a
small shrink kernel, then decode_gemv's row kernel with the LoRA expand in its epilogue.

Why: at batch 1 with ``decode_gemv`` a 7B decode step spends 1.93 ms in the one-row kernel and 0.89 ms in the 112
launches of the one-launch LoRA kernel (:mod:`vllm_ext.lora_fused`, ~8 us each then, far above the ~0.05 ms its 161 MB
of adapter weights need; docs/benchmarks.md §4k lease 2; its v3 of §4v takes ~5.2 us and was not timed against this
path); running that kernel beside the row kernel on a second stream is slower than after it (§4l lease 2). A first
version put the shrink into the row kernel's grid and had each block's finishing program wait for it: 0.87 ms per
step *slower* than row + fused LoRA (§4m lease 1), the cost of a counter that thousands of programs per launch (4 736
for gate/up) each hit with an acquire and an acq_rel atomic. This version has no counter, no wait and nothing to reset:

* :func:`_shrink_kernel`, grid ``(KS, slices)``: program ``(c, s)`` writes the float32 partial ``A_s[:, chunk c] @
  x[chunk c]`` to ``hp[s, c, :]`` (at most :data:`MAX_CHUNKS` chunks of a multiple of 256 input features);
* :func:`_row_lora_kernel`: the row kernel's loop (:func:`vllm_ext.nvfp4_gemv._row_dot`, ``decode_tile(n, k,
  lora=True)``'s tiles, split-K's fixed-order sum of partials); the program that finishes an output block rounds the
  base result (bias included) to the output dtype, sums its slice's partials of ``h`` in a fixed order, applies
  ``scale`` and the token's slot, rounds ``h`` to the dtype, takes the float32 dot with its rows of ``B``, rounds,
  adds in float32 and stores once. The rows of ``B`` are loaded before the main loop (without split-K), so their
  latency hides behind it. On Hopper it is a programmatic dependent launch: it starts while the shrink runs and waits
  for that grid (``griddepcontrol.wait``) only before it reads the partials, after its main loop (without PDL the
  partials load before the loop too).

Per 7B decode step at batch 1 on an H200 (§4m lease 4): 2.229 ms, against 2.774 ms for the row kernel followed by
the LoRA kernel and 1.877 ms for the row kernel alone; in the engine, batch-1 decode 16.2 % faster. On an H100 with
the pipelined loop (§4n): 2.256 ms against 2.816 (1.883 alone); in the engine 2.21x BF16 + LoRA. Since §4p the shrink
is a dependent launch too (it waits for the kernel before it, then lets the row kernel start): 2.151 against 2.243 ms
per 7B step and 8.393 against 8.640 per 32B step on an H100, the same bits; in the engine level with before.

The arithmetic is that of the row kernel followed by :mod:`vllm_ext.lora_fused`'s kernel (punica's): the base output
rounded once, ``h = A @ x`` summed in float32, ``scale`` in float32, ``h`` rounded to the dtype, the update's float32
sum rounded, then added to the rounded base in float32 and rounded. The float32 sums run in other orders than there
(partials per chunk instead of atomics, a sum over the rank instead of a dot), and unlike there the result is the
same bits on every launch.

Used by the overlap LoRA mode (the default) for one-row calls of engines with ``decode_gemv`` on
(:mod:`vllm_ext.lora_dense_wrapper`). Imports torch, Triton and :mod:`qerl_plugin.options` only.
"""

from __future__ import annotations

import torch

from vllm_ext import lora_fused
from vllm_ext.nvfp4_decode import decode_mode
from vllm_ext.nvfp4_gemv import NO_PDL_ENV, decode_tile, one_row_buffers, pdl_first_allowed, pdl_supported
from vllm_ext.nvfp4_marlin_row import CHUNK, marlin_row_tile, x_alignment
from vllm_ext.triton_support import TRITON_IMPORT_ERROR as _TRITON_IMPORT_ERROR
from vllm_ext.triton_support import tl, triton

__all__ = ["MAX_CHUNKS", "NO_PDL_ENV", "chunking", "first_slice_sizes", "launch", "launch_supported", "pdl_choice",
           "pdl_supported", "ragged_slices", "row_tile", "supports"]

SUB_K = 256  # input features per step of a shrink program
MAX_CHUNKS = 16  # shrink programs per slice: the partials a finishing program sums


def chunking(k: int) -> tuple[int, int]:
    """``(features per shrink program, programs)`` for input size ``k``: multiples of :data:`SUB_K`, at most
    :data:`MAX_CHUNKS` programs (3 584 -> 14 x 256; 18 944 -> 15 x 1 280)."""
    steps = -(-k // SUB_K)
    per = -(-steps // MAX_CHUNKS) * SUB_K
    return per, -(-k // per)


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from vllm_ext.nvfp4_decode import _decode_up
    from vllm_ext.nvfp4_gemv import _row_dot, _scaled, _sum_partials
    from vllm_ext.nvfp4_marlin_row import _marlin_row_dot, _marlin_rows

    @triton.jit
    def _shrink_program(a0, a1, a2, PDL: tl.constexpr, WAIT: tl.constexpr):
        """A shrink program's start, ``(chunk, slice, that slice's A)``: with ``WAIT`` (the grid is itself a
        programmatic dependent launch) it first waits for the kernel before it, which wrote ``x``; with ``PDL`` it
        then lets the GEMM that follows start (that GEMM waits for this grid before it reads the partials). Used by
        :func:`_shrink_kernel` and :mod:`vllm_ext.nvfp4_gluon_lora`'s shrink."""
        if WAIT:
            gdc_wait()
        if PDL:
            gdc_launch_dependents()
        s = tl.program_id(1)
        a_ptr = a0
        if s == 1:
            a_ptr = a1
        elif s == 2:
            a_ptr = a2
        return tl.program_id(0), s, a_ptr

    @triton.jit
    def _shrink_kernel(x_ptr, a0, a1, a2, hp_ptr, K, CH, R: tl.constexpr, SUB: tl.constexpr, KS_PAD: tl.constexpr,
                       PDL: tl.constexpr, WAIT: tl.constexpr):
        """``hp[s, c, :] = A_s[:, c*CH : (c+1)*CH] @ x[c*CH : (c+1)*CH]`` in float32 (products of 16-bit values,
        exact in float32). ``WAIT``: this grid is itself a programmatic dependent launch; its programs wait for the
        previous kernel (which wrote ``x``) before anything else, and only then let the row kernel start, so the row
        kernel never reads ``x`` early. ``PDL``: let the row kernel start now (it waits for this grid before reading
        ``hp``)."""
        c, s, a_ptr = _shrink_program(a0, a1, a2, PDL, WAIT)
        offs_r = tl.arange(0, R)
        acc = tl.zeros((R, SUB), dtype=tl.float32)
        for k0 in range(c * CH, tl.minimum(c * CH + CH, K), SUB):
            offs_k = k0 + tl.arange(0, SUB)
            kmask = offs_k < K
            xv = tl.load(x_ptr + offs_k, mask=kmask, other=0.0).to(tl.float32)
            at = tl.load(a_ptr + offs_r[:, None] * K + offs_k[None, :], mask=kmask[None, :], other=0.0)
            acc += at.to(tl.float32) * xv[None, :]
        tl.store(hp_ptr + (s * KS_PAD + c) * R + offs_r, tl.sum(acc, axis=1))

    @triton.jit
    def _lora_rows(b0, b1, b2, n0, n1, rn, n_ok, row0, R: tl.constexpr):
        """This block's rows of B ``[BLOCK_N, R]`` and its slice (a block never straddles two slices: launch() checks
        that the slice sizes are multiples of BLOCK_N)."""
        offs_r = tl.arange(0, R)
        if row0 >= n0 + n1:
            bt = tl.load(b2 + (rn - n0 - n1)[:, None] * R + offs_r[None, :], mask=n_ok[:, None], other=0.0)
            hs = 2
        elif row0 >= n0:
            bt = tl.load(b1 + (rn - n0)[:, None] * R + offs_r[None, :], mask=n_ok[:, None], other=0.0)
            hs = 1
        else:
            bt = tl.load(b0 + rn[:, None] * R + offs_r[None, :], mask=n_ok[:, None], other=0.0)
            hs = 0
        return bt, hs

    @triton.jit
    def _lora_h(hp_ptr, idx_ptr, hs, KS, lscale, out_ty: tl.constexpr, R: tl.constexpr, KS_PAD: tl.constexpr,
                PDL: tl.constexpr):
        """Slice ``hs``'s ``h``: the shrink's partials summed in a fixed order, scaled, zero for a token without the
        adapter, rounded to the output dtype. ``PDL``: first wait until the shrink grid has finished."""
        if PDL:
            gdc_wait()
        offs_r = tl.arange(0, R)
        offs_c = tl.arange(0, KS_PAD)
        parts = tl.load(hp_ptr + (hs * KS_PAD + offs_c)[:, None] * R + offs_r[None, :], mask=(offs_c < KS)[:, None],
                        other=0.0)
        slot = tl.load(idx_ptr)
        return tl.where(slot == 0, tl.sum(parts, axis=0) * lscale, 0.0).to(out_ty)  # punica's intermediate, rounded

    @triton.jit
    def _store_with_update(tot, bt, h, g_ptr, bias_ptr, y_ptr, rn, n_ok, HAS_BIAS: tl.constexpr, z_ptr,
                           ZEROS: tl.constexpr, ASM: tl.constexpr):
        """The output with the update added; ``ZEROS``: also zeros into ``z_ptr``'s outputs (the split add's
        "update" of a call that added it here, so that it costs no launch of its own)."""
        out_ty = y_ptr.dtype.element_ty
        if ZEROS:
            tl.store(z_ptr + rn, tl.zeros(rn.shape, dtype=out_ty), mask=n_ok)
        # the row kernel's output (global scale, bias in float32), rounded once
        base = _scaled(tot, _decode_up(ASM) / tl.load(g_ptr), bias_ptr + rn, n_ok, HAS_BIAS).to(out_ty)
        up = tl.sum(bt.to(tl.float32) * h.to(tl.float32)[None, :], axis=1).to(out_ty)
        tl.store(y_ptr + rn, (base.to(tl.float32) + up.to(tl.float32)).to(out_ty), mask=n_ok)

    @triton.jit
    def _dot(x_ptr, w_ptr, s_ptr, rn, n_ok, pid_n, pid_k, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             SPLIT_K: tl.constexpr, ASM: tl.constexpr, STAGES: tl.constexpr, MARLIN: tl.constexpr, ASUM: tl.constexpr):
        """The base GEMM's float32 sums for the outputs ``rn``: the checkpoint layout's row loop, or with ``MARLIN``
        the loop over Marlin's tensors (:mod:`vllm_ext.nvfp4_marlin_row`; ``BLOCK_N`` = 8 HB, ``BLOCK_K`` = 16 T)."""
        if MARLIN:
            part = _marlin_row_dot(x_ptr, w_ptr, s_ptr, pid_n, pid_k, N, K, BLOCK_N // 8, BLOCK_K // 16, SPLIT_K, ASM,
                                   STAGES, ASUM)
        else:
            part = _row_dot(x_ptr, w_ptr, s_ptr, rn, n_ok, pid_k, K, BLOCK_N, BLOCK_K, SPLIT_K, ASM, True, STAGES)
        return part

    @triton.jit
    def _row_lora_kernel(
        x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, ws_ptr, cnt_ptr, bias_ptr, N, K,
        hp_ptr, idx_ptr, b0, b1, b2, n0, n1, KS, lscale, z_ptr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, ASM: tl.constexpr,
        HAS_BIAS: tl.constexpr, R: tl.constexpr, KS_PAD: tl.constexpr, PDL: tl.constexpr, STAGES: tl.constexpr,
        MARLIN: tl.constexpr, ASUM: tl.constexpr, ZEROS: tl.constexpr,
    ):  # fmt: skip
        out_ty: tl.constexpr = y_ptr.dtype.element_ty
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        if MARLIN:  # 8 HB outputs of one or more 64-output chunks, strided (vllm_ext.nvfp4_marlin_row); the first
            # chunk's slice (launch checks that a block never straddles two)
            row0 = (pid_n * BLOCK_N) // 64 * 64
            rn = _marlin_rows(pid_n, BLOCK_N // 8)
        else:
            row0 = pid_n * BLOCK_N
            rn = row0 + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        if SPLIT_K == 1:  # every program finishes its block: B's rows (and, without PDL, h) load before the main loop
            bt, hs = _lora_rows(b0, b1, b2, n0, n1, rn, n_ok, row0, R)
            if not PDL:
                h = _lora_h(hp_ptr, idx_ptr, hs, KS, lscale, out_ty, R, KS_PAD, PDL)
            part = _dot(x_ptr, w_ptr, s_ptr, rn, n_ok, pid_n, pid_k, N, K, BLOCK_N, BLOCK_K, SPLIT_K, ASM, STAGES,
                        MARLIN, ASUM)
            if PDL:  # the shrink grid may still be running: h after the main loop
                h = _lora_h(hp_ptr, idx_ptr, hs, KS, lscale, out_ty, R, KS_PAD, PDL)
            _store_with_update(part, bt, h, g_ptr, bias_ptr, y_ptr, rn, n_ok, HAS_BIAS, z_ptr, ZEROS, ASM)
        else:  # float32 partials [SPLIT_K, N]; the block's last program to arrive finishes it
            part = _dot(x_ptr, w_ptr, s_ptr, rn, n_ok, pid_n, pid_k, N, K, BLOCK_N, BLOCK_K, SPLIT_K, ASM, STAGES,
                        MARLIN, ASUM)
            tl.store(ws_ptr + pid_k * N + rn, part, mask=n_ok)
            arrived = tl.atomic_add(cnt_ptr + pid_n, 1)  # acq_rel at GPU scope: the partials above are visible
            if arrived == SPLIT_K - 1:
                bt, hs = _lora_rows(b0, b1, b2, n0, n1, rn, n_ok, row0, R)
                h = _lora_h(hp_ptr, idx_ptr, hs, KS, lscale, out_ty, R, KS_PAD, PDL)
                tot = _sum_partials(ws_ptr + rn, N, n_ok, part, SPLIT_K)
                tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next call (and the next CUDA-graph replay)
                _store_with_update(tot, bt, h, g_ptr, bias_ptr, y_ptr, rn, n_ok, HAS_BIAS, z_ptr, ZEROS, ASM)


def supports(x: torch.Tensor, packed: torch.Tensor, lora_a: tuple[torch.Tensor, ...],
             lora_b: tuple[torch.Tensor, ...], output_slices: tuple[int, ...]) -> str | None:
    """``None`` when :func:`launch` runs this call (one row, an adapter the fused LoRA kernel takes, slices that
    meet the row kernel's blocks), else why not (a sentence)."""
    if triton is None:
        return f"Triton is not importable ({_TRITON_IMPORT_ERROR})"
    k = x.shape[-1]
    tokens = x.numel() // k
    if tokens != 1:
        return f"{tokens} rows (one supported)"
    why = lora_fused.weights_supported(x.dtype, k, lora_a, lora_b, output_slices)
    if why is not None:
        return why
    marlin, n = _layout(packed)
    if sum(output_slices) != n or tuple(packed.shape) != ((k // 16, 2 * n) if marlin else (n, k // 2)):
        return f"weight {tuple(packed.shape)} does not fit input {k} and slices {tuple(output_slices)}"
    tile = row_tile(n, k, marlin, tuple(output_slices))
    if tile is None:
        return (f"Marlin's layout of this weight is padded (N={n}, K={k})" if marlin
                else f"K={k} is not a multiple of 128")
    ragged = ragged_slices(output_slices, _block_outputs(tile, marlin))
    if ragged:
        rows = (f"{_block_outputs(tile, marlin)}-output chunks of Marlin's layout" if marlin
                else f"{tile['block_n']} rows per block")
        return f"slice sizes {ragged} are not multiples of the row kernel's {rows}"
    return None


def _layout(packed: torch.Tensor) -> tuple[bool, int]:
    """``(marlin, N)``: whether ``packed`` is Marlin's int32 ``[K/16, 2N]`` (``decode_gemv: "shared"``) rather than
    the checkpoint's uint8 ``[N, K/2]``, and the weight's output count."""
    marlin = packed.dtype == torch.int32
    return marlin, packed.shape[1] // 2 if marlin else packed.shape[0]


def _block_outputs(tile: dict[str, int], marlin: bool) -> int:
    """The outputs a slice size must be a multiple of, so that no program's block straddles two slices: the tile's
    ``block_n`` rows, or on Marlin's layout its chunks (64 outputs, or ``block_n`` where a block is several)."""
    return max(CHUNK, tile["block_n"]) if marlin else tile["block_n"]


def row_tile(n: int, k: int, marlin: bool = False, slices: tuple[int, ...] = ()) -> dict[str, int] | None:
    """The row+lora kernel's tile (``block_n``, ``block_k``, ``split_k``, ``num_warps``, ``stages``) for an ``[n, k]``
    weight: :func:`~vllm_ext.nvfp4_gemv.decode_tile` for the checkpoint layout, or with ``marlin`` (Marlin's own
    tensors, ``decode_gemv: "shared"``) :func:`~vllm_ext.nvfp4_marlin_row.marlin_row_tile` in these terms
    (``block_n`` = 8 HB outputs, ``block_k`` = 16 T inputs per loop step), its programs narrowed to fewer chunks
    (down to one, 64 outputs) where a block of several would straddle two of the layer's ``slices`` (e.g. a K/V
    slice of 192 outputs against §4ai's blocks of 128)."""
    if not marlin:
        return decode_tile(n, k, lora=True)
    t = marlin_row_tile(n, k, lora=True)
    if t is None:
        return None
    block_n = 8 * t["hb"]
    while block_n > CHUNK and ragged_slices(slices, block_n):
        block_n //= 2
    return dict(block_n=block_n, block_k=16 * t["t"], split_k=t["split_k"], num_warps=t["num_warps"],
                stages=t["stages"], asum=t.get("asum", 0))


def first_slice_sizes(output_slices: tuple[int, ...], n: int) -> list[int]:
    """The first two slice sizes as the epilogues take them (``n0``, ``n1``): a block's slice is the first whose end
    lies past its first row; missing slices count as ``n`` (their start lies beyond the outputs: never taken)."""
    return list(output_slices[:2]) + [n] * (2 - min(2, len(output_slices)))


def pdl_choice(device: torch.device, pdl: bool | None, pdl_first: bool | None) -> tuple[bool, bool]:
    """``(pdl, pdl_first)`` of a two-launch linear: the GEMM as a programmatic dependent launch where
    :func:`pdl_supported` (unless ``pdl`` says), and the shrink too where also
    :func:`~vllm_ext.nvfp4_gemv.pdl_first_allowed` (unless ``pdl_first`` says)."""
    if pdl is None:
        pdl = pdl_supported(device)
    if pdl_first is None:
        pdl_first = pdl and pdl_first_allowed()
    return pdl, pdl_first


def ragged_slices(output_slices: tuple[int, ...], block_n: int) -> list[int]:
    """The slices (all but the last) that would make an output block straddle two slices: sizes not a multiple of
    ``block_n`` (the kernel finds a block's slice from its first row)."""
    return [size for size in output_slices[:-1] if size % block_n]


def launch(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
           bias: torch.Tensor | None, lora_a: tuple[torch.Tensor, ...], lora_b: tuple[torch.Tensor, ...],
           lora_scale: float, output_slices: tuple[int, ...], token_lora_indices: torch.Tensor,
           pdl: bool | None = None, pdl_first: bool | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias) + B_s @ (lora_scale * A_s @ x)`` per slice for one row ``x`` ``[..., K]``, where the token's
    slot (``token_lora_indices[0]``) is 0; returns ``[..., N]`` in ``x``'s dtype. ``W`` is the NVFP4 triple
    (``packed`` uint8 ``[N, K/2]``, ``scale`` float8_e4m3fn ``[N, K/16]``, ``global_scale`` the float32 divisor), or
    Marlin's own tensors (``packed`` int32 ``[K/16, 2N]``, ``scale`` ``[K/16, N]``, ``global_scale``
    :func:`~vllm_ext.nvfp4_marlin_row.marlin_divisor`'s divisor; :mod:`vllm_ext.nvfp4_marlin_row`);
    ``bias`` ``[N]`` in natural order; ``lora_a[s]`` ``[1, 1, R, K]``, ``lora_b[s]`` ``[1, 1, n_s, R]``. Two
    launches (shrink, then the row kernel with the expand); ``pdl`` (default: where :func:`pdl_supported`): the row
    kernel as a programmatic dependent launch, so it starts while the shrink runs and waits for it only before
    reading ``h``; ``pdl_first`` (default: ``pdl`` and :func:`~vllm_ext.nvfp4_gemv.pdl_first_allowed`): the shrink
    too, waiting for the kernel before it. Raises :class:`~vllm_ext.lora_fused.FusedLoRAUnsupported` where
    :func:`supports` says no."""
    why = supports(x, packed, lora_a, lora_b, tuple(output_slices))
    if why is not None:
        raise lora_fused.FusedLoRAUnsupported(why)
    return launch_supported(x, packed, scale, global_scale, bias, lora_a, lora_b, lora_scale, output_slices,
                            token_lora_indices, pdl, pdl_first=pdl_first)


def launch_supported(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     bias: torch.Tensor | None, lora_a: tuple[torch.Tensor, ...], lora_b: tuple[torch.Tensor, ...],
                     lora_scale: float, output_slices: tuple[int, ...], token_lora_indices: torch.Tensor,
                     pdl: bool | None = None, tile: dict[str, int] | None = None,
                     pdl_first: bool | None = None, zeros: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """:func:`launch` for a caller that has already had ``None`` from :func:`supports` for this call (the overlap op
    asks it to choose its path); still refuses a scale or bias of the wrong shape. ``tile``: the row kernel's tile
    in place of :func:`decode_tile`'s (for timing the kernel's variants side by side: scripts/gpu/check_row_lora.py);
    the slices must be multiples of its ``block_n``. ``zeros``: returns ``(output, zeros)``, the second a tensor like
    the output that the kernel fills with zeros in its epilogue (the overlap op's split add, whose model adds the
    two: no launch of its own for the zeros)."""
    slices = tuple(output_slices)
    k = x.shape[-1]
    marlin, n = _layout(packed)
    rank = lora_a[0].shape[-2]
    want = (k // 16, n) if marlin else (n, k // 16)
    if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != want:
        raise ValueError(f"scale {scale.dtype} {tuple(scale.shape)}, expected float8_e4m3fn {want}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias {tuple(bias.shape)}, expected ({n},)")
    mode = decode_mode(x.device)
    if tile is None:
        tile = row_tile(n, k, marlin, slices)
    elif marlin and (tile["block_n"] not in (8, 16, 32, 64, 128, 256, 512) or k % tile["block_k"]
                     or tile["block_k"] % 16 or n % tile["block_n"]):
        raise ValueError(f"tile {tile}: on Marlin's layout block_n is 8 ... 512 (a power of two dividing N={n}) and "
                         f"block_k 16 T dividing K={k}")
    elif ragged_slices(slices, _block_outputs(tile, marlin)):
        raise ValueError(f"slices {slices} are not multiples of the given tile's {_block_outputs(tile, marlin)} rows "
                         "per block")
    block_n, split_k = tile["block_n"], min(tile["split_k"], k // tile["block_k"])
    blocks = triton.cdiv(n, block_n)
    align = x_alignment(tile.get("asum", 0)) if marlin else 1  # forms 3 and 4 of Marlin's layout: x in 4 / 16 bytes
    x2, out, ws, cnt = one_row_buffers(x, n, split_k, blocks, x_align=align)
    z = torch.empty_like(out) if zeros else out  # every element gets written
    s_count = len(slices)
    a, b = lora_fused.slice_operands(lora_a, lora_b, rank, k)
    n_first = first_slice_sizes(slices, n)
    per, ks = chunking(k)
    hp = torch.empty(s_count, MAX_CHUNKS, rank, device=x.device, dtype=torch.float32)  # every read row is written
    pdl, pdl_first = pdl_choice(x.device, pdl, pdl_first)
    _shrink_kernel[(ks, s_count)](x2, *a, hp, k, per, R=rank, SUB=SUB_K, KS_PAD=MAX_CHUNKS, PDL=pdl, WAIT=pdl_first,
                                  num_warps=4, launch_pdl=pdl_first)
    g = global_scale.reshape(-1)[:1].to(torch.float32)
    w = packed if marlin else packed.contiguous().view(torch.int32)
    _row_lora_kernel[(blocks, split_k)](
        x2, w, scale.view(torch.int32) if marlin else scale.contiguous(), g, out, ws, cnt,
        out if bias is None else bias.contiguous(), n, k, hp, token_lora_indices, *b, n_first[0], n_first[1], ks,
        float(lora_scale), z,
        BLOCK_N=block_n, BLOCK_K=tile["block_k"], SPLIT_K=split_k, ASM=mode, HAS_BIAS=bias is not None,
        R=rank, KS_PAD=MAX_CHUNKS, PDL=pdl, STAGES=tile.get("stages", 0), MARLIN=marlin,
        ASUM=int(tile.get("asum", 0)), ZEROS=zeros, num_warps=tile["num_warps"], launch_pdl=pdl,
    )  # fmt: skip
    if zeros:
        return out.reshape(*x.shape[:-1], n), z.reshape(*x.shape[:-1], n)
    return out.reshape(*x.shape[:-1], n)
