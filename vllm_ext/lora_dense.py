"""Dense single-adapter LoRA in vLLM: the RL rollout's one adapter as two cuBLAS GEMMs per slice.

vLLM applies LoRA through its punica kernels (Triton shrink/expand that look up each token's adapter slot),
built for serving many adapters at once. An RL rollout serves one adapter (``max_loras=1``): every token
uses slot 0, or no adapter (slot -1: requests without LoRA, padding). Then
``y += ((x @ A.T) * keep) @ B.T`` with ``keep`` 1 for slot-0 tokens and 0 otherwise is the same arithmetic
as punica's (fp32 accumulation, bf16 intermediate), done by cuBLAS. It is CUDA-graph safe (no host reads).

On with ``additional_config={"qerl_lora": "dense"}`` for an engine with ``max_loras=1`` (``"overlap"``, the
default, and ``"fused"``: the one-launch kernel of :mod:`vllm_ext.lora_fused`, beside or after the base GEMM);
otherwise the engine runs vLLM's punica wrapper unchanged (:class:`vllm_ext.lora_dense_wrapper.QerlPunicaWrapper`
only inherits it). This module imports no vLLM LoRA code: :func:`register` runs in every vLLM process and names
the wrapper class, which vLLM imports when it builds a LoRA engine.
"""

from __future__ import annotations

import torch

from qerl_plugin import options

QUALNAME = "vllm_ext.lora_dense_wrapper.QerlPunicaWrapper"


def dense_lora_linear(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a_stacked: tuple[torch.Tensor, ...],
    lora_b_stacked: tuple[torch.Tensor, ...],
    scale: float,
    output_slices: tuple[int, ...],
    token_lora_indices: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    """punica's ``add_lora_linear`` for one adapter in slot 0 (``lora_*_stacked[i]``: ``[1, 1, r, in]`` /
    ``[1, 1, out_i, r]``); ``y`` ``[tokens, sum(output_slices)]`` is updated in place (or overwritten per
    slice when ``add_inputs`` is False)."""
    x2 = x.reshape(-1, x.shape[-1])
    y2 = y.view(-1, y.shape[-1])
    keep = (token_lora_indices[: x2.shape[0]] == 0).to(x2.dtype).unsqueeze(1)
    if scale != 1.0:
        keep = keep * scale
    offset = 0
    for a, b, size in zip(lora_a_stacked, lora_b_stacked, output_slices):
        h = torch.mm(x2, a[0, 0].t()) * keep
        out = y2[:, offset : offset + size]
        if add_inputs:
            out.addmm_(h, b[0, 0].t())
        else:
            out.copy_(torch.mm(h, b[0, 0].t()))
        offset += size


def requested_mode() -> str:
    """The LoRA mode the engine being built asked for (``additional_config["qerl_lora"]``; ``options.LORA_DEFAULT`` when it names none)."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return options.lora_mode(getattr(config, "additional_config", None))


def register(platform_cls: type | None = None) -> None:
    """Make the (CUDA) platform build :data:`QUALNAME` (vLLM's own wrapper unless an engine asks); idempotent."""
    if platform_cls is None:
        from vllm.platforms import current_platform

        platform_cls = type(current_platform)
    if getattr(platform_cls.get_punica_wrapper, "__qerl_patch__", False):
        return

    def get_punica_wrapper(cls) -> str:
        return QUALNAME

    get_punica_wrapper.__qerl_patch__ = True
    platform_cls.get_punica_wrapper = classmethod(get_punica_wrapper)
