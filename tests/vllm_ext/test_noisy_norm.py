"""The AQN RMSNorm against vLLM's own RMSNorm, an fp64 reference, and vLLM's plugin/custom-op machinery.

Real vLLM throughout: vLLM 0.24 imports on a CPU machine and its RMSNorm ``forward_native`` runs there.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from vllm import ir  # noqa: E402
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.layernorm import RMSNorm  # noqa: E402

from qerl_plugin.aqn import noise_vector  # noqa: E402
from vllm_ext import noisy_norm  # noqa: E402
from vllm_ext.noisy_norm import NoisyRMSNorm  # noqa: E402

noisy_norm.register()


def _config(aqn: bool | None) -> VllmConfig:
    extra = {} if aqn is None else {"qerl_aqn": aqn}
    return VllmConfig(device_config=DeviceConfig(device="cpu"), additional_config=extra)


def make_norm(hidden, *, aqn=True, dtype=torch.bfloat16, var_hidden_size=None, seed=0, eps=1e-6) -> NoisyRMSNorm:
    with set_current_vllm_config(_config(aqn)):
        norm = RMSNorm(hidden, eps=eps, var_hidden_size=var_hidden_size, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.2 * torch.randn(hidden, generator=gen, dtype=torch.float64))
    return norm


def set_z(norm: NoisyRMSNorm, z: torch.Tensor) -> None:
    """Write a noise vector by hand (what set_noise does for each norm)."""
    norm.qerl_noise.copy_(z)
    norm.qerl_active.fill_(True)


def _rand(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return (3.0 * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)


class TinyBlock(nn.Module):
    """Qwen3-like naming (``model.layers.N.{input,post_attention}_layernorm``, per-head q/k norms, final norm)."""

    def __init__(self, hidden: int, head_dim: int):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden)
        self.self_attn = nn.Module()
        self.self_attn.q_norm = RMSNorm(head_dim)
        self.self_attn.k_norm = RMSNorm(head_dim)
        self.post_attention_layernorm = RMSNorm(hidden)


class TinyModel(nn.Module):
    def __init__(self, hidden=64, layers=2, head_dim=16):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([TinyBlock(hidden, head_dim) for _ in range(layers)])
        self.model.norm = RMSNorm(hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        residual = None
        for layer in self.model.layers:
            if residual is None:
                residual, h = h, layer.input_layernorm(h)
            else:
                h, residual = layer.input_layernorm(h, residual)
            h, residual = layer.post_attention_layernorm(torch.tanh(h), residual)
        h, _ = self.model.norm(h, residual)
        return h


def tiny_model(aqn=True, dtype=torch.bfloat16) -> TinyModel:
    with set_current_vllm_config(_config(aqn)):
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = TinyModel()
        finally:
            torch.set_default_dtype(old)
    return model


# ---------------------------------------------------------------------------------------------------------
# registration through vLLM's own lookup
# ---------------------------------------------------------------------------------------------------------


def test_vllm_plugin_loader_installs_the_noisy_norm_in_a_fresh_process():
    code = textwrap.dedent(
        """
        import json
        import vllm.plugins
        vllm.plugins.load_general_plugins()
        vllm.plugins.load_general_plugins()   # vLLM calls it in several places: must stay idempotent
        from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
        from vllm.model_executor.custom_op import op_registry, op_registry_oot
        from vllm.model_executor.layers.layernorm import RMSNorm
        with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
            off = RMSNorm(8)
        cfg = VllmConfig(device_config=DeviceConfig(device="cpu"), additional_config={"qerl_aqn": True})
        with set_current_vllm_config(cfg):
            on = RMSNorm(8)
        print(json.dumps({
            "oot": {k: f"{v.__module__}.{v.__qualname__}" for k, v in op_registry_oot.items()},
            "in_tree": f"{op_registry['rms_norm'].__module__}.{op_registry['rms_norm'].__qualname__}",
            "type_off": f"{type(off).__module__}.{type(off).__qualname__}",
            "type_on": f"{type(on).__module__}.{type(on).__qualname__}",
            "aqn_off": off.qerl_aqn, "aqn_on": on.qerl_aqn,
            "buffers_off": [n for n, _ in off.named_buffers()],
            "buffers_on": [n for n, _ in on.named_buffers()],
            "state_dict_on": sorted(on.state_dict()),
            "op_name": type(on).name,
            "is_rmsnorm": isinstance(on, RMSNorm),
        }))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["oot"]["RMSNorm"] == "vllm_ext.noisy_norm.NoisyRMSNorm"
    assert got["in_tree"] == "vllm.model_executor.layers.layernorm.RMSNorm"  # stock op stays registered
    assert got["type_off"] == got["type_on"] == "vllm_ext.noisy_norm.NoisyRMSNorm"
    assert got["is_rmsnorm"] and got["op_name"] == "rms_norm"  # custom_ops=+/-rms_norm still applies
    assert (got["aqn_off"], got["aqn_on"]) == (False, True)
    assert got["buffers_off"] == [] and got["buffers_on"] == ["qerl_noise", "qerl_active"]
    assert got["state_dict_on"] == ["weight"]  # the noise buffer never reaches checkpoints or dummy init


