"""The ``nvfp4`` quantization method on CPU, against the codec and through vLLM's real loading code.

Real vLLM throughout: its config dispatch (``ModelConfig._verify_quantization``), linear layers, weight
loaders, online-quantization/layerwise-reload machinery and model loader run on this CPU machine. Without
CUDA the method picks its emulation backend, whose kernel tensors are the compressed-tensors triple, so the
bytes vLLM holds can be compared with :func:`qerl_plugin.nvfp4.quantize_fused`. The Marlin repack is
covered by ``test_quant_gpu.py``. Only one thing is patched: the attention backend lookup of vLLM's
"unspecified" CPU platform (there is none), so that whole models can be built and loaded.
"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from helpers import make_tiny_qwen2, read_safetensors_dir  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config  # noqa: E402

from qerl_plugin import nvfp4  # noqa: E402
from qerl_plugin.format import quantization_config_dict  # noqa: E402
from qerl_plugin.nvfp4 import NVFP4Error  # noqa: E402
from vllm_ext import quant  # noqa: E402
from vllm_ext.quant import NVFP4Config, NVFP4ConfigError  # noqa: E402

quant.register()

QKV_MAP = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


# ---------------------------------------------------------------------------------------------------
# fixtures


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cpu_config() -> VllmConfig:
    """A current vLLM config for building layers, with vLLM's single-rank process groups (gloo) up."""
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(cfg):
        if not torch.distributed.is_initialized():
            init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                local_rank=0,
                backend="gloo",
            )
        if not model_parallel_is_initialized():
            initialize_model_parallel(1, 1)
    return cfg


def _bf16(shape, seed, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=g, dtype=torch.float64)).to(torch.bfloat16)


def _qconfig(ct: bool) -> NVFP4Config:
    qc = NVFP4Config.from_config(quantization_config_dict(ignore=["lm_head"])) if ct else NVFP4Config()
    qc.packed_modules_mapping = QKV_MAP
    return qc


def _qkv(cfg, qc, bias=True):
    from vllm.model_executor.layers.linear import QKVParallelLinear

    with set_current_vllm_config(cfg):
        # hidden 64, head 16, 4 q heads, 2 kv heads -> q 64, k 32, v 32 rows
        return QKVParallelLinear(64, 16, 4, 2, bias=bias, params_dtype=torch.bfloat16, quant_config=qc,
                                 prefix="model.layers.0.self_attn.qkv_proj")


def _load_qkv(layer, q, k, v, name="weight"):
    param = getattr(layer, name)
    for shard, w in (("q", q), ("k", k), ("v", v)):
        param.weight_loader(param, w, shard)


def _ct_tensors(parts):
    """What a compressed-tensors NVFP4A16 checkpoint stores for the parts of one fused layer."""
    return nvfp4.quantize_fused(parts)


def _assert_bytes(layer, ref: list[nvfp4.NVFP4Weight]):
    assert torch.equal(layer.weight, torch.cat([r.packed for r in ref]))
    assert torch.equal(layer.weight_scale.view(torch.uint8), torch.cat([r.scale for r in ref]).view(torch.uint8))
    assert torch.equal(layer.weight_global_scale.reshape(1), ref[0].global_scale.reshape(1))


# ---------------------------------------------------------------------------------------------------
# config: from_config, override, dispatch


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


def test_model_config_picks_nvfp4_for_both_checkpoint_kinds(tmp_path, tiny_qwen2_dir):
    """vLLM's own ModelConfig: --quantization nvfp4 takes BF16 and CT NVFP4A16 checkpoints; CT alone stays stock."""
    from vllm.config import ModelConfig

    from qerl_plugin.quantize import quantize_checkpoint

    ct_dir = tmp_path / "ct"
    quantize_checkpoint(tiny_qwen2_dir, ct_dir, progress=False, log=lambda m: None)
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


