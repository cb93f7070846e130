"""The dense single-adapter LoRA path against vLLM's own punica arithmetic (its CPU torch ops) on the CPU.

The GPU check (dense vs punica's Triton kernels inside an engine, and its speed) is
scripts/gpu/bench_rollout.py's ``dense-lora`` variant.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.lora.layers import LoRAMapping  # noqa: E402
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU  # noqa: E402

from qerl_plugin import options  # noqa: E402
from vllm_ext import lora_dense  # noqa: E402
from vllm_ext.lora_dense import dense_lora_linear  # noqa: E402


@pytest.fixture(autouse=True)
def _no_pinned_memory(monkeypatch):
    # vLLM's metadata upload pins host memory, which needs a CUDA driver; the CPU reference needs none
    import vllm.utils.torch_utils as tu

    monkeypatch.setattr(tu, "PIN_MEMORY", False)


def _stacked(rank, in_features, out_slices, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    a = tuple(torch.randn(1, 1, rank, in_features, generator=g).to(dtype) / in_features**0.5 for _ in out_slices)
    b = tuple(torch.randn(1, 1, out, rank, generator=g).to(dtype) / rank**0.5 for out in out_slices)
    return a, b


def _punica(index_mapping, prefill, max_tokens=64):
    w = PunicaWrapperCPU(max_tokens, 8, device="cpu")
    n = len(index_mapping)
    prompt_mapping = index_mapping if not prefill else (index_mapping[0],)
    # adapter id 1 sits in slot 0; id 0 means "no adapter" (slot -1)
    w.update_metadata(LoRAMapping(index_mapping, prompt_mapping, is_prefill=prefill), [1], 1, 32000)
    assert w._token_lora_indices[:n].tolist() == [0 if i == 1 else -1 for i in index_mapping]
    return w


@pytest.mark.parametrize("out_slices", [(48,), (32, 16, 16), (64, 64)])
@pytest.mark.parametrize("prefill", [False, True])
def test_dense_equals_punica_for_one_adapter(out_slices, prefill):
    torch.manual_seed(0)
    n, k, r = 12, 32, 8
    dtype = torch.float32  # the reference's own arithmetic, so the two agree to float32 rounding
    x = torch.randn(n, k, dtype=dtype)
    y0 = torch.randn(n, sum(out_slices), dtype=dtype)
    a, b = _stacked(r, k, out_slices, 1, dtype)
    mapping = (1,) * n if prefill else (1,) * (n - 3) + (0, 1, 0)  # decode batch: two tokens without the adapter
    w = _punica(mapping, prefill)
    ref = y0.clone()
    w.add_lora_linear(ref, x, a, b, 1.0, out_slices)
    got = y0.clone()
    dense_lora_linear(got, x, a, b, 1.0, out_slices, w._token_lora_indices)
    served = torch.tensor([i == 1 for i in mapping])
    torch.testing.assert_close(got[served], ref[served], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[served], y0[served])  # the adapter really contributed
    # Tokens without an adapter (slot -1) stay as they are, as vLLM's Triton kernels leave them ("exits early
    # when lora_id == -1"). vLLM's CPU torch ops are no reference there: they index the weights with -1.
    assert torch.equal(got[~served], y0[~served])


def test_scale_and_overwrite_mode():
    torch.manual_seed(1)
    n, k, r, out = 6, 16, 4, (16, 8)
    x = torch.randn(n, k)
    a, b = _stacked(r, k, out, 2, torch.float32)
    idx = torch.tensor([0, 0, -1, 0, 0, 0])
    y = torch.randn(n, sum(out))
    expect = torch.cat([(x @ a[i][0, 0].t()) @ b[i][0, 0].t() for i in range(2)], dim=1) * 0.5
    expect[2] = 0
    got = y.clone()
    dense_lora_linear(got, x, a, b, 0.5, out, idx, add_inputs=False)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-6)
    got = y.clone()
    dense_lora_linear(got, x, a, b, 0.5, out, idx)
    torch.testing.assert_close(got, y + expect, rtol=1e-5, atol=1e-6)


def test_bf16_within_punicas_own_rounding():
    """In bf16 the two paths round at different places; their gap stays within what bf16 itself rounds."""
    torch.manual_seed(2)
    n, k, r, out = 16, 64, 16, (64, 32, 32)
    x = torch.randn(n, k, dtype=torch.bfloat16)
    y0 = torch.randn(n, sum(out), dtype=torch.bfloat16)
    a, b = _stacked(r, k, out, 3, torch.bfloat16)
    w = _punica((1,) * n, False)
    ref, got = y0.clone(), y0.clone()
    w.add_lora_linear(ref, x, a, b, 1.0, out)
    dense_lora_linear(got, x, a, b, 1.0, out, w._token_lora_indices)
    exact = y0.float() + torch.cat([(x.float() @ a[i][0, 0].float().t()) @ b[i][0, 0].float().t() for i in range(3)], 1)
    floor = (ref.float() - exact).abs().max()
    assert (got.float() - exact).abs().max() <= 2 * floor + 1e-2


def test_platform_names_the_wrapper_once_registered():
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU
    from vllm.utils.import_utils import resolve_obj_by_qualname

    class Platform:
        @classmethod
        def get_punica_wrapper(cls) -> str:
            return "vllm.lora.punica_wrapper.punica_gpu.PunicaWrapperGPU"

    lora_dense.register(Platform)
    lora_dense.register(Platform)  # idempotent
    assert Platform.get_punica_wrapper() == lora_dense.QUALNAME
    wrapper_cls = resolve_obj_by_qualname(Platform.get_punica_wrapper())
    from vllm_ext.lora_dense_wrapper import QerlPunicaWrapper

    assert issubclass(wrapper_cls, PunicaWrapperGPU) and wrapper_cls is QerlPunicaWrapper


def test_dense_is_asked_for_per_engine(monkeypatch):
    import types

    import vllm.config

    assert lora_dense.requested_mode() != "dense"  # no engine being built
    for extra, want in (({}, False), ({"qerl_lora": "punica"}, False), ({"qerl_lora": "Dense"}, True)):
        # the engine's config while vLLM builds its LoRA manager (a VllmConfig needs a device to be built here)
        config = types.SimpleNamespace(additional_config=extra)
        monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: config)
        assert (lora_dense.requested_mode() == "dense") is want
    with pytest.raises(ValueError, match="qerl_lora.*expected one of fused, punica, dense"):
        options.lora_mode({"qerl_lora": "cublas"})


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64, 300])
def test_gpu_dense_matches_punica_triton(tokens):
    """On the GPU: the dense path against vLLM's Triton punica kernels, bf16, within their own rounding."""
    from vllm.config.lora import LoRAConfig
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    torch.manual_seed(3)
    k, r, out = 512, 16, (512, 128, 128)
    cfg = LoRAConfig(max_loras=1, max_lora_rank=r, lora_dtype=torch.bfloat16)
    w = PunicaWrapperGPU(1024, 256, device="cuda", lora_config=cfg)
    mapping = tuple(0 if i % 5 == 4 else 1 for i in range(tokens))  # every fifth token without the adapter; 1 token: served
    w.update_metadata(LoRAMapping(mapping, mapping, is_prefill=False), [1], 1, 32000)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    y0 = torch.randn(tokens, sum(out), device="cuda", dtype=torch.bfloat16)
    a, b = _stacked(r, k, out, 4, torch.bfloat16)
    a, b = tuple(t.cuda() for t in a), tuple(t.cuda() for t in b)
    ref, got = y0.clone(), y0.clone()
    w.add_lora_linear(ref, x, a, b, 1.0, out)
    dense_lora_linear(got, x, a, b, 1.0, out, w._token_lora_indices)
    served = torch.tensor(mapping, device="cuda") == 1
    exact = y0.float() + torch.cat([(x.float() @ a[i][0, 0].float().t()) @ b[i][0, 0].float().t() for i in range(3)], 1)
    floor = (ref.float() - exact)[served].abs().max()
    assert (got.float() - exact)[served].abs().max() <= 2 * floor + 1e-2
    assert torch.equal(got[~served], y0[~served]) and torch.equal(ref[~served], y0[~served])