def test_register_twice_is_a_no_op_and_refuses_a_foreign_replacement(monkeypatch):
    from vllm.model_executor.custom_op import op_registry_oot

    noisy_norm.register()
    assert op_registry_oot["RMSNorm"] is NoisyRMSNorm

    class OtherNorm(RMSNorm):
        pass

    monkeypatch.setitem(op_registry_oot, "RMSNorm", OtherNorm)
    with pytest.raises(RuntimeError, match="OtherNorm.*VLLM_PLUGINS"):
        noisy_norm.register()


def test_switch_is_additional_config_only_and_enters_the_compile_hash(monkeypatch):
    monkeypatch.setenv("QERL_AQN", "1")  # an environment variable switches nothing
    assert not make_norm(8, aqn=None).qerl_aqn
    assert make_norm(8, aqn=True).qerl_aqn
    assert not make_norm(8, aqn=False).qerl_aqn
    on, off = _config(True), _config(None)
    # vLLM keys its torch.compile / AOT caches on this hash: AQN and stock graphs must not share a cache.
    assert on.compute_hash() != off.compute_hash()
    with set_current_vllm_config(on):
        assert not RMSNorm(8, has_weight=False).qerl_aqn  # nothing to perturb
    with pytest.raises(ValueError, match=r"additional_config\['qerl_aqn'\]: expected true or false, got 'maybe'"):
        make_norm(8, aqn="maybe")


# ---------------------------------------------------------------------------------------------------------
# math
# ---------------------------------------------------------------------------------------------------------

