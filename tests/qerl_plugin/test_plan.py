"""qerl_plugin.plan: what each tensor becomes (ignore lists, fused groups, --force), the --dry-run
report, and every input the plan refuses before reading tensor data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qerl_plugin.cli import main
from qerl_plugin.plan import plan_quantization
from qerl_plugin.source import QuantizeError
from helpers import make_tiny_qwen2, read_safetensors_dir


def test_dry_run_writes_nothing_and_reports_sizes(tiny_qwen2_dir, tmp_path, capsys):
    dst = tmp_path / "never"
    assert main(["quantize", str(tiny_qwen2_dir), str(dst), "--dry-run"]) == 0
    assert not dst.exists() and list(tmp_path.iterdir()) == []
    text = capsys.readouterr().out
    assert "quantize  model.layers.0.self_attn.q_proj.weight" in text
    assert "keep      lm_head.weight" in text and "keep      model.embed_tokens.weight" in text
    plan = plan_quantization(tiny_qwen2_dir)
    assert plan.src_bytes == (tiny_qwen2_dir / "model.safetensors").stat().st_size - _header_bytes(tiny_qwen2_dir / "model.safetensors")
    assert f"14 of 15 Linear weights quantized" in text and "->" in text and "dry run: nothing written" in text


def _header_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_ignore_keeps_modules_and_whole_fused_groups(tiny_qwen2_dir, tmp_path, capsys):
    dst = tmp_path / "ign"
    assert main(["quantize", str(tiny_qwen2_dir), str(dst), "--quiet", "--ignore", "model.layers.0.self_attn.q_proj", "--ignore", r"re:.*\.1\.mlp\.down_proj$"]) == 0
    assert "also keeping model.layers.0.self_attn.k_proj" in capsys.readouterr().err
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    expected = ["lm_head"] + [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"] + ["model.layers.1.mlp.down_proj"]
    assert qc["ignore"][0] == "lm_head" and sorted(qc["ignore"]) == sorted(expected)
    src = load_file(str(tiny_qwen2_dir / "model.safetensors"))
    out = read_safetensors_dir(dst)
    for m in expected[1:]:
        assert torch.equal(out[f"{m}.weight"], src[f"{m}.weight"]) and f"{m}.weight_packed" not in out
    assert "model.layers.1.self_attn.q_proj.weight_packed" in out
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer

    mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert should_ignore_layer("model.layers.0.self_attn.qkv_proj", qc["ignore"], mapping)
    assert not should_ignore_layer("model.layers.1.self_attn.qkv_proj", qc["ignore"], mapping)
    assert should_ignore_layer("model.layers.1.mlp.down_proj", qc["ignore"], mapping)


def test_ignore_entry_that_matches_nothing_is_refused(tiny_qwen2_dir):
    with pytest.raises(QuantizeError, match=r"--ignore 'model.layers.0.q_proj' matches no module.*model.layers.0.self_attn.q_proj"):
        plan_quantization(tiny_qwen2_dir, ignore=["model.layers.0.q_proj"])
    with pytest.raises(QuantizeError, match="invalid regular expression"):
        plan_quantization(tiny_qwen2_dir, ignore=["re:(("])


# ---------------------------------------------------------------------------------------------------------
# bad input: each error names the file or tensor and the fix, and nothing is written


def test_input_dim_not_divisible_by_16(tmp_path, run_qerl, assert_refused):
    src = make_tiny_qwen2(tmp_path / "src", intermediate_size=120, tokenizer=False)
    assert_refused(src, tmp_path, r"model\.layers\.0\.mlp\.down_proj\.weight has input dimension 120.*--ignore model\.layers\.0\.mlp\.down_proj")
    dst = tmp_path / "ok"
    assert run_qerl(src, dst, "--ignore", r"re:.*mlp\.down_proj$") == 0
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["ignore"] == [
        "lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"
    ]


def test_already_quantized_source(quantized, tmp_path, copy_model, assert_refused):
    assert_refused(copy_model(quantized, tmp_path), tmp_path, r"already quantized \(quantization_config with quant_method 'compressed-tensors'\).*original BF16")
    src = tmp_path / "src"
    cfg = json.loads((src / "config.json").read_text())
    del cfg["quantization_config"]
    (src / "config.json").write_text(json.dumps(cfg))
    assert_refused(src, tmp_path, r"tensor model\.layers\.0\.\S+\.weight_\w+ belongs to a quantized checkpoint")


def test_unsupported_architecture(tiny_qwen2_dir, tmp_path, run_qerl, copy_model, assert_refused):
    src = copy_model(tiny_qwen2_dir, tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_experts=4)
    (src / "config.json").write_text(json.dumps(cfg))
    assert_refused(src, tmp_path, r"architecture Qwen2MoeForCausalLM \(model_type 'qwen2_moe'\) is not supported.*Mixture-of-experts.*--force")
    dst = tmp_path / "forced"
    assert run_qerl(src, dst, "--force") == 0
    out = read_safetensors_dir(dst)
    assert "model.layers.0.mlp.down_proj.weight_packed" in out and "lm_head.weight" in out


def test_unknown_module_in_a_supported_architecture(tiny_qwen2_dir, tmp_path, run_qerl, copy_model, edit_tensor, assert_refused):
    src = copy_model(tiny_qwen2_dir, tmp_path)
    edit_tensor(src / "model.safetensors", "model.norm.weight", lambda t: t)  # rewrite in place
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.1.mlp.router.weight"] = torch.zeros(4, 64, dtype=torch.bfloat16)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    assert_refused(src, tmp_path, r"tensor model\.layers\.1\.mlp\.router\.weight \[4, 64\] is not one of the Linear weights.*--force")
    dst = tmp_path / "forced"
    assert run_qerl(src, dst, "--force") == 0
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head", "model.layers.1.mlp.router"]
