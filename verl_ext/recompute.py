"""Spend the memory an NVFP4 base saves on recomputing fewer decoder layers: :func:`keep_activations`.

Under gradient checkpointing (verl's ``model.enable_gradient_checkpointing``) every decoder layer keeps only
its input in the forward and runs its forward a second time in the backward. That second forward is about a
quarter of a LoRA layer's training time (the frozen base needs no weight gradient, so its backward is one matmul
per linear, as its forward is): 15-26 ms per layer of a ~2.4 s 7B step at 16 384 tokens. A layer that keeps its
activations skips it, at the cost of holding them from its forward to its backward: for the Qwen2.5-7B shape
4.0 / 2.0 / 1.0 GiB per layer at 16 384 / 8 192 / 4 096 tokens per micro-batch, about 0.25 MiB per token
(measured on an H100, docs/benchmarks.md §4u).

An NVFP4 base holds ~0.56 bytes per weight instead of 2, so the 7B actor peaks 8.76 GiB below a BF16 actor: enough
for its last 2 / 4 / 8 layers to keep their activations at those token counts, which makes it 1.01-1.07× the BF16
actor's tokens/s at the same peak memory; the 32B shape has 41.8 GiB to spend and gains 1.11-1.12× with 28 of
its 64 layers kept at 4 096 tokens (§4u). The setting is ``custom.qerl.actor.no_recompute_layers`` of the
rollout block (:mod:`verl_ext.config`); it applies to any LoRA actor, BF16 too. This module imports no verl: the
GPU bench uses it.
"""

from __future__ import annotations

import torch.nn as nn

__all__ = ["checkpointed_layers", "keep_activations"]


def checkpointed_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The decoder layers that recompute their forward in backward, in the model's order, as ``(name, layer)``.

    transformers marks each checkpointable layer (``GradientCheckpointingLayer``: a decoder layer) with its own
    ``gradient_checkpointing`` flag, set by ``gradient_checkpointing_enable()``; PEFT's wrapper leaves them as
    they are.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]


def keep_activations(model: nn.Module, n: int, key: str = "no_recompute_layers") -> list[str]:
    """Turn gradient checkpointing off for the last ``n`` checkpointed decoder layers of ``model``; their names.

    The last layers, because the backward reaches them first and frees their activations first. ``key`` names the
    setting in errors. ``n == 0`` changes nothing. Raises ``ValueError`` when ``n`` is not a non-negative
    integer, when no layer is checkpointed (nothing to skip: the model keeps every activation already), or when
    ``n`` exceeds the checkpointed layers.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{key}: expected a whole number of decoder layers >= 0, got {n!r}")
    if n == 0:
        return []
    layers = checkpointed_layers(model)
    if not layers:
        raise ValueError(
            f"{key}={n}, but no decoder layer of {type(model).__name__} recomputes its forward: gradient checkpointing "
            "is off, so every layer keeps its activations already; enable it (model.enable_gradient_checkpointing=true) "
            f"or drop {key}"
        )
    if n > len(layers):
        raise ValueError(
            f"{key}={n}, but {type(model).__name__} has {len(layers)} checkpointed decoder layers; give at most "
            f"{len(layers)} (all of them is the same as turning gradient checkpointing off)"
        )
    kept = layers[len(layers) - n :]
    for _, layer in kept:
        layer.gradient_checkpointing = False
    return [name for name, _ in kept]
