"""The ``nvfp4`` Marlin backend on a CUDA GPU: same layout as vLLM's stock compressed-tensors path, correct
GEMMs, reloads into the same buffers. Skipped (with the reason) where there is no CUDA device.

    python -m pytest tests/vllm_ext/test_nvfp4_backends_gpu.py -q      # on the GPU machine
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from nvfp4_layers import QKV_MAP, free_port  # noqa: E402

from qerl_plugin import nvfp4  # noqa: E402

pytestmark = pytest.mark.gpu

HIDDEN, HEAD, NH, NKV, INTER = 256, 64, 4, 2, 512  # Marlin-friendly (multiples of 64/128)


@pytest.fixture(scope="module")
def cfg():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    from vllm_ext import quant

    quant.register()
    config = VllmConfig()
    with set_current_vllm_config(config):
        if not torch.distributed.is_initialized():
            init_distributed_environment(1, 0, f"tcp://127.0.0.1:{free_port()}", 0, backend="gloo")
        if not model_parallel_is_initialized():
            initialize_model_parallel(1, 1)
    return config


def _w(shape, seed, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=g, dtype=torch.float64)).to(torch.bfloat16).cuda()


def _qkv(cfg, quant_config, bias=True):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.linear import QKVParallelLinear

    with set_current_vllm_config(cfg), torch.device("cuda"):
        return QKVParallelLinear(HIDDEN, HEAD, NH, NKV, bias=bias, params_dtype=torch.bfloat16,
                                 quant_config=quant_config, prefix="model.layers.0.self_attn.qkv_proj")


def _nvfp4_config(ct: bool):
    from qerl_plugin.format import quantization_config_dict
    from vllm_ext.quant import NVFP4Config

    qc = NVFP4Config.from_config(quantization_config_dict()) if ct else NVFP4Config()
    qc.packed_modules_mapping = QKV_MAP
    return qc


def _parts():
    return [_w((NH * HEAD, HIDDEN), 1), _w((NKV * HEAD, HIDDEN), 2, 0.2), _w((NKV * HEAD, HIDDEN), 3)]


def _load_bf16(layer, parts, bias=None):
    if bias is not None:
        offs = [0, NH * HEAD, (NH + NKV) * HEAD, (NH + 2 * NKV) * HEAD]
        for i, s in enumerate("qkv"):
            layer.bias.weight_loader(layer.bias, bias[offs[i]:offs[i + 1]], s)
    for s, w in zip("qkv", parts):
        layer.weight.weight_loader(layer.weight, w, s)


def test_marlin_layout_equals_vllm_stock_compressed_tensors(cfg):
    """Our BF16-source layer holds exactly the Marlin tensors vLLM's own CT NVFP4A16 scheme builds."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    from qerl_plugin.format import quantization_config_dict

    parts, bias = _parts(), _w(((NH + 2 * NKV) * HEAD,), 4)
    ours = _qkv(cfg, _nvfp4_config(ct=False))
    _load_bf16(ours, parts, bias)
    assert ours.quant_method.backend.name == "marlin"

    stock_cfg = CompressedTensorsConfig.from_config(quantization_config_dict())
    stock_cfg.packed_modules_mapping = QKV_MAP
    stock = _qkv(cfg, stock_cfg)
    ref = nvfp4.quantize_fused([p.cpu() for p in parts])
    offs = [0, NH * HEAD, (NH + NKV) * HEAD, (NH + 2 * NKV) * HEAD]
    for i, s in enumerate("qkv"):
        stock.weight_packed.weight_loader(stock.weight_packed, ref[i].packed.cuda(), s)
        stock.weight_scale.weight_loader(stock.weight_scale, ref[i].scale.cuda(), s)
        stock.weight_global_scale.weight_loader(stock.weight_global_scale, ref[i].global_scale.cuda(), s)
        stock.bias.weight_loader(stock.bias, bias[offs[i]:offs[i + 1]], s)
    stock.quant_method.process_weights_after_loading(stock)
    for name in ("weight", "weight_scale", "weight_global_scale", "bias"):
        a, b = getattr(ours, name), getattr(stock, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b), name
    x = _w((7, HIDDEN), 5, 1.0)
    assert torch.equal(ours(x)[0], stock(x)[0])


