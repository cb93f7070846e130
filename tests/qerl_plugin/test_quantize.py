"""``qerl quantize`` end to end on tiny random Qwen2 checkpoints, checked against compressed-tensors,
vLLM's config parser and transformers; plus every bad input it must refuse clearly."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qerl_plugin import format as fmt
from qerl_plugin import nvfp4
from qerl_plugin.cli import main
from qerl_plugin.quantize import QuantizeError, parse_size, plan_quantization, quantize_checkpoint, resolve_source
from helpers import TINY_QWEN2, file_hashes, make_tiny_model, make_tiny_qwen2, read_safetensors_dir

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))


def run_qerl(*args: str) -> int:
    return main(["quantize", *map(str, args), "--quiet"])


@pytest.fixture(scope="module")
def quantized(tiny_qwen2_dir, tmp_path_factory):
    before = file_hashes(tiny_qwen2_dir)
    dst = tmp_path_factory.mktemp("quantized") / "nvfp4"
    assert run_qerl(tiny_qwen2_dir, dst) == 0
    assert file_hashes(tiny_qwen2_dir) == before, "SRC was modified"
    return dst


def ct_reference(parts: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """compressed-tensors' own NVFP4A16 quantization of the parts of one fused layer (shared global scale)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = fmt.nvfp4a16_scheme()
    amax = torch.stack([p.abs().amax() for p in parts]).amax()
    gs = generate_gparam(-amax.reshape(1), amax.reshape(1))
    out = []
    # compressed-tensors torch.compile-s its elementwise FP4 rounding; compiling costs ~20 s on 2 cores and
    # gives the same values as running it eagerly, so run it eagerly
    with torch._dynamo.config.patch(disable=True):
        for w in parts:
            groups = w.reshape(w.shape[0], -1, 16)
            scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=gs)
            out.append(NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs}, scheme))
    return out


# ---------------------------------------------------------------------------------------------------------
# the output checkpoint


def test_layout_and_files(quantized, tiny_qwen2_dir):
    names = sorted(p.name for p in quantized.iterdir())
    assert names == sorted(["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"])
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (quantized / name).read_bytes() == (tiny_qwen2_dir / name).read_bytes()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(quantized)
    assert tok.decode(tok("qerl 4 bit")["input_ids"]) == "qerl 4 bit"
    assert not list(quantized.parent.glob(".*qerl*")), "temporary directory left behind"


def test_quantized_weights_match_compressed_tensors_bit_for_bit(quantized, tiny_qwen2_dir):
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    src = load_file(str(tiny_qwen2_dir / "model.safetensors"))
    out = read_safetensors_dir(quantized)
    scheme = fmt.QuantizationConfig.model_validate(
        json.loads((quantized / "config.json").read_text())["quantization_config"]
    ).config_groups["group_0"]
    groups = [g for g in GROUPS] + [("self_attn.o_proj",), ("mlp.down_proj",)]
    checked = 0
    for layer in range(2):
        for group in groups:
            names = [f"model.layers.{layer}.{m}" for m in group]
            refs = ct_reference([src[f"{n}.weight"] for n in names])
            for name, ref in zip(names, refs):
                packed, scale, gs = (out[f"{name}.{p}"] for p in fmt.PARAM_NAMES)
                assert f"{name}.weight" not in out
                assert packed.dtype == torch.uint8 and scale.dtype == torch.float8_e4m3fn and gs.dtype == torch.float32
                assert torch.equal(packed, ref["weight_packed"]), name
                assert torch.equal(scale.view(torch.uint8), ref["weight_scale"].view(torch.uint8)), name
                assert torch.equal(gs, ref["weight_global_scale"]), name
                # compressed-tensors' decompression of what we wrote == our dequantize
                back = NVFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale, "weight_global_scale": gs}, scheme)
                ours = nvfp4.dequantize(packed, scale, gs, dtype=back["weight"].dtype)
                assert torch.equal(back["weight"], ours), name
                checked += 1
    assert checked == 14