def test_dispatch_per_layer_type(cpu_config):
    from vllm.model_executor.layers.linear import RowParallelLinear, UnquantizedLinearMethod

    from vllm_ext.nvfp4_linear import QerlNVFP4LinearMethod

    qc = NVFP4Config.from_config({"quant_method": "nvfp4", "ignore": ["model.layers.0.mlp.down_proj"]})
    with set_current_vllm_config(cpu_config):
        down = RowParallelLinear(64, 64, bias=False, params_dtype=torch.bfloat16, quant_config=qc,
                                 prefix="model.layers.0.mlp.down_proj")
        o = RowParallelLinear(64, 64, bias=False, params_dtype=torch.bfloat16, quant_config=qc,
                              prefix="model.layers.0.self_attn.o_proj")
        odd = RowParallelLinear(40, 64, bias=False, params_dtype=torch.bfloat16, quant_config=qc,
                                prefix="model.layers.0.odd")
    assert isinstance(down.quant_method, UnquantizedLinearMethod)  # ignored
    assert isinstance(o.quant_method, QerlNVFP4LinearMethod) and o.quant_method.source == "bf16"
    assert o.weight.is_meta and o.quant_method.uses_meta_device
    assert isinstance(odd.quant_method, UnquantizedLinearMethod)  # in % 16 != 0 stays BF16 (warned)
    qkv = _qkv(cpu_config, _qconfig(ct=True))
    assert qkv.quant_method.source == "checkpoint" and not qkv.quant_method.uses_meta_device
    assert {n: p.dtype for n, p in qkv.named_parameters()} == {
        "weight_packed": torch.uint8, "weight_scale": torch.float8_e4m3fn,
        "weight_global_scale": torch.float32, "bias": torch.bfloat16,
    }
    assert qc.get_quant_method(torch.nn.LayerNorm(4), "model.norm") is None


# ---------------------------------------------------------------------------------------------------
# layers: BF16 source (quantized while loading)


def test_bf16_fused_layer_bytes_forward_and_rerun(cpu_config):
    layer = _qkv(cpu_config, _qconfig(ct=False))
    q, k, v = _bf16((64, 64), 1), _bf16((32, 64), 2, scale=3.0), _bf16((32, 64), 3)
    bias = _bf16((128,), 4)
    for shard, sl in (("q", slice(0, 64)), ("k", slice(64, 96)), ("v", slice(96, 128))):
        layer.bias.weight_loader(layer.bias, bias[sl], shard)
    _load_qkv(layer, q, k, v)  # the last part triggers vLLM's online processing -> our quantization
    ref = nvfp4.quantize_fused([q, k, v])
    _assert_bytes(layer, ref)

    x = _bf16((5, 64), 5)
    expected = F.linear(x, torch.cat([r.dequantize() for r in ref]), bias)
    assert torch.equal(layer(x)[0], expected)

    before = {n: (p.data_ptr(), p.dtype, p.shape) for n, p in layer.named_parameters()}
    layer.quant_method.process_weights_after_loading(layer)  # vLLM calls it again after loading: no-op
    _assert_bytes(layer, ref)
    assert {n: (p.data_ptr(), p.dtype, p.shape) for n, p in layer.named_parameters()} == before


def test_bf16_reload_through_load_weights_keeps_buffers(cpu_config):
    """verl's base sync: model.load_weights(BF16) into an installed layer re-quantizes into the same buffers."""
    layer = _qkv(cpu_config, _qconfig(ct=False))
    _load_qkv(layer, _bf16((64, 64), 1), _bf16((32, 64), 2), _bf16((32, 64), 3))
    ptrs = {n: p.data_ptr() for n, p in layer.named_parameters()}
    q2, k2, v2 = _bf16((64, 64), 11, 0.1), _bf16((32, 64), 12, 5.0), _bf16((32, 64), 13)
    bias2 = _bf16((128,), 14)
    layer.weight.weight_loader(layer.weight, q2, "q")
    layer.weight.weight_loader(layer.weight, k2, "k")
    with pytest.raises(NVFP4Error, match=r"missing \['model.layers.0.self_attn.v_proj'\].*share one global scale"):
        layer.quant_method.process_weights_after_loading(layer)
    layer.weight.weight_loader(layer.weight, v2, "v")
    for shard, sl in (("q", slice(0, 64)), ("k", slice(64, 96)), ("v", slice(96, 128))):
        layer.bias.weight_loader(layer.bias, bias2[sl], shard)
    layer.quant_method.process_weights_after_loading(layer)
    ref = nvfp4.quantize_fused([q2, k2, v2])
    _assert_bytes(layer, ref)
    assert torch.equal(layer.bias, bias2)
    assert {n: p.data_ptr() for n, p in layer.named_parameters()} == ptrs  # CUDA-graph safe
    with pytest.raises(NVFP4Error, match="packed NVFP4 bytes"):
        layer.weight.weight_loader(layer.weight, ref[0].packed, "q")
    with pytest.raises(NVFP4Error, match="kernel layout"):
        layer.weight_scale.weight_loader(layer.weight_scale, ref[0].scale)