SHAPES = [(1, 64), (7, 128), (3, 5, 96)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("weight_dtype", ["same", "float32"])
def test_sigma0_is_bit_identical_to_vllm_forward_native(dtype, shape, residual, weight_dtype):
    hidden = shape[-1]
    wdt = dtype if weight_dtype == "same" else torch.float32
    noisy = make_norm(hidden, aqn=True, dtype=wdt)
    stock = make_norm(hidden, aqn=False, dtype=wdt)
    assert noisy.qerl_aqn and torch.count_nonzero(noisy.qerl_noise) == 0
    x, r = _rand(shape, dtype, 1), _rand(shape, dtype, 2)
    with torch.inference_mode():
        if residual:
            # vLLM's fused form may work in place: give every call its own copies.
            got = noisy(x.clone(), r.clone())
            ref = RMSNorm.forward_native(stock, x.clone(), r.clone())
            ref_ir = ir.ops.fused_add_rms_norm.impls["native"].impl_fn(x.clone(), r.clone(), stock.weight.data, 1e-6)
            off = stock(x.clone(), r.clone())
            for a, b, c, d in zip(got, ref, ref_ir, off, strict=True):
                assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
                assert a.dtype == dtype
        else:
            got = noisy(x)
            ref = RMSNorm.forward_native(stock, x)
            assert torch.equal(got, ref) and torch.equal(got, stock(x)) and got.dtype == dtype


def test_sigma0_bit_identical_with_variance_size_override():
    noisy = make_norm(96, aqn=True, var_hidden_size=32)
    stock = make_norm(96, aqn=False, var_hidden_size=32)
    x, r = _rand((5, 96), torch.bfloat16, 3), _rand((5, 96), torch.bfloat16, 4)
    with torch.inference_mode():
        assert torch.equal(noisy(x), RMSNorm.forward_native(stock, x))
        a, b = noisy(x.clone(), r.clone()), RMSNorm.forward_native(stock, x.clone(), r.clone())
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _reference64(x, w, z, eps, residual=None):
    h = x.double()
    if residual is not None:
        h = h + residual.double()
    h = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h * (w.double() + z.double())


@pytest.mark.parametrize("sigma", [1e-2, 1e-4])
@pytest.mark.parametrize("residual", [False, True])
def test_noise_matches_fp64_reference_in_fp32(sigma, residual):
    norm = make_norm(128, aqn=True, dtype=torch.float32)
    z = noise_vector("model.layers.0.input_layernorm", 128, sigma, 7, 1)
    set_z(norm, z)
    x, r = _rand((9, 128), torch.float32, 5), _rand((9, 128), torch.float32, 6)
    with torch.inference_mode():
        out = norm(x, r)[0] if residual else norm(x)
    ref = _reference64(x, norm.weight.data, z, 1e-6, r if residual else None)
    torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=1e-6)
    clean = _reference64(x, norm.weight.data, torch.zeros(128), 1e-6, r if residual else None)
    # the output moved by normalize(x) * z (fp32 rounding of the output aside), not by anything else
    moved, expected = out.double() - clean, ref - clean
    assert torch.linalg.norm(moved - expected) < 0.02 * torch.linalg.norm(expected)


def test_noise_matches_fp64_reference_in_bf16_within_half_an_ulp():
    norm = make_norm(256, aqn=True)
    z = noise_vector("model.norm", 256, 1e-2, 3, 2)
    set_z(norm, z)
    x = _rand((16, 256), torch.bfloat16, 8)
    with torch.inference_mode():
        out = norm(x)
    ref = _reference64(x, norm.weight.data, z, 1e-6)
    # normalize(x) * (w + z) in fp32, rounded once to bf16 (unit roundoff 2**-8)
    assert torch.all((out.double() - ref).abs() <= ref.abs() * 2.0**-8 * 1.001 + 1e-30)


@pytest.mark.parametrize("weights", ["random", "ones"])
def test_sigma_1e_minus_4_moves_bf16_outputs_where_a_bf16_weight_could_not(weights):
    hidden, rows = 2048, 256
    norm = make_norm(hidden, aqn=True)
    if weights == "ones":  # a freshly initialised norm: w = 1 exactly
        norm.weight.data.fill_(1.0)
    w = norm.weight.data
    x = _rand((rows, hidden), torch.bfloat16, 9)
    z = noise_vector("model.layers.3.post_attention_layernorm", hidden, 1e-4, 0, 1)
    with torch.inference_mode():
        set_z(norm, torch.zeros(hidden))
        clean = norm(x)  # the noisy expression at z = 0
        set_z(norm, z)
        noisy = norm(x)
    # what the released code does (w + z in bf16) is a no-op at this sigma ...
    assert torch.equal((w.float() + z).to(torch.bfloat16), w)
    # ... while w + z in fp32 moves about sigma/ulp of the outputs by one ulp
    changed = noisy != clean
    frac = changed.float().mean().item()
    assert 0.002 < frac < 0.2, frac
    # every change goes the way normalize(x) * z points (rounding is monotone)
    xn = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    direction = torch.sign(xn * z)[changed]
    moved = torch.sign(noisy.float() - clean.float())[changed]
    assert torch.equal(direction, moved)
    assert torch.all((noisy.float() - clean.float()).abs()[changed] <= clean.float().abs()[changed] * 2.0**-7)