def _merged_layer(kind: str, wrapper_mode: str):
    """A real vLLM merged column-parallel LoRA layer (gate/up or q/k/v, float32, one adapter in slot 0) whose
    punica wrapper is qerl's in ``wrapper_mode``. The wrapper is built without PunicaWrapperGPU's Triton
    metadata (it needs Triton's GPU backend); the qerl paths read only the base class's token indices."""
    from vllm.config.lora import LoRAConfig
    from vllm.lora.layers import MergedColumnParallelLinearWithLoRA, MergedQKVParallelLinearWithLoRA
    from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    from vllm_ext.lora_dense_wrapper import QerlPunicaWrapper

    torch.manual_seed(5)
    k, r = 64, 16
    if kind == "gate_up":
        base = MergedColumnParallelLinear(k, [48, 80], bias=False, params_dtype=torch.float32)
        layer = MergedColumnParallelLinearWithLoRA(base)
    else:
        base = QKVParallelLinear(k, head_size=16, total_num_heads=4, total_num_kv_heads=2, bias=True,
                                 params_dtype=torch.float32)
        base.bias.data.normal_()
        layer = MergedQKVParallelLinearWithLoRA(base)
    base.weight.data.normal_()
    cfg = LoRAConfig(max_loras=1, max_lora_rank=r, lora_dtype=torch.float32)
    layer.create_lora_weights(1, cfg)
    w = QerlPunicaWrapper.__new__(QerlPunicaWrapper)
    PunicaWrapperBase.__init__(w, 64, 8, "cpu")
    w.lora_config, w.max_loras, w.qerl_mode = cfg, 1, wrapper_mode
    mapping = (1, 1, 0, 1, 1)  # the third token has no adapter
    PunicaWrapperBase.update_metadata(w, LoRAMapping(mapping, mapping, is_prefill=False), [1], 1, 32000)
    layer.set_mapping(w)
    a = [torch.randn(r, k) / k**0.5 for _ in layer.output_slices]
    b = [torch.randn(n, r) / r**0.5 for n in layer.output_slices]
    layer.set_lora(0, a, b)
    return layer, base, a, b, torch.tensor(mapping) == 1