def test_fused_parts_share_one_global_scale(tiny_qwen2_dir, tmp_path):
    src = _copy(tiny_qwen2_dir, tmp_path)
    # make k_proj and up_proj hold their group's largest |w| so that sharing changes q/v and gate
    _edit_tensor(src / "model.safetensors", "model.layers.0.self_attn.k_proj.weight", lambda t: t * 3)
    _edit_tensor(src / "model.safetensors", "model.layers.0.mlp.up_proj.weight", lambda t: t * 5)
    dst = tmp_path / "dst"
    assert run_qerl(src, dst) == 0
    w = load_file(str(src / "model.safetensors"))
    out = read_safetensors_dir(dst)
    for layer in range(2):
        for group in GROUPS:
            names = [f"model.layers.{layer}.{m}" for m in group]
            shared = nvfp4.global_scale(*(w[f"{n}.weight"] for n in names))
            for n in names:
                assert torch.equal(out[f"{n}.weight_global_scale"], shared), n
    for alone, big in (("self_attn.q_proj", "self_attn.k_proj"), ("mlp.gate_proj", "mlp.up_proj")):
        own = nvfp4.global_scale(w[f"model.layers.0.{alone}.weight"])
        assert not torch.equal(out[f"model.layers.0.{alone}.weight_global_scale"], own)
        assert torch.equal(out[f"model.layers.0.{alone}.weight_global_scale"], nvfp4.global_scale(w[f"model.layers.0.{big}.weight"]))


