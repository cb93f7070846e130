"""Shape-specific Triton configs for vLLM's LoRA kernels (the ``lora-tuned`` variant of ``qerl bench rollout``),
written where ``VLLM_TUNED_CONFIG_FOLDER`` points."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["write_lora_kernel_configs"]


def write_lora_kernel_configs(folder: Path, gpu_name: str, dims: dict[str, int], rank: int, batches: list[int],
                              max_loras: int) -> list[str]:
    """Shape-specific LoRA Triton configs for VLLM_TUNED_CONFIG_FOLDER (structure: README_TUNING.md of vLLM).

    Heuristics, to be measured: shrink with one N tile covering the rank and split-K so that
    block_k * split_k ~ K (vLLM's default split_k=64 x block_k=256 leaves most CTAs without work at K=3584);
    expand with block_k = rank (one K step). Large m (prefill) keeps vLLM's defaults.
    """
    q = dims["heads"] * dims["head_dim"]
    kv = dims["kv_heads"] * dims["head_dim"]
    ks = sorted({dims["hidden"], dims["inter"], q})
    ns = sorted({q, kv, dims["hidden"], dims["inter"]})
    ms = sorted(set(batches) | {max(batches) * 2, 256, 1024, 4096, 16384})
    bn_rank = 1 << max(4, (rank - 1).bit_length())

    def shrink(m: int, k: int) -> dict[str, Any]:
        if m > 128:
            return dict(block_m=32, block_n=16, block_k=32, split_k=8, num_warps=4, num_ctas=1, group_size_m=8,
                        num_stages=2, max_nreg=None)
        block_k = 128
        split_k = max(1, min(32, k // (block_k * 4)))
        return dict(block_m=16, block_n=min(bn_rank, 64), block_k=block_k, split_k=split_k, num_warps=4,
                    num_ctas=1, group_size_m=8, num_stages=2, max_nreg=None)

    def expand(m: int, n: int, slices: int) -> dict[str, Any]:
        if m > 128:
            return dict(block_m=64, block_n=64 if slices > 1 else 128, block_k=32, num_warps=4, num_ctas=1,
                        num_stages=2, max_nreg=None)
        return dict(block_m=16, block_n=128 if n >= 2048 else 64, block_k=max(16, min(rank, 64)), num_warps=4,
                    num_ctas=1, num_stages=2, max_nreg=None)

    loras = sorted({1, max_loras, max_loras + 1})
    shrink_cfg = {str(L): {str(s): {str(m): {str(k): {str(rank): shrink(m, k)} for k in ks} for m in ms}
                           for s in (1, 2, 3)} for L in loras}
    expand_cfg = {str(L): {str(s): {str(m): {str(rank): {str(n): expand(m, n, s) for n in ns}} for m in ms}
                           for s in (1, 2, 3)} for L in loras}
    folder.mkdir(parents=True, exist_ok=True)
    name = gpu_name.replace(" ", "_").replace("-", "_")
    written = []
    for fname, data in ((f"{name}_SHRINK.json", shrink_cfg), (f"{name}_EXPAND_TRUE.json", expand_cfg),
                        (f"{name}_EXPAND_FALSE.json", expand_cfg)):
        (folder / fname).write_text(json.dumps(data))
        written.append(str(folder / fname))
    return written
