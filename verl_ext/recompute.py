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

__all__ = ["checkpointed_layers", "keep_activations", "suggest_kept_layers"]


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


# Bytes a kept decoder layer's activations hold per token of the micro-batch: about A per element of the hidden
# size and B per element of the intermediate size. Fitted to the H100 runs of docs/benchmarks.md §4u (7B, 14B and
# 32B shapes: 22.7 and 8.1, within 0.4 % on all three) and rounded up, so that the estimate errs towards fewer layers.
ACTIVATION_BYTES_PER_HIDDEN = 24
ACTIVATION_BYTES_PER_INTERMEDIATE = 8.5
NVFP4_BYTES_PER_WEIGHT = 0.5 + 1 / 16  # the 4-bit value plus an FP8 scale per 16 weights


def suggest_kept_layers(hf_config: dict, tokens: int, kept_weight_budget: int = 1 << 30) -> tuple[int, float, float]:
    """How many layers an NVFP4 LoRA actor can let keep their activations and still peak no higher than a BF16
    LoRA actor of the same model and micro-batch: ``(layers, weight GiB saved, activation GiB per kept layer)``.

    The weight memory saved is the decoder projections' bytes in BF16 less their NVFP4 bytes. A kept layer holds
    its activations, ``(ACTIVATION_BYTES_PER_HIDDEN * hidden + ACTIVATION_BYTES_PER_INTERMEDIATE * intermediate)``
    bytes per token, and its decoded BF16 weights from forward to backward while the actor's kept-weight budget
    (``QERL_ACTOR_SAVED_WEIGHT_MIB``, ``kept_weight_budget`` bytes) lasts. Estimates for Qwen2/Llama-style decoders
    (q/k/v/o, gate/up/down). Against the H100 runs of §4u (the most layers within BF16's peak): 7B at 16 384 /
    8 192 / 4 096 tokens 2 / 4 / 8 (measured 2 / 4 / 8), 14B at 16 384 tokens 4 (5 did not fit; 4 did, 61.01 vs
    63.89 GiB, in a run made after the fit, §4v), 32B at 4 096 tokens 29 (28 fitted, 32 did not).
    """
    try:
        hidden = int(hf_config["hidden_size"])
        inter = int(hf_config["intermediate_size"])
        layers = int(hf_config["num_hidden_layers"])
        heads = int(hf_config["num_attention_heads"])
        kv_heads = int(hf_config.get("num_key_value_heads") or heads)
        head_dim = int(hf_config.get("head_dim") or hidden // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ValueError(f"not a Qwen2/Llama-style decoder config (hidden/intermediate sizes, layers, heads): {e}") from None
    if tokens <= 0:
        raise ValueError(f"tokens per micro-batch must be positive, got {tokens}")
    per_layer_weights = (hidden * heads * head_dim * 2  # q, o
                         + hidden * kv_heads * head_dim * 2  # k, v
                         + hidden * inter * 3)  # gate, up, down
    saved = layers * per_layer_weights * (2 - NVFP4_BYTES_PER_WEIGHT)
    activations = (ACTIVATION_BYTES_PER_HIDDEN * hidden + ACTIVATION_BYTES_PER_INTERMEDIATE * inter) * tokens
    n = 0
    while n < layers and (n + 1) * activations + min(kept_weight_budget, (n + 1) * 2 * per_layer_weights) <= saved:
        n += 1
    return n, saved / 2**30, activations / 2**30
