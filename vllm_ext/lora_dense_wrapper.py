"""The punica wrapper that :func:`vllm_ext.lora_dense.register` names: vLLM's GPU one, with the dense path.

Imported by vLLM when it builds the LoRA manager of an engine (it subclasses vLLM's GPU punica wrapper, whose
import loads vLLM's LoRA layers), never at plugin registration.
"""

from __future__ import annotations

import logging

from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

from vllm_ext.lora_dense import dense_lora_linear, dense_requested

__all__ = ["QerlPunicaWrapper"]

logger = logging.getLogger("qerl.vllm.lora_dense")


class QerlPunicaWrapper(PunicaWrapperGPU):
    """vLLM's GPU punica wrapper; linear layers take :func:`~vllm_ext.lora_dense.dense_lora_linear` when the
    engine asked for it and has one adapter slot (``max_loras=1``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.qerl_dense = self.max_loras == 1 and dense_requested()
        # in the engine's log, so that a benchmark shows which path its LoRA layers took
        logger.warning("qerl: LoRA linears on the %s path (max_loras=%d)", "dense" if self.qerl_dense else "punica",
                       self.max_loras)

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None, **kwargs):
        if not self.qerl_dense:
            return super().add_lora_linear(
                y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, buffer=buffer, **kwargs
            )
        dense_lora_linear(
            y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, self._token_lora_indices,
            add_inputs=kwargs.get("add_inputs", True),
        )  # fmt: skip
        return None