def test_bf16_bad_inputs(cpu_config):
    from vllm.model_executor.layers.linear import RowParallelLinear

    # (a fresh layer per case: vLLM's online loading buffers a call before running it)
    layer = _qkv(cpu_config, _qconfig(ct=False))
    with pytest.raises(NVFP4Error, match=r"v_proj\.weight: expected a bf16/fp16/fp32 weight.*got torch.uint8"):
        layer.weight.weight_loader(layer.weight, torch.zeros(32, 32, dtype=torch.uint8), "v")
    layer = _qkv(cpu_config, _qconfig(ct=False))
    with pytest.raises(NVFP4Error, match=r"k_proj\.weight: shape \(32, 48\) does not fit.*expected \[out, in\] = \(32, 64\)"):
        layer.weight.weight_loader(layer.weight, _bf16((32, 48), 0), "k")
    layer = _qkv(cpu_config, _qconfig(ct=False))
    bad = _bf16((64, 64), 1)
    bad[3, 7] = float("nan")
    layer.weight.weight_loader(layer.weight, _bf16((32, 64), 2), "k")
    layer.weight.weight_loader(layer.weight, _bf16((32, 64), 3), "v")
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


# ---------------------------------------------------------------------------------------------------
# layers: compressed-tensors NVFP4A16 source


def _load_ct_qkv(layer, ref):
    for name in ("weight_packed", "weight_scale", "weight_global_scale"):
        attr = {"weight_packed": "packed", "weight_scale": "scale", "weight_global_scale": "global_scale"}[name]
        param = getattr(layer, name)
        for shard, r in zip("qkv", ref):
            param.weight_loader(param, getattr(r, attr), shard)


def test_ct_layer_keeps_checkpoint_bytes_and_reloads_bf16(cpu_config):
    layer = _qkv(cpu_config, _qconfig(ct=True), bias=False)
    parts = [_bf16((64, 64), 1), _bf16((32, 64), 2, 4.0), _bf16((32, 64), 3)]
    ref = _ct_tensors(parts)
    _load_ct_qkv(layer, ref)
    layer.quant_method.process_weights_after_loading(layer)
    _assert_bytes(layer, ref)
    assert "weight_packed" not in dict(layer.named_parameters())
    x = _bf16((3, 64), 9)
    assert torch.equal(layer(x)[0], F.linear(x, torch.cat([r.dequantize() for r in ref])))
    # a BF16 base reload into an engine started from the NVFP4A16 checkpoint: same bits as quantizing them
    ptrs = {n: p.data_ptr() for n, p in layer.named_parameters()}
    new = [p * 1.5 for p in parts]
    _load_qkv(layer, *new)
    _assert_bytes(layer, nvfp4.quantize_fused(new))
    assert {n: p.data_ptr() for n, p in layer.named_parameters()} == ptrs


def test_ct_bad_checkpoints(cpu_config):
    parts = [_bf16((64, 64), 1), _bf16((32, 64), 2), _bf16((32, 64), 3)]
    ref = _ct_tensors(parts)

    layer = _qkv(cpu_config, _qconfig(ct=True), bias=False)
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
    layer = _qkv(cpu_config, _qconfig(ct=True), bias=False)
    for shard, r in zip("qkv", ref):
        layer.weight_packed.weight_loader(layer.weight_packed, r.packed, shard)
        layer.weight_scale.weight_loader(layer.weight_scale, r.scale, shard)
    layer.weight_global_scale.weight_loader(layer.weight_global_scale, ref[0].global_scale, "q")
    with pytest.raises(NVFP4Error, match=r"no weight_global_scale for \['model.layers.0.self_attn.k_proj', 'model.layers.0.self_attn.v_proj'\]"):
        layer.quant_method.process_weights_after_loading(layer)

    # fused parts quantized with separate global scales (not a qerl/llmcompressor export)
    layer = _qkv(cpu_config, _qconfig(ct=True), bias=False)
    separate = [nvfp4.quantize(p) for p in parts]
    assert len({float(r.global_scale) for r in separate}) > 1
    _load_ct_qkv(layer, separate)
    with pytest.raises(NVFP4Error, match="different weight_global_scale.*re-quantize with `qerl quantize`"):
        layer.quant_method.process_weights_after_loading(layer)

    # negative group scales
    layer = _qkv(cpu_config, _qconfig(ct=True), bias=False)
    neg = [nvfp4.NVFP4Weight(r.packed, (-r.scale.float()).to(torch.float8_e4m3fn), r.global_scale) for r in ref]
    _load_ct_qkv(layer, neg)
    with pytest.raises(NVFP4Error, match="negative values"):
        layer.quant_method.process_weights_after_loading(layer)

    # a part whose weight_packed never arrived
    layer = _qkv(cpu_config, _qconfig(ct=True), bias=False)
    _load_ct_qkv(layer, ref)
    layer.qerl_nvfp4.loaded_parts.discard("v")
    with pytest.raises(NVFP4Error, match=r"no weight_packed for \['model.layers.0.self_attn.v_proj'\]"):
        layer.quant_method.process_weights_after_loading(layer)


