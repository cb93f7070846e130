"""``vllm_ext.quant``: the ``nvfp4`` config (from_config, override_quantization_method) and vLLM's own
ModelConfig choosing it for both checkpoint kinds."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.config import DeviceConfig, VllmConfig  # noqa: E402

from qerl_plugin import notices  # noqa: E402
from qerl_plugin.format import quantization_config_dict  # noqa: E402
from vllm_ext import quant  # noqa: E402
from vllm_ext.quant import NVFP4Config, NVFP4ConfigError  # noqa: E402

quant.register()


def test_from_config_sources_and_bad_configs():
    ct = NVFP4Config.from_config(quantization_config_dict(ignore=["lm_head"]))
    assert ct.source == "checkpoint" and ct.get_name() == "nvfp4" and ct.ct_config.ignore == ["lm_head"]
    assert NVFP4Config().source == "bf16"
    assert NVFP4Config.from_config({"quant_method": "nvfp4", "ignore": ["re:.*down_proj"]}).ignore == ["re:.*down_proj"]
    assert NVFP4Config.get_min_capability() == 75
    assert NVFP4Config().get_supported_act_dtypes() == [torch.bfloat16, torch.float16]

    w4a4 = quantization_config_dict()
    w4a4["config_groups"]["group_0"]["input_activations"] = dict(w4a4["config_groups"]["group_0"]["weights"])
    with pytest.raises(NVFP4ConfigError, match="input activations.*W4A4.*drop `--quantization nvfp4`"):
        NVFP4Config.from_config(w4a4)
    int4 = quantization_config_dict()
    int4["config_groups"]["group_0"]["weights"].update(type="int", strategy="group", group_size=128)
    with pytest.raises(NVFP4ConfigError, match="group_0.*NVFP4 is"):
        NVFP4Config.from_config(int4)
    with pytest.raises(NVFP4ConfigError, match="quant_method 'fp8'"):
        NVFP4Config.from_config({"quant_method": "fp8"})
    with pytest.raises(NVFP4ConfigError, match=r"unknown keys \['group_size'\]"):
        NVFP4Config.from_config({"quant_method": "nvfp4", "group_size": 32})


def test_override_quantization_method():
    ct = quantization_config_dict()
    assert NVFP4Config.override_quantization_method(ct, "nvfp4") == "nvfp4"
    assert NVFP4Config.override_quantization_method(ct, None) is None  # stock compressed-tensors path
    assert NVFP4Config.override_quantization_method(ct, "compressed-tensors") is None
    assert NVFP4Config.override_quantization_method({"quant_method": "nvfp4"}, "nvfp4") == "nvfp4"
    with pytest.raises(NVFP4ConfigError, match="cannot load this checkpoint.*'awq'"):
        NVFP4Config.override_quantization_method({"quant_method": "awq", "bits": 4}, "nvfp4")


def test_the_stock_path_says_once_how_to_choose_qerls_method(monkeypatch, caplog):
    """An NVFP4A16 checkpoint without --quantization keeps vLLM's stock path, with one log line naming the flag;
    other checkpoints (and an explicit --quantization compressed-tensors) load without it."""
    notices.forget("quant/")
    w4a4 = quantization_config_dict()
    w4a4["config_groups"]["group_0"]["input_activations"] = dict(w4a4["config_groups"]["group_0"]["weights"])
    with caplog.at_level("WARNING", logger="qerl.vllm.quant"):
        for cfg, user in ((w4a4, None), ({"quant_method": "awq", "bits": 4}, None),
                          (quantization_config_dict(), "compressed-tensors")):
            assert NVFP4Config.override_quantization_method(cfg, user) is None
        assert not caplog.records
        for _ in range(2):
            assert NVFP4Config.override_quantization_method(quantization_config_dict(), None) is None
    (record,) = caplog.records
    assert "runs on vLLM's stock compressed-tensors path; --quantization nvfp4 runs it on qerl's" in record.getMessage()


def test_model_config_picks_nvfp4_for_both_checkpoint_kinds(tmp_path, tiny_qwen2_dir, tiny_qwen2_nvfp4_dir):
    """vLLM's own ModelConfig: --quantization nvfp4 takes BF16 and CT NVFP4A16 checkpoints; CT alone stays stock."""
    from vllm.config import ModelConfig

    ct_dir = tiny_qwen2_nvfp4_dir
    assert ModelConfig(model=str(tiny_qwen2_dir), quantization="nvfp4").quantization == "nvfp4"
    assert ModelConfig(model=str(ct_dir), quantization="nvfp4").quantization == "nvfp4"
    assert ModelConfig(model=str(ct_dir)).quantization == "compressed-tensors"
    # BF16 checkpoint, some modules kept in BF16: a quantization_config naming nvfp4 (here via hf_overrides)
    overrides = {"quantization_config": {"quant_method": "nvfp4", "ignore": ["re:.*down_proj"]}}
    mc = ModelConfig(model=str(tiny_qwen2_dir), hf_overrides=overrides)
    assert mc.quantization == "nvfp4"
    vc = VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"))
    assert isinstance(vc.quant_config, NVFP4Config) and vc.quant_config.ignore == ["re:.*down_proj"]

    bad = tmp_path / "w4a4"
    shutil.copytree(ct_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    group = cfg["quantization_config"]["config_groups"]["group_0"]
    group["input_activations"] = dict(group["weights"])
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="cannot load this checkpoint.*W4A4"):
        ModelConfig(model=str(bad), quantization="nvfp4")
