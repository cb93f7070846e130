"""The vLLM 0.24.0 internals the ``nvfp4`` method builds on; fails loudly when upstream moves them.

No monkeypatching is involved: these are the functions/classes ``vllm_ext.quant`` and the
``vllm_ext.nvfp4_*`` modules call or subclass, with the parameters they pass.
"""

from __future__ import annotations

import inspect
import pkgutil

import pytest

pytest.importorskip("vllm")

# dotted target -> parameters our code passes by name (checked against the signature)
UPSTREAM = {
    "vllm.model_executor.layers.quantization:register_quantization_config": ["quantization"],
    "vllm.model_executor.layers.quantization:QUANTIZATION_METHODS": None,
    "vllm.model_executor.layers.quantization:_CUSTOMIZED_METHOD_TO_QUANT_CONFIG": None,
    "vllm.model_executor.layers.quantization.base_config:QuantizationConfig.override_quantization_method": [
        "hf_quant_cfg", "user_quant", "hf_config"],
    "vllm.model_executor.layers.quantization.base_config:QuantizationConfig.apply_vllm_mapper": ["hf_to_vllm_mapper"],
    "vllm.model_executor.layers.linear:register_weight_loader_v2_supported_method": ["cls"],
    "vllm.model_executor.layers.linear:LinearMethodBase.create_weights": [
        "layer", "input_size_per_partition", "output_partition_sizes", "input_size", "output_size", "params_dtype"],
    "vllm.model_executor.layers.linear:QKVParallelLinear.weight_loader_v2": ["param", "loaded_weight", "loaded_shard_id"],
    "vllm.model_executor.layers.linear:MergedColumnParallelLinear.weight_loader_v2": [
        "param", "loaded_weight", "loaded_shard_id"],
    "vllm.model_executor.layers.linear:QKVParallelLinear.weight_loader": ["param", "loaded_weight", "loaded_shard_id"],
    "vllm.model_executor.model_loader.reload.layerwise:initialize_online_processing": ["layer"],
    "vllm.model_executor.model_loader.reload:initialize_layerwise_reload": ["model"],
    "vllm.model_executor.model_loader.reload:finalize_layerwise_reload": None,
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors:CompressedTensorsConfig.from_config": [
        "config"],
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors:CompressedTensorsConfig.get_scheme_dict": [
        "layer", "layer_name"],
    "vllm.model_executor.layers.quantization.compressed_tensors.utils:should_ignore_layer": [
        "layer_name", "ignore", "fused_mapping"],
    "vllm.model_executor.layers.quantization.utils.marlin_utils_fp4:prepare_fp4_layer_for_marlin": ["layer"],
    "vllm.model_executor.layers.quantization.utils.marlin_utils_fp4:apply_fp4_marlin_linear": [
        "input", "weight", "weight_scale", "weight_global_scale", "workspace", "size_n", "size_k", "bias",
        "use_fp32_reduce"],
    "vllm.model_executor.layers.quantization.utils.marlin_utils:marlin_permute_bias": None,
    "vllm.model_executor.layers.quantization.utils.marlin_utils:marlin_pad_dim": ["x", "size", "padded"],
    "vllm.model_executor.layers.quantization.utils.marlin_utils:marlin_padded_nk": ["size_n", "size_k", "group_size"],
    "vllm.model_executor.parameter:ModelWeightParameter": None,
    "vllm.model_executor.parameter:GroupQuantScaleParameter": None,
    "vllm.model_executor.parameter:PerTensorScaleParameter": None,
}


@pytest.mark.parametrize("target", sorted(UPSTREAM))
def test_upstream_target_resolves_with_our_parameters(target):
    obj = pkgutil.resolve_name(target)
    params = UPSTREAM[target]
    if params:
        names = list(inspect.signature(obj).parameters)
        missing = [p for p in params if p not in names]
        assert not missing, f"{target} lost parameters {missing} (has {names}); update vllm_ext for this vLLM"


def test_prepare_fp4_layer_for_marlin_reads_what_we_set():
    """Our scratch module carries exactly the attributes vLLM's Marlin preparation reads."""
    from vllm.model_executor.layers.quantization.utils import marlin_utils_fp4

    src = inspect.getsource(marlin_utils_fp4.prepare_fp4_layer_for_marlin)
    for attr in ("weight_global_scale", "output_size_per_partition", "input_size_per_partition", "params_dtype",
                 "layer.weight", "layer.weight_scale", "layer.bias", "layer.workspace"):
        assert attr in src, attr


def test_online_processing_and_dummy_loader_contract():
    """The hooks vLLM's loaders use for online quantization, which BF16 sources rely on."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader import base_loader, dummy_loader

    assert QuantizeMethodBase.uses_meta_device is False  # class default; our method sets it per instance
    assert "uses_meta_device" in inspect.getsource(base_loader)
    assert "_process_online_quant_layer" in inspect.getsource(dummy_loader.DummyModelLoader)
