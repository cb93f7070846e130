"""``qerl quantize`` end to end on tiny random Qwen2 checkpoints, checked against compressed-tensors,
vLLM's config parser and transformers; plus the bad tensor data it must refuse clearly."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from qerl_plugin import format as fmt
from qerl_plugin import nvfp4
from qerl_plugin import quantize
from qerl_plugin.quantize import QuantizeError, quantize_checkpoint
from helpers import TINY_QWEN2, file_hashes, make_tiny_model, make_tiny_qwen2, read_safetensors_dir

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))


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


def test_public_names_import_from_qerl_plugin_quantize():
    """Callers (scripts/gpu, the vLLM and verl tests) import everything from qerl_plugin.quantize."""
    from qerl_plugin import plan, shards, source

    for name in quantize.__all__:
        obj = getattr(quantize, name)
        homes = [m for m in (source, plan, shards) if getattr(m, name, None) is obj]
        assert homes or obj.__module__ == "qerl_plugin.quantize", name


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


def test_fused_parts_share_one_global_scale(tiny_qwen2_dir, tmp_path, run_qerl, copy_model, edit_tensor):
    src = copy_model(tiny_qwen2_dir, tmp_path)
    # make k_proj and up_proj hold their group's largest |w| so that sharing changes q/v and gate
    edit_tensor(src / "model.safetensors", "model.layers.0.self_attn.k_proj.weight", lambda t: t * 3)
    edit_tensor(src / "model.safetensors", "model.layers.0.mlp.up_proj.weight", lambda t: t * 5)
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
    assert fmt.nvfp4a16_problem(qc) is None and fmt.is_nvfp4a16_config(fmt.parse_quantization_config(qc))


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
def test_other_supported_architectures(tmp_path, arch, run_qerl):
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


def test_tied_embeddings_and_fp16(tmp_path, run_qerl):
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


def test_sharded_source_gives_the_same_checkpoint(tiny_qwen2_sharded_dir, quantized, tmp_path, run_qerl):
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


# ---------------------------------------------------------------------------------------------------------
# DST


def test_overwrite(tiny_qwen2_dir, tmp_path, capsys, run_qerl):
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


# ---------------------------------------------------------------------------------------------------------
# bad tensor data: refused with the tensor, the file and the fix; nothing is written


@pytest.mark.parametrize(
    "tensor,value",
    [("model.layers.1.mlp.down_proj.weight", float("nan")), ("model.layers.0.self_attn.k_proj.weight", float("inf"))],
)
def test_nan_or_inf_in_a_weight(tiny_qwen2_dir, tmp_path, tensor, value, copy_model, edit_tensor, assert_refused):
    src = copy_model(tiny_qwen2_dir, tmp_path)

    def poison(t):
        t[3, 5] = value
        return t

    edit_tensor(src / "model.safetensors", tensor, poison)
    assert_refused(src, tmp_path, rf"{tensor} in {re.escape(str(src / 'model.safetensors'))}: contains NaN/Inf \(first at index \(3, 5\)\).*re-export")


@pytest.mark.parametrize("tensor", ["model.layers.1.mlp.up_proj.weight", "model.norm.weight"])
def test_failure_with_overwrite_keeps_the_old_dst(tiny_qwen2_dir, tmp_path, copy_model, edit_tensor, tensor):
    src = copy_model(tiny_qwen2_dir, tmp_path)
    edit_tensor(src / "model.safetensors", tensor, lambda t: t.fill_(float("nan")))
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "precious.txt").write_text("x")
    with pytest.raises(QuantizeError, match="NaN"):
        quantize_checkpoint(src, dst, overwrite=True, progress=False)
    assert [p.name for p in dst.iterdir()] == ["precious.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]


# the tensors written as they are: a NaN there would reach vLLM untouched
@pytest.mark.parametrize(
    "tensor,value,index,kept_as,ignore",
    [
        ("model.norm.weight", float("nan"), (5,), "norm", ()),
        ("model.layers.0.post_attention_layernorm.weight", float("inf"), (5,), "norm", ()),
        ("model.embed_tokens.weight", float("inf"), (3, 5), "embedding", ()),
        ("lm_head.weight", float("-inf"), (3, 5), "lm_head stays in high precision", ()),
        ("model.layers.0.self_attn.q_proj.bias", float("nan"), (5,), "bias", ()),
        ("model.layers.1.mlp.down_proj.weight", float("nan"), (3, 5), "ignored", ["model.layers.1.mlp.down_proj"]),
    ],
    ids=["norm", "layernorm", "embedding", "lm_head", "bias", "ignored"],
)
def test_nan_or_inf_in_a_kept_tensor(tiny_qwen2_dir, tmp_path, tensor, value, index, kept_as, ignore, copy_model, edit_tensor, assert_refused):
    src = copy_model(tiny_qwen2_dir, tmp_path)

    def poison(t):
        t[index] = value
        return t

    edit_tensor(src / "model.safetensors", tensor, poison)
    assert_refused(
        src,
        tmp_path,
        rf"{re.escape(tensor)} in {re.escape(str(src / 'model.safetensors'))}: contains NaN/Inf "
        rf"\(first at index {re.escape(str(index))}\) \(kept unquantized: {kept_as}\); .*re-export it from a healthy state",
        ignore=ignore,
    )


def test_nan_found_after_some_files_were_written_leaves_nothing(tiny_qwen2_sharded_dir, tmp_path, copy_model, edit_tensor, assert_refused, monkeypatch):
    import safetensors.torch

    src = copy_model(tiny_qwen2_sharded_dir, tmp_path)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    edit_tensor(src / index["model.norm.weight"], "model.norm.weight", lambda t: t.fill_(float("nan")))
    written = []
    save_file = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", lambda tensors, path, **kw: (written.append(path), save_file(tensors, path, **kw)))
    assert_refused(src, tmp_path, r"model\.norm\.weight in .*: contains NaN/Inf.*kept unquantized: norm", max_shard_size="3kB")
    assert len(written) > 1, "the NaN should be found after some output files were written"
