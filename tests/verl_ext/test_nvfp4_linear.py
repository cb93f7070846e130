"""verl_ext.nvfp4_linear: NVFP4Linear's forward/backward against float64 references, LoRA gradients, the
module's buffers, dtype casts, state dicts and bad input, and the layer on CUDA (gpu marker)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from qerl_plugin import nvfp4
from qerl_plugin.nvfp4 import NVFP4Error
from verl_ext import kernels, nvfp4_linear
from verl_ext.nvfp4_linear import NVFP4Linear


def bf16_exact(t: torch.Tensor) -> torch.Tensor:
    """float32 values that a bf16 checkpoint holds (an actor loaded in fp32 from bf16 weights)."""
    return t.to(torch.bfloat16).to(torch.float32)


def make_layer(out_f=48, in_f=64, bias=True, seed=0) -> tuple[NVFP4Linear, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_f, in_f, generator=g) * 0.05).to(torch.bfloat16)
    b = (torch.randn(out_f, generator=g) * 0.1).to(torch.bfloat16) if bias else None
    layer = NVFP4Linear.from_weight(w, b)
    w_deq = nvfp4.dequantize(layer.weight_packed, layer.weight_scale, layer.weight_global_scale, torch.float32)
    return layer, w_deq, b


# ---------------------------------------------------------------------------------------------------------
# forward / backward against float64


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 64)])
def test_forward_and_input_grad_match_float64(bias, shape):
    layer, w, b = make_layer(bias=bias)
    x = torch.randn(*shape, dtype=torch.float32, requires_grad=True)
    y = layer(x)
    ref = x.detach().double() @ w.double().T + (b.double() if b is not None else 0)
    assert y.dtype == torch.float32 and y.shape == (*shape[:-1], 48)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(x.grad.double(), g.double() @ w.double(), rtol=1e-5, atol=1e-5)
    assert all(t.grad is None for t in layer.buffers())
    assert layer.bias is None or (layer.bias.grad is None and not layer.bias.requires_grad)


def test_bf16_forward_uses_the_bf16_weight():
    layer, w, b = make_layer()
    x = torch.randn(7, 64).to(torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    w_bf16 = nvfp4.dequantize(layer.weight_packed, layer.weight_scale, layer.weight_global_scale, torch.bfloat16)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w_bf16, b))
    ref = x.double() @ w.double().T + b.double()
    torch.testing.assert_close(y.double(), ref, rtol=2e-2, atol=2e-2)


def test_autocast_computes_in_the_autocast_dtype():
    layer, _, _ = make_layer()
    x = torch.randn(4, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, layer(x.to(torch.bfloat16)))


def test_bias_grad_when_unfrozen():
    layer, w, b = make_layer()
    layer.bias.requires_grad_(True)
    x = torch.randn(6, 64)
    g = torch.randn(6, 48)
    layer(x).backward(g)
    torch.testing.assert_close(layer.bias.grad.float(), g.sum(0).to(torch.bfloat16).float())


def test_lora_grads_match_float64():
    from peft import LoraConfig, get_peft_model

    layer, w, b = make_layer(bias=True)

    class One(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = layer

        def forward(self, x):
            return self.proj(x)

    model = get_peft_model(One(), LoraConfig(r=4, lora_alpha=8, target_modules=["proj"], init_lora_weights=False))
    lora = model.base_model.model.proj
    a_w, b_w = lora.lora_A["default"].weight, lora.lora_B["default"].weight
    scaling = lora.scaling["default"]
    x = torch.randn(3, 5, 64, requires_grad=True)
    y = model(x)
    g = torch.randn_like(y)
    y.backward(g)

    x64 = x.detach().double().requires_grad_(True)
    a64 = a_w.detach().double().requires_grad_(True)
    b64 = b_w.detach().double().requires_grad_(True)
    y64 = x64 @ w.double().T + b.double() + scaling * (x64 @ a64.T) @ b64.T
    y64.backward(g.double())
    torch.testing.assert_close(y.double(), y64.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a_w.grad.double(), a64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b_w.grad.double(), b64.grad, rtol=1e-5, atol=1e-5)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(trainable) == sorted(
        ["base_model.model.proj.lora_A.default.weight", "base_model.model.proj.lora_B.default.weight"]
    )


def _saved_dense(layer, x, budget_env, monkeypatch):
    """The floating tensors of at least the layer's weight size that autograd saves for the layer's backward."""
    monkeypatch.setenv(nvfp4_linear.SAVED_WEIGHT_ENV, budget_env)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    n = layer.out_features * layer.in_features
    return y, [t for t in saved if t.is_floating_point() and t.numel() >= n and t.dtype != torch.float8_e4m3fn]


def test_budget_zero_keeps_no_dense_weight(monkeypatch):
    """QERL_ACTOR_SAVED_WEIGHT_MIB=0: the autograd graph holds the 4-bit buffers only; backward decodes again."""
    layer, _, _ = make_layer(out_f=64, in_f=128)
    x = torch.randn(4, 128, requires_grad=True)
    before = nvfp4_linear.saved_weight_bytes()
    y, dense = _saved_dense(layer, x, "0", monkeypatch)
    assert dense == [] and nvfp4_linear.saved_weight_bytes() == before
    y.sum().backward()
    assert x.grad is not None


def test_kept_weight_is_counted_until_backward_and_gives_the_same_grads(monkeypatch):
    """Default budget: the forward's decoded weight (one [out, in] tensor) is kept for backward, counted while it
    lives and released once backward has run; input and LoRA-free gradients are bit-equal to decoding again."""
    layer, w_deq, _ = make_layer(out_f=64, in_f=128)
    x = torch.randn(4, 128, requires_grad=True)
    gy = torch.randn(4, 64)
    before = nvfp4_linear.saved_weight_bytes()
    y, dense = _saved_dense(layer, x, "", monkeypatch)
    # autograd's own matmul saves the decoded weight (as its [in, out] transposed view)
    assert len(dense) == 1 and torch.equal(dense[0].reshape(-1, 128) if dense[0].shape == (64, 128) else dense[0].t(), w_deq)
    del dense
    assert nvfp4_linear.saved_weight_bytes() == before + 64 * 128 * 4  # float32 input: a float32 weight
    y.backward(gy)
    del y
    assert nvfp4_linear.saved_weight_bytes() == before
    kept_grad = x.grad.clone()
    x.grad = None
    monkeypatch.setenv(nvfp4_linear.SAVED_WEIGHT_ENV, "0")
    layer(x).backward(gy)
    assert torch.equal(kept_grad, x.grad)


def test_no_weight_kept_without_input_grad(monkeypatch):
    monkeypatch.setenv(nvfp4_linear.SAVED_WEIGHT_ENV, "")
    layer, _, _ = make_layer(out_f=64, in_f=128)
    before = nvfp4_linear.saved_weight_bytes()
    layer.bias.requires_grad_(True)  # a graph, but no gradient for the input
    y = layer(torch.randn(4, 128))
    assert nvfp4_linear.saved_weight_bytes() == before
    y.sum().backward()
    assert layer.bias.grad is not None


class _Block(nn.Module):
    def __init__(self, seed):
        super().__init__()
        self.up = make_layer(out_f=96, in_f=64, bias=False, seed=seed)[0]
        self.down = make_layer(out_f=64, in_f=96, bias=False, seed=seed + 100)[0]

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


def _run_blocks(checkpointed: bool, budget_env: str, monkeypatch):
    """Four blocks of two NVFP4 layers, forward + backward; the most kept bytes seen at any layer's backward."""
    monkeypatch.setenv(nvfp4_linear.SAVED_WEIGHT_ENV, budget_env)
    blocks = nn.ModuleList([_Block(seed) for seed in range(4)])
    seen = []
    for blk in blocks:
        for lin in (blk.up, blk.down):
            lin.register_full_backward_pre_hook(lambda m, g: seen.append(nvfp4_linear.saved_weight_bytes()))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5), requires_grad=True)
    before = nvfp4_linear.saved_weight_bytes()
    h = x
    for blk in blocks:
        h = torch.utils.checkpoint.checkpoint(blk, h, use_reentrant=False) if checkpointed else blk(h)
    after_forward = nvfp4_linear.saved_weight_bytes() - before
    h.square().sum().backward()
    assert nvfp4_linear.saved_weight_bytes() == before
    return x.grad, after_forward, max(seen) - before


