"""One-launch single-adapter LoRA for decode: shrink and expand of every slice of a linear in one Triton kernel.

vLLM's punica path spends three launches per LoRA linear (zero the buffer, shrink, expand), 12 per decoder
layer, and they are latency-bound at decode (§4b of docs/benchmarks.md: 1.57 ms of LoRA per 7B decode step at
batch 1, 70 % of the 4-bit GEMMs). When the engine serves one adapter (the RL rollout), each token either uses
slot 0 or no adapter, and ``y += cast(B @ cast(scale * (A @ x)))`` needs no per-token adapter lookup.

This kernel does it in one launch. Its programs take a ticket from a counter in launch order, so a program
that holds ticket *t* knows every ticket below *t* is already running:

* tickets ``0 .. KS-1`` (shrink): 256 input features each, for every slice, in one load of ``x`` and of ``A``;
  the fp32 partial is added with atomics into this launch's half of a workspace ``h`` ``[2, S, tokens, R]``
  (zero when the launch starts); then the program counts itself done;
* the other tickets (expand): load their block of ``B``, of ``y`` and the token slots first, zero their strip of
  the workspace's other half, then wait until the KS shrink programs are done (those never wait and hold lower
  tickets, so they are running: no deadlock whatever the scheduling), read ``h``, apply ``scale`` and the token
  mask, round to the weight dtype, multiply by the block of B and add into ``y``.

No program waits at the end and none cleans up after the others. The ticket word also holds which half of the
workspace the launch uses (its parity); the program that takes the last ticket knows every program has read
it, so it resets the count and flips the parity in one exchange, and clears the other half's done-counter. The
launch before left that half in use; this launch's expand programs zero it, so the next launch (or CUDA-graph
replay, which reads the parity from memory) finds it clean. Up to the nineteenth session (v2, docs/benchmarks.md
§4g-§4u) every program counted itself out at the end and the last one zeroed the workspace and the counters:
one more atomic per program and a tail on the launch's critical path (§4v).

The arithmetic is punica's: fp32 accumulation of ``A @ x`` (split over the input features and summed with fp32
atomics, as punica's split-K shrink does, so the order of that sum varies from launch to launch), ``scale``
applied in fp32, the intermediate rounded to bf16/fp16, fp32 accumulation of ``B @ h``, rounded, added to ``y``
in its dtype. Under ``TRITON_INTERPRET=1`` programs run one after another in launch order, so the shrink
programs finish before any expand program starts and the kernel runs (slowly) on the CPU.

Used by :class:`vllm_ext.lora_dense_wrapper.QerlPunicaWrapper` for ``additional_config={"qerl_lora":
"fused"}`` (and the default ``"overlap"``, below) through its torch op, which decides per call (at run time,
not when torch.compile traces the model): at most :data:`MAX_TOKENS` tokens (decode, small prefills) take this
kernel, larger calls punica. The ``"overlap"`` mode launches it on a side stream beside the base GEMM with
``add_inputs=False`` (it overwrites a scratch tensor with the update, which the caller adds after joining).
Imports torch and Triton only.
"""

from __future__ import annotations

import torch

from vllm_ext.triton_support import TRITON_IMPORT_ERROR as _TRITON_IMPORT_ERROR
from vllm_ext.triton_support import interpreting as _interpreting
from vllm_ext.triton_support import tl, triton

MAX_TOKENS = 64  # calls with more tokens than this take punica (one program holds all tokens in registers)
MAX_SLICES = 3  # q/k/v
CHUNK_K = 256  # input features per shrink program (one load of x and of each slice's A)
BLOCK_N = 128  # output features per expand program
ZERO_BLOCK = 512  # workspace floats an expand program zeroes per store
PARITY_SHIFT = 16  # the ticket word: (parity << PARITY_SHIFT) | tickets taken
MAX_PROGRAMS = (1 << PARITY_SHIFT) - 1  # programs one launch may have (tickets must stay below the parity bit)


