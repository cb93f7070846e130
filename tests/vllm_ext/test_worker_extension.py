"""QerlWorkerExtension on CPU: noise RPCs over a model built from real vLLM layers, in-memory LoRA validation.

The engine (GPUModelRunner, LoRA punica kernels) cannot run here; the extension is mixed into a minimal
host exposing what vLLM's worker exposes (``model_runner.get_model()``, ``rank``). Adding a validated adapter
to vLLM's LoRA manager is covered by scripts/gpu/check_aqn_vllm.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from vllm.config import (  # noqa: E402
    CompilationConfig,
    CompilationMode,
    DeviceConfig,
    LoRAConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.model_executor.layers.layernorm import RMSNorm  # noqa: E402
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear  # noqa: E402
from vllm.model_executor.models.interfaces import SupportsLoRA  # noqa: E402
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM, Qwen2MLP  # noqa: E402

from qerl_plugin.aqn import noise_vector  # noqa: E402
from vllm_ext import noisy_norm  # noqa: E402
from vllm_ext.worker_extension import (  # noqa: E402
    LoRAAdapterError,
    QerlWorkerExtension,
    build_lora_model,
    lora_module_table,
)

noisy_norm.register()

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2  # = tests/helpers.TINY_QWEN2
HEAD_DIM = HIDDEN // HEADS


# ---------------------------------------------------------------------------------------------------------
# a tiny Qwen2-named model from vLLM layers (vLLM's attention backend needs a GPU platform; the rest is real)
# ---------------------------------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, prefix: str):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=True, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, bias=False, prefix=f"{prefix}.o_proj")


class DecoderLayer(nn.Module):
    def __init__(self, prefix: str):
        super().__init__()
        self.input_layernorm = RMSNorm(HIDDEN)
        self.self_attn = Attention(f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(HIDDEN)
        self.mlp = Qwen2MLP(HIDDEN, INTER, "silu", prefix=f"{prefix}.mlp")


class TinyQwen2(nn.Module, SupportsLoRA):
    packed_modules_mapping = Qwen2ForCausalLM.packed_modules_mapping  # vLLM's own, read off the class

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([DecoderLayer(f"model.layers.{i}") for i in range(LAYERS)])
        self.model.norm = RMSNorm(HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        residual = None
        for layer in self.model.layers:
            if residual is None:
                residual, h = h, layer.input_layernorm(h)
            else:
                h, residual = layer.input_layernorm(h, residual)
            q = layer.self_attn.qkv_proj(h)[0][..., : HEADS * HEAD_DIM]
            h = layer.self_attn.o_proj(q)[0]
            h, residual = layer.post_attention_layernorm(h, residual)
            h = layer.mlp(h)
        return self.model.norm(h, residual)[0]


@pytest.fixture(scope="module")
def vllm_parallel(tmp_path_factory):
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(cfg):
        if not torch.distributed.is_initialized():
            init_file = tmp_path_factory.mktemp("dist") / "init"
            init_distributed_environment(
                world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{init_file}", backend="gloo"
            )
        ensure_model_parallel_initialized(1, 1)
    return True


def build_model(aqn: bool = True) -> TinyQwen2:
    # compilation off and custom ops native: SiluAndMul would otherwise torch.compile itself (~15 s on CPU)
    cfg = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        compilation_config=CompilationConfig(mode=CompilationMode.NONE, custom_ops=["none"]),
        additional_config={"qerl_aqn": aqn},
    )
    old = torch.get_default_dtype()
    with set_current_vllm_config(cfg):
        torch.set_default_dtype(torch.bfloat16)
        try:
            torch.manual_seed(0)
            model = TinyQwen2()
        finally:
            torch.set_default_dtype(old)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.1)
    return model


class Runner:
    """The part of vLLM's GPUModelRunner the extension reads (``get_model``); no LoRA manager on CPU."""

    def __init__(self, model: nn.Module):
        self.model = model

    def get_model(self) -> nn.Module:
        return self.model


class Host(QerlWorkerExtension):
    def __init__(self, model: nn.Module | None, rank: int = 0):
        self.model_runner = Runner(model) if model is not None else None
        self.rank = rank


@pytest.fixture()
def model(vllm_parallel):
    return build_model(aqn=True)