# ---------------------------------------------------------------------------------------------------
# whole models through vLLM's model loader


@pytest.fixture
def cpu_attention(monkeypatch):
    """vLLM's unspecified CPU platform has no attention backend; name vLLM's CPU one so models can be built."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(
        type(current_platform),
        "get_attn_backend_cls",
        classmethod(lambda cls, *a, **k: "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"),
    )


def _random_bias_model(path: Path) -> Path:
    """The tiny Qwen2 with random (not zero) q/k/v biases, so bias handling is checked too."""
    make_tiny_qwen2(path, init_std=0.05)
    sd = read_safetensors_dir(path)
    for i, name in enumerate(sorted(n for n in sd if n.endswith(".bias"))):
        sd[name] = _bf16(tuple(sd[name].shape), 100 + i, 0.5)
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _load_model(cpu_config, path: Path, quantization: str | None = "nvfp4", load_format: str = "safetensors"):
    from vllm.config import LoadConfig, ModelConfig
    from vllm.model_executor.model_loader import get_model_loader

    mc = ModelConfig(model=str(path), quantization=quantization, dtype="bfloat16", enforce_eager=True)
    vc = VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"), load_config=LoadConfig(load_format=load_format))
    with set_current_vllm_config(vc):
        model = get_model_loader(vc.load_config).load_model(vllm_config=vc, model_config=mc)
    return model, mc, vc


def _linears(model) -> dict[str, torch.nn.Module]:
    from vllm.model_executor.layers.linear import LinearBase

    return {n: m for n, m in model.named_modules() if isinstance(m, LinearBase)}


def _expected(sd: dict[str, torch.Tensor], layer_name: str) -> list[nvfp4.NVFP4Weight]:
    head, _, last = layer_name.rpartition(".")
    parts = QKV_MAP.get(last, [last])
    return nvfp4.quantize_fused([sd[f"{head}.{p}.weight"] for p in parts])


def test_models_from_bf16_and_ct_checkpoints_hold_identical_bytes(tmp_path, cpu_config, cpu_attention):
    from qerl_plugin.quantize import quantize_checkpoint

    src = _random_bias_model(tmp_path / "bf16")
    ct = tmp_path / "ct"
    quantize_checkpoint(src, ct, progress=False, log=lambda m: None)
    sd = read_safetensors_dir(src)

    m_bf16, _, _ = _load_model(cpu_config, src)
    m_ct, mc_ct, _ = _load_model(cpu_config, ct)
    assert mc_ct.quantization == "nvfp4"
    lin_bf16, lin_ct = _linears(m_bf16), _linears(m_ct)
    assert sorted(lin_bf16) == sorted(lin_ct) and len(lin_bf16) == 8
    for name, layer in lin_bf16.items():
        _assert_bytes(layer, _expected(sd, name))
        other = lin_ct[name]
        for pname, p in layer.named_parameters():
            assert torch.equal(p.view(torch.uint8), getattr(other, pname).view(torch.uint8)), (name, pname)
    qkv = lin_bf16["model.layers.1.self_attn.qkv_proj"]
    assert torch.equal(qkv.bias, torch.cat([sd[f"model.layers.1.self_attn.{p}.bias"] for p in QKV_MAP["qkv_proj"]]))
    assert m_bf16.lm_head.weight.dtype == torch.bfloat16  # lm_head and embeddings stay BF16


def test_dummy_load_quantizes_random_weights(tmp_path, cpu_config, cpu_attention, tiny_qwen2_dir):
    model, _, _ = _load_model(cpu_config, tiny_qwen2_dir, load_format="dummy")
    for name, layer in _linears(model).items():
        assert layer.weight.dtype == torch.uint8 and not layer.weight.is_meta, name
        assert float(layer.weight_global_scale) > 0


def _ptrs(model) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in model.named_parameters()}


def test_reload_paths_keep_buffers_and_requantize(tmp_path, cpu_config, cpu_attention):
    """Base reloads in both engines: vLLM's layerwise reload and verl's model.load_weights + process."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from qerl_plugin.quantize import quantize_checkpoint

    src = _random_bias_model(tmp_path / "bf16")
    ct = tmp_path / "ct"
    quantize_checkpoint(src, ct, progress=False, log=lambda m: None)
    new_src = _random_bias_model(tmp_path / "bf16_new")
    for f in new_src.glob("*.safetensors"):  # a different model of the same shape
        sd_new = read_safetensors_dir(new_src)
        sd_new = {k: (v * 1.7 + 0.01 if v.dim() == 2 else v + 0.25) for k, v in sd_new.items()}
        save_file(sd_new, str(f), metadata={"format": "pt"})
    new_ct = tmp_path / "ct_new"
    quantize_checkpoint(new_src, new_ct, progress=False, log=lambda m: None)
    sd_new = read_safetensors_dir(new_src)

    # 1) vLLM layerwise reload, checkpoint format of each engine (BF16 engine <- BF16, CT engine <- CT)
    for path, new_path in ((src, new_src), (ct, new_ct)):
        model, mc, vc = _load_model(cpu_config, path)
        ptrs = _ptrs(model)
        with set_current_vllm_config(vc):
            initialize_layerwise_reload(model)
            model.load_weights(read_safetensors_dir(new_path).items())
            finalize_layerwise_reload(model, mc)
        assert _ptrs(model) == ptrs, path
        for name, layer in _linears(model).items():
            _assert_bytes(layer, _expected(sd_new, name))
        qkv = _linears(model)["model.layers.0.self_attn.qkv_proj"]
        assert torch.equal(qkv.bias, torch.cat([sd_new[f"model.layers.0.self_attn.{p}.bias"] for p in QKV_MAP["qkv_proj"]]))

    # 2) verl's base sync into the CT engine: BF16 tensors through model.load_weights, then processing
    model, mc, vc = _load_model(cpu_config, ct)
    ptrs = _ptrs(model)
    with set_current_vllm_config(vc):
        model.load_weights(sd_new.items())
        process_weights_after_loading(model, mc, torch.device("cpu"))
    assert _ptrs(model) == ptrs
    for name, layer in _linears(model).items():
        _assert_bytes(layer, _expected(sd_new, name))
    assert torch.equal(model.model.norm.weight, sd_new["model.norm.weight"])


