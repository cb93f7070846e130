"""``vllm_ext.bench.shapes``: the random adapter is one that PEFT and vLLM's LoRA loader accept."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from helpers import make_tiny_qwen2  # noqa: E402

from vllm_ext.bench import shapes  # noqa: E402


def test_adapter_loads_into_peft_with_matching_shapes(tmp_path):
    """The dummy adapter is a real PEFT adapter: PEFT loads it into the HF model (shape-checked), B != 0."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    src = make_tiny_qwen2(tmp_path / "tiny", tokenizer=False)
    adapter = shapes.write_adapter(src, 8, tmp_path / "adapter")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(src), adapter)
    loaded = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(loaded) == 2 * 7 * 2  # A and B for 7 projections x 2 layers
    assert all(float(p.abs().max()) > 0 for n, p in loaded.items() if "lora_B" in n)
    assert model.peft_config["default"].r == 8 and sorted(model.peft_config["default"].target_modules) == sorted(shapes.LORA_TARGETS)

    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_local_dir(str(adapter), max_position_embeddings=256)
    assert helper.r == 8 and helper.lora_alpha == 16
    assert shapes.write_adapter(src, 8, tmp_path / "adapter") == adapter  # reused, not rewritten