def test_checkpointing_keeps_one_block_at_a_time(monkeypatch):
    """Under verl's non-reentrant checkpointing nothing stays kept after the forward, and during backward only the
    recomputed block's two weights are (2 x 96 x 64 float32 = 48 KiB); gradients equal decoding again."""
    block_bytes = 2 * 96 * 64 * 4
    grad_kept, after_fwd, most = _run_blocks(True, "", monkeypatch)
    assert after_fwd == 0
    assert 0 < most <= block_bytes
    grad_again, after_fwd0, most0 = _run_blocks(True, "0", monkeypatch)
    assert after_fwd0 == 0 and most0 == 0
    assert torch.equal(grad_kept, grad_again)


def test_budget_caps_what_is_kept_without_checkpointing(monkeypatch):
    """Without checkpointing every forward would keep its weight; a budget of 3 weights' bytes keeps three (the
    first three forwards) and the other five decode again; the gradients are the same."""
    one = 96 * 64 * 4
    grad_capped, after_fwd, _ = _run_blocks(False, str(3 * one / 2**20), monkeypatch)
    assert after_fwd == 3 * one
    grad_all, after_fwd_all, _ = _run_blocks(False, "1024", monkeypatch)
    assert after_fwd_all == 8 * one
    assert torch.equal(grad_capped, grad_all)