# ---------------------------------------------------------------------------------------------------------
# composing with vLLM's worker and verl's extension
# ---------------------------------------------------------------------------------------------------------


def test_extension_passes_vllms_conflict_check_and_composes_with_verl():
    from vllm.v1.worker.gpu_worker import Worker

    public = [a for a in dir(QerlWorkerExtension) if not a.startswith("__")]
    assert {"qerl_set_noise", "qerl_clear_noise", "qerl_add_lora_from_tensors", "qerl_memory_report"} <= set(public)
    assert all(a.startswith(("qerl_", "_qerl_")) for a in public)
    # vLLM's init_worker asserts exactly this before mixing the extension into the worker class
    assert [a for a in public if hasattr(Worker, a)] == []
    assert "__init__" not in QerlWorkerExtension.__dict__ and "__new__" not in QerlWorkerExtension.__dict__

    verl_utils = pytest.importorskip("verl.workers.rollout.vllm_rollout.utils")
    verl_ext_cls = verl_utils.vLLMColocateWorkerExtension
    combined = type("QerlVerlWorkerExtension", (QerlWorkerExtension, verl_ext_cls), {})
    names = [a for a in dir(combined) if not a.startswith("__")]
    assert [a for a in names if hasattr(Worker, a)] == []
    assert combined.__new__ is verl_ext_cls.__new__  # verl's per-worker setup still runs
    assert set(public) <= set(names)


# ---------------------------------------------------------------------------------------------------------
# AQN RPCs
# ---------------------------------------------------------------------------------------------------------


def test_set_and_clear_noise_through_the_extension(model):
    host = Host(model, rank=3)
    h = torch.randn(5, HIDDEN, dtype=torch.bfloat16)
    with torch.inference_mode():
        base = model(h)
    rep = host.qerl_set_noise(1e-2, 5, 2)
    assert rep["norms"] == 2 * LAYERS + 1 and rep["rank"] == 3 and rep["sigma"] == 1e-2 and rep["enabled"]
    layer0 = model.model.layers[0].input_layernorm
    assert torch.equal(layer0.qerl_noise, noise_vector("model.layers.0.input_layernorm", HIDDEN, 1e-2, 5, 2))
    with torch.inference_mode():
        assert not torch.equal(model(h), base)
    assert host.qerl_memory_report()["aqn_noise"] == {"sigma": 1e-2, "seed": 5, "stage": 2}
    rep = host.qerl_clear_noise()
    assert rep == {"norms": 2 * LAYERS + 1, "sigma": 0.0, "enabled": True, "rank": 3}
    with torch.inference_mode():
        assert torch.equal(model(h), base)


@pytest.mark.parametrize(
    "args,message",
    [((-0.5, 0, 0), "sigma=-0.5"), ((float("nan"), 0, 0), "sigma=nan"), ((1e-2, 2.5, 0), "seed=2.5"),
     ((1e-2, "7", 0), "seed='7'"), ((1e-2, 0, -3), "stage=-3")],
)
def test_bad_noise_arguments_leave_the_engine_state_alone(model, args, message):
    host = Host(model)
    host.qerl_set_noise(1e-2, 1, 1)
    before = [m.qerl_noise.clone() for _, m in noisy_norm.noisy_norms(model)]
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        host.qerl_set_noise(*args)
    assert all(torch.equal(m.qerl_noise, b) for (_, m), b in zip(noisy_norm.noisy_norms(model), before))
    assert host.qerl_memory_report()["aqn_noise"] == {"sigma": 1e-2, "seed": 1, "stage": 1}


def test_noise_on_an_engine_without_aqn_is_an_error_naming_the_switch(vllm_parallel):
    host = Host(build_model(aqn=False))
    with pytest.raises(RuntimeError, match=r"additional_config=\{.qerl_aqn.: True\} \(vllm serve --additional-config"):
        host.qerl_set_noise(1e-2, 0, 1)
    assert host.qerl_clear_noise()["norms"] == 0


def test_worker_without_model_says_so():
    with pytest.raises(RuntimeError, match="model_runner"):
        Host(None).qerl_set_noise(1e-2, 0, 0)


