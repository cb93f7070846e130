"""Marlin's NVFP4 tensors built on the CPU from vLLM's own pure-torch code: the repack as
``marlin_utils_test.marlin_weights`` states it (vLLM's reference of ``gptq_marlin_repack``, which needs CUDA), the
scales through ``marlin_permute_scales`` and ``nvfp4_marlin_process_scales``, and the global scale through
``nvfp4_marlin_process_global_scale``: the steps of ``prepare_fp4_layer_for_marlin`` for an unpadded layer. A GPU
test checks that they equal what the CUDA repack gives (tests/vllm_ext/test_nvfp4_marlin_row.py)."""

from __future__ import annotations

import torch


def codes_kn(packed: torch.Tensor) -> torch.Tensor:
    """The E2M1 codes of a compressed-tensors ``packed`` uint8 ``[N, K/2]`` (even column in the low nibble) as int32
    ``[K, N]``: GPTQ's orientation, which Marlin's repack takes."""
    n = packed.shape[0]
    lo = (packed & 15).to(torch.int32)
    hi = (packed >> 4).to(torch.int32)
    return torch.stack([lo, hi], dim=-1).reshape(n, -1).t().contiguous()


def marlin_tensors(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(qweight int32 [K/16, 2N], scale FP8 [K/16, N], global scale float32 [1])`` as Marlin holds the NVFP4
    triple (``global_scale`` the compressed-tensors divisor) for activations in ``dtype``."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_permute_scales
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import (
        nvfp4_marlin_process_global_scale,
        nvfp4_marlin_process_scales,
    )
    from vllm.model_executor.layers.quantization.utils.marlin_utils_test import get_weight_perm, marlin_weights

    n, k = packed.shape[0], packed.shape[1] * 2
    qweight = marlin_weights(codes_kn(packed.cpu()), k, n, 4, get_weight_perm(4)).to(packed.device)
    s = marlin_permute_scales(scale.t().contiguous().to(dtype), k, n, 16)
    s, factor = nvfp4_marlin_process_scales(s, a_dtype=dtype)
    g = nvfp4_marlin_process_global_scale(1.0 / global_scale.reshape(-1)[:1].to(torch.float32), dtype) / factor
    return qweight, s, g