@pytest.mark.parametrize("raw", ["-1", "lots", "nan"])
def test_bad_budget_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv(nvfp4_linear.SAVED_WEIGHT_ENV, raw)
    layer, _, _ = make_layer()
    with pytest.raises(NVFP4Error, match="QERL_ACTOR_SAVED_WEIGHT_MIB"):
        layer(torch.randn(2, 64, requires_grad=True))


# ---------------------------------------------------------------------------------------------------------
# module behaviour


def test_buffers_are_compressed_tensors_names_and_survive_dtype_casts():
    layer, _, _ = make_layer()
    sd = layer.state_dict()
    assert set(sd) == {"weight_packed", "weight_scale", "weight_global_scale", "bias"}
    assert (sd["weight_packed"].dtype, sd["weight_scale"].dtype, sd["weight_global_scale"].dtype) == (
        torch.uint8, torch.float8_e4m3fn, torch.float32)
    before = {k: v.clone() for k, v in sd.items()}
    layer.to(torch.bfloat16)
    layer.half()
    layer.float()
    after = layer.state_dict()
    for k in ("weight_packed", "weight_scale", "weight_global_scale"):
        assert after[k].dtype == before[k].dtype
        assert torch.equal(after[k].view(torch.uint8), before[k].view(torch.uint8))
    assert after["bias"].dtype == torch.float32  # the bias is an ordinary (frozen) parameter
    fresh = NVFP4Linear(64, 48, bias=True)
    fresh.load_state_dict(before)
    x = torch.randn(3, 64)
    torch.testing.assert_close(fresh(x), make_layer()[0](x))


