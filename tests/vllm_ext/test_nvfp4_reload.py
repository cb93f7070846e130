"""Base-weight reloads into installed ``nvfp4`` layers keep every buffer and re-quantize: verl's
``model.load_weights`` (``vllm_ext.nvfp4_reload``) and vLLM's layerwise reload (CPU; helpers in
``nvfp4_layers.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from helpers import read_safetensors_dir  # noqa: E402
from nvfp4_layers import (  # noqa: E402
    QKV_MAP,
    assert_bytes,
    expected_parts,
    linears,
    load_model,
    load_qkv,
    make_qkv,
    nvfp4_config,
    param_ptrs,
    rand_bf16,
    random_bias_model,
)
from safetensors.torch import save_file  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402

from qerl_plugin import nvfp4  # noqa: E402
from qerl_plugin.nvfp4 import NVFP4Error  # noqa: E402


def test_bf16_reload_through_load_weights_keeps_buffers(cpu_config):
    """verl's base sync: model.load_weights(BF16) into an installed layer re-quantizes into the same buffers."""
    layer = make_qkv(cpu_config, nvfp4_config(ct=False))
    load_qkv(layer, rand_bf16((64, 64), 1), rand_bf16((32, 64), 2), rand_bf16((32, 64), 3))
    ptrs = {n: p.data_ptr() for n, p in layer.named_parameters()}
    q2, k2, v2 = rand_bf16((64, 64), 11, 0.1), rand_bf16((32, 64), 12, 5.0), rand_bf16((32, 64), 13)
    bias2 = rand_bf16((128,), 14)
    layer.weight.weight_loader(layer.weight, q2, "q")
    layer.weight.weight_loader(layer.weight, k2, "k")
    with pytest.raises(NVFP4Error, match=r"missing \['model.layers.0.self_attn.v_proj'\].*share one global scale"):
        layer.quant_method.process_weights_after_loading(layer)
    layer.weight.weight_loader(layer.weight, v2, "v")
    for shard, sl in (("q", slice(0, 64)), ("k", slice(64, 96)), ("v", slice(96, 128))):
        layer.bias.weight_loader(layer.bias, bias2[sl], shard)
    layer.quant_method.process_weights_after_loading(layer)
    ref = nvfp4.quantize_fused([q2, k2, v2])
    assert_bytes(layer, ref)
    assert torch.equal(layer.bias, bias2)
    assert {n: p.data_ptr() for n, p in layer.named_parameters()} == ptrs  # CUDA-graph safe
    with pytest.raises(NVFP4Error, match="packed NVFP4 bytes"):
        layer.weight.weight_loader(layer.weight, ref[0].packed, "q")
    with pytest.raises(NVFP4Error, match="kernel layout"):
        layer.weight_scale.weight_loader(layer.weight_scale, ref[0].scale)


def test_reload_paths_keep_buffers_and_requantize(tmp_path, cpu_config, cpu_attention):
    """Base reloads in both engines: vLLM's layerwise reload and verl's model.load_weights + process."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from qerl_plugin.quantize import quantize_checkpoint

    src = random_bias_model(tmp_path / "bf16")
    ct = tmp_path / "ct"
    quantize_checkpoint(src, ct, progress=False, log=lambda m: None)
    new_src = random_bias_model(tmp_path / "bf16_new")
    for f in new_src.glob("*.safetensors"):  # a different model of the same shape
        sd_new = read_safetensors_dir(new_src)
        sd_new = {k: (v * 1.7 + 0.01 if v.dim() == 2 else v + 0.25) for k, v in sd_new.items()}
        save_file(sd_new, str(f), metadata={"format": "pt"})
    new_ct = tmp_path / "ct_new"
    quantize_checkpoint(new_src, new_ct, progress=False, log=lambda m: None)
    sd_new = read_safetensors_dir(new_src)

    # 1) vLLM layerwise reload, checkpoint format of each engine (BF16 engine <- BF16, CT engine <- CT)
    for path, new_path in ((src, new_src), (ct, new_ct)):
        model, mc, vc = load_model(cpu_config, path)
        ptrs = param_ptrs(model)
        with set_current_vllm_config(vc):
            initialize_layerwise_reload(model)
            model.load_weights(read_safetensors_dir(new_path).items())
            finalize_layerwise_reload(model, mc)
        assert param_ptrs(model) == ptrs, path
        for name, layer in linears(model).items():
            assert_bytes(layer, expected_parts(sd_new, name))
        qkv = linears(model)["model.layers.0.self_attn.qkv_proj"]
        assert torch.equal(qkv.bias, torch.cat([sd_new[f"model.layers.0.self_attn.{p}.bias"] for p in QKV_MAP["qkv_proj"]]))

    # 2) verl's base sync into the CT engine: BF16 tensors through model.load_weights, then processing
    model, mc, vc = load_model(cpu_config, ct)
    ptrs = param_ptrs(model)
    with set_current_vllm_config(vc):
        model.load_weights(sd_new.items())
        process_weights_after_loading(model, mc, torch.device("cpu"))
    assert param_ptrs(model) == ptrs
    for name, layer in linears(model).items():
        assert_bytes(layer, expected_parts(sd_new, name))
    assert torch.equal(model.model.norm.weight, sd_new["model.norm.weight"])
