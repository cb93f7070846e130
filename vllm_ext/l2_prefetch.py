"""Weights pulled into the GPU's L2 cache ahead of the kernel that reads them: a decode step's small 4-bit linears
are bound by memory latency, not bandwidth (§4n: a 7B q/k/v or o one-row call reads 1.1-1.2 TB/s of the H100's
3.35), and the kernels between them (rotary, attention, norms) leave the memory nearly idle. A kernel given a
*prefetch plan* has each of its programs ask the copy engine for a share of the plan's bytes
(``cp.async.bulk.prefetch.L2.global``, Hopper and later) before it starts its own work. The request is a hint: the
program does not wait for it, nothing is written, and the kernel's results are the same bits with or without it.

A plan is an int64 tensor ``[regions, 2]`` of (address, bytes) pairs, built by :func:`prefetch_plan` from
contiguous tensors or leading rows of them. Each region is cut into units of :data:`UNIT` bytes (the last one
shorter); unit ``u`` goes to program ``u mod P`` of the ``P`` programs, one unit per thread and round.
"""

from __future__ import annotations

import torch

from vllm_ext.triton_support import interpreting as _interpreting
from vllm_ext.triton_support import tl, triton

__all__ = ["UNIT", "prefetch_plan", "plan_bytes", "prefetch_supported", "units"]

UNIT = 4096  # bytes per prefetch request (a multiple of 16, as the instruction requires)
_ALIGN = 16


def prefetch_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can issue the bulk L2 prefetch (CUDA, compute capability 9.0 or later, not under
    the Triton interpreter)."""
    return device.type == "cuda" and not _interpreting() and torch.cuda.get_device_capability(device)[0] >= 9


def prefetch_plan(*regions: torch.Tensor | tuple[torch.Tensor, int]) -> torch.Tensor:
    """The plan for ``regions``, on their device: each is a contiguous tensor (all of it) or ``(tensor, rows)`` (its
    first ``rows`` rows). Each region must start on a 16-byte boundary and hold a multiple of 16 bytes; the error
    names the region otherwise. The tensors must outlive every kernel (and CUDA graph) that uses the plan: the plan
    holds their addresses, not references."""
    if not regions:
        raise ValueError("prefetch_plan: no regions given")
    pairs, device = [], None
    for i, region in enumerate(regions):
        t, rows = (region, None) if isinstance(region, torch.Tensor) else region
        if not t.is_contiguous():
            raise ValueError(f"prefetch_plan: region {i} ({tuple(t.shape)} {t.dtype}) is not contiguous")
        if rows is None:
            nbytes = t.numel() * t.element_size()
        else:
            if t.dim() == 0 or not 0 < rows <= t.shape[0]:
                raise ValueError(f"prefetch_plan: region {i} asks for {rows} rows of a tensor of shape {tuple(t.shape)}")
            nbytes = rows * (t.numel() // t.shape[0]) * t.element_size()
        addr = t.data_ptr()
        if addr % _ALIGN or nbytes % _ALIGN or nbytes == 0:
            raise ValueError(f"prefetch_plan: region {i} starts at {addr:#x} with {nbytes} bytes; the L2 prefetch "
                             f"takes a 16-byte aligned start and a non-zero multiple of 16 bytes")
        if device is not None and t.device != device:
            raise ValueError(f"prefetch_plan: region {i} is on {t.device}, region 0 on {device}")
        device = t.device
        pairs.append((addr, nbytes))
    return torch.tensor(pairs, dtype=torch.int64, device=device)


def plan_bytes(plan: torch.Tensor) -> int:
    """Bytes a plan asks for (its regions summed)."""
    return int(plan[:, 1].sum().item())


def units(plan: torch.Tensor, programs: int, threads: int) -> list[tuple[int, int, int, int]]:
    """What the kernels issue for ``plan`` (on the CPU, for tests): ``(program, thread, address, bytes)`` per request,
    in the order the device code computes them (:func:`_prefetch` with ``programs`` programs of ``threads`` threads)."""
    out = []
    for addr, nbytes in plan.cpu().tolist():
        n_units = (nbytes + UNIT - 1) // UNIT
        for pid in range(programs):
            for base in range(pid * threads, n_units, programs * threads):  # one round: a unit per thread
                for lane in range(threads):
                    u = base + lane
                    if u < n_units:
                        out.append((pid, lane, addr + u * UNIT, min(UNIT, nbytes - u * UNIT)))
    return out


if triton is not None:

    @triton.jit
    def _bulk_prefetch(addr, nbytes):
        """One ``cp.async.bulk.prefetch.L2.global`` per element (64-bit address, 32-bit byte count)."""
        return tl.inline_asm_elementwise(
            asm="cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0;",
            constraints="=r,l,r", args=[addr, nbytes], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip

    @triton.jit
    def _bulk_prefetch_once(addr, nbytes):
        """One ``cp.async.bulk.prefetch.L2.global`` from the program's thread 0 only (the operands are the same in
        every thread)."""
        return tl.inline_asm_elementwise(
            asm="{\n.reg .pred p;\n.reg .b32 t;\nmov.u32 t, %tid.x;\nsetp.eq.u32 p, t, 0;\n"
                "@p cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0;\n}",
            constraints="=r,l,r", args=[addr, nbytes], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip

    @triton.jit
    def _prefetch(plan_ptr, pid, programs, NPF: tl.constexpr, THREADS: tl.constexpr, ONE: tl.constexpr = False):
        """This program's share of the plan at ``plan_ptr`` (``NPF`` regions; see the module docstring): ``THREADS``
        must be the program's thread count, so that each thread issues one request per round. Lanes past a region's
        end repeat its last unit (a second request for the same lines is harmless and keeps the asm unmasked).
        ``ONE``: instead, one request per program and region, from thread 0: the program's contiguous share of the
        region (its bytes / programs, rounded up to 16), which needs no loop over the lanes' distinct operands."""
        lane = tl.arange(0, THREADS)
        for r in tl.static_range(NPF):
            addr = tl.load(plan_ptr + 2 * r)
            nbytes = tl.load(plan_ptr + 2 * r + 1)
            if ONE:
                share = (nbytes + 16 * programs - 1) // (16 * programs) * 16
                start = pid * share
                size = tl.minimum(nbytes - start, share)
                if size > 0:
                    _bulk_prefetch_once(addr + start + lane * 0, (size + lane * 0).to(tl.int32))
            else:
                n_units = (nbytes + 4095) // 4096
                for base in range(pid * THREADS, n_units, programs * THREADS):
                    u = tl.minimum(base + lane, n_units - 1)
                    size = tl.minimum(nbytes - u * 4096, 4096).to(tl.int32)
                    _bulk_prefetch(addr + u * 4096, size)