def test_is_an_nn_linear_without_dense_weight():
    layer, _, _ = make_layer()
    assert isinstance(layer, nn.Linear) and layer.weight is None
    assert (layer.in_features, layer.out_features) == (64, 48)
    assert layer.qweight is layer.weight_packed
    assert [n for n, _ in layer.named_parameters()] == ["bias"]
    assert "format=nvfp4" in repr(layer)
    assert layer.nbytes() == 48 * 32 + 48 * 4 + 4 + 48 * 2


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(NVFP4Error, match="in_features=40 is not divisible by the NVFP4 group size 16"):
        NVFP4Linear(40, 8)
    with pytest.raises(NVFP4Error, match="not divisible by the NVFP4 group size"):
        NVFP4Linear.from_linear(nn.Linear(24, 8))
    with pytest.raises(NVFP4Error, match="already an NVFP4Linear"):
        NVFP4Linear.from_linear(make_layer()[0])
    layer, _, _ = make_layer()
    with pytest.raises(NVFP4Error, match="weight_scale: expected torch.float8_e4m3fn"):
        NVFP4Linear.from_packed(layer.weight_packed, layer.weight_scale.float(), layer.weight_global_scale)
    with pytest.raises(NVFP4Error, match="weight_packed: expected torch.uint8"):
        NVFP4Linear.from_packed(layer.weight_packed.to(torch.int8), layer.weight_scale, layer.weight_global_scale)
    with pytest.raises(NVFP4Error, match="weight_scale has shape"):
        NVFP4Linear.from_packed(layer.weight_packed, layer.weight_scale[:, :2], layer.weight_global_scale)
    with pytest.raises(NVFP4Error, match="bias has shape"):
        NVFP4Linear.from_packed(layer.weight_packed, layer.weight_scale, layer.weight_global_scale, bias=torch.zeros(3))
    with pytest.raises(NVFP4Error, match="last dimension 32"):
        layer(torch.randn(2, 32))
    with pytest.raises(NVFP4Error, match="float32/bfloat16/float16 inputs, got torch.int64"):
        layer(torch.ones(2, 64, dtype=torch.long))
    with pytest.raises(NVFP4Error, match="not exactly representable in torch.bfloat16"):
        NVFP4Linear.from_linear(nn.Linear(32, 8))  # fp32 random init: not a bf16 checkpoint's values
    assert NVFP4Linear.from_linear(nn.Linear(32, 8), quant_dtype=None).in_features == 32
    layer._buffers["weight_global_scale"] = layer.weight_global_scale.to(torch.bfloat16)
    with pytest.raises(NVFP4Error, match="buffer_dtype: fp32"):
        layer(torch.randn(2, 64))


def test_fsdp_buffer_cast_leaves_the_nvfp4_bytes_alone():
    """FSDP1 MixedPrecision(buffer_dtype=fp32) casts every floating buffer in place, with this very function."""
    from torch.distributed.fsdp._runtime_utils import _cast_buffers_to_dtype_and_device

    layer, _, _ = make_layer()
    x = torch.randn(3, 64)
    y = layer(x)
    before = {n: (b.dtype, b.numel() * b.element_size()) for n, b in layer.named_buffers()}
    buffers = list(layer.buffers())
    _cast_buffers_to_dtype_and_device(buffers, [torch.float32] * len(buffers), torch.device("cpu"))
    after = {n: (b.dtype, b.numel() * b.element_size()) for n, b in layer.named_buffers()}
    assert after == before  # uint8 codes, uint8 FP8 bytes, fp32 global scale: nothing grows
    assert layer.weight_scale.dtype == torch.float8_e4m3fn
    assert torch.equal(layer(x), y)
    _cast_buffers_to_dtype_and_device(buffers, [torch.bfloat16] * len(buffers), torch.device("cpu"))
    with pytest.raises(NVFP4Error, match="buffer_dtype: fp32"):
        layer(x)


def test_state_dict_takes_fp8_or_bytes_and_rejects_non_fp8_values():
    layer, _, _ = make_layer()
    sd = layer.state_dict()
    for variant in (sd["weight_scale"], sd["weight_scale"].view(torch.uint8), sd["weight_scale"].float()):
        fresh = NVFP4Linear(64, 48, bias=True)
        fresh.load_state_dict(dict(sd, weight_scale=variant))
        assert torch.equal(fresh.weight_scale.view(torch.uint8), layer.weight_scale.view(torch.uint8))
    bad = dict(sd, weight_scale=sd["weight_scale"].float() + 0.01)
    with pytest.raises(RuntimeError, match="not FP8-E4M3"):
        NVFP4Linear(64, 48, bias=True).load_state_dict(bad)
    assert sd["weight_scale"].dtype == torch.float8_e4m3fn  # the caller's dict is left as it was


def test_scale_cast_by_a_wrapper_decodes_the_same():
    """Scales assigned as wider floats (FP8 values are exact there) decode to the same bits."""
    layer, _, _ = make_layer()
    x = torch.randn(3, 64)
    y = layer(x)
    layer._buffers["weight_scale"] = layer.weight_scale.float()
    assert torch.equal(layer(x), y)


