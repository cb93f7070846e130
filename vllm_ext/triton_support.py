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

__all__ = ["TRITON_IMPORT_ERROR", "interpreting", "tl", "triton"]


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET=1`` (the CPU interpreter). Under it our kernels run their dots on float32 copies
    of the bf16/fp16 tiles: Triton 3.6's interpreter returns garbage for ``tl.dot`` of bfloat16 tiles (float16 and
    float32 are right). Products of bf16/fp16 values are exact in float32 and the sums are float32 either way, so
    the arithmetic is the GPU's (where the dots take the 16-bit tiles and accumulate in float32)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