@pytest.mark.parametrize("m, mode", [(1, "off"), (1, "shared"), (8, "off"), (64, "off")])
def test_marlin_gemm_matches_dequantized_reference(cfg, m, mode, monkeypatch):
    """Marlin's GEMM, and at one row also decode_gemv shared's row kernel (the default on Hopper since §4al, so the
    mode is named: off keeps one-row calls on Marlin), against the dequantized weights in float32."""
    monkeypatch.setenv("QERL_NVFP4_DECODE_GEMV", mode)
    parts, bias = _parts(), _w(((NH + 2 * NKV) * HEAD,), 4)
    layer = _qkv(cfg, _nvfp4_config(ct=False))
    _load_bf16(layer, parts, bias)
    w = torch.cat([r.dequantize(torch.float32) for r in nvfp4.quantize_fused([p.cpu() for p in parts])]).cuda()
    x = _w((m, HIDDEN), 6, 1.0)
    ref = F.linear(x.float(), w, bias.float())
    out = layer(x)[0].float()
    err = (out - ref).abs().max() / ref.abs().max()
    assert err < 2e-2, float(err)


def test_marlin_reload_keeps_buffers(cfg):
    layer = _qkv(cfg, _nvfp4_config(ct=True))
    parts = _parts()
    ref = nvfp4.quantize_fused([p.cpu() for p in parts])
    for i, s in enumerate("qkv"):
        for name, attr in (("weight_packed", "packed"), ("weight_scale", "scale"), ("weight_global_scale", "global_scale")):
            param = getattr(layer, name)
            param.weight_loader(param, getattr(ref[i], attr).cuda(), s)
    zero_bias = torch.zeros((NH + 2 * NKV) * HEAD, dtype=torch.bfloat16, device="cuda")
    layer.bias.data.copy_(zero_bias)
    layer.quant_method.process_weights_after_loading(layer)
    ptrs = {n: p.data_ptr() for n, p in layer.named_parameters()}
    workspace = layer.workspace.data_ptr()

    new, new_bias = [p * 3 for p in parts], _w(((NH + 2 * NKV) * HEAD,), 8)
    _load_bf16(layer, new, new_bias)
    layer.quant_method.process_weights_after_loading(layer)
    assert {n: p.data_ptr() for n, p in layer.named_parameters()} == ptrs
    assert layer.workspace.data_ptr() == workspace

    fresh = _qkv(cfg, _nvfp4_config(ct=False))
    _load_bf16(fresh, new, new_bias)
    for name in ("weight", "weight_scale", "weight_global_scale", "bias"):
        a, b = getattr(layer, name), getattr(fresh, name)
        assert torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b), name


def test_fp32_reduce_switch(cfg, monkeypatch):
    monkeypatch.setenv("QERL_NVFP4_FP32_REDUCE", "0")
    layer = _qkv(cfg, _nvfp4_config(ct=False), bias=False)
    assert layer.quant_method.backend.fp32_reduce is False
    parts = _parts()
    _load_bf16(layer, parts)
    w = torch.cat([r.dequantize(torch.float32) for r in nvfp4.quantize_fused([p.cpu() for p in parts])]).cuda()
    x = _w((4, HIDDEN), 9, 1.0)
    ref = F.linear(x.float(), w)
    assert ((layer(x)[0].float() - ref).abs().max() / ref.abs().max()) < 3e-2