def test_backend_options_from_additional_config(cpu_config, monkeypatch):
    ok = VllmConfig(device_config=DeviceConfig(device="cpu"), additional_config={"qerl_nvfp4": {"backend": "emulation"}})
    assert _qkv(ok, _qconfig(ct=False)).quant_method.backend.name == "emulation"
    bad = VllmConfig(device_config=DeviceConfig(device="cpu"), additional_config={"qerl_nvfp4": {"backend": "bogus"}})
    with pytest.raises(NVFP4Error, match="backend='bogus'.*expected auto, marlin or emulation"):
        _qkv(bad, _qconfig(ct=False))
    monkeypatch.setenv("QERL_NVFP4_BACKEND", "marlin")  # no CUDA here: a clear error, not a crash later
    with pytest.raises(NVFP4Error, match="needs an NVIDIA GPU"):
        _qkv(cpu_config, _qconfig(ct=False))


def test_gpu_below_marlin_requirement_is_refused(monkeypatch):
    """A Volta-class GPU (7.0): a clear error when the layer is built, naming the requirement and the fix."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    from vllm_ext.nvfp4_linear import MarlinBackend

    monkeypatch.setattr(type(current_platform), "is_cuda", lambda *a: True)
    monkeypatch.setattr(type(current_platform), "get_device_capability", classmethod(lambda cls, device_id=0: DeviceCapability(7, 0)))
    with pytest.raises(NVFP4Error, match=r"compute capability >= 7\.5.*this GPU is 7\.0.*without --quantization"):
        MarlinBackend()
