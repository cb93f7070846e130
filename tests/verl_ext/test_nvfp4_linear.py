"""NVFP4Linear: float64 references for forward/backward, PEFT LoRA on a tiny Qwen2, the rollout's bytes,
memory, checkpoint loading, bad input; the Triton dequant kernel under the Triton interpreter (CPU) and on
CUDA (gpu marker)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
import torch.nn as nn

from qerl_plugin import nvfp4
from qerl_plugin.nvfp4 import NVFP4Error
from verl_ext import kernels
from verl_ext.nvfp4_linear import (
    DEFAULT_FUSED_GROUPS,
    NVFP4Linear,
    load_nvfp4_checkpoint_into,
    nvfp4_modules,
    replace_linears_with_nvfp4,
)

PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def bf16_exact(t: torch.Tensor) -> torch.Tensor:
    """float32 values that a bf16 checkpoint holds (an actor loaded in fp32 from bf16 weights)."""
    return t.to(torch.bfloat16).to(torch.float32)


def make_layer(out_f=48, in_f=64, bias=True, seed=0) -> tuple[NVFP4Linear, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_f, in_f, generator=g) * 0.05).to(torch.bfloat16)
    b = (torch.randn(out_f, generator=g) * 0.1).to(torch.bfloat16) if bias else None
    layer = NVFP4Linear.from_weight(w, b)
    w_deq = nvfp4.dequantize(layer.weight_packed, layer.weight_scale, layer.weight_global_scale, torch.float32)
    return layer, w_deq, b


def tiny_qwen2(layers=2, seed=0, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    return model.to(torch.bfloat16).to(dtype), cfg  # values of a bf16 checkpoint


# ---------------------------------------------------------------------------------------------------------
# forward / backward against float64


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 64)])
def test_forward_and_input_grad_match_float64(bias, shape):
    layer, w, b = make_layer(bias=bias)
    x = torch.randn(*shape, dtype=torch.float32, requires_grad=True)
    y = layer(x)
    ref = x.detach().double() @ w.double().T + (b.double() if b is not None else 0)
    assert y.dtype == torch.float32 and y.shape == (*shape[:-1], 48)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(x.grad.double(), g.double() @ w.double(), rtol=1e-5, atol=1e-5)
    assert all(t.grad is None for t in layer.buffers())
    assert layer.bias is None or (layer.bias.grad is None and not layer.bias.requires_grad)


def test_bf16_forward_uses_the_bf16_weight():
    layer, w, b = make_layer()
    x = torch.randn(7, 64).to(torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    w_bf16 = nvfp4.dequantize(layer.weight_packed, layer.weight_scale, layer.weight_global_scale, torch.bfloat16)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w_bf16, b))
    ref = x.double() @ w.double().T + b.double()
    torch.testing.assert_close(y.double(), ref, rtol=2e-2, atol=2e-2)


def test_autocast_computes_in_the_autocast_dtype():
    layer, _, _ = make_layer()
    x = torch.randn(4, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, layer(x.to(torch.bfloat16)))


def test_bias_grad_when_unfrozen():
    layer, w, b = make_layer()
    layer.bias.requires_grad_(True)
    x = torch.randn(6, 64)
    g = torch.randn(6, 48)
    layer(x).backward(g)
    torch.testing.assert_close(layer.bias.grad.float(), g.sum(0).to(torch.bfloat16).float())


def test_lora_grads_match_float64():
    from peft import LoraConfig, get_peft_model

    layer, w, b = make_layer(bias=True)

    class One(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = layer

        def forward(self, x):
            return self.proj(x)

    model = get_peft_model(One(), LoraConfig(r=4, lora_alpha=8, target_modules=["proj"], init_lora_weights=False))
    lora = model.base_model.model.proj
    a_w, b_w = lora.lora_A["default"].weight, lora.lora_B["default"].weight
    scaling = lora.scaling["default"]
    x = torch.randn(3, 5, 64, requires_grad=True)
    y = model(x)
    g = torch.randn_like(y)
    y.backward(g)

    x64 = x.detach().double().requires_grad_(True)
    a64 = a_w.detach().double().requires_grad_(True)
    b64 = b_w.detach().double().requires_grad_(True)
    y64 = x64 @ w.double().T + b.double() + scaling * (x64 @ a64.T) @ b64.T
    y64.backward(g.double())
    torch.testing.assert_close(y.double(), y64.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a_w.grad.double(), a64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b_w.grad.double(), b64.grad, rtol=1e-5, atol=1e-5)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(trainable) == sorted(
        ["base_model.model.proj.lora_A.default.weight", "base_model.model.proj.lora_B.default.weight"]
    )


def test_backward_keeps_no_dense_weight():
    """The autograd graph holds the 4-bit buffers, not a dense copy (saved tensors are recorded)."""
    layer, _, _ = make_layer(out_f=64, in_f=128)
    x = torch.randn(4, 128, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    dense = [t for t in saved if t.is_floating_point() and t.numel() >= 64 * 128 and t.dtype != torch.float8_e4m3fn]
    assert dense == [], [(t.dtype, tuple(t.shape)) for t in dense]
    y.sum().backward()
    assert x.grad is not None


# ---------------------------------------------------------------------------------------------------------
# module behaviour


def test_buffers_are_compressed_tensors_names_and_survive_dtype_casts():
    layer, _, _ = make_layer()
    sd = layer.state_dict()
    assert set(sd) == {"weight_packed", "weight_scale", "weight_global_scale", "bias"}
    assert (sd["weight_packed"].dtype, sd["weight_scale"].dtype, sd["weight_global_scale"].dtype) == (
        torch.uint8, torch.float8_e4m3fn, torch.float32)
    before = {k: v.clone() for k, v in sd.items()}
    layer.to(torch.bfloat16)
    layer.half()
    layer.float()
    after = layer.state_dict()
    for k in ("weight_packed", "weight_scale", "weight_global_scale"):
        assert after[k].dtype == before[k].dtype
        assert torch.equal(after[k].view(torch.uint8), before[k].view(torch.uint8))
    assert after["bias"].dtype == torch.float32  # the bias is an ordinary (frozen) parameter
    fresh = NVFP4Linear(64, 48, bias=True)
    fresh.load_state_dict(before)
    x = torch.randn(3, 64)
    torch.testing.assert_close(fresh(x), make_layer()[0](x))


def test_is_an_nn_linear_without_dense_weight():
    layer, _, _ = make_layer()
    assert isinstance(layer, nn.Linear) and layer.weight is None
    assert (layer.in_features, layer.out_features) == (64, 48)
    assert layer.qweight is layer.weight_packed
    assert [n for n, _ in layer.named_parameters()] == ["bias"]
    assert "format=nvfp4" in repr(layer)
    assert layer.nbytes() == 48 * 32 + 48 * 4 + 4 + 48 * 2


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(NVFP4Error, match="in_features=40 is not divisible by the NVFP4 group size 16"):
        NVFP4Linear(40, 8)
    with pytest.raises(NVFP4Error, match="not divisible by the NVFP4 group size"):
        NVFP4Linear.from_linear(nn.Linear(24, 8))
    with pytest.raises(NVFP4Error, match="already an NVFP4Linear"):
        NVFP4Linear.from_linear(make_layer()[0])
    layer, _, _ = make_layer()
    with pytest.raises(NVFP4Error, match="weight_scale: expected torch.float8_e4m3fn"):
        NVFP4Linear.from_packed(layer.weight_packed, layer.weight_scale.float(), layer.weight_global_scale)
    with pytest.raises(NVFP4Error, match="weight_packed: expected torch.uint8"):
        NVFP4Linear.from_packed(layer.weight_packed.to(torch.int8), layer.weight_scale, layer.weight_global_scale)
    with pytest.raises(NVFP4Error, match="weight_scale has shape"):
        NVFP4Linear.from_packed(layer.weight_packed, layer.weight_scale[:, :2], layer.weight_global_scale)
    with pytest.raises(NVFP4Error, match="bias has shape"):
        NVFP4Linear.from_packed(layer.weight_packed, layer.weight_scale, layer.weight_global_scale, bias=torch.zeros(3))
    with pytest.raises(NVFP4Error, match="last dimension 32"):
        layer(torch.randn(2, 32))
    with pytest.raises(NVFP4Error, match="float32/bfloat16/float16 inputs, got torch.int64"):
        layer(torch.ones(2, 64, dtype=torch.long))
    with pytest.raises(NVFP4Error, match="not exactly representable in torch.bfloat16"):
        NVFP4Linear.from_linear(nn.Linear(32, 8))  # fp32 random init: not a bf16 checkpoint's values
    assert NVFP4Linear.from_linear(nn.Linear(32, 8), quant_dtype=None).in_features == 32
    layer._buffers["weight_global_scale"] = layer.weight_global_scale.to(torch.bfloat16)
    with pytest.raises(NVFP4Error, match="buffer_dtype: fp32"):
        layer(torch.randn(2, 64))


def test_fsdp_buffer_cast_leaves_the_nvfp4_bytes_alone():
    """FSDP1 MixedPrecision(buffer_dtype=fp32) casts every floating buffer in place, with this very function."""
    from torch.distributed.fsdp._runtime_utils import _cast_buffers_to_dtype_and_device

    layer, _, _ = make_layer()
    x = torch.randn(3, 64)
    y = layer(x)
    before = {n: (b.dtype, b.numel() * b.element_size()) for n, b in layer.named_buffers()}
    buffers = list(layer.buffers())
    _cast_buffers_to_dtype_and_device(buffers, [torch.float32] * len(buffers), torch.device("cpu"))
    after = {n: (b.dtype, b.numel() * b.element_size()) for n, b in layer.named_buffers()}
    assert after == before  # uint8 codes, uint8 FP8 bytes, fp32 global scale: nothing grows
    assert layer.weight_scale.dtype == torch.float8_e4m3fn
    assert torch.equal(layer(x), y)
    _cast_buffers_to_dtype_and_device(buffers, [torch.bfloat16] * len(buffers), torch.device("cpu"))
    with pytest.raises(NVFP4Error, match="buffer_dtype: fp32"):
        layer(x)


def test_state_dict_takes_fp8_or_bytes_and_rejects_non_fp8_values():
    layer, _, _ = make_layer()
    sd = layer.state_dict()
    for variant in (sd["weight_scale"], sd["weight_scale"].view(torch.uint8), sd["weight_scale"].float()):
        fresh = NVFP4Linear(64, 48, bias=True)
        fresh.load_state_dict(dict(sd, weight_scale=variant))
        assert torch.equal(fresh.weight_scale.view(torch.uint8), layer.weight_scale.view(torch.uint8))
    bad = dict(sd, weight_scale=sd["weight_scale"].float() + 0.01)
    with pytest.raises(RuntimeError, match="not FP8-E4M3"):
        NVFP4Linear(64, 48, bias=True).load_state_dict(bad)
    assert sd["weight_scale"].dtype == torch.float8_e4m3fn  # the caller's dict is left as it was


def test_scale_cast_by_a_wrapper_decodes_the_same():
    """Scales assigned as wider floats (FP8 values are exact there) decode to the same bits."""
    layer, _, _ = make_layer()
    x = torch.randn(3, 64)
    y = layer(x)
    layer._buffers["weight_scale"] = layer.weight_scale.float()
    assert torch.equal(layer(x), y)


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
    assert DEFAULT_FUSED_GROUPS == (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def test_fused_groups_table_agrees_with_the_checkpoint_format():
    fmt = pytest.importorskip("qerl_plugin.format")
    assert tuple(map(tuple, fmt.FUSED_GROUPS)) == DEFAULT_FUSED_GROUPS


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
    report = replace_linears_with_nvfp4(model, ignore=("lm_head", "model.layers.0.self_attn.k_proj", "re:down_proj$"))
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
# loading an NVFP4 checkpoint


def write_nvfp4_checkpoint(model: nn.Module, cfg, path, shards=2):
    """A compressed-tensors style NVFP4A16 checkpoint of ``model`` (bf16 values), written independently."""
    from safetensors.torch import save_file

    sd = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if "rotary" not in k}
    out: dict[str, torch.Tensor] = {}
    done = set()
    for k in list(sd):
        if not k.endswith("_proj.weight") or k in done:
            continue
        mod = k[: -len(".weight")]
        prefix, leaf = mod.rsplit(".", 1)
        group = next((g for g in DEFAULT_FUSED_GROUPS if leaf in g), (leaf,))
        names = [f"{prefix}.{p}" for p in group]
        for n, q in zip(names, nvfp4.quantize_fused([sd[f"{n}.weight"] for n in names], names)):
            out.update(q.tensors(n))
            done.add(f"{n}.weight")
    out.update({k: v for k, v in sd.items() if k not in done})
    keys = sorted(out)
    weight_map = {}
    for i in range(shards):
        part = keys[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: out[k].contiguous() for k in part}, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = cfg.to_dict()
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                                     "config_groups": {"group_0": {"format": "nvfp4-pack-quantized"}}}
    (path / "config.json").write_text(json.dumps(config))
    return out


def test_load_checkpoint_gives_the_same_model_as_replacing(tmp_path):
    src, cfg = tiny_qwen2(layers=2, seed=5)
    write_nvfp4_checkpoint(src, cfg, tmp_path)
    replaced, _ = tiny_qwen2(layers=2, seed=5)
    replace_linears_with_nvfp4(replaced)

    target, _ = tiny_qwen2(layers=2, seed=99)  # other random weights: everything must come from the checkpoint
    report = load_nvfp4_checkpoint_into(target, tmp_path)
    assert len(report.replaced) == 14 and report.meta_left == []
    assert "model.embed_tokens.weight" in report.loaded and "model.layers.0.self_attn.q_proj.bias" in report.loaded
    sd_a, sd_b = replaced.state_dict(), target.state_dict()
    assert sd_a.keys() == sd_b.keys()
    for k in sd_a:
        assert sd_a[k].dtype == sd_b[k].dtype, k
        assert torch.equal(sd_a[k].view(torch.uint8) if sd_a[k].dtype == torch.float8_e4m3fn else sd_a[k],
                           sd_b[k].view(torch.uint8) if sd_b[k].dtype == torch.float8_e4m3fn else sd_b[k]), k
    ids = torch.randint(0, 64, (1, 10))
    assert torch.equal(replaced(input_ids=ids).logits, target(input_ids=ids).logits)


def test_load_checkpoint_into_meta_model(tmp_path):
    src, cfg = tiny_qwen2(layers=1, seed=6)
    write_nvfp4_checkpoint(src, cfg, tmp_path, shards=1)
    with torch.device("meta"):
        target, _ = tiny_qwen2(layers=1)
    report = load_nvfp4_checkpoint_into(target, tmp_path, device="cpu")
    assert len(report.replaced) == 7
    assert report.meta_left == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"] or all(
        "rotary" in n for n in report.meta_left)
    assert all(not t.is_meta for n, t in target.named_parameters())


def test_load_checkpoint_errors(tmp_path):
    src, cfg = tiny_qwen2(layers=1, seed=7)
    with pytest.raises(NVFP4Error, match="not a directory"):
        load_nvfp4_checkpoint_into(src, tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(NVFP4Error, match="no quantization_config.*qerl quantize"):
        load_nvfp4_checkpoint_into(src, tmp_path)
    write_nvfp4_checkpoint(src, cfg, tmp_path, shards=1)
    bigger, _ = tiny_qwen2(layers=2, seed=7)
    with pytest.raises(NVFP4Error, match=r"model tensors the checkpoint lacks: \['model.layers.1"):
        load_nvfp4_checkpoint_into(bigger, tmp_path)


# ---------------------------------------------------------------------------------------------------------
# the Triton kernel


KERNEL_CHECK = textwrap.dedent(
    """
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from qerl_plugin import nvfp4
    from verl_ext import kernels
    assert kernels.triton_interpreting()
    g = torch.Generator().manual_seed(0)
    bad = []
    cases = [(16, 32, 1.0), (37, 96, 2688.0), (5, 528, 1e-3), (64, 256, 3.0e7), (3, 4096, 0.37)]
    for rows, cols, gs in cases:
        packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
        sbytes = torch.randint(0, 256, (rows, cols // 16), dtype=torch.uint8, generator=g)
        sbytes.view(-1)[: min(256, sbytes.numel())] = torch.arange(min(256, sbytes.numel()), dtype=torch.uint8)
        scale = sbytes.view(torch.float8_e4m3fn)
        gscale = torch.tensor([gs], dtype=torch.float32)
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            a = kernels.dequantize_nvfp4_triton(packed, scale, gscale, dt)
            b = nvfp4.dequantize(packed, scale, gscale, dt)
            iv = torch.int32 if dt == torch.float32 else torch.int16
            nan = torch.isnan(b)
            if not (torch.equal(torch.isnan(a), nan) and torch.equal(a.view(iv)[~nan], b.view(iv)[~nan])):
                bad.append((rows, cols, gs, str(dt)))
    # a real quantized weight, through the dispatcher with backend="triton"
    w = torch.randn(48, 160, generator=g).to(torch.bfloat16)
    q = nvfp4.quantize(w)
    a = kernels.dequantize(q.packed, q.scale, q.global_scale, torch.bfloat16, backend="triton")
    if not torch.equal(a.view(torch.int16), q.dequantize(torch.bfloat16).view(torch.int16)):
        bad.append("quantized weight")
    print("BAD", bad)
    sys.exit(1 if bad else 0)
    """
)


def test_triton_kernel_is_bit_exact_under_the_interpreter():
    """The kernel's arithmetic (E2M1/FP8 decoding, IEEE division, bf16 rounding) on CPU, every code and
    every FP8 scale byte (subnormals, negative zero, NaN), several global scales and output dtypes."""
    pytest.importorskip("triton", reason="Triton is not installed: the kernel cannot be interpreted")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", KERNEL_CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]


def test_dispatch_uses_torch_on_cpu_and_validates():
    layer, _, _ = make_layer()
    a = kernels.dequantize(layer.weight_packed, layer.weight_scale, layer.weight_global_scale, torch.float16)
    assert torch.equal(a, nvfp4.dequantize(layer.weight_packed, layer.weight_scale, layer.weight_global_scale, torch.float16))
    a8 = kernels.dequantize(layer.weight_packed, layer.weight_scale.view(torch.uint8), layer.weight_global_scale)
    assert torch.equal(a8.view(torch.int16), layer.dequantize_weight().view(torch.int16))
    with pytest.raises(NVFP4Error, match="weight_scale must be float8_e4m3fn"):
        kernels.dequantize(layer.weight_packed, layer.weight_scale.float(), layer.weight_global_scale)
    with pytest.raises(NVFP4Error, match="float32, bfloat16 or float16"):
        kernels.dequantize(layer.weight_packed, layer.weight_scale, layer.weight_global_scale, torch.float64)
    with pytest.raises(NVFP4Error, match="one float32 value"):
        kernels.dequantize(layer.weight_packed, layer.weight_scale, torch.ones(2))
    with pytest.raises(ValueError, match="backend"):
        kernels.dequantize(layer.weight_packed, layer.weight_scale, layer.weight_global_scale, backend="cuda")
    if not kernels.triton_interpreting():
        with pytest.raises((NVFP4Error, RuntimeError), match="CUDA|Triton"):
            kernels.dequantize_nvfp4_triton(layer.weight_packed, layer.weight_scale, layer.weight_global_scale)


# ---------------------------------------------------------------------------------------------------------
# GPU


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton kernel and CUDA matmuls)")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("shape", [(16, 16), (37, 96), (512, 3584), (3584, 18944), (4608, 3584), (1000, 5136)])
def test_gpu_triton_equals_torch_codec(shape):
    g = torch.Generator().manual_seed(shape[0])
    w = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16).cuda()
    q = nvfp4.quantize(w)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        a = kernels.dequantize_nvfp4_triton(q.packed, q.scale, q.global_scale, dt)
        b = nvfp4.dequantize(q.packed, q.scale, q.global_scale, dt)
        iv = torch.int32 if dt == torch.float32 else torch.int16
        assert torch.equal(a.view(iv), b.view(iv)), (shape, dt)
        assert torch.equal(a.cpu().view(iv), nvfp4.dequantize(q.packed.cpu(), q.scale.cpu(), q.global_scale.cpu(), dt).view(iv))
    # every byte value of packed and scale
    packed = torch.randint(0, 256, (64, 128), dtype=torch.uint8, generator=g).cuda()
    sb = (torch.arange(64 * 16) % 256).to(torch.uint8).reshape(64, 16).cuda()  # every FP8 byte (256 inputs = 16 groups)
    for gs in (1.0, 2688.0, 1e-3, 3e7):
        gsc = torch.tensor([gs], device="cuda")
        a = kernels.dequantize_nvfp4_triton(packed, sb.view(torch.float8_e4m3fn), gsc, torch.bfloat16)
        b = nvfp4.dequantize(packed, sb.view(torch.float8_e4m3fn), gsc, torch.bfloat16)
        nan = torch.isnan(b)
        assert torch.equal(torch.isnan(a), nan) and torch.equal(a.view(torch.int16)[~nan], b.view(torch.int16)[~nan])


@pytest.mark.gpu
@cuda
def test_gpu_forward_backward_and_peft():
    from peft import LoraConfig, get_peft_model

    layer, w, b = make_layer(out_f=256, in_f=512)
    layer = layer.cuda()
    x = torch.randn(4, 33, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    g = torch.randn_like(y)
    y.backward(g)
    wd = w.cuda().double()
    torch.testing.assert_close(y.double(), x.detach().double() @ wd.T + b.cuda().double(), rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(x.grad.double(), g.double() @ wd, rtol=2e-2, atol=5e-2)

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


def test_gpu_check_script_runs_on_cpu(tmp_path):
    """scripts/gpu/check_actor_kernels.py --smoke-cpu: the lead's GPU script, its plumbing checked here."""
    pytest.importorskip("triton", reason="the script's kernel steps need Triton (interpreted on CPU)")
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "gpu", "check_actor_kernels.py")
    out = subprocess.run(
        [sys.executable, script, "--smoke-cpu", "--steps", "exact,dequant,layer", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "check_actor_kernels.jsonl").read_text().splitlines()]
    steps = {r["step"] for r in rows}
    assert {"env", "exact", "dequant", "layer"} <= steps and "error" not in steps
    assert all(r["ok"] for r in rows if r["step"] == "exact")
    assert "=== check_actor_kernels summary ===" in out.stdout
