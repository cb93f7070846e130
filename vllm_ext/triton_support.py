"""Triton for vllm_ext's kernels (:mod:`vllm_ext.lora_fused`, :mod:`vllm_ext.nvfp4_gemv`): the import, which a
CPU-only install may lack, Gluon's (:mod:`vllm_ext.nvfp4_gluon` and the modules built on it), and whether the Triton
interpreter is on. (verl_ext has its own copy in
``verl_ext.kernels``: the two packages do not import each other.)"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl

    TRITON_IMPORT_ERROR: Exception | None = None
except Exception as exc:  # pragma: no cover - CPU-only installs may lack Triton
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    TRITON_IMPORT_ERROR = exc

try:  # Gluon (Triton's explicit-layout dialect) ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma
except Exception as exc:  # noqa: BLE001 (an old or missing Triton: the Gluon kernels are simply unavailable)
    gluon = gl = mma_v2 = fence_async_shared = warpgroup_mma = None
    GLUON_IMPORT_ERROR: str | Exception | None = (f"{type(exc).__name__}: {exc}" if triton is not None
                                                  else TRITON_IMPORT_ERROR)
else:
    GLUON_IMPORT_ERROR = None

__all__ = ["GLUON_IMPORT_ERROR", "TRITON_IMPORT_ERROR", "compile_sm90", "fence_async_shared", "gl", "gluon",
           "interpreting", "mma_v2", "tl", "triton", "warpgroup_mma"]


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET=1`` (the CPU interpreter). Under it our kernels run their dots on float32 copies
    of the bf16/fp16 tiles: Triton 3.6's interpreter returns garbage for ``tl.dot`` of bfloat16 tiles (float16 and
    float32 are right). Products of bf16/fp16 values are exact in float32 and the sums are float32 either way, so
    the arithmetic is the GPU's (where the dots take the 16-bit tiles and accumulate in float32)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def compile_sm90(fn, types: dict[str, str], consts: dict, num_warps: int,
                 aligned: tuple[str, ...] = (), gluon: bool = False):  # noqa: ANN001, ANN201
    """The ``@triton.jit`` function ``fn`` (``gluon``: a ``@gluon.jit`` one) compiled for sm_90 (Hopper) without a
    GPU: Triton's front end, its LLVM and the ptxas its wheel bundles. ``consts``: its constexprs; ``types``: its other
    arguments' Triton types (default ``i32``); ``aligned``: the arguments Triton's launcher would find divisible by 16
    (pointers to 16-byte aligned memory, sizes that are multiples of 16; without them it cannot prove a 16-byte load
    aligned and splits it). What the interpreter cannot check: e.g. that a kernel's branches return one type
    (docs/benchmarks.md §4ai)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(fn=fn, signature=sig, constexprs=dict(consts), attrs=attrs)
    else:
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