# ---------------------------------------------------------------------------------------------------------
# model-level noise: names, determinism, in place
# ---------------------------------------------------------------------------------------------------------


def test_noise_is_set_per_hf_name_deterministic_and_in_place():
    model = tiny_model()
    names = [n for n, _ in noisy_norm.noisy_norms(model)]
    assert names == sorted(
        [f"model.layers.{i}.{k}" for i in range(2) for k in ("input_layernorm", "post_attention_layernorm")]
        + ["model.norm"]
    )
    ptrs = {n: m.qerl_noise.data_ptr() for n, m in noisy_norm.noisy_norms(model)}

    rep = noisy_norm.set_noise(model, 1e-2, 11, 3)
    assert rep["norms"] == 5 and rep["sigma"] == 1e-2 and (rep["seed"], rep["stage"]) == (11, 3) and rep["enabled"]
    first = {n: m.qerl_noise.clone() for n, m in noisy_norm.noisy_norms(model)}
    for name, z in first.items():
        assert torch.equal(z, noise_vector(name, 64, 1e-2, 11, 3))  # the trainer draws the same vector
    assert math.isclose(rep["checksum"], sum(z.double().sum().item() for z in first.values()), rel_tol=1e-12)
    assert len({z.sum().item() for z in first.values()}) == 5  # one vector per norm

    noisy_norm.set_noise(model, 1e-2, 11, 3)
    assert all(torch.equal(m.qerl_noise, first[n]) for n, m in noisy_norm.noisy_norms(model))
    noisy_norm.set_noise(model, 1e-2, 11, 4)
    assert all(not torch.equal(m.qerl_noise, first[n]) for n, m in noisy_norm.noisy_norms(model))
    noisy_norm.set_noise(model, 1e-2, 12, 3)
    assert all(not torch.equal(m.qerl_noise, first[n]) for n, m in noisy_norm.noisy_norms(model))
    assert {n: m.qerl_noise.data_ptr() for n, m in noisy_norm.noisy_norms(model)} == ptrs

    # per-head q/k norms carry no noise: they scale attention logits, they do not feed a projection
    for layer in model.model.layers:
        for qk in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            assert qk.qerl_aqn and torch.count_nonzero(qk.qerl_noise) == 0

    cleared = noisy_norm.clear_noise(model)
    assert cleared == {"norms": 5, "sigma": 0.0, "enabled": True}
    assert all(torch.count_nonzero(m.qerl_noise) == 0 for _, m in noisy_norm.noisy_norms(model))
    assert {n: m.qerl_noise.data_ptr() for n, m in noisy_norm.noisy_norms(model)} == ptrs


def test_model_output_sigma0_matches_stock_and_noise_changes_it():
    aqn, stock = tiny_model(aqn=True), tiny_model(aqn=False)
    stock.load_state_dict(aqn.state_dict())
    h = _rand((6, 64), torch.bfloat16, 10)
    with torch.inference_mode():
        base = stock(h)
        assert torch.equal(aqn(h), base)
        noisy_norm.set_noise(aqn, 1e-3, 0, 1)
        assert not torch.equal(aqn(h), base)
        noisy_norm.set_noise(aqn, 0.0, 0, 1)
        assert torch.equal(aqn(h), base)


BAD_ARGS = [
    ((-1e-3, 0, 0), "sigma=-0.001"),
    ((float("nan"), 0, 0), "sigma=nan"),
    ((float("inf"), 0, 0), "sigma=inf"),
    (("0.01", 0, 0), "sigma='0.01'"),
    ((True, 0, 0), "sigma=True"),
    ((1e-2, 1.5, 0), "seed=1.5"),
    ((1e-2, "3", 0), "seed='3'"),
    ((1e-2, -1, 0), "seed=-1"),
    ((1e-2, True, 0), "seed=True"),
    ((1e-2, 0, 2.0), "stage=2.0"),
    ((1e-2, 0, None), "stage=None"),
]


