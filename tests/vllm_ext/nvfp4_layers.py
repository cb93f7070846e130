"""Small vLLM layers and models for the ``nvfp4`` method tests, built and loaded on CPU with real vLLM.

Real vLLM throughout: its config dispatch (``ModelConfig._verify_quantization``), linear layers, weight
loaders, online-quantization/layerwise-reload machinery and model loader run on a CPU machine. Without CUDA
the method picks its emulation backend, whose kernel tensors are the compressed-tensors triple, so the bytes
vLLM holds can be compared with :func:`qerl_plugin.nvfp4.quantize_fused`. Importing this module registers
``nvfp4`` with vLLM. The fixtures ``cpu_config`` and ``cpu_attention`` are in this folder's conftest.py.
"""

from __future__ import annotations

import socket
from pathlib import Path

import torch
from helpers import make_tiny_qwen2, read_safetensors_dir
from safetensors.torch import save_file
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

from qerl_plugin import nvfp4
from qerl_plugin.format import quantization_config_dict
from vllm_ext import quant
from vllm_ext.quant import NVFP4Config

quant.register()

QKV_MAP = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rand_bf16(shape, seed, scale=1.0) -> torch.Tensor:
    """A seeded random normal BF16 tensor times ``scale``."""
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=g, dtype=torch.float64)).to(torch.bfloat16)


def nvfp4_config(ct: bool) -> NVFP4Config:
    """The config for an NVFP4A16 checkpoint (``ct``) or a BF16 one, with the q/k/v and gate/up fusions."""
    qc = NVFP4Config.from_config(quantization_config_dict(ignore=["lm_head"])) if ct else NVFP4Config()
    qc.packed_modules_mapping = QKV_MAP
    return qc


def make_qkv(cfg, qc, bias=True):
    """A small QKVParallelLinear under ``qc``."""
    from vllm.model_executor.layers.linear import QKVParallelLinear

    with set_current_vllm_config(cfg):
        # hidden 64, head 16, 4 q heads, 2 kv heads -> q 64, k 32, v 32 rows
        return QKVParallelLinear(64, 16, 4, 2, bias=bias, params_dtype=torch.bfloat16, quant_config=qc,
                                 prefix="model.layers.0.self_attn.qkv_proj")


def load_qkv(layer, q, k, v, name="weight"):
    """Load the q, k, v parts of ``name`` through its weight loader."""
    param = getattr(layer, name)
    for shard, w in (("q", q), ("k", k), ("v", v)):
        param.weight_loader(param, w, shard)


def ct_tensors(parts):
    """What a compressed-tensors NVFP4A16 checkpoint stores for the parts of one fused layer."""
    return nvfp4.quantize_fused(parts)


def assert_bytes(layer, ref: list[nvfp4.NVFP4Weight]):
    assert torch.equal(layer.weight, torch.cat([r.packed for r in ref]))
    assert torch.equal(layer.weight_scale.view(torch.uint8), torch.cat([r.scale for r in ref]).view(torch.uint8))
    assert torch.equal(layer.weight_global_scale.reshape(1), ref[0].global_scale.reshape(1))


def load_ct_qkv(layer, ref):
    for name in ("weight_packed", "weight_scale", "weight_global_scale"):
        attr = {"weight_packed": "packed", "weight_scale": "scale", "weight_global_scale": "global_scale"}[name]
        param = getattr(layer, name)
        for shard, r in zip("qkv", ref):
            param.weight_loader(param, getattr(r, attr), shard)


def random_bias_model(path: Path) -> Path:
    """The tiny Qwen2 with random (not zero) q/k/v biases, so bias handling is checked too."""
    make_tiny_qwen2(path, init_std=0.05)
    sd = read_safetensors_dir(path)
    for i, name in enumerate(sorted(n for n in sd if n.endswith(".bias"))):
        sd[name] = rand_bf16(tuple(sd[name].shape), 100 + i, 0.5)
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def load_model(cpu_config, path: Path, quantization: str | None = "nvfp4", load_format: str = "safetensors"):
    from vllm.config import LoadConfig, ModelConfig
    from vllm.model_executor.model_loader import get_model_loader

    mc = ModelConfig(model=str(path), quantization=quantization, dtype="bfloat16", enforce_eager=True)
    vc = VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"), load_config=LoadConfig(load_format=load_format))
    with set_current_vllm_config(vc):
        model = get_model_loader(vc.load_config).load_model(vllm_config=vc, model_config=mc)
    return model, mc, vc


def linears(model) -> dict[str, torch.nn.Module]:
    from vllm.model_executor.layers.linear import LinearBase

    return {n: m for n, m in model.named_modules() if isinstance(m, LinearBase)}


def expected_parts(sd: dict[str, torch.Tensor], layer_name: str) -> list[nvfp4.NVFP4Weight]:
    head, _, last = layer_name.rpartition(".")
    parts = QKV_MAP.get(last, [last])
    return nvfp4.quantize_fused([sd[f"{head}.{p}.weight"] for p in parts])


def param_ptrs(model) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in model.named_parameters()}
