"""Triton for vllm_ext's kernels (:mod:`vllm_ext.lora_fused`, :mod:`vllm_ext.nvfp4_gemv`): the import, which a
CPU-only install may lack, and whether the Triton interpreter is on. (verl_ext has its own copy in
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

__all__ = ["TRITON_IMPORT_ERROR", "compile_sm90", "interpreting", "tl", "triton"]


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