@pytest.mark.parametrize("args,message", BAD_ARGS)
def test_bad_arguments_raise_and_keep_the_previous_noise(args, message):
    model = tiny_model()
    noisy_norm.set_noise(model, 1e-2, 1, 1)
    before = {n: m.qerl_noise.clone() for n, m in noisy_norm.noisy_norms(model)}
    with pytest.raises(ValueError) as err:
        noisy_norm.set_noise(model, *args)
    assert message in str(err.value)
    assert all(torch.equal(m.qerl_noise, before[n]) for n, m in noisy_norm.noisy_norms(model))


def test_engine_without_aqn_refuses_noise_but_accepts_zero():
    model = tiny_model(aqn=False)
    with pytest.raises(RuntimeError, match="qerl_aqn"):
        noisy_norm.set_noise(model, 1e-2, 0, 1)
    assert noisy_norm.set_noise(model, 0.0, 0, 1)["norms"] == 0
    assert noisy_norm.clear_noise(model) == {"norms": 0, "sigma": 0.0, "enabled": False}


def test_vllm_names_map_back_to_hf_names_through_the_weights_mapper():
    from vllm.model_executor.models.utils import WeightsMapper

    class VLWrapper(nn.Module):  # vLLM's Qwen2.5-VL layout and its (real) mapper rules
        hf_to_vllm_mapper = WeightsMapper(
            orig_to_new_prefix={
                "model.language_model.": "language_model.model.",
                "model.visual.": "visual.",
                "lm_head.": "language_model.lm_head.",
                "model.": "language_model.model.",
            }
        )

        def __init__(self):
            super().__init__()
            self.language_model = tiny_model()

    vl = VLWrapper()
    names = [n for n, _ in noisy_norm.noisy_norms(vl)]
    assert "model.language_model.layers.0.input_layernorm" in names
    assert "model.language_model.norm" in names and len(names) == 5
    assert noisy_norm.hf_module_name("model.layers.0.input_layernorm", tiny_model()) == "model.layers.0.input_layernorm"


# ---------------------------------------------------------------------------------------------------------
# torch.compile: an in-place resample reaches the compiled graph without recompiling
# ---------------------------------------------------------------------------------------------------------


def test_compiled_graph_reads_the_buffer_in_place_without_recompiling():
    model = tiny_model()
    h = _rand((4, 64), torch.bfloat16, 12)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    with torch.inference_mode():
        base = compiled(h)
        noisy_norm.set_noise(model, 1e-2, 0, 1)
        noisy = compiled(h)
        eager_noisy = model(h)
        noisy_norm.clear_noise(model)
        again = compiled(h)
    assert counter.frame_count == 1
    assert torch.equal(noisy, eager_noisy) and not torch.equal(noisy, base) and torch.equal(again, base)


@pytest.mark.slow
def test_inductor_sigma0_equals_inductor_compiled_vllm_native_and_sees_resample():
    """vLLM lowers ``rms_norm`` to its native form under Inductor; the AQN graph at z = 0 must match it."""
    norm = make_norm(896, aqn=True)
    x, r = _rand((37, 896), torch.bfloat16, 13), _rand((37, 896), torch.bfloat16, 14)
    native = ir.ops.fused_add_rms_norm.impls["native"].impl_fn
    torch._dynamo.reset()
    with torch.inference_mode():
        stock = torch.compile(lambda a, b: native(a, b, norm.weight.data, 1e-6))(x, r)
        ours = torch.compile(lambda a, b: norm(a, b))
        got = ours(x, r)
        set_z(norm, noise_vector("model.norm", 896, 1e-2, 0, 1))
        moved = ours(x, r)
        norm.qerl_noise.zero_()
        norm.qerl_active.fill_(False)
        back = ours(x, r)
    assert torch.equal(got[0], stock[0]) and torch.equal(got[1], stock[1])
    assert not torch.equal(moved[0], got[0]) and torch.equal(back[0], got[0])
