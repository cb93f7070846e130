"""The NVFP4 + LoRA actor built through verl's own FSDPEngine methods (wrapped by qerl), on CPU.

verl's ``FSDPEngine._build_module`` / ``_build_lora_module`` are plain methods reading ``self.model_config``
and ``self.engine_config``; here ``self`` carries verl's real config objects (``HFModelConfig`` of a tiny
checkpoint, ``FSDPEngineConfig``), so the code under test is verl's and qerl's, unmocked. FSDP itself is
left out (it needs a process group; the GPU script covers it).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("verl")


@pytest.fixture
def tiny_bf16(tiny_qwen2_dir) -> Path:
    return tiny_qwen2_dir


@pytest.fixture
def tiny_nvfp4(tiny_qwen2_nvfp4_dir) -> Path:
    return tiny_qwen2_nvfp4_dir


@pytest.fixture(scope="module")
def fsdp_engine():
    from verl_ext import patches

    patches.apply_all()
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    assert patches.is_patched(FSDPEngine._build_lora_module) and patches.is_patched(FSDPEngine._build_module)
    return FSDPEngine


def _engine(path: Path, model_dtype: str = "fp32", checkpointing: bool = False):
    from verl.workers.config import FSDPEngineConfig, HFModelConfig

    mc = HFModelConfig(
        path=str(path), lora_rank=8, lora_alpha=16, target_modules="all-linear", use_remove_padding=False,
        override_config={"attn_implementation": "sdpa"}, enable_gradient_checkpointing=checkpointing,
    )
    ec = FSDPEngineConfig(model_dtype=model_dtype, strategy="fsdp2")
    rank0 = SimpleNamespace(get_coordinate=lambda: [0])  # verl's _build_module asks the mesh which rank loads weights
    return SimpleNamespace(
        model_config=mc, engine_config=ec, use_remove_padding=False, ulysses_sequence_parallel_size=1, device_mesh=rank0
    )


@pytest.fixture
def qerl_nvfp4(tiny_bf16):
    from verl_ext.settings import activate, settings_from

    def use(path):
        activate(settings_from({"quantization": "nvfp4"}, {"path": str(path)}))

    yield use
    activate(None)


def test_bf16_checkpoint_becomes_nvfp4_base_under_lora(fsdp_engine, tiny_bf16, qerl_nvfp4):
    from safetensors.torch import load_file

    from qerl_plugin import nvfp4
    from verl_ext.nvfp4_linear import NVFP4Linear

    qerl_nvfp4(tiny_bf16)
    eng = _engine(tiny_bf16)
    module = fsdp_engine._build_module(eng)  # verl's own build (BF16 checkpoint)
    assert not any(isinstance(m, NVFP4Linear) for m in module.modules())
    module = fsdp_engine._build_lora_module(eng, module)

    nv = {n: m for n, m in module.named_modules() if isinstance(m, NVFP4Linear)}
    assert len(nv) == 2 * 7, "every decoder projection of the 2-layer model is NVFP4"
    assert all(n.endswith(".base_layer") for n in nv), "each NVFP4 layer sits under a PEFT lora.Linear"
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert not any(b.requires_grad for b in module.buffers())

    # the bytes are those of the rollout's load-time quantization: q/k/v and gate/up share a global scale
    sd = load_file(str(tiny_bf16 / "model.safetensors"))
    layer = "model.layers.1"
    qkv = nvfp4.quantize_fused([sd[f"{layer}.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")], names=["q", "k", "v"])
    got = nv[f"base_model.model.{layer}.self_attn.k_proj.base_layer"]
    assert torch.equal(got.weight_packed.cpu(), qkv[1].packed)
    assert torch.equal(got.weight_scale.cpu().view(torch.uint8), qkv[1].scale.view(torch.uint8))
    assert torch.equal(got.weight_global_scale.cpu(), qkv[1].global_scale)

    # forward and backward: gradients reach LoRA only
    ids = torch.randint(0, 90, (2, 12))
    out = module(input_ids=ids)
    out.logits.float().pow(2).mean().backward()
    grads = {n for n, p in module.named_parameters() if p.grad is not None}
    assert grads and grads <= set(trainable)


def test_nvfp4_checkpoint_loads_packed_bytes_without_dense_weights(fsdp_engine, tiny_nvfp4, qerl_nvfp4):
    from safetensors.torch import load_file

    from verl_ext.settings import current
    from verl_ext.nvfp4_linear import NVFP4Linear

    qerl_nvfp4(tiny_nvfp4)
    assert current().nvfp4_checkpoint
    eng = _engine(tiny_nvfp4)
    module = fsdp_engine._build_module(eng)
    ckpt = {}
    for f in sorted(tiny_nvfp4.glob("*.safetensors")):
        ckpt.update(load_file(str(f)))
    nv = {n: m for n, m in module.named_modules() if isinstance(m, NVFP4Linear)}
    assert len(nv) == 14
    for name, m in nv.items():
        assert torch.equal(m.weight_packed, ckpt[f"{name}.weight_packed"]), name
        assert torch.equal(m.weight_global_scale, ckpt[f"{name}.weight_global_scale"]), name
    # non-quantized tensors come from the checkpoint, in verl's training dtype (fp32)
    emb = module.get_input_embeddings().weight
    assert emb.dtype == torch.float32 and torch.equal(emb, ckpt["model.embed_tokens.weight"].float())
    assert not any(p.is_meta for p in module.parameters()) and not any(b.is_meta for b in module.buffers())
    # the HF config the rollout and the checkpoint manager see still says "quantized"
    assert getattr(eng.model_config.hf_config, "quantization_config", None) is not None
    # _build_lora_module keeps the checkpoint's bytes (no second quantization) and adds LoRA
    module = fsdp_engine._build_lora_module(eng, module)
    after = {n[len("base_model.model.") : -len(".base_layer")]: m for n, m in module.named_modules() if isinstance(m, NVFP4Linear)}
    assert set(after) == set(nv) and all(torch.equal(after[n].weight_packed, ckpt[f"{n}.weight_packed"]) for n in after)


def test_bf16_run_is_untouched(fsdp_engine, tiny_bf16):
    from verl_ext.settings import activate
    from verl_ext.nvfp4_linear import NVFP4Linear

    activate(None)
    eng = _engine(tiny_bf16)
    module = fsdp_engine._build_lora_module(eng, fsdp_engine._build_module(eng))
    assert not any(isinstance(m, NVFP4Linear) for m in module.modules())


@pytest.mark.parametrize("quantization", ["nvfp4", None])
def test_no_recompute_layers_reach_verls_lora_build(fsdp_engine, tiny_bf16, quantization, capsys):
    from verl_ext.config import QerlConfigError
    from verl_ext.recompute import checkpointed_layers
    from verl_ext.settings import activate, settings_from

    def build(n, checkpointing=True):
        activate(settings_from({"quantization": quantization, "custom": {"qerl": {"actor": {"no_recompute_layers": n}}}},
                               {"path": str(tiny_bf16)}))
        eng = _engine(tiny_bf16, checkpointing=checkpointing)
        return fsdp_engine._build_lora_module(eng, fsdp_engine._build_module(eng))

    try:
        module = build(1)  # the tiny checkpoint has 2 decoder layers; verl checkpointed both in _build_module
        assert [n for n, _ in checkpointed_layers(module)] == ["base_model.model.model.layers.0"]
        assert module.base_model.model.model.layers[1].gradient_checkpointing is False
        assert "[qerl] actor: 1 decoder layers keep their activations instead of recomputing them " \
               "(actor_rollout_ref.rollout.custom.qerl.actor.no_recompute_layers): layers.1" in capsys.readouterr().out
        with pytest.raises(QerlConfigError, match=r"no_recompute_layers=3, but .* has 2 checkpointed decoder layers"):
            build(3)
        with pytest.raises(QerlConfigError, match=r"gradient checkpointing is off"):
            build(1, checkpointing=False)
    finally:
        activate(None)


def test_init_model_wrapper_reads_the_workers_rollout_config(tiny_bf16):
    from omegaconf import OmegaConf

    from verl_ext.actor import wrap_init_model
    from verl_ext.settings import activate, current

    cfg = OmegaConf.create(
        {
            "rollout": {"quantization": "nvfp4", "custom": {"qerl": {"aqn": {"enable": True, "num_stages": 4}}}},
            "model": {"path": str(tiny_bf16)},
        }
    )
    seen = {}
    init = wrap_init_model(lambda self: seen.setdefault("settings", current()), "t")
    try:
        init(SimpleNamespace(config=cfg, role="actor_rollout"))
        s = seen["settings"]
        assert s.nvfp4 and s.model_quant == "bf16" and s.aqn.num_stages == 4
    finally:
        activate(None)