def test_memory_report_on_cpu(model):
    rep = Host(model).qerl_memory_report()
    assert rep["device"] == "cpu" and rep["rss_bytes"] > 0 and rep["total_bytes"] > rep["rss_bytes"]
    assert rep["aqn_norms"] == 2 * LAYERS + 1 and rep["aqn_buffer_bytes"] == (4 * HIDDEN + 1) * (2 * LAYERS + 1)
    assert rep["rank"] == 0 and "lora_adapters" not in rep


# ---------------------------------------------------------------------------------------------------------
# in-memory LoRA
# ---------------------------------------------------------------------------------------------------------

PROJ = {  # HF module -> (in, out)
    "self_attn.q_proj": (HIDDEN, HEADS * HEAD_DIM),
    "self_attn.k_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
    "self_attn.v_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
    "self_attn.o_proj": (HEADS * HEAD_DIM, HIDDEN),
    "mlp.gate_proj": (HIDDEN, INTER),
    "mlp.up_proj": (HIDDEN, INTER),
    "mlp.down_proj": (INTER, HIDDEN),
}


def adapter(r=8, modules=tuple(PROJ), layers=range(LAYERS)):
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for i in layers:
        for m in modules:
            n_in, n_out = PROJ.get(m, (HIDDEN, HIDDEN))
            base = f"base_model.model.model.layers.{i}.{m}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(r, n_in, generator=gen)
            tensors[f"{base}.lora_B.weight"] = torch.randn(n_out, r, generator=gen)
    config = {"r": r, "lora_alpha": 2 * r, "target_modules": sorted({m.split(".")[-1] for m in modules}),
              "bias": "none", "peft_type": "LORA"}
    return tensors, config


@pytest.fixture(autouse=True)
def _no_pinned_memory_without_a_driver(monkeypatch):
    # vLLM's LoRAModel pins CPU copies when its platform says pinning works; on this GPU-less machine the
    # "unspecified" platform says so but torch cannot pin without an NVIDIA driver.
    import vllm.lora.lora_model

    if not torch.cuda.is_available():
        monkeypatch.setattr(vllm.lora.lora_model, "PIN_MEMORY", False)


def build(model, tensors, config, lora_config=None, name="policy", int_id=1):
    return build_lora_model(name, int_id, tensors, config, model=model,
                            lora_config=lora_config or LoRAConfig(max_lora_rank=16), vocab_size=128)


def test_table_of_served_modules_matches_the_vllm_layers(model):
    table = lora_module_table(model, LoRAConfig(max_lora_rank=16))
    assert sorted(table) == sorted(f"model.layers.{i}.{m}" for i in range(LAYERS) for m in PROJ)
    qkv, index = table["model.layers.1.self_attn.v_proj"]
    assert type(qkv).__name__ == "QKVParallelLinear" and index == 2
    restricted = lora_module_table(model, LoRAConfig(max_lora_rank=16, target_modules=["o_proj", "gate_up_proj"]))
    assert {n.rsplit(".", 1)[-1] for n in restricted} == {"o_proj", "gate_proj", "up_proj"}


def test_valid_adapter_builds_vllms_lora_model(model):
    tensors, config = adapter(r=8)
    lora = build(model, tensors, config, int_id=7)
    assert lora.id == 7 and lora.rank == 8
    assert sorted(lora.loras) == sorted(f"model.layers.{i}.{m}" for i in range(LAYERS) for m in PROJ)
    q = lora.loras["model.layers.0.self_attn.q_proj"]
    assert q.lora_a.device.type == "cpu" and q.scaling == 2.0
    torch.testing.assert_close(q.lora_a, tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"])
    # the caller's buffers are copied, never aliased (verl reuses its transfer buffers)
    assert q.lora_a.data_ptr() != tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].data_ptr()


def test_adapter_from_real_peft_on_the_hf_twin_is_accepted(model):
    peft = pytest.importorskip("peft")
    from transformers import Qwen2Config
    from transformers import Qwen2ForCausalLM as HFQwen2

    hf = HFQwen2(Qwen2Config(vocab_size=128, hidden_size=HIDDEN, intermediate_size=INTER,
                             num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS))
    cfg = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"])
    peft_model = peft.get_peft_model(hf, cfg)
    tensors = peft.get_peft_model_state_dict(peft_model)
    lora = build(model, tensors, cfg.to_dict(), name="from-peft")
    assert len(lora.loras) == LAYERS * len(PROJ) and lora.rank == 16


