"""``vllm_ext.nvfp4_load``: wrong tensors from BF16 and NVFP4A16 checkpoints are refused with the tensor's
name and the fix (CPU; helpers in ``nvfp4_layers.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from nvfp4_layers import ct_tensors, load_ct_qkv, make_qkv, nvfp4_config, rand_bf16  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402

from qerl_plugin import nvfp4  # noqa: E402
from qerl_plugin.nvfp4 import NVFP4Error  # noqa: E402
from vllm_ext.quant import NVFP4Config  # noqa: E402


def test_bf16_bad_inputs(cpu_config):
    from vllm.model_executor.layers.linear import RowParallelLinear

    # (a fresh layer per case: vLLM's online loading buffers a call before running it)
    layer = make_qkv(cpu_config, nvfp4_config(ct=False))
    with pytest.raises(NVFP4Error, match=r"v_proj\.weight: expected a bf16/fp16/fp32 weight.*got torch.uint8"):
        layer.weight.weight_loader(layer.weight, torch.zeros(32, 32, dtype=torch.uint8), "v")
    layer = make_qkv(cpu_config, nvfp4_config(ct=False))
    with pytest.raises(NVFP4Error, match=r"k_proj\.weight: shape \(32, 48\) does not fit.*expected \[out, in\] = \(32, 64\)"):
        layer.weight.weight_loader(layer.weight, rand_bf16((32, 48), 0), "k")
    layer = make_qkv(cpu_config, nvfp4_config(ct=False))
    bad = rand_bf16((64, 64), 1)
    bad[3, 7] = float("nan")
    layer.weight.weight_loader(layer.weight, rand_bf16((32, 64), 2), "k")
    layer.weight.weight_loader(layer.weight, rand_bf16((32, 64), 3), "v")
    with pytest.raises(NVFP4Error, match=r"q_proj: contains NaN/Inf"):
        layer.weight.weight_loader(layer.weight, bad, "q")

    qc = NVFP4Config(ct_config=None)
    from vllm_ext.nvfp4_linear import QerlNVFP4LinearMethod

    class ForceQuant(NVFP4Config):  # a config that insists on quantizing an in % 16 != 0 layer
        def get_quant_method(self, layer, prefix):
            return QerlNVFP4LinearMethod(source="checkpoint", prefix=prefix)

    with set_current_vllm_config(cpu_config), pytest.raises(NVFP4Error, match=r"odd_proj: input size per partition 40.*'ignore' list"):
        RowParallelLinear(40, 64, bias=False, params_dtype=torch.bfloat16, quant_config=ForceQuant(), prefix="m.odd_proj")
    with set_current_vllm_config(cpu_config), pytest.raises(NVFP4Error, match=r"float32.*--dtype bfloat16"):
        RowParallelLinear(64, 64, bias=False, params_dtype=torch.float32, quant_config=qc, prefix="m.o_proj")


def test_ct_bad_checkpoints(cpu_config):
    parts = [rand_bf16((64, 64), 1), rand_bf16((32, 64), 2), rand_bf16((32, 64), 3)]
    ref = ct_tensors(parts)

    layer = make_qkv(cpu_config, nvfp4_config(ct=True), bias=False)
    with pytest.raises(NVFP4Error, match=r"q_proj\.weight_packed: expected uint8.*got torch.bfloat16"):
        layer.weight_packed.weight_loader(layer.weight_packed, parts[0], "q")
    with pytest.raises(NVFP4Error, match=r"k_proj\.weight_scale: expected float8_e4m3fn.*got torch.bfloat16"):
        layer.weight_scale.weight_loader(layer.weight_scale, ref[1].scale.to(torch.bfloat16), "k")
    with pytest.raises(NVFP4Error, match=r"v_proj\.weight_scale: shape \(32, 8\).*\[out, in/16\] = \(32, 4\)"):
        layer.weight_scale.weight_loader(layer.weight_scale, torch.zeros(32, 8, dtype=torch.float8_e4m3fn), "v")
    with pytest.raises(NVFP4Error, match=r"q_proj\.weight_packed: shape \(64, 64\).*\[out, in/2\] = \(64, 32\)"):
        layer.weight_packed.weight_loader(layer.weight_packed, torch.zeros(64, 64, dtype=torch.uint8), "q")
    with pytest.raises(NVFP4Error, match=r"weight_global_scale: expected one global scale"):
        layer.weight_global_scale.weight_loader(layer.weight_global_scale, torch.ones(2), "q")

    # a part without weight_global_scale / weight_scale
    layer = make_qkv(cpu_config, nvfp4_config(ct=True), bias=False)
    for shard, r in zip("qkv", ref):
        layer.weight_packed.weight_loader(layer.weight_packed, r.packed, shard)
        layer.weight_scale.weight_loader(layer.weight_scale, r.scale, shard)
    layer.weight_global_scale.weight_loader(layer.weight_global_scale, ref[0].global_scale, "q")
    with pytest.raises(NVFP4Error, match=r"no weight_global_scale for \['model.layers.0.self_attn.k_proj', 'model.layers.0.self_attn.v_proj'\]"):
        layer.quant_method.process_weights_after_loading(layer)

    # fused parts quantized with separate global scales (not a qerl/llmcompressor export)
    layer = make_qkv(cpu_config, nvfp4_config(ct=True), bias=False)
    separate = [nvfp4.quantize(p) for p in parts]
    assert len({float(r.global_scale) for r in separate}) > 1
    load_ct_qkv(layer, separate)
    with pytest.raises(NVFP4Error, match="different weight_global_scale.*re-quantize with `qerl quantize`"):
        layer.quant_method.process_weights_after_loading(layer)

    # negative group scales
    layer = make_qkv(cpu_config, nvfp4_config(ct=True), bias=False)
    neg = [nvfp4.NVFP4Weight(r.packed, (-r.scale.float()).to(torch.float8_e4m3fn), r.global_scale) for r in ref]
    load_ct_qkv(layer, neg)
    with pytest.raises(NVFP4Error, match="negative values"):
        layer.quant_method.process_weights_after_loading(layer)

    # a part whose weight_packed never arrived
    layer = make_qkv(cpu_config, nvfp4_config(ct=True), bias=False)
    load_ct_qkv(layer, ref)
    layer.qerl_nvfp4.loaded_parts.discard("v")
    with pytest.raises(NVFP4Error, match=r"no weight_packed for \['model.layers.0.self_attn.v_proj'\]"):
        layer.quant_method.process_weights_after_loading(layer)
