"""``vllm_ext.bench.lora_configs``: the Triton configs it writes are the ones vLLM's LoRA kernels read."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from vllm_ext.bench import shapes  # noqa: E402
from vllm_ext.bench.lora_configs import write_lora_kernel_configs  # noqa: E402


def test_lora_kernel_configs_are_what_vllm_reads(tmp_path, monkeypatch):
    from vllm.lora.ops.triton_ops import utils as lora_utils

    dims = shapes.model_dims(shapes.write_shape("7B", tmp_path))
    write_lora_kernel_configs(tmp_path / "cfg", "NVIDIA H100 80GB HBM3", dims, 32, [1, 8, 64], 1)
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(tmp_path / "cfg"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "NVIDIA H100 80GB HBM3")
    lora_utils.load_lora_op_config.cache_clear()
    if hasattr(lora_utils.get_lora_op_configs, "cache_clear"):
        lora_utils.get_lora_op_configs.cache_clear()
    try:
        shrink = lora_utils.get_lora_op_configs("shrink", max_loras=2, batch=1, hidden_size=3584, rank=32, num_slices=3)
        assert (shrink["block_n"], shrink["block_k"], shrink["split_k"]) == (32, 128, 7)
        assert 3584 % (shrink["block_k"] * shrink["split_k"]) == 0  # EVEN_K: no masked loads
        expand = lora_utils.get_lora_op_configs("expand", max_loras=2, batch=8, hidden_size=18944, rank=32,
                                                num_slices=2, add_inputs=True)
        assert (expand["block_k"], expand["block_n"]) == (32, 128)
        prefill = lora_utils.get_lora_op_configs("shrink", max_loras=2, batch=16384, hidden_size=3584, rank=32,
                                                 num_slices=1)
        assert prefill["split_k"] == 8  # large m keeps vLLM's defaults
    finally:
        lora_utils.load_lora_op_config.cache_clear()
        if hasattr(lora_utils.get_lora_op_configs, "cache_clear"):
            lora_utils.get_lora_op_configs.cache_clear()
