"""verl_ext.nvfp4_replace: which linears become NVFP4, the rollout's bytes (fused groups), no dense copy left,
ignores, PEFT LoRA on a replaced tiny Qwen2 (a training step, gradient checkpointing, on CUDA), meta models."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn

from helpers import tiny_qwen2_model as tiny_qwen2
from qerl_plugin import format as fmt
from qerl_plugin import nvfp4
from verl_ext.nvfp4_linear import NVFP4Linear
from verl_ext.nvfp4_replace import nvfp4_modules, replace_linears_with_nvfp4

PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ---------------------------------------------------------------------------------------------------------
# model surgery: the rollout's bytes, PEFT, memory


@pytest.fixture(scope="module")
def qwen_pair():
    model, cfg = tiny_qwen2()
    originals = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    biases = {n: m.bias.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear) and m.bias is not None}
    report = replace_linears_with_nvfp4(model)
    return model, cfg, originals, biases, report


def test_replacement_targets_decoder_projections_only(qwen_pair):
    model, cfg, originals, _, report = qwen_pair
    expected = sorted(f"model.layers.{i}.{'self_attn' if p in PROJ[:4] else 'mlp'}.{p}" for i in range(2) for p in PROJ)
    assert sorted(report.replaced) == expected
    assert sorted(nvfp4_modules(model)) == expected
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.shape == (64, 64)
    assert len(report.fused_groups) == 4
    assert fmt.FUSED_GROUPS == (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def test_actor_bytes_equal_quantize_fused_of_the_bf16_checkpoint(qwen_pair):
    model, _, originals, _, _ = qwen_pair
    for i in range(2):
        for prefix, group in ((f"model.layers.{i}.self_attn", ("q_proj", "k_proj", "v_proj")),
                              (f"model.layers.{i}.mlp", ("gate_proj", "up_proj")),
                              (f"model.layers.{i}.self_attn", ("o_proj",)),
                              (f"model.layers.{i}.mlp", ("down_proj",))):
            names = [f"{prefix}.{p}" for p in group]
            ref = nvfp4.quantize_fused([originals[n].to(torch.bfloat16) for n in names], names)
            for n, q in zip(names, ref):
                m = model.get_submodule(n)
                assert torch.equal(m.weight_packed, q.packed), n
                assert torch.equal(m.weight_scale.view(torch.uint8), q.scale.view(torch.uint8)), n
                assert torch.equal(m.weight_global_scale, q.global_scale), n
                deq = nvfp4.dequantize(q.packed, q.scale, q.global_scale, torch.bfloat16)
                assert torch.equal(m.dequantize_weight(torch.bfloat16).view(torch.int16), deq.view(torch.int16)), n


def test_no_dense_copy_of_the_base_remains():
    model, _ = tiny_qwen2(layers=2, seed=1)
    dense_shapes = {n: tuple(m.weight.shape) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    refs = {n: weakref.ref(m.weight) for n, m in model.named_modules() if isinstance(m, nn.Linear) and "layers" in n}
    before = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    report = replace_linears_with_nvfp4(model)
    gc.collect()
    assert all(r() is None for r in refs.values()), [n for n, r in refs.items() if r() is not None]
    after = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    # what is left: embeddings, lm_head, norms, biases, rotary buffers + the NVFP4 bytes
    rest = sum(t.numel() * t.element_size() for n, t in list(model.named_parameters()) + list(model.named_buffers())
               if not any(s in n for s in ("weight_packed", "weight_scale", "weight_global_scale")) and ".bias" not in n)
    assert after == rest + report.nvfp4_bytes
    assert before - after == report.dense_bytes - report.nvfp4_bytes
    assert report.nvfp4_bytes < report.dense_bytes / 4 * 0.6  # fp32 dense -> ~0.56 byte/weight (+ biases)
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        assert not ("layers" in n and t.is_floating_point() and t.dim() == 2), (n, t.dtype, tuple(t.shape))


def test_ignore_takes_the_whole_fused_group():
    model, _ = tiny_qwen2(layers=1, seed=2)
    report = replace_linears_with_nvfp4(model, ignore=("lm_head", "model.layers.0.self_attn.k_proj", "re:.*down_proj$"))
    assert sorted(report.ignored) == [
        "model.layers.0.mlp.down_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj"]
    assert sorted(report.replaced) == ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
                                       "model.layers.0.self_attn.o_proj"]
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear


@pytest.mark.parametrize("targets", [PROJ, "all-linear"])
def test_peft_wraps_nvfp4_and_a_training_step_changes_only_lora(targets):
    from peft import LoraConfig, get_peft_model

    model, _ = tiny_qwen2(layers=2, seed=3)
    replace_linears_with_nvfp4(model)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    wrapped = [n for n, m in model.named_modules() if isinstance(m, NVFP4Linear)]
    assert len(wrapped) == 14 and all(n.endswith(".base_layer") for n in wrapped)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert not any("lm_head" in n for n in trainable)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(trainable)

    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 64, (2, 12))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    for n, p in model.named_parameters():
        assert (p.grad is not None) == p.requires_grad, n
    opt.step()
    after = model.state_dict()
    changed = sorted(k for k in before if not torch.equal(before[k].view(torch.uint8) if before[k].dtype == torch.float8_e4m3fn else before[k],
                                                          after[k].view(torch.uint8) if after[k].dtype == torch.float8_e4m3fn else after[k]))
    assert changed == sorted(k for k in before if ".lora_A." in k or ".lora_B." in k)


def test_gradient_checkpointing_gives_the_same_grads():
    from peft import LoraConfig, get_peft_model

    grads = []
    for ckpt in (False, True):
        model, _ = tiny_qwen2(layers=2, seed=4)
        replace_linears_with_nvfp4(model)
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=PROJ, init_lora_weights=False))
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        model.train()
        ids = torch.arange(24).reshape(2, 12) % 64
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-6)


def test_meta_layers_become_empty_meta_nvfp4():
    with torch.device("meta"):
        model, _ = tiny_qwen2(layers=1)
    report = replace_linears_with_nvfp4(model)
    assert len(report.replaced) == 7 and report.fused_groups == []
    m = model.model.layers[0].self_attn.q_proj
    assert isinstance(m, NVFP4Linear) and m.weight_packed.is_meta and m.weight_packed.dtype == torch.uint8
    assert m.bias is not None and m.bias.is_meta


# ---------------------------------------------------------------------------------------------------------
# GPU


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton kernel and CUDA matmuls)")


@pytest.mark.gpu
@cuda
def test_gpu_peft_on_a_replaced_model():
    from peft import LoraConfig, get_peft_model

    model, _ = tiny_qwen2(layers=2, seed=8)
    replace_linears_with_nvfp4(model, device="cuda")
    model = model.cuda()
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=PROJ))
    assert model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.is_cuda
    ids = torch.randint(0, 64, (2, 16), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert all((p.grad is not None) == p.requires_grad for p in model.parameters())
