"""One launch for a one-row NVFP4 linear and its single adapter's LoRA: decode_gemv's row kernel with the LoRA
shrink in the same grid and the expand in its epilogue.

Why: at batch 1 with ``decode_gemv`` a 7B decode step spends 1.93 ms in the one-row kernel and 0.89 ms in the
one-launch LoRA kernel (:mod:`vllm_ext.lora_fused`, 112 launches, ~8 us each, far above the ~0.05 ms its 161 MB of
adapter weights need; docs/benchmarks.md §4k lease 2), and running that kernel beside the row kernel on a second
stream is slower than after it (§4l lease 2: 2.939 vs 2.671 ms per step). Here the LoRA costs no launch of its own:

* programs ``0 .. KS-1`` claim 256-feature chunks of ``A_s @ x`` (every slice, from a claim counter) and add their
  float32 partials into a workspace ``h`` ``[S, R]`` with atomics, counting each chunk done;
* the other programs run the row kernel's loop (:func:`vllm_ext.nvfp4_gemv._row_dot`, the same tiles as
  :func:`~vllm_ext.nvfp4_gemv.decode_tile`; with split-K the last of a block's programs to arrive sums the partials
  in a fixed order). The program that finishes a block rounds the base result (bias included) to the output dtype,
  loads its ``BLOCK_N x R`` rows of ``B``, then waits for the shrink: if chunks are still unclaimed it claims and
  computes them itself, so it never waits on a program that may not be running (no deadlock whatever the order the
  GPU starts programs in), then reads ``h``, applies ``scale`` and the token's slot, rounds to the dtype, takes the
  dot with its rows of B in float32, rounds, adds and stores once;
* the last of the programs that touch ``h`` to leave zeroes it and the counters for the next launch (or CUDA-graph
  replay).

The arithmetic is that of the row kernel followed by :mod:`vllm_ext.lora_fused`'s kernel (punica's): the base output
rounded once, ``h`` in float32 from atomics (so its summation order varies between launches), ``scale`` in float32,
``h`` rounded to the dtype, the update's float32 sum rounded, then added to the rounded base in float32 and rounded.
Only the order of the update's float32 sum over the rank differs (a sum here, a dot there). Under
``TRITON_INTERPRET=1`` programs run one after another in launch order (program 0 claims every chunk) and the decode
runs in plain Triton, not PTX.

Used by the overlap LoRA mode (the default) for one-row calls of engines with ``decode_gemv`` on
(:mod:`vllm_ext.lora_dense_wrapper`); the kernel state is :func:`vllm_ext.lora_fused.new_sync`'s, shared with that
kernel (launches on one stream run one after another). Imports torch and Triton only.
"""

from __future__ import annotations

import torch

from vllm_ext import lora_fused
from vllm_ext.nvfp4_gemv import _counters, decode_tile
from vllm_ext.triton_support import TRITON_IMPORT_ERROR as _TRITON_IMPORT_ERROR
from vllm_ext.triton_support import interpreting as _interpreting
from vllm_ext.triton_support import tl, triton

__all__ = ["launch", "supports"]

CHUNK_K = lora_fused.CHUNK_K  # input features per shrink chunk
_HEAD = lora_fused._HEAD  # new_sync's int32 counters in front of its float32 workspace: claim, chunks done, leavers