def test_non_linear_tensors_are_byte_identical(quantized, tiny_qwen2_dir):
    src = load_file(str(tiny_qwen2_dir / "model.safetensors"))
    out = read_safetensors_dir(quantized)
    kept = [k for k in src if not any(k.endswith(f"{m}.weight") for m in LINEARS)]
    assert {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.bias"} <= set(kept)
    for k in kept:
        assert out[k].dtype == src[k].dtype == torch.bfloat16, k
        assert torch.equal(out[k].view(torch.uint8), src[k].view(torch.uint8)), k
    n_quantized = sum(1 for k in src if k not in kept)
    assert len(out) == len(kept) + 3 * n_quantized
    with safe_open(str(quantized / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_config_json(quantized, tiny_qwen2_dir):
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    src_cfg = json.loads((tiny_qwen2_dir / "config.json").read_text())
    cfg = json.loads((quantized / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    assert cfg == src_cfg
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["format"] == "nvfp4-pack-quantized" and qc["quantization_status"] == "compressed"
    assert qc["ignore"] == ["lm_head"]
    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.quantization_status == QuantizationStatus.COMPRESSED
    (group,) = parsed.config_groups.values()
    assert group.targets == ["Linear"] and group.input_activations is None and group.format == "nvfp4-pack-quantized"
    assert group.weights.num_bits == 4 and group.weights.group_size == 16 and group.weights.strategy == "tensor_group"
    assert group.weights.scale_dtype == torch.float8_e4m3fn
    assert fmt.is_nvfp4a16_config(fmt.parse_quantization_config(qc))


def test_vllm_parses_the_config_and_picks_the_marlin_nvfp4a16_scheme(quantized):
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    qc = json.loads((quantized / "config.json").read_text())["quantization_config"]
    assert get_quantization_config(qc["quant_method"]) is CompressedTensorsConfig
    cfg = CompressedTensorsConfig.from_config(json.loads(json.dumps(qc)))
    cfg.packed_modules_mapping = dict(Qwen2ForCausalLM.packed_modules_mapping)  # as vLLM's model loader sets it
    linear = torch.nn.Linear(64, 64)
    for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"):
        d = cfg.get_scheme_dict(linear, name)
        assert d is not None and d["format"] == "nvfp4-pack-quantized", name
        assert cfg._is_nvfp4_format(d["weights"]) and d["input_activations"] is None
    assert cfg.get_scheme_dict(linear, "lm_head") is None  # ignored: stays unquantized
    # NVFP4 weights without activation quantization -> CompressedTensorsW4A4Fp4(use_a16=True), whose kernel
    # vLLM forces to Marlin; building it needs a CUDA GPU with sm75+, so on CPU the Marlin kernel is refused.
    if torch.cuda.is_available():
        scheme = cfg.get_scheme(linear, "model.layers.0.self_attn.qkv_proj")
        assert type(scheme).__name__ == "CompressedTensorsW4A4Fp4" and scheme.use_a16
    else:
        with pytest.raises(ValueError, match="MarlinNvFp4LinearKernel"):
            cfg.get_scheme(linear, "model.layers.0.self_attn.qkv_proj")


def test_transformers_loads_the_output_and_matches_our_dequantized_weights(quantized, tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    ct_model = AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.bfloat16)
    ref = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.bfloat16)
    out = read_safetensors_dir(quantized)
    with torch.no_grad():
        for layer in range(2):
            for m in LINEARS:
                name = f"model.layers.{layer}.{m}"
                w = nvfp4.dequantize(*(out[f"{name}.{p}"] for p in fmt.PARAM_NAMES), dtype=torch.bfloat16)
                ref.get_submodule(name).weight.copy_(w)
        ids = torch.tensor([[1, 5, 9, 17, 33, 65, 100]])
        assert torch.equal(ct_model(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM"])
def test_other_supported_architectures(tmp_path, arch):
    import transformers

    cfg_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    kw = {k: v for k, v in TINY_QWEN2.items()}
    cfg = cfg_cls(**kw, head_dim=16)
    src = make_tiny_model(tmp_path / "src", cfg, getattr(transformers, arch), tokenizer=False)
    dst = tmp_path / "dst"
    assert run_qerl(src, dst) == 0
    out = read_safetensors_dir(dst)
    srct = load_file(str(src / "model.safetensors"))
    for layer in range(2):
        for m in LINEARS:
            assert f"model.layers.{layer}.{m}.weight_packed" in out, (arch, m)
    kept = [k for k in out if not k.endswith(fmt.PARAM_NAMES)]
    assert kept and all(torch.equal(out[k].view(torch.uint8), srct[k].view(torch.uint8)) for k in kept)
    if arch == "Qwen3ForCausalLM":  # q_norm / k_norm are RMSNorm weights: kept
        assert "model.layers.0.self_attn.q_norm.weight" in kept


def test_tied_embeddings_and_fp16(tmp_path):
    src = make_tiny_qwen2(tmp_path / "src", dtype=torch.float16, tie_word_embeddings=True, tokenizer=False)
    srct = load_file(str(src / "model.safetensors"))
    assert "lm_head.weight" not in srct
    dst = tmp_path / "dst"
    assert run_qerl(src, dst) == 0
    out = read_safetensors_dir(dst)
    assert "lm_head.weight" not in out and out["model.embed_tokens.weight"].dtype == torch.float16
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["ignore"] == ["lm_head"]
    names = [f"model.layers.1.{m}" for m in GROUPS[0]]
    ref = nvfp4.quantize_fused([srct[f"{n}.weight"] for n in names], names)
    for n, q in zip(names, ref):
        assert torch.equal(out[f"{n}.weight_packed"], q.packed) and torch.equal(out[f"{n}.weight_global_scale"], q.global_scale)


# ---------------------------------------------------------------------------------------------------------
# sharding


def test_sharded_source_gives_the_same_checkpoint(tiny_qwen2_sharded_dir, quantized, tmp_path):
    index = json.loads((tiny_qwen2_sharded_dir / "model.safetensors.index.json").read_text())["weight_map"]
    qkv_files = {index[f"model.layers.0.{m}.weight"] for m in GROUPS[0]}
    assert len(qkv_files) > 1, "the fixture should split q/k/v over several shards"
    before = file_hashes(tiny_qwen2_sharded_dir)
    dst = tmp_path / "from_sharded"
    assert run_qerl(tiny_qwen2_sharded_dir, dst) == 0
    assert file_hashes(tiny_qwen2_sharded_dir) == before
    a, b = read_safetensors_dir(dst), read_safetensors_dir(quantized)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    assert not (dst / "model.safetensors.index.json").exists()  # output fits one file at the default 5GB


def test_sharded_output_has_a_consistent_index(tiny_qwen2_dir, quantized, tmp_path):
    dst = tmp_path / "sharded_out"
    assert run_qerl(tiny_qwen2_dir, dst, "--max-shard-size", "20kB") == 0
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in dst.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == files
    total = 0
    for f in files:
        with safe_open(str(dst / f), "pt") as h:
            keys = set(h.keys())
            assert keys == {k for k, v in index["weight_map"].items() if v == f}
            total += sum(h.get_tensor(k).numel() * h.get_tensor(k).element_size() for k in keys)
        for k in keys:  # a module's packed/scale/global scale stay together
            if k.endswith("weight_packed"):
                assert {k.replace("packed", "scale"), k.replace("packed", "global_scale")} <= keys
    assert index["metadata"]["total_size"] == total
    a, b = read_safetensors_dir(dst), read_safetensors_dir(quantized)
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


# ---------------------------------------------------------------------------------------------------------
# options


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


def test_overwrite(tiny_qwen2_dir, tmp_path, capsys):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("keep me")
    assert run_qerl(tiny_qwen2_dir, dst) == 1
    assert "is not empty; pass --overwrite" in capsys.readouterr().err
    assert (dst / "old.txt").read_text() == "keep me"
    assert run_qerl(tiny_qwen2_dir, dst, "--overwrite") == 0
    assert not (dst / "old.txt").exists() and (dst / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_qerl(tiny_qwen2_dir, empty) == 0  # an empty DST is fine


def test_leftovers_of_a_killed_run_are_pointed_out(tiny_qwen2_dir, tmp_path):
    (tmp_path / ".out.qerl-partial-deadbeef").mkdir()
    logs: list[str] = []
    quantize_checkpoint(tiny_qwen2_dir, tmp_path / "out", progress=False, log=logs.append)
    assert any(".out.qerl-partial-deadbeef is left over from an interrupted run" in m for m in logs)
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_dst_overlapping_src_is_refused(tiny_qwen2_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_qwen2_dir, src)
    before = file_hashes(src)
    for dst in (src, src / "sub", tmp_path):
        with pytest.raises(QuantizeError, match="overlaps SRC"):
            quantize_checkpoint(src, dst, overwrite=True, progress=False)
    assert file_hashes(src) == before


def test_max_shard_size_parsing():
    assert parse_size("5GB") == 5_000_000_000 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("20kB") == 20_000 and parse_size("1000") == 1000 and parse_size(7) == 7
    for bad in ("five", "0", "-3MB"):
        with pytest.raises(QuantizeError, match="size"):
            parse_size(bad)


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
# bad input: each error names the file or tensor and the fix, and nothing is written


def _copy(src: Path, tmp_path: Path, name: str = "src") -> Path:
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _edit_tensor(path: Path, name: str, fn) -> None:
    tensors = load_file(str(path))
    tensors[name] = fn(tensors[name].clone())
    save_file(tensors, str(path), metadata={"format": "pt"})


def _fails(src: Path, tmp_path: Path, match: str) -> None:
    dst = tmp_path / "dst"
    before = file_hashes(src)
    with pytest.raises(QuantizeError, match=match):
        quantize_checkpoint(src, dst, progress=False)
    assert not dst.exists(), "DST written despite the error"
    assert not [p for p in tmp_path.iterdir() if "qerl" in p.name], "temporary directory left behind"
    assert file_hashes(src) == before


def test_input_dim_not_divisible_by_16(tmp_path):
    src = make_tiny_qwen2(tmp_path / "src", intermediate_size=120, tokenizer=False)
    _fails(src, tmp_path, r"model\.layers\.0\.mlp\.down_proj\.weight has input dimension 120.*--ignore model\.layers\.0\.mlp\.down_proj")
    dst = tmp_path / "ok"
    assert run_qerl(src, dst, "--ignore", r"re:.*mlp\.down_proj$") == 0
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["ignore"] == [
        "lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"
    ]


@pytest.mark.parametrize(
    "tensor,value",
    [("model.layers.1.mlp.down_proj.weight", float("nan")), ("model.layers.0.self_attn.k_proj.weight", float("inf"))],
)
def test_nan_or_inf_in_a_weight(tiny_qwen2_dir, tmp_path, tensor, value):
    src = _copy(tiny_qwen2_dir, tmp_path)

    def poison(t):
        t[3, 5] = value
        return t

    _edit_tensor(src / "model.safetensors", tensor, poison)
    _fails(src, tmp_path, rf"{tensor} in {re.escape(str(src / 'model.safetensors'))}: contains NaN/Inf \(first at index \(3, 5\)\).*re-export")


def test_failure_with_overwrite_keeps_the_old_dst(tiny_qwen2_dir, tmp_path):
    src = _copy(tiny_qwen2_dir, tmp_path)
    _edit_tensor(src / "model.safetensors", "model.layers.1.mlp.up_proj.weight", lambda t: t.fill_(float("nan")))
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "precious.txt").write_text("x")
    with pytest.raises(QuantizeError, match="NaN"):
        quantize_checkpoint(src, dst, overwrite=True, progress=False)
    assert [p.name for p in dst.iterdir()] == ["precious.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]


def test_missing_shard(tiny_qwen2_sharded_dir, tmp_path):
    src = _copy(tiny_qwen2_sharded_dir, tmp_path)
    victim = sorted(src.glob("model-*.safetensors"))[2]
    victim.unlink()
    _fails(src, tmp_path, rf"{re.escape(str(victim))}: missing; model\.safetensors\.index\.json lists it.*download the complete checkpoint")


def test_truncated_file(tiny_qwen2_sharded_dir, tmp_path):
    src = _copy(tiny_qwen2_sharded_dir, tmp_path)
    victim = sorted(src.glob("model-*.safetensors"))[1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 100])
    _fails(src, tmp_path, rf"{re.escape(str(victim))}: not a readable safetensors file .*truncated or corrupt")


def test_bad_header(tiny_qwen2_dir, tmp_path):
    src = _copy(tiny_qwen2_dir, tmp_path)
    victim = src / "model.safetensors"
    data = bytearray(victim.read_bytes())
    data[8:20] = b"not json!!!!"
    victim.write_bytes(bytes(data))
    _fails(src, tmp_path, rf"{re.escape(str(victim))}: not a readable safetensors file")


def test_index_naming_a_tensor_the_file_lacks(tiny_qwen2_sharded_dir, tmp_path):
    src = _copy(tiny_qwen2_sharded_dir, tmp_path)
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.layers.0.extra.weight"] = idx["weight_map"]["model.norm.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    _fails(src, tmp_path, r"has no tensor model\.layers\.0\.extra\.weight although model\.safetensors\.index\.json says so")


def test_missing_config(tiny_qwen2_dir, tmp_path):
    src = _copy(tiny_qwen2_dir, tmp_path)
    (src / "config.json").unlink()
    _fails(src, tmp_path, r"no config\.json; SRC must be a Hugging Face model directory")
    (src / "config.json").write_text("{broken")
    _fails(src, tmp_path, r"config\.json: cannot read it as JSON")


def test_no_safetensors(tiny_qwen2_dir, tmp_path):
    src = _copy(tiny_qwen2_dir, tmp_path)
    (src / "model.safetensors").rename(src / "pytorch_model.bin")
    _fails(src, tmp_path, r"only PyTorch weights \(pytorch_model\.bin\).*save_pretrained")


def test_already_quantized_source(quantized, tmp_path):
    _fails(_copy(quantized, tmp_path), tmp_path, r"already quantized \(quantization_config with quant_method 'compressed-tensors'\).*original BF16")
    src = tmp_path / "src"
    cfg = json.loads((src / "config.json").read_text())
    del cfg["quantization_config"]
    (src / "config.json").write_text(json.dumps(cfg))
    _fails(src, tmp_path, r"tensor model\.layers\.0\.\S+\.weight_\w+ belongs to a quantized checkpoint")


def test_unsupported_architecture(tiny_qwen2_dir, tmp_path):
    src = _copy(tiny_qwen2_dir, tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_experts=4)
    (src / "config.json").write_text(json.dumps(cfg))
    _fails(src, tmp_path, r"architecture Qwen2MoeForCausalLM \(model_type 'qwen2_moe'\) is not supported.*Mixture-of-experts.*--force")
    dst = tmp_path / "forced"
    assert run_qerl(src, dst, "--force") == 0
    out = read_safetensors_dir(dst)
    assert "model.layers.0.mlp.down_proj.weight_packed" in out and "lm_head.weight" in out


def test_unknown_module_in_a_supported_architecture(tiny_qwen2_dir, tmp_path):
    src = _copy(tiny_qwen2_dir, tmp_path)
    _edit_tensor(src / "model.safetensors", "model.norm.weight", lambda t: t)  # rewrite in place
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.1.mlp.router.weight"] = torch.zeros(4, 64, dtype=torch.bfloat16)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    _fails(src, tmp_path, r"tensor model\.layers\.1\.mlp\.router\.weight \[4, 64\] is not one of the Linear weights.*--force")
    dst = tmp_path / "forced"
    assert run_qerl(src, dst, "--force") == 0
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head", "model.layers.1.mlp.router"]


# ---------------------------------------------------------------------------------------------------------
# the command line


def _qerl_exe() -> str:
    exe = Path(sys.executable).parent / "qerl"
    return str(exe) if exe.exists() else shutil.which("qerl") or pytest.skip("the qerl console script is not installed")


def test_console_script_end_to_end(tiny_qwen2_dir, quantized, tmp_path):
    dst = tmp_path / "via_script"
    r = subprocess.run([_qerl_exe(), "quantize", str(tiny_qwen2_dir), str(dst)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and "14 Linear weights in NVFP4" in r.stdout
    a, b = read_safetensors_dir(dst), read_safetensors_dir(quantized)
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    bad = subprocess.run([_qerl_exe(), "quantize", str(tmp_path / "nowhere"), str(tmp_path / "x")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qerl quantize: error: SRC") and "Traceback" not in bad.stderr


def test_debug_shows_the_traceback(tmp_path, capsys):
    assert main(["quantize", str(tmp_path / "nowhere"), str(tmp_path / "x"), "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "QuantizeError" in err


def test_missing_dst_without_dry_run(tiny_qwen2_dir, capsys):
    assert main(["quantize", str(tiny_qwen2_dir)]) == 1
    assert "DST is missing" in capsys.readouterr().err
