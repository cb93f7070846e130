"""qerl_plugin.source: SRC as a local directory or a Hub id, and every unreadable checkpoint refused
with the file and the fix (through ``quantize_checkpoint``, which then writes nothing)."""

from __future__ import annotations

import json
import re

import pytest

from qerl_plugin.source import QuantizeError, resolve_source


def test_hub_ids_resolve_through_snapshot_download(tiny_qwen2_dir, monkeypatch, tmp_path):
    import huggingface_hub

    calls = []

    def fake_download(repo_id, **kw):
        calls.append(repo_id)
        if repo_id == "acme/tiny":
            return str(tiny_qwen2_dir)
        raise huggingface_hub.errors.RepositoryNotFoundError("404 Client Error: Repository Not Found")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    monkeypatch.chdir(tmp_path)
    assert resolve_source("acme/tiny") == tiny_qwen2_dir.resolve()
    with pytest.raises(QuantizeError, match="'acme/missing' is not a local directory and could not be downloaded"):
        resolve_source("acme/missing")
    with pytest.raises(QuantizeError, match="does not exist"):
        resolve_source("no_such_dir")
    assert calls == ["acme/tiny", "acme/missing"]


# ---------------------------------------------------------------------------------------------------------
# bad input: each error names the file and the fix, and nothing is written


def test_missing_shard(tiny_qwen2_sharded_dir, tmp_path, copy_model, assert_refused):
    src = copy_model(tiny_qwen2_sharded_dir, tmp_path)
    victim = sorted(src.glob("model-*.safetensors"))[2]
    victim.unlink()
    assert_refused(src, tmp_path, rf"{re.escape(str(victim))}: missing; model\.safetensors\.index\.json lists it.*download the complete checkpoint")


def test_truncated_file(tiny_qwen2_sharded_dir, tmp_path, copy_model, assert_refused):
    src = copy_model(tiny_qwen2_sharded_dir, tmp_path)
    victim = sorted(src.glob("model-*.safetensors"))[1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 100])
    assert_refused(src, tmp_path, rf"{re.escape(str(victim))}: not a readable safetensors file .*truncated or corrupt")


def test_bad_header(tiny_qwen2_dir, tmp_path, copy_model, assert_refused):
    src = copy_model(tiny_qwen2_dir, tmp_path)
    victim = src / "model.safetensors"
    data = bytearray(victim.read_bytes())
    data[8:20] = b"not json!!!!"
    victim.write_bytes(bytes(data))
    assert_refused(src, tmp_path, rf"{re.escape(str(victim))}: not a readable safetensors file")


def test_index_naming_a_tensor_the_file_lacks(tiny_qwen2_sharded_dir, tmp_path, copy_model, assert_refused):
    src = copy_model(tiny_qwen2_sharded_dir, tmp_path)
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.layers.0.extra.weight"] = idx["weight_map"]["model.norm.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    assert_refused(src, tmp_path, r"has no tensor model\.layers\.0\.extra\.weight although model\.safetensors\.index\.json says so")


def test_missing_config(tiny_qwen2_dir, tmp_path, copy_model, assert_refused):
    src = copy_model(tiny_qwen2_dir, tmp_path)
    (src / "config.json").unlink()
    assert_refused(src, tmp_path, r"no config\.json; SRC must be a Hugging Face model directory")
    (src / "config.json").write_text("{broken")
    assert_refused(src, tmp_path, r"config\.json: cannot read it as JSON")


def test_no_safetensors(tiny_qwen2_dir, tmp_path, copy_model, assert_refused):
    src = copy_model(tiny_qwen2_dir, tmp_path)
    (src / "model.safetensors").rename(src / "pytorch_model.bin")
    assert_refused(src, tmp_path, r"only PyTorch weights \(pytorch_model\.bin\).*save_pretrained")