def test_rank_above_max_lora_rank_names_adapter_rank_and_fix(model):
    tensors, config = adapter(r=32)
    with pytest.raises(LoRAAdapterError) as err:
        build(model, tensors, config, name="too-big")
    msg = str(err.value)
    assert "'too-big'" in msg and "r=32" in msg and "max_lora_rank=16" in msg and "max_lora_rank >= 32" in msg


def test_unknown_modules_are_named_with_the_served_ones(model):
    tensors, config = adapter(modules=("self_attn.q_proj", "self_attn.qq_proj"))
    with pytest.raises(LoRAAdapterError) as err:
        build(model, tensors, config, name="typo")
    msg = str(err.value)
    assert "'typo'" in msg and "model.layers.0.self_attn.qq_proj" in msg and "q_proj" in msg
    assert "target_modules" in msg


def test_layers_beyond_the_model_are_unknown_modules(model):
    tensors, config = adapter(layers=[0, 5])
    with pytest.raises(LoRAAdapterError, match="model.layers.5"):
        build(model, tensors, config)


def test_peft_target_modules_that_match_nothing_are_rejected(model):
    tensors, config = adapter(modules=("self_attn.q_proj",))
    config["target_modules"] = ["q_proj", "w_pack"]
    with pytest.raises(LoRAAdapterError, match=r"\['w_pack'\]"):
        build(model, tensors, config)


def test_engine_restricted_target_modules_reject_other_modules(model):
    tensors, config = adapter(modules=("self_attn.q_proj",))
    with pytest.raises(LoRAAdapterError, match="self_attn.q_proj.*target_modules=\\['o_proj'\\]"):
        build(model, tensors, config, lora_config=LoRAConfig(max_lora_rank=16, target_modules=["o_proj"]))


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda t: t.update({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(8, 48)}),
         "q_proj: lora_A has 48 input features, the layer has 64"),
        (lambda t: t.update({"base_model.model.model.layers.0.mlp.down_proj.lora_B.weight": torch.randn(32, 8)}),
         "down_proj: lora_B has 32 output features, the layer has 64"),
        (lambda t: t.update({"base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight": torch.randn(16, 8)}),
         "k_proj: lora_B has 16 output features, the layer has 32"),
        (lambda t: t.update({"base_model.model.model.layers.1.mlp.up_proj.lora_A.weight": torch.randn(4, 64)}),
         "up_proj: .* do not have rank r=8"),
        (lambda t: t.pop("base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"), "up_proj: lora_B missing"),
    ],
)
def test_tensor_shapes_are_checked_against_the_layers(model, mutate, match):
    tensors, config = adapter(r=8)
    mutate(tensors)
    with pytest.raises(LoRAAdapterError, match=match):
        build(model, tensors, config, name="shapes")


@pytest.mark.parametrize(
    "tensors,config,int_id,match",
    [
        ({}, {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}, 1, "no tensors"),
        ({"base_model.model.model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2)},
         {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}, 1, "not LoRA weights"),
        (adapter()[0], {"r": 8, "target_modules": ["q_proj"]}, 1, "invalid peft_config"),
        (adapter()[0], {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "use_dora": True}, 1, "DoRA"),
        (adapter()[0], {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "bias": "all"}, 1, "bias"),
        (adapter()[0], adapter()[1], 0, "lora_int_id=0"),
        (adapter()[0], adapter()[1], True, "lora_int_id=True"),
        (adapter()[0], "r=8", 1, "must be a dict"),
    ],
)
def test_malformed_adapters_raise_clear_errors(model, tensors, config, int_id, match):
    with pytest.raises(LoRAAdapterError, match=match):
        build(model, tensors, config, int_id=int_id)


def test_adding_lora_on_an_engine_without_lora_names_the_fix(model):
    tensors, config = adapter()
    with pytest.raises(LoRAAdapterError, match="'policy'.*enable_lora=True"):
        Host(model).qerl_add_lora_from_tensors("policy", 1, tensors, config)
