"""Spend the memory an NVFP4 base saves on recomputing fewer decoder layers: :func:`keep_activations`.

Under gradient checkpointing (verl's ``model.enable_gradient_checkpointing``) every decoder layer keeps only
its input in the forward and runs its forward a second time in the backward. That second forward is about a
third of a LoRA layer's training time: the frozen base needs no weight gradient, so its backward is one matmul
per linear, as its forward is. A layer that keeps its activations skips it, at the cost of holding them from its
forward to its backward (for the Qwen2.5-7B shape about 3 GiB per layer at 16 384 tokens, measured in
docs/benchmarks.md §4u).

An NVFP4 base holds ~0.56 bytes per weight instead of 2, so the 7B actor has about 9 GiB to spare against a
BF16 actor's peak: enough for the last two or three layers to keep their activations, which is how the NVFP4
actor can be faster than the BF16 one at the same peak memory (§4u). The setting is ``custom.qerl.actor.
no_recompute_layers`` of the rollout block (:mod:`verl_ext.config`). It imports no verl: the GPU bench uses it.
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