@pytest.mark.parametrize("kind", ["gate_up", "qkv"])
def test_merged_layers_take_the_qerl_path(cpu_config, kind):
    """vLLM 0.24 sends merged q/k/v and gate/up LoRA layers through add_shrink/add_expand, past the wrapper's
    add_lora_linear; route_merged_layers brings them back to it (base GEMM + add_lora_linear, same arithmetic)."""
    from vllm.config import set_current_vllm_config

    from vllm_ext.lora_dense_wrapper import route_merged_layers

    with set_current_vllm_config(cpu_config):
        route_merged_layers()
        layer, base, a, b, served = _merged_layer(kind, "dense")
        calls = []
        original = layer.punica_wrapper.add_lora_linear
        layer.punica_wrapper.add_lora_linear = lambda *args, **kw: calls.append(args[-1]) or original(*args, **kw)

        def no_shrink(*args, **kw):
            raise AssertionError("the merged layer went through add_shrink (vLLM's _mcp_apply)")

        layer.punica_wrapper.add_shrink = no_shrink
        x = torch.randn(5, 64)
        out = layer(x)
        out = out[0] if isinstance(out, tuple) else out
    assert calls == [tuple(layer.output_slices)]  # one add_lora_linear call with every slice
    plain = torch.nn.functional.linear(x, base.weight, base.bias)
    delta = torch.cat([(x @ ai.t()) @ bi.t() for ai, bi in zip(a, b)], dim=1)
    torch.testing.assert_close(out[served], (plain + delta)[served], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out[~served], plain[~served], rtol=1e-5, atol=1e-5)


def test_merged_layers_keep_vllms_route_on_punica(cpu_config):
    import pkgutil

    from vllm.config import set_current_vllm_config

    from vllm_ext import lora_dense_wrapper as ldw

    with set_current_vllm_config(cpu_config):
        ldw.route_merged_layers()
        ldw.route_merged_layers()  # idempotent: one wrapper around vLLM's function
        patched = pkgutil.resolve_name(ldw.MERGED_APPLY_TARGET)
        assert patched.__qerl_patch__ and not getattr(patched.__wrapped__, "__qerl_patch__", False)
        layer, *_ = _merged_layer("gate_up", "punica")

        class Shrink(Exception):
            pass

        def shrink(*args, **kw):
            raise Shrink

        layer.punica_wrapper.add_shrink = shrink
        with pytest.raises(Shrink):  # punica mode: vLLM's own add_shrink/add_expand route, unchanged
            layer(torch.randn(5, 64))
        layer, *_ = _merged_layer("qkv", "fused")
        layer.tp_size = 2  # tensor parallelism: _mcp_apply's gather/communication route stays vLLM's
        layer.punica_wrapper.add_shrink = shrink
        with pytest.raises(Shrink):
            layer(torch.randn(5, 64))
