"""``actor.no_recompute_layers``: the last N decoder layers of a LoRA actor keep their activations instead of
recomputing them under gradient checkpointing (verl_ext.recompute), on CPU with transformers' Qwen2 and PEFT.

The reference is the same model with every layer checkpointed and with checkpointing off: the LoRA gradients must
be the same bits (the recomputed forward is the same computation), and only the kept layers' forwards must run
once per step.
"""

from __future__ import annotations

import pytest
import torch

from verl_ext.recompute import checkpointed_layers, keep_activations

LAYERS = 4


def _model(nvfp4: bool, checkpointing: bool = True):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    if nvfp4:
        from verl_ext.nvfp4_replace import replace_linears_with_nvfp4

        replace_linears_with_nvfp4(model, quant_dtype=None)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.train()
    return model


def _step(model, ids):
    """LoRA gradients of one forward + backward, and how often each decoder layer's forward ran."""
    calls = {}
    hooks = [layer.register_forward_pre_hook(lambda m, a, k, i=i: calls.__setitem__(i, calls.get(i, 0) + 1), with_kwargs=True)
             for i, layer in enumerate(model.base_model.model.model.layers)]
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        for h in hooks:
            h.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return grads, [calls[i] for i in range(LAYERS)]


@pytest.mark.parametrize("nvfp4", [False, True], ids=["bf16-base", "nvfp4-base"])
def test_kept_layers_skip_the_recompute_with_the_same_gradients(nvfp4, monkeypatch):
    from verl_ext import kernels

    ids = torch.randint(0, 96, (2, 24))
    reference, calls = _step(_model(nvfp4, checkpointing=False), ids)
    assert calls == [1] * LAYERS
    full, calls = _step(_model(nvfp4), ids)
    assert calls == [2] * LAYERS, "every checkpointed layer runs its forward again in backward"

    model = _model(nvfp4)
    names = keep_activations(model, 2)
    assert names == ["base_model.model.model.layers.2", "base_model.model.model.layers.3"]
    assert [n for n, _ in checkpointed_layers(model)] == ["base_model.model.model.layers.0", "base_model.model.model.layers.1"]
    decodes = []
    real = kernels.dequantize
    monkeypatch.setattr(kernels, "dequantize", lambda *a, **k: decodes.append(1) or real(*a, **k))  # a spy: the real decode runs
    kept, calls = _step(model, ids)
    assert calls == [2, 2, 1, 1]
    if nvfp4:
        # 7 linears a layer: forward + recompute for the two checkpointed layers, one forward for the kept two
        # (their decoded weights serve the backward: within the kept-weight budget)
        assert len(decodes) == 7 * (2 * 2 + 2 * 1)
    assert full.keys() == kept.keys() == reference.keys() and len(full) == 2 * 7 * LAYERS
    for n in full:
        assert torch.equal(kept[n], full[n]), n
        assert torch.equal(kept[n], reference[n]), n


def test_zero_changes_nothing_and_bad_counts_name_the_fix():
    model = _model(nvfp4=False)
    assert keep_activations(model, 0) == [] and len(checkpointed_layers(model)) == LAYERS
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"whole number of decoder layers >= 0"):
            keep_activations(model, bad)
    with pytest.raises(ValueError, match=rf"has {LAYERS} checkpointed decoder layers; give at most {LAYERS}"):
        keep_activations(model, LAYERS + 1)
    assert keep_activations(model, LAYERS, key="k") and checkpointed_layers(model) == []
    with pytest.raises(ValueError, match=r"k=1, but no decoder layer .* gradient checkpointing is off"):
        keep_activations(model, 1, key="k")
    with pytest.raises(ValueError, match=r"enable_gradient_checkpointing=true"):
        keep_activations(_model(nvfp4=False, checkpointing=False), 1)


FSDP2_CHECK = """
import os, socket, sys
import torch, torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from test_recompute import _model, _step
from verl_ext.recompute import keep_activations

mesh = init_device_mesh("cpu", (1,))
ids = torch.randint(0, 96, (2, 24))
grads = {}
for keep in (0, 2):
    model = _model(nvfp4=True)
    keep_activations(model, keep)  # before wrapping, as verl's _build_lora_module is
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    g, calls = _step(model, ids)
    grads[keep] = {k: v.full_tensor() for k, v in g.items()}
    print("calls", keep, calls)
print("equal", all(torch.equal(grads[0][k], grads[2][k]) for k in grads[0]), len(grads[0]))
dist.destroy_process_group()
"""


def test_kept_layers_under_fsdp2():
    """verl's fsdp2 strategy wraps each decoder layer with ``fully_shard`` after the LoRA build; the kept layers must
    still run their forward once and give the same gradients (one process, gloo, CPU)."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    out = subprocess.run([sys.executable, "-c", FSDP2_CHECK, str(here), str(here.parents[1])],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "calls 0 [2, 2, 2, 2]" in lines and "calls 2 [2, 2, 1, 1]" in lines, out.stdout
    assert f"equal True {2 * 7 * LAYERS}" in lines, out.stdout


QWEN25_7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
             "num_key_value_heads": 4}
QWEN25_32B = {"hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64, "num_attention_heads": 40,
              "num_key_value_heads": 8}


QWEN25_14B = {"hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48, "num_attention_heads": 40,
              "num_key_value_heads": 8}


def test_suggestion_stays_within_the_h100_measurements():
    """docs/benchmarks.md §4u: with the default 1 GiB kept-weight budget, the most kept layers whose step peak stayed
    within BF16's were 2 / 4 / 8 (7B at 16 384 / 8 192 / 4 096 tokens); at 14B and 16 384 tokens 5 did not fit; at
    32B and 4 096 tokens 28 fitted and 32 did not. The weights saved: 8.7 and 41.8 GiB (the peak differences)."""
    from verl_ext.recompute import suggest_kept_layers

    for tokens, measured in ((16384, 2), (8192, 4), (4096, 8)):
        kept, saved, _ = suggest_kept_layers(QWEN25_7B, tokens)
        assert kept == measured and abs(saved - 8.76) < 0.1
    assert suggest_kept_layers(QWEN25_14B, 16384)[0] < 5
    kept, saved, _ = suggest_kept_layers(QWEN25_32B, 4096)
    assert 28 <= kept < 32 and abs(saved - 41.8) < 0.3, (kept, saved)
    assert suggest_kept_layers(QWEN25_7B, 16)[0] == 28  # capped at the model's layers
    # a larger kept-weight budget holds more decoded weights at the peak: fewer layers fit
    assert suggest_kept_layers(QWEN25_7B, 4096, kept_weight_budget=8 << 30)[0] < 8
    with pytest.raises(ValueError, match="not a Qwen2/Llama-style decoder config"):
        suggest_kept_layers({"hidden_size": 8}, 1024)
    with pytest.raises(ValueError, match="must be positive"):
        suggest_kept_layers(QWEN25_7B, 0)