def programs(in_features: int, output_slices: tuple[int, ...]) -> tuple[int, int]:
    """The kernel's grid for a linear: ``(shrink programs, all programs)``, one shrink program per
    :data:`CHUNK_K` input features and one expand program per :data:`BLOCK_N` output features of each slice."""
    shrink = -(-in_features // CHUNK_K)
    return shrink, shrink + sum(-(-size // BLOCK_N) for size in output_slices)


class FusedLoRAUnsupported(ValueError):
    """The call's shapes or dtypes are outside what the fused kernel handles; the caller takes punica."""


def weights_supported(dtype: torch.dtype, in_features: int, lora_a: tuple[torch.Tensor, ...],
                      lora_b: tuple[torch.Tensor, ...], output_slices: tuple[int, ...]) -> str | None:
    """``None`` when the kernel handles a linear with these weights and input dtype, else why not. Nothing here
    depends on the call's token count, so torch.compile can decide it once when it traces the model."""
    if triton is None:
        return f"Triton is not importable ({_TRITON_IMPORT_ERROR})"
    if not 1 <= len(output_slices) <= MAX_SLICES:
        return f"{len(output_slices)} slices (1..{MAX_SLICES} supported)"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"input dtype {dtype} (bfloat16/float16 supported)"
    rank = lora_a[0].shape[-2]
    if rank < 16 or rank & (rank - 1):
        return f"rank {rank} (a power of two >= 16 supported)"
    grid = programs(in_features, output_slices)[1]
    if grid > MAX_PROGRAMS:
        return f"{grid} programs for {in_features} input and {sum(output_slices)} output features (at most {MAX_PROGRAMS})"
    for a, b, size in zip(lora_a, lora_b, output_slices):
        if a.shape[0] != 1 or b.shape[0] != 1:
            return f"{a.shape[0]} adapter slots (one supported)"
        if a.dtype != dtype or b.dtype != dtype:
            return f"weights in {a.dtype}/{b.dtype} for input {dtype}"
        if tuple(a.shape[-2:]) != (rank, in_features) or tuple(b.shape[-2:]) != (size, rank):
            return f"A {tuple(a.shape)} / B {tuple(b.shape)} do not fit input {in_features}, slice {size}, rank {rank}"
        if not (a.is_contiguous() and b.is_contiguous()):
            return "non-contiguous LoRA weights"
    return None


def supports(x: torch.Tensor, lora_a: tuple[torch.Tensor, ...], lora_b: tuple[torch.Tensor, ...],
             output_slices: tuple[int, ...]) -> str | None:
    """``None`` when :func:`fused_lora_linear` can run this call, else why not (a sentence)."""
    tokens = x.numel() // x.shape[-1]
    if tokens > MAX_TOKENS:
        return f"{tokens} tokens > {MAX_TOKENS}"
    return weights_supported(x.dtype, x.shape[-1], lora_a, lora_b, output_slices)


if triton is not None:

    @triton.jit
    def _shrink_slice(x_ptr, sxm, a_ptr, h_ptr, t, s, M, K,
                      R: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, HROWS: tl.constexpr,
                      UPCAST: tl.constexpr):
        # one chunk of the input features in one load each (no loop: the loads of all slices are in flight
        # together), its fp32 partial added into h with atomics
        offs_m = tl.arange(0, BLOCK_M)
        offs_r = tl.arange(0, R)
        offs_k = t * CHUNK + tl.arange(0, CHUNK)
        kmask = offs_k < K
        mmask = offs_m < M
        xt = tl.load(x_ptr + offs_m[:, None] * sxm + offs_k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        at = tl.load(a_ptr + offs_r[None, :] * K + offs_k[:, None], mask=kmask[:, None], other=0.0)  # [CHUNK, R]
        if UPCAST:
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc = tl.dot(xt, at)
        dst = h_ptr + (s * HROWS + offs_m[:, None]) * R + offs_r[None, :]
        tl.atomic_add(dst, acc, mask=mmask[:, None], sem="relaxed")

    @triton.jit
    def _expand_block(y_ptr, sym, idx_ptr, b_ptr, h_ptr, done_ptr, s, j, col0, n, M, KS, scale,
                      R: tl.constexpr, BLOCK_M: tl.constexpr, BN: tl.constexpr, HROWS: tl.constexpr,
                      UPCAST: tl.constexpr, ADD: tl.constexpr):
        offs_m = tl.arange(0, BLOCK_M)
        offs_r = tl.arange(0, R)
        mmask = offs_m < M
        offs_n = j * BN + tl.arange(0, BN)
        nmask = offs_n < n
        # what does not depend on the shrink is loaded before waiting for it
        slot = tl.load(idx_ptr + offs_m, mask=mmask, other=-1)
        bt = tl.load(b_ptr + offs_n[None, :] * R + offs_r[:, None], mask=nmask[None, :], other=0.0)  # [R, BN]
        yp = y_ptr + offs_m[:, None] * sym + col0 + offs_n[None, :]
        ymask = mmask[:, None] & nmask[None, :]
        if ADD:
            yv = tl.load(yp, mask=ymask, other=0.0)
        done = tl.atomic_add(done_ptr, 0, sem="acquire")
        while done < KS:
            done = tl.atomic_add(done_ptr, 0, sem="acquire")
        h = tl.load(h_ptr + (s * HROWS + offs_m[:, None]) * R + offs_r[None, :], mask=mmask[:, None], other=0.0,
                    cache_modifier=".cg")
        h = tl.where((slot == 0)[:, None], h * scale, 0.0)
        hw = h.to(y_ptr.dtype.element_ty)
        if UPCAST:
            out = tl.dot(hw.to(tl.float32), bt.to(tl.float32)).to(y_ptr.dtype.element_ty)
        else:
            out = tl.dot(hw, bt).to(y_ptr.dtype.element_ty)
        if ADD:
            tl.store(yp, (yv.to(tl.float32) + out.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=ymask)
        else:  # y = the update alone (rows without the adapter get 0): the caller adds it later
            tl.store(yp, out, mask=ymask)

    @triton.jit
    def _fused_lora_kernel(
        x_ptr, sxm,  # [M, K], unit stride along K
        y_ptr, sym,  # [M, n0 + n1 + n2], unit stride along the output features
        idx_ptr,  # [>= M] int: each token's adapter slot (0: the adapter, -1: none)
        a0, a1, a2,  # [R, K] per slice (unused ones alias a0)
        b0, b1, b2,  # [n_s, R] per slice
        n0, n1, n2,
        sync_ptr,  # int32 [4]: (parity << PARITY_SHIFT) | tickets taken, shrink programs done (parity 0, 1), padding
        h_ptr,  # fp32 [2, HALF]: a half per parity, the launch's half zero when it starts
        M, K, KS, scale, HALF,
        S: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, BN: tl.constexpr,
        HROWS: tl.constexpr, UPCAST: tl.constexpr, ADD: tl.constexpr, SHIFT: tl.constexpr, ZB: tl.constexpr,
    ):
        word = tl.atomic_add(sync_ptr, 1, sem="acq_rel")
        parity = word >> SHIFT
        t = word & ((1 << SHIFT) - 1)
        nb0 = tl.cdiv(n0, BN)
        nb1 = tl.cdiv(n1, BN)
        nb2 = tl.cdiv(n2, BN)
        nb = nb0 + nb1 + nb2
        if t == KS + nb - 1:  # the last ticket: every program has its ticket and parity
            tl.atomic_xchg(sync_ptr + 2 - parity, 0)  # the other half's counter, left at KS by the launch before
            tl.atomic_xchg(sync_ptr, (1 - parity) << SHIFT)
        h_now = h_ptr + parity * HALF
        done_ptr = sync_ptr + 1 + parity
        if t < KS:
            _shrink_slice(x_ptr, sxm, a0, h_now, t, 0, M, K, R, BLOCK_M, CHUNK, HROWS, UPCAST)
            if S > 1:
                _shrink_slice(x_ptr, sxm, a1, h_now, t, 1, M, K, R, BLOCK_M, CHUNK, HROWS, UPCAST)
            if S > 2:
                _shrink_slice(x_ptr, sxm, a2, h_now, t, 2, M, K, R, BLOCK_M, CHUNK, HROWS, UPCAST)
            tl.atomic_add(done_ptr, 1, sem="release")
        else:
            e = t - KS
            # this program's strip of the other half (the launch before used it, the next launch will): zero it
            h_next = h_ptr + (1 - parity) * HALF
            strip = tl.cdiv(HALF, nb)
            for z in range(e * strip, tl.minimum((e + 1) * strip, HALF), ZB):
                offs = z + tl.arange(0, ZB)
                tl.store(h_next + offs, tl.zeros((ZB,), tl.float32), mask=offs < tl.minimum((e + 1) * strip, HALF))
            if e < nb0:
                _expand_block(y_ptr, sym, idx_ptr, b0, h_now, done_ptr, 0, e, 0, n0, M, KS, scale, R, BLOCK_M, BN,
                              HROWS, UPCAST, ADD)
            elif e < nb0 + nb1:
                _expand_block(y_ptr, sym, idx_ptr, b1, h_now, done_ptr, 1, e - nb0, n0, n1, M, KS, scale, R, BLOCK_M,
                              BN, HROWS, UPCAST, ADD)
            else:
                _expand_block(y_ptr, sym, idx_ptr, b2, h_now, done_ptr, 2, e - nb0 - nb1, n0 + n1, n2, M, KS, scale,
                              R, BLOCK_M, BN, HROWS, UPCAST, ADD)


_HEAD = 4  # int32 words in front of the fp32 workspace: the ticket word, two done-counters, padding


def new_sync(device: torch.device | str, max_rank: int = 64) -> torch.Tensor:
    """The kernel's state for one device and ranks up to ``max_rank``: its counters and an fp32 workspace for
    ``A @ x`` in two halves (``2 x MAX_SLICES x MAX_TOKENS x max_rank``), all zero. Each launch leaves the half the
    next one uses zero (:func:`ready`). One per engine is enough: launches on one stream run one after another."""
    return torch.zeros(_HEAD + 2 * MAX_SLICES * MAX_TOKENS * max_rank, dtype=torch.int32, device=device)


def ready(sync: torch.Tensor) -> bool:
    """Whether ``sync`` is as a launch must find it: no ticket taken, and the half of the workspace that the parity
    names, with its done-counter, zero. (The other half holds the last launch's ``A @ x`` until the next launch
    zeroes it.) For tests; it copies the state to the host."""
    head = sync[:_HEAD].tolist()
    parity, taken = head[0] >> PARITY_SHIFT, head[0] & MAX_PROGRAMS
    half = (sync.numel() - _HEAD) // 2
    h = sync[_HEAD:]
    return (taken == 0 and parity in (0, 1) and head[1 + parity] == 0
            and int(h[parity * half:(parity + 1) * half].count_nonzero()) == 0)


def fused_lora_linear(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a_stacked: tuple[torch.Tensor, ...],
    lora_b_stacked: tuple[torch.Tensor, ...],
    scale: float,
    output_slices: tuple[int, ...],
    token_lora_indices: torch.Tensor,
    sync: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    """punica's ``add_lora_linear`` for one adapter in slot 0, in one launch: ``y`` ``[tokens,
    sum(output_slices)]`` gains ``B_s @ (scale * A_s @ x)`` in each slice's columns for tokens whose slot is 0
    (``add_inputs=False``: ``y`` is overwritten with the update alone, zero for the other tokens, so it needs no
    initial value). ``lora_*_stacked[s]``: ``[1, 1, r, in]`` / ``[1, 1, out_s, r]``. Raises
    :class:`FusedLoRAUnsupported` where :func:`supports` says no."""
    why = supports(x, lora_a_stacked, lora_b_stacked, output_slices)
    if why is not None:
        raise FusedLoRAUnsupported(why)
    launch(y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, token_lora_indices, sync, add_inputs)


def slice_a(lora_a_stacked: tuple[torch.Tensor, ...], rank: int, k: int) -> list[torch.Tensor]:
    """Each slice's ``A`` ``[rank, k]`` as the kernels take them: :data:`MAX_SLICES` of them, the missing ones aliasing
    the first (never read)."""
    pad = MAX_SLICES - len(lora_a_stacked)
    return [t.view(rank, k) for t in lora_a_stacked] + [lora_a_stacked[0].view(rank, k)] * pad


def slice_operands(lora_a_stacked: tuple[torch.Tensor, ...], lora_b_stacked: tuple[torch.Tensor, ...], rank: int,
                   k: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`slice_a`'s ``A`` and each slice's ``B`` ``[n_s, rank]`` alike."""
    pad = MAX_SLICES - len(lora_b_stacked)
    b = [t.view(t.shape[-2], rank) for t in lora_b_stacked] + [lora_b_stacked[0].view(-1, rank)] * pad
    return slice_a(lora_a_stacked, rank, k), b


def launch(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a_stacked: tuple[torch.Tensor, ...],
    lora_b_stacked: tuple[torch.Tensor, ...],
    scale: float,
    output_slices: tuple[int, ...],
    token_lora_indices: torch.Tensor,
    sync: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    """:func:`fused_lora_linear` for a caller that has already had ``None`` from :func:`supports` for this call
    (the engine's op asks it once per call to choose its path); still refuses a strided output and a state too
    small for the rank."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y2 = y.view(-1, y.shape[-1])
    if y2.stride(-1) != 1:
        raise FusedLoRAUnsupported("output with non-unit stride along its features")
    m, k = x2.shape
    rank = lora_a_stacked[0].shape[-2]
    half = (sync.numel() - _HEAD) // 2
    if sync.dtype != torch.int32 or half < MAX_SLICES * MAX_TOKENS * rank:
        raise FusedLoRAUnsupported(f"state of {sync.numel()} {sync.dtype} words is too small for rank {rank}; "
                                   f"make it with new_sync(device, max_rank>={rank})")
    slices = len(output_slices)
    block_m = max(16, triton.next_power_of_2(m))
    ks, grid = programs(k, output_slices)
    h = sync[_HEAD:].view(torch.float32)
    a, b = slice_operands(lora_a_stacked, lora_b_stacked, rank, k)
    n = list(output_slices) + [0] * (MAX_SLICES - slices)
    _fused_lora_kernel[(grid,)](
        x2, x2.stride(0), y2, y2.stride(0), token_lora_indices, *a, *b, *n, sync, h, m, k, ks, float(scale), half,
        S=slices, R=rank, BLOCK_M=block_m, CHUNK=CHUNK_K, BN=BLOCK_N, HROWS=MAX_TOKENS, UPCAST=_interpreting(),
        ADD=bool(add_inputs), SHIFT=PARITY_SHIFT, ZB=ZERO_BLOCK,
    )  # fmt: skip


def launch_beside(base, update: torch.Tensor, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...],
                  lora_b_stacked: tuple[torch.Tensor, ...], scale: float, output_slices: tuple[int, ...],
                  token_lora_indices: torch.Tensor, sync: torch.Tensor, side: "torch.cuda.Stream",
                  start: "torch.cuda.Event", done: "torch.cuda.Event", add: bool = True):
    """``base() + LoRA(x)`` with the kernel beside the base GEMM (the overlap mode): ``start`` is recorded on the
    current stream, ``base()`` is enqueued there, the kernel (overwrite mode, into ``update`` ``[tokens, sum(slices)]``)
    on ``side`` after ``start``; the current stream waits for ``done`` and adds. ``x``, ``update`` and ``sync`` must
    stay untouched until then, which the wait guarantees for anything the current stream does next. CUDA graphs
    capture the fork and join as edges (``side`` joins the capture through ``start``). With ``add=False`` it
    returns ``(base(), update)`` after the join, for the caller to add (and a compiler to fuse the add)."""
    main = torch.cuda.current_stream(x.device)
    start.record(main)
    out = base()
    with torch.cuda.stream(side):
        side.wait_event(start)
        launch(update, x, lora_a_stacked, lora_b_stacked, scale, output_slices, token_lora_indices, sync,
               add_inputs=False)
        done.record(side)
    main.wait_event(done)
    if not add:
        return out, update
    out.view(-1, out.shape[-1]).add_(update)
    return out