@pytest.mark.parametrize("m", [1, 8, 64])
def test_humming_backend_matches_the_dequantized_reference_and_reloads_in_place(cfg, m, monkeypatch):
    """backend humming (vLLM's humming kernels, opt-in) on a q/k/v layer with a bias: within twice Marlin's error of
    the float64 product with the dequantized weight, and a reload copies into the same buffers (CUDA graphs hold them)
    and gives the new weights' product. With this layer's K (256) humming has at most a couple of K tiles to split
    (it passed at 2x Marlin's error in §4ad's call 30); its bf16 split-K sums on a 7B shape, 1.8-3.5x Marlin's error
    in §4ac, are tested in tests/vllm_ext/test_bench_humming.py."""
    pytest.importorskip("humming", reason="humming-kernels (vLLM's optional humming package) is not installed")
    from vllm_ext.nvfp4_backends import HummingBackend

    parts, bias = _parts(), _w(((NH + 2 * NKV) * HEAD,), 4)
    x = _w((m, HIDDEN), 6, 1.0)

    def exact(ws, b):  # noqa: ANN001, ANN202
        w = torch.cat([r.dequantize(torch.float32) for r in nvfp4.quantize_fused([p.cpu() for p in ws])]).cuda()
        return x.double() @ w.double().t() + b.double()

    def rel(out, ref):  # noqa: ANN001, ANN202
        return ((out.double() - ref).abs().max() / ref.abs().max()).item()

    layers = {}
    for backend in ("humming", "marlin"):
        monkeypatch.setenv("QERL_NVFP4_BACKEND", backend)
        layers[backend] = _qkv(cfg, _nvfp4_config(ct=False))
        _load_bf16(layers[backend], parts, bias)
    hum = layers["humming"]
    assert isinstance(hum.quant_method.backend, HummingBackend)
    ref = exact(parts, bias)
    err = {b: rel(layer(x)[0], ref) for b, layer in layers.items()}
    assert err["humming"] <= max(2 * err["marlin"], 2.0**-8), err

    ptrs = {n: p.data_ptr() for n, p in hum.named_parameters()}
    locks = hum.qerl_humming_locks.data_ptr()
    new, new_bias = [p * 3 for p in parts], _w(((NH + 2 * NKV) * HEAD,), 8)
    _load_bf16(hum, new, new_bias)
    assert {n: p.data_ptr() for n, p in hum.named_parameters()} == ptrs and hum.qerl_humming_locks.data_ptr() == locks
    assert rel(hum(x)[0], exact(new, new_bias)) <= max(2 * err["marlin"], 2.0**-8)


def test_decode_gemv_small_copies_only_the_small_layers(cfg, monkeypatch):
    """decode_gemv small: a q/k/v layer (K 256) keeps the row kernel's copy of its weights and a layer with K = 8 320
    (above 8 192, as the MLPs' down projections) does not; one-row calls of both match the dequantized reference."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.linear import RowParallelLinear

    monkeypatch.setenv("QERL_NVFP4_DECODE_GEMV", "small")
    parts, bias = _parts(), _w(((NH + 2 * NKV) * HEAD,), 4)
    qkv = _qkv(cfg, _nvfp4_config(ct=False))
    assert qkv.quant_method.backend.decode_gemv == "small"
    _load_bf16(qkv, parts, bias)
    wide_k = 8320
    with set_current_vllm_config(cfg), torch.device("cuda"):
        wide = RowParallelLinear(wide_k, 256, bias=False, params_dtype=torch.bfloat16,
                                 quant_config=_nvfp4_config(ct=False), prefix="model.layers.0.mlp.down_proj")
    w_wide = _w((256, wide_k), 11)
    wide.weight.weight_loader(wide.weight, w_wide)
    assert "qerl_gemv_packed" in qkv._parameters and "qerl_gemv_packed" not in wide._parameters
    w = torch.cat([r.dequantize(torch.float32) for r in nvfp4.quantize_fused([p.cpu() for p in parts])]).cuda()
    x = _w((1, HIDDEN), 6, 1.0)
    ref = F.linear(x.float(), w, bias.float())
    assert ((qkv(x)[0].float() - ref).abs().max() / ref.abs().max()) < 2e-2
    w2 = nvfp4.quantize(w_wide.cpu()).dequantize(torch.float32).cuda()
    x2 = _w((1, wide_k), 7, 1.0)
    ref2 = F.linear(x2.float(), w2)
    assert ((wide(x2)[0].float() - ref2).abs().max() / ref2.abs().max()) < 2e-2
