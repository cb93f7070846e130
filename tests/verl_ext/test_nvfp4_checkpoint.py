"""verl_ext.nvfp4_checkpoint: loading an NVFP4A16 checkpoint gives the model replace_linears_with_nvfp4 gives,
also into a meta model; errors for a directory that is not such a checkpoint or does not match the model."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from helpers import tiny_qwen2_model as tiny_qwen2
from qerl_plugin import format as fmt
from qerl_plugin import nvfp4
from qerl_plugin.nvfp4 import NVFP4Error
from verl_ext.nvfp4_checkpoint import load_nvfp4_checkpoint_into
from verl_ext.nvfp4_replace import replace_linears_with_nvfp4


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
        group = next((g for g in fmt.FUSED_GROUPS if leaf in g), (leaf,))
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
    config["quantization_config"] = fmt.quantization_config_dict()
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