def test_dispatch_uses_torch_on_cpu_and_validates():
    layer, _, _ = make_layer()
    a = kernels.dequantize(layer.weight_packed, layer.weight_scale, layer.weight_global_scale, torch.float16)
    assert torch.equal(a, nvfp4.dequantize(layer.weight_packed, layer.weight_scale, layer.weight_global_scale, torch.float16))
    a8 = kernels.dequantize(layer.weight_packed, layer.weight_scale.view(torch.uint8), layer.weight_global_scale)
    assert torch.equal(a8.view(torch.int16), layer.dequantize_weight().view(torch.int16))
    with pytest.raises(NVFP4Error, match="weight_scale must be float8_e4m3fn"):
        kernels.dequantize(layer.weight_packed, layer.weight_scale.float(), layer.weight_global_scale)
    with pytest.raises(NVFP4Error, match="float32, bfloat16 or float16"):
        kernels.dequantize(layer.weight_packed, layer.weight_scale, layer.weight_global_scale, torch.float64)
    with pytest.raises(NVFP4Error, match="one float32 value"):
        kernels.dequantize(layer.weight_packed, layer.weight_scale, torch.ones(2))
    with pytest.raises(ValueError, match="backend"):
        kernels.dequantize(layer.weight_packed, layer.weight_scale, layer.weight_global_scale, backend="cuda")
    if not kernels.triton_interpreting():
        with pytest.raises((NVFP4Error, RuntimeError), match="CUDA|Triton"):
            kernels.dequantize_nvfp4_triton(layer.weight_packed, layer.weight_scale, layer.weight_global_scale)


# ---------------------------------------------------------------------------------------------------------
# GPU


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton kernel and CUDA matmuls)")


@pytest.mark.gpu
@cuda
def test_gpu_forward_backward():
    layer, w, b = make_layer(out_f=256, in_f=512)
    layer = layer.cuda()
    x = torch.randn(4, 33, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    g = torch.randn_like(y)
    y.backward(g)
    wd = w.cuda().double()
    torch.testing.assert_close(y.double(), x.detach().double() @ wd.T + b.cuda().double(), rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(x.grad.double(), g.double() @ wd, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("autocast", [False, True])
def test_kept_and_decode_again_paths_agree_with_bias_and_3d_inputs(monkeypatch, autocast):
    """The two backward paths (autograd's own matmul keeping the decoded weight; the custom function decoding again)
    give the same output and the same input and bias gradients, for [B, T, in] inputs, fp32 and bf16 autocast."""
    layer, _, _ = make_layer(out_f=48, in_f=64, bias=True)
    layer.bias.requires_grad_(True)
    x0 = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3))
    results = []
    for budget in ("", "0"):
        monkeypatch.setenv(nvfp4_linear.SAVED_WEIGHT_ENV, budget)
        x = x0.clone().requires_grad_(True)
        layer.bias.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(x)
        y.float().square().sum().backward()
        results.append((y.detach(), x.grad, layer.bias.grad))
    assert results[0][0].dtype == (torch.bfloat16 if autocast else torch.float32)
    for kept, again in zip(*results):
        torch.testing.assert_close(kept, again, rtol=0, atol=0)


def test_a_failed_decode_keeps_no_bytes_reserved(monkeypatch):
    """A decode that raises (here: an FP8 scale buffer of the wrong shape) leaves the kept-byte count as it was, so
    later layers still get the whole budget."""
    monkeypatch.setenv(nvfp4_linear.SAVED_WEIGHT_ENV, "")
    layer, _, _ = make_layer()
    layer._buffers["weight_scale"] = torch.zeros(layer.out_features, layer.in_features // 16 + 1, dtype=torch.uint8)
    before = nvfp4_linear.saved_weight_bytes()
    with pytest.raises(NVFP4Error, match="weight_scale has shape"):
        layer(torch.randn(2, 64, requires_grad=True))
    assert nvfp4_linear.saved_weight_bytes() == before