if triton is not None:
    from vllm_ext.lora_fused import _shrink_slice
    from vllm_ext.nvfp4_gemv import _row_dot

    @triton.jit
    def _shrink_claimed(x_ptr, a0, a1, a2, h_ptr, sync_ptr, K, KS, S: tl.constexpr, R: tl.constexpr,
                        CHUNK: tl.constexpr, HROWS: tl.constexpr, UPCAST: tl.constexpr):
        """Claim chunks of ``A_s @ x`` from the claim counter until none is left; add each into ``h`` and count it."""
        c = tl.atomic_add(sync_ptr, 1)
        while c < KS:
            _shrink_slice(x_ptr, 0, a0, h_ptr, c, 0, 1, K, R, 16, CHUNK, HROWS, UPCAST)
            if S > 1:
                _shrink_slice(x_ptr, 0, a1, h_ptr, c, 1, 1, K, R, 16, CHUNK, HROWS, UPCAST)
            if S > 2:
                _shrink_slice(x_ptr, 0, a2, h_ptr, c, 2, 1, K, R, 16, CHUNK, HROWS, UPCAST)
            tl.atomic_add(sync_ptr + 1, 1, sem="release")
            c = tl.atomic_add(sync_ptr, 1)

    @triton.jit
    def _leave(sync_ptr, h_ptr, total, S: tl.constexpr, R: tl.constexpr, HROWS: tl.constexpr):
        """Count this program out; the last of ``total`` zeroes ``h``'s first row of each slice and the counters."""
        left = tl.atomic_add(sync_ptr + 2, 1, sem="acq_rel")
        if left == total - 1:  # every other program is past its claims and its reads of h
            offs_r = tl.arange(0, R)
            for s in tl.static_range(S):
                tl.store(h_ptr + s * HROWS * R + offs_r, tl.zeros((R,), tl.float32))
            tl.atomic_xchg(sync_ptr + 1, 0)
            tl.atomic_xchg(sync_ptr + 2, 0)
            tl.atomic_xchg(sync_ptr, 0)

    @triton.jit
    def _epilogue(tot, rn, n_ok, row0, g_ptr, bias_ptr, y_ptr, idx_ptr, x_ptr, a0, a1, a2, b0, b1, b2, n0, n1,
                  sync_ptr, h_ptr, K, KS, total, lscale,
                  HAS_BIAS: tl.constexpr, S: tl.constexpr, R: tl.constexpr, CHUNK: tl.constexpr,
                  HROWS: tl.constexpr, UPCAST: tl.constexpr):
        out_ty = y_ptr.dtype.element_ty
        base = tot * (16384.0 / tl.load(g_ptr))
        if HAS_BIAS:
            base += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        base = base.to(out_ty)  # the row kernel's output, rounded once
        offs_r = tl.arange(0, R)
        # what does not depend on the shrink is loaded before waiting for it: this block's rows of B (a block never
        # straddles two slices: launch() checks that the slice sizes are multiples of BLOCK_N) and the token's slot
        if row0 >= n0 + n1:
            bt = tl.load(b2 + (rn - n0 - n1)[:, None] * R + offs_r[None, :], mask=n_ok[:, None], other=0.0)
            hs = 2
        elif row0 >= n0:
            bt = tl.load(b1 + (rn - n0)[:, None] * R + offs_r[None, :], mask=n_ok[:, None], other=0.0)
            hs = 1
        else:
            bt = tl.load(b0 + rn[:, None] * R + offs_r[None, :], mask=n_ok[:, None], other=0.0)
            hs = 0
        slot = tl.load(idx_ptr)
        done = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
        if done < KS:  # help with the chunks nobody has claimed yet, then wait for the claimed ones
            _shrink_claimed(x_ptr, a0, a1, a2, h_ptr, sync_ptr, K, KS, S, R, CHUNK, HROWS, UPCAST)
            done = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
            while done < KS:
                done = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
        h = tl.load(h_ptr + hs * HROWS * R + offs_r, cache_modifier=".cg")
        h = tl.where(slot == 0, h * lscale, 0.0).to(out_ty)  # punica's intermediate, rounded to the dtype
        up = tl.sum(bt.to(tl.float32) * h.to(tl.float32)[None, :], axis=1).to(out_ty)
        tl.store(y_ptr + rn, (base.to(tl.float32) + up.to(tl.float32)).to(out_ty), mask=n_ok)
        _leave(sync_ptr, h_ptr, total, S, R, HROWS)

    @triton.jit
    def _row_lora_kernel(
        x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, ws_ptr, cnt_ptr, bias_ptr, N, K,
        idx_ptr, a0, a1, a2, b0, b1, b2, n0, n1, sync_ptr, h_ptr, KS, lscale,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, ASM: tl.constexpr,
        HAS_BIAS: tl.constexpr, S: tl.constexpr, R: tl.constexpr, CHUNK: tl.constexpr, HROWS: tl.constexpr,
        UPCAST: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        blocks = tl.cdiv(N, BLOCK_N)
        total = KS + blocks  # the programs that count themselves out: the shrink ones and one finisher per block
        if pid < KS:
            _shrink_claimed(x_ptr, a0, a1, a2, h_ptr, sync_ptr, K, KS, S, R, CHUNK, HROWS, UPCAST)
            _leave(sync_ptr, h_ptr, total, S, R, HROWS)
        else:
            job = pid - KS
            pid_n = job // SPLIT_K
            pid_k = job % SPLIT_K
            row0 = pid_n * BLOCK_N
            rn = row0 + tl.arange(0, BLOCK_N)
            n_ok = rn < N
            part = _row_dot(x_ptr, w_ptr, s_ptr, rn, n_ok, pid_k, K, BLOCK_N, BLOCK_K, SPLIT_K, ASM, True)
            if SPLIT_K == 1:
                _epilogue(part, rn, n_ok, row0, g_ptr, bias_ptr, y_ptr, idx_ptr, x_ptr, a0, a1, a2, b0, b1, b2, n0,
                          n1, sync_ptr, h_ptr, K, KS, total, lscale, HAS_BIAS, S, R, CHUNK, HROWS, UPCAST)
            else:  # float32 partials [SPLIT_K, N]; the block's last program to arrive finishes it
                tl.store(ws_ptr + pid_k * N + rn, part, mask=n_ok)
                arrived = tl.atomic_add(cnt_ptr + pid_n, 1)  # acq_rel at GPU scope: the partials above are visible
                if arrived == SPLIT_K - 1:
                    tot = tl.zeros_like(part)
                    for s in tl.static_range(SPLIT_K):  # a fixed order: the sum does not depend on arrival
                        tot += tl.load(ws_ptr + s * N + rn, mask=n_ok, other=0.0, cache_modifier=".cg")
                    tl.atomic_xchg(cnt_ptr + pid_n, 0)
                    _epilogue(tot, rn, n_ok, row0, g_ptr, bias_ptr, y_ptr, idx_ptr, x_ptr, a0, a1, a2, b0, b1, b2,
                              n0, n1, sync_ptr, h_ptr, K, KS, total, lscale, HAS_BIAS, S, R, CHUNK, HROWS, UPCAST)


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
    n = packed.shape[0]
    if sum(output_slices) != n or tuple(packed.shape) != (n, k // 2):
        return f"weight {tuple(packed.shape)} does not fit input {k} and slices {tuple(output_slices)}"
    tile = decode_tile(n, k)
    if tile is None:
        return f"K={k} is not a multiple of 128"
    ragged = [size for size in output_slices[:-1] if size % tile["block_n"]]
    if ragged:
        return f"slice sizes {ragged} are not multiples of the row kernel's {tile['block_n']} rows per block"
    return None


def launch(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
           bias: torch.Tensor | None, lora_a: tuple[torch.Tensor, ...], lora_b: tuple[torch.Tensor, ...],
           lora_scale: float, output_slices: tuple[int, ...], token_lora_indices: torch.Tensor,
           sync: torch.Tensor) -> torch.Tensor:
    """``x @ W.T (+ bias) + B_s @ (lora_scale * A_s @ x)`` per slice for one row ``x`` ``[..., K]``, where the token's
    slot (``token_lora_indices[0]``) is 0, in one launch; returns ``[..., N]`` in ``x``'s dtype. ``W`` is the NVFP4
    triple (``packed`` uint8 ``[N, K/2]``, ``scale`` float8_e4m3fn ``[N, K/16]``, ``global_scale`` the float32
    divisor); ``bias`` ``[N]`` in natural order; ``lora_a[s]`` ``[1, 1, R, K]``, ``lora_b[s]`` ``[1, 1, n_s, R]``;
    ``sync`` from :func:`vllm_ext.lora_fused.new_sync` (left at zero). Raises
    :class:`~vllm_ext.lora_fused.FusedLoRAUnsupported` where :func:`supports` says no."""
    slices = tuple(output_slices)
    why = supports(x, packed, lora_a, lora_b, slices)
    if why is not None:
        raise lora_fused.FusedLoRAUnsupported(why)
    k = x.shape[-1]
    n = packed.shape[0]
    rank = lora_a[0].shape[-2]
    if sync.dtype != torch.int32 or sync.numel() < _HEAD + lora_fused.MAX_SLICES * lora_fused.MAX_TOKENS * rank:
        raise lora_fused.FusedLoRAUnsupported(f"state of {sync.numel()} {sync.dtype} words is too small for rank "
                                              f"{rank}; make it with lora_fused.new_sync(device, max_rank>={rank})")
    if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (n, k // 16):
        raise ValueError(f"scale {scale.dtype} {tuple(scale.shape)}, expected float8_e4m3fn ({n}, {k // 16})")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias {tuple(bias.shape)}, expected ({n},)")
    tile = decode_tile(n, k)
    x2 = x.reshape(1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    block_n, split_k = tile["block_n"], min(tile["split_k"], k // tile["block_k"])
    blocks = triton.cdiv(n, block_n)
    out = torch.empty(1, n, device=x.device, dtype=x.dtype)
    if split_k > 1:
        ws = torch.empty(split_k, n, device=x.device, dtype=torch.float32)
        cnt = _counters(x.device, blocks)
    else:
        ws, cnt = out, out  # unused
    s_count = len(slices)
    a = [t.view(rank, k) for t in lora_a] + [lora_a[0].view(rank, k)] * (lora_fused.MAX_SLICES - s_count)
    b = [t.view(t.shape[-2], rank) for t in lora_b] + [lora_b[0].view(-1, rank)] * (lora_fused.MAX_SLICES - s_count)
    n_first = list(slices[:2]) + [n] * (2 - min(2, s_count))  # slices past the last start beyond N: never taken
    ks = triton.cdiv(k, CHUNK_K)
    h = sync[_HEAD:].view(torch.float32)
    g = global_scale.reshape(-1)[:1].to(torch.float32)
    _row_lora_kernel[(ks + blocks * split_k,)](
        x2, packed.contiguous().view(torch.int32), scale.contiguous(), g, out, ws, cnt,
        out if bias is None else bias.contiguous(), n, k, token_lora_indices, *a, *b, n_first[0], n_first[1], sync,
        h, ks, float(lora_scale),
        BLOCK_N=block_n, BLOCK_K=tile["block_k"], SPLIT_K=split_k, ASM=not _interpreting(), HAS_BIAS=bias is not None,
        S=s_count, R=rank, CHUNK=CHUNK_K, HROWS=lora_fused.MAX_TOKENS, UPCAST=_interpreting(),
        num_warps=tile["num_warps"],
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)

