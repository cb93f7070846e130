"""``vllm_ext.nvfp4_linear``: which layers get the method, and the method on layers and whole models from
BF16 and NVFP4A16 checkpoints (CPU, emulation backend; helpers in ``nvfp4_layers.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from helpers import read_safetensors_dir  # noqa: E402
from nvfp4_layers import (  # noqa: E402
    QKV_MAP,
    assert_bytes,
    ct_tensors,
    expected_parts,
    linears,
    load_ct_qkv,
    load_model,
    load_qkv,
    make_qkv,
    nvfp4_config,
    rand_bf16,
    random_bias_model,
)
from vllm.config import set_current_vllm_config  # noqa: E402

from qerl_plugin import nvfp4  # noqa: E402
from vllm_ext.quant import NVFP4Config  # noqa: E402


def test_dispatch_per_layer_type(cpu_config):
    from vllm.model_executor.layers.linear import RowParallelLinear, UnquantizedLinearMethod

    from vllm_ext.nvfp4_linear import QerlNVFP4LinearMethod

    qc = NVFP4Config.from_config({"quant_method": "nvfp4", "ignore": ["model.layers.0.mlp.down_proj"]})
    with set_current_vllm_config(cpu_config):
        down = RowParallelLinear(64, 64, bias=False, params_dtype=torch.bfloat16, quant_config=qc,
                                 prefix="model.layers.0.mlp.down_proj")
        o = RowParallelLinear(64, 64, bias=False, params_dtype=torch.bfloat16, quant_config=qc,
                              prefix="model.layers.0.self_attn.o_proj")
        odd = RowParallelLinear(40, 64, bias=False, params_dtype=torch.bfloat16, quant_config=qc,
                                prefix="model.layers.0.odd")
    assert isinstance(down.quant_method, UnquantizedLinearMethod)  # ignored
    assert isinstance(o.quant_method, QerlNVFP4LinearMethod) and o.quant_method.source == "bf16"
    assert o.weight.is_meta and o.quant_method.uses_meta_device
    assert isinstance(odd.quant_method, UnquantizedLinearMethod)  # in % 16 != 0 stays BF16 (warned)
    qkv = make_qkv(cpu_config, nvfp4_config(ct=True))
    assert qkv.quant_method.source == "checkpoint" and not qkv.quant_method.uses_meta_device
    assert {n: p.dtype for n, p in qkv.named_parameters()} == {
        "weight_packed": torch.uint8, "weight_scale": torch.float8_e4m3fn,
        "weight_global_scale": torch.float32, "bias": torch.bfloat16,
    }
    assert qc.get_quant_method(torch.nn.LayerNorm(4), "model.norm") is None


def test_bf16_fused_layer_bytes_forward_and_rerun(cpu_config):
    layer = make_qkv(cpu_config, nvfp4_config(ct=False))
    q, k, v = rand_bf16((64, 64), 1), rand_bf16((32, 64), 2, scale=3.0), rand_bf16((32, 64), 3)
    bias = rand_bf16((128,), 4)
    for shard, sl in (("q", slice(0, 64)), ("k", slice(64, 96)), ("v", slice(96, 128))):
        layer.bias.weight_loader(layer.bias, bias[sl], shard)
    load_qkv(layer, q, k, v)  # the last part triggers vLLM's online processing -> our quantization
    ref = nvfp4.quantize_fused([q, k, v])
    assert_bytes(layer, ref)

    x = rand_bf16((5, 64), 5)
    expected = F.linear(x, torch.cat([r.dequantize() for r in ref]), bias)
    assert torch.equal(layer(x)[0], expected)

    before = {n: (p.data_ptr(), p.dtype, p.shape) for n, p in layer.named_parameters()}
    layer.quant_method.process_weights_after_loading(layer)  # vLLM calls it again after loading: no-op
    assert_bytes(layer, ref)
    assert {n: (p.data_ptr(), p.dtype, p.shape) for n, p in layer.named_parameters()} == before


def test_ct_layer_keeps_checkpoint_bytes_and_reloads_bf16(cpu_config):
    layer = make_qkv(cpu_config, nvfp4_config(ct=True), bias=False)
    parts = [rand_bf16((64, 64), 1), rand_bf16((32, 64), 2, 4.0), rand_bf16((32, 64), 3)]
    ref = ct_tensors(parts)
    load_ct_qkv(layer, ref)
    layer.quant_method.process_weights_after_loading(layer)
    assert_bytes(layer, ref)
    assert "weight_packed" not in dict(layer.named_parameters())
    x = rand_bf16((3, 64), 9)
    assert torch.equal(layer(x)[0], F.linear(x, torch.cat([r.dequantize() for r in ref])))
    # a BF16 base reload into an engine started from the NVFP4A16 checkpoint: same bits as quantizing them
    ptrs = {n: p.data_ptr() for n, p in layer.named_parameters()}
    new = [p * 1.5 for p in parts]
    load_qkv(layer, *new)
    assert_bytes(layer, nvfp4.quantize_fused(new))
    assert {n: p.data_ptr() for n, p in layer.named_parameters()} == ptrs


def test_models_from_bf16_and_ct_checkpoints_hold_identical_bytes(tmp_path, cpu_config, cpu_attention):
    from qerl_plugin.quantize import quantize_checkpoint

    src = random_bias_model(tmp_path / "bf16")
    ct = tmp_path / "ct"
    quantize_checkpoint(src, ct, progress=False, log=lambda m: None)
    sd = read_safetensors_dir(src)

    m_bf16, _, _ = load_model(cpu_config, src)
    m_ct, mc_ct, _ = load_model(cpu_config, ct)
    assert mc_ct.quantization == "nvfp4"
    lin_bf16, lin_ct = linears(m_bf16), linears(m_ct)
    assert sorted(lin_bf16) == sorted(lin_ct) and len(lin_bf16) == 8
    for name, layer in lin_bf16.items():
        assert_bytes(layer, expected_parts(sd, name))
        other = lin_ct[name]
        for pname, p in layer.named_parameters():
            assert torch.equal(p.view(torch.uint8), getattr(other, pname).view(torch.uint8)), (name, pname)
    qkv = lin_bf16["model.layers.1.self_attn.qkv_proj"]
    assert torch.equal(qkv.bias, torch.cat([sd[f"model.layers.1.self_attn.{p}.bias"] for p in QKV_MAP["qkv_proj"]]))
    assert m_bf16.lm_head.weight.dtype == torch.bfloat16  # lm_head and embeddings stay BF16


def test_dummy_load_quantizes_random_weights(tmp_path, cpu_config, cpu_attention, tiny_qwen2_dir):
    model, _, _ = load_model(cpu_config, tiny_qwen2_dir, load_format="dummy")
    for name, layer in linears(model).items():
        assert layer.weight.dtype == torch.uint8 and not layer.weight.is_meta, name
        assert float(layer.weight_global_scale) > 0
