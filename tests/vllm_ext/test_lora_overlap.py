"""The ``overlap`` LoRA mode (vllm_ext.lora_dense_wrapper): one op per LoRA linear that runs the base GEMM on the
current CUDA stream and the one-launch LoRA kernel (vllm_ext.lora_fused, writing the update into a scratch
tensor) on a side stream, then joins and adds.

CPU: real vLLM LoRA layers (merged gate/up and q/k/v, row-parallel o_proj) in float32 reach the op in the
overlap mode, eagerly and under ``torch.compile(fullgraph=True)``; the layer is found by name; the result equals
the base linear plus the adapter computed independently in torch. On the CPU the op runs its in-order path (no
streams), with the wrapper's update replaced by the torch reference. GPU: the streams themselves, bf16 on the 7B
shapes, eager and replayed from a CUDA graph, against the exact fp32 result and the fused mode's output.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm")

from vllm.lora.layers import LoRAMapping  # noqa: E402

from qerl_plugin import notices, options  # noqa: E402
from vllm_ext import lora_dense_wrapper as ldw  # noqa: E402
from vllm_ext.lora_dense import dense_lora_linear  # noqa: E402


@pytest.fixture(autouse=True)
def _no_pinned_memory(monkeypatch):
    # vLLM's metadata upload pins host memory, which needs a CUDA driver
    import vllm.utils.torch_utils as tu

    monkeypatch.setattr(tu, "PIN_MEMORY", False)


def test_overlap_is_a_lora_mode():
    assert "overlap" in options.LORA_MODES
    assert options.lora_mode({"qerl_lora": " Overlap "}) == "overlap"
    assert options.LORA_DEFAULT in options.LORA_MODES


# layer sizes: (in features, gate/up outputs, q/k/v head size / heads / kv heads, o_proj outputs)
SMALL = (64, [48, 80], (16, 4, 2), 96)
QWEN_7B = {"qkv": 3584, "gate_up": 3584, "o": 3584, "down": 18944}  # in features of the 7B LoRA linears


def _sizes_7b(kind: str):
    return (QWEN_7B[kind], [18944, 18944], (128, 28, 4), 3584)


def _layer(kind: str, mode: str, *, prefix: str | None = None, sizes=SMALL, r: int = 16, dtype=torch.float32,
           device: str = "cpu", wrapper=None):
    """A real vLLM LoRA layer (gate_up, qkv, or a row-parallel o/down), one adapter in slot 0, whose punica wrapper
    is ``wrapper`` or else qerl's in ``mode`` built without PunicaWrapperGPU's Triton metadata (tokens 0, 1, 3, 4
    served, token 2 without the adapter). Returns the layer, its base layer, and the adapter's A and B per slice."""
    from vllm.config.lora import LoRAConfig
    from vllm.lora.layers import (MergedColumnParallelLinearWithLoRA, MergedQKVParallelLinearWithLoRA,
                                  RowParallelLinearWithLoRA)
    from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    ldw.route_merged_layers()  # what QerlPunicaWrapper.__init__ does before vLLM hands layers their wrapper
    k, gate_up, (head, heads, kv_heads), row_out = sizes
    prefix = f"model.layers.0.{kind}" if prefix is None else prefix
    cfg = LoRAConfig(max_loras=1, max_lora_rank=r, lora_dtype=dtype)
    with torch.device(device):
        if kind == "gate_up":
            base = MergedColumnParallelLinear(k, gate_up, bias=False, params_dtype=dtype, prefix=prefix)
            layer = MergedColumnParallelLinearWithLoRA(base)
        elif kind == "qkv":
            base = QKVParallelLinear(k, head_size=head, total_num_heads=heads, total_num_kv_heads=kv_heads, bias=True,
                                     params_dtype=dtype, prefix=prefix)
            base.bias.data.normal_()
            layer = MergedQKVParallelLinearWithLoRA(base)
        else:
            base = RowParallelLinear(k, row_out, bias=False, params_dtype=dtype, prefix=prefix)
            layer = RowParallelLinearWithLoRA(base)
        base.weight.data.normal_(std=k**-0.5)
        layer.create_lora_weights(1, cfg)
    if wrapper is None:
        wrapper = ldw.QerlPunicaWrapper.__new__(ldw.QerlPunicaWrapper)
        PunicaWrapperBase.__init__(wrapper, 64, 8, device)
        wrapper.lora_config, wrapper.max_loras, wrapper.qerl_mode = cfg, 1, mode
        wrapper._qerl_sync, wrapper._qerl_side = None, None
        mapping = (1, 1, 0, 1, 1)
        PunicaWrapperBase.update_metadata(wrapper, LoRAMapping(mapping, mapping, is_prefill=False), [1], 1, 32000)
    layer.set_mapping(wrapper)
    g = torch.Generator().manual_seed(len(kind))
    a = [(torch.randn(r, k, generator=g) / k**0.5).to(device, dtype) for _ in layer.output_slices]
    b = [(torch.randn(n, r, generator=g) / r**0.5).to(device, dtype) for n in layer.output_slices]
    layer.set_lora(0, a if len(a) > 1 else a[0], b if len(b) > 1 else b[0])
    return layer, base, a, b


def _torch_update(wrapper):
    """The wrapper's ``add_lora_linear`` replaced by the torch statement of one adapter (vllm_ext.lora_dense), so
    the CPU path needs no Triton; the calls are recorded."""
    calls = []

    def add(y, x, a, b, scale, slices, **kw):
        calls.append((tuple(y.shape), tuple(slices)))
        dense_lora_linear(y, x, a, b, scale, slices, wrapper._token_lora_indices, add_inputs=True)

    wrapper.add_lora_linear = add
    return calls


def _call(layer, x):
    """The layer's forward, as the model calls it (it passes the bias on to ``apply``)."""
    out = layer(x)
    return out[0] if isinstance(out, tuple) else out


def _expected(base, a, b, x, served):
    plain = torch.nn.functional.linear(x, base.weight, getattr(base, "bias", None))
    delta = torch.cat([(x @ ai.t()) @ bi.t() for ai, bi in zip(a, b)], dim=1)
    return torch.where(served[:, None], plain + delta, plain), plain


@pytest.mark.parametrize("kind", ["gate_up", "qkv", "o"])
def test_overlap_mode_routes_each_linear_through_the_op(cpu_config, monkeypatch, kind):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(cpu_config):
        layer, base, a, b = _layer(kind, "overlap")
        assert layer in ldw._LAYERS[base.prefix]  # registered by name when the layer got its wrapper
        calls = _torch_update(layer.punica_wrapper)
        ops = []
        real = ldw._apply_overlapped
        monkeypatch.setattr(ldw, "_apply_overlapped", lambda *args, **kw: ops.append(args[0]) or real(*args, **kw))
        x = torch.randn(5, 64)
        out = _call(layer, x)
    assert ops == [layer]  # one op call, which found this layer by its name
    assert calls == [((5, sum(layer.output_slices)), tuple(layer.output_slices))]  # CPU: in order, one update
    served = torch.tensor([True, True, False, True, True])
    want, plain = _expected(base, a, b, x, served)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out[~served], plain[~served], rtol=1e-5, atol=1e-5)


def _compiled(layer, x):
    """The layer's forward under torch.compile as vLLM runs it (fullgraph, a symbolic token count): its result on
    ``x`` and the targets of the traced graph's function calls. Dynamo's caches are reset first: every call
    compiles the same lambda for another layer, which would otherwise count as recompilations."""
    torch._dynamo.reset()
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    compiled = torch.compile(lambda x: _call(layer, x), backend=backend, dynamic=True, fullgraph=True)
    return compiled(x), seen


@pytest.mark.parametrize("kind", ["gate_up", "o"])
def test_overlap_op_is_one_opaque_node_under_torch_compile(cpu_config, kind):
    """vLLM compiles the model with fullgraph=True and a symbolic token count: the routed apply must trace into
    one ``qerl::linear_lora_overlap`` node, with no graph break, and give the eager result."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(cpu_config):
        layer, base, a, b = _layer(kind, "overlap", prefix=f"compiled.{kind}")
        _torch_update(layer.punica_wrapper)
        x = torch.randn(5, 64)
        got, seen = _compiled(layer, x)
        eager = _call(layer, x)
    assert sum("linear_lora_overlap" in t for t in seen) == 1, seen
    assert not any("linear.default" in t or t.endswith("mm") for t in seen), seen  # the base GEMM is inside the op
    torch.testing.assert_close(got, eager, rtol=0, atol=0)


def test_overlap_op_schema_and_fake_kernel(cpu_config):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(cpu_config):
        layer, base, *_ = _layer("gate_up", "overlap", prefix="opcheck.gate_up")
        _torch_update(layer.punica_wrapper)
        x = torch.randn(5, 64)
        a0 = layer.lora_a_stacked[0]
        torch.library.opcheck(ldw.linear_lora_overlap, (x, None, a0, base.prefix, 128),
                              test_utils=("test_schema", "test_faketensor"))
        out = torch.ops.qerl.linear_lora_overlap(x, None, a0, base.prefix, 128)
    assert out.shape == (5, 128)


@pytest.mark.parametrize("split", ["1", "0", ""])
@pytest.mark.parametrize("kind", ["gate_up", "qkv", "o"])
def test_the_add_is_left_to_the_compiled_model_when_asked(cpu_config, monkeypatch, kind, split):
    """With ``QERL_LORA_SPLIT_ADD`` 1 or unset (the default since §4ah) the overlap op returns the base output and the
    update apart and the traced model adds them (one ``qerl::linear_lora_overlap_split`` node, then an add that
    torch.compile can fuse into the next kernel), except on q/k/v; with 0 the add stays inside
    ``qerl::linear_lora_overlap``. Same result either way."""
    from vllm.config import set_current_vllm_config

    if split:
        monkeypatch.setenv(options.LORA_SPLIT_ADD_ENV, split)
    else:  # unset: the default
        monkeypatch.delenv(options.LORA_SPLIT_ADD_ENV, raising=False)
    with set_current_vllm_config(cpu_config):
        layer, base, a, b = _layer(kind, "overlap", prefix=f"split{split or 'unset'}.{kind}")
        _torch_update(layer.punica_wrapper)
        splits = split in ("1", "") and kind != "qkv"
        assert ldw.split_add(layer) is splits
        x = torch.randn(5, 64)
        got, nodes = _compiled(layer, x)
    ops = [t for t in nodes if "linear_lora_overlap" in t]
    if splits:
        assert ops == ["qerl.linear_lora_overlap_split"], nodes
        after = nodes[nodes.index(ops[0]) + 1:]
        assert any("add" in t for t in after), nodes  # the sum, in the graph
    else:
        assert ops == ["qerl.linear_lora_overlap"], nodes
    served = torch.tensor([True, True, False, True, True])
    want, _ = _expected(base, a, b, x, served)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_split_op_schema_fake_kernel_and_its_parts(cpu_config):
    """The split op's two outputs: on the CPU (in order) the whole output and zeros."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(cpu_config):
        layer, base, a, b = _layer("gate_up", "overlap", prefix="opcheck_split.gate_up")
        _torch_update(layer.punica_wrapper)
        x = torch.randn(5, 64)
        a0 = layer.lora_a_stacked[0]
        torch.library.opcheck(ldw.linear_lora_overlap_split, (x, None, a0, base.prefix, 128),
                              test_utils=("test_schema", "test_faketensor"))
        out, update = torch.ops.qerl.linear_lora_overlap_split(x, None, a0, base.prefix, 128)
    assert out.shape == update.shape == (5, 128)
    assert torch.count_nonzero(update) == 0
    want, _ = _expected(base, a, b, x, torch.tensor([True, True, False, True, True]))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)


def test_a_bad_split_switch_is_an_error_naming_it(cpu_config, monkeypatch):
    from vllm.config import set_current_vllm_config

    monkeypatch.setenv(options.LORA_SPLIT_ADD_ENV, "maybe")
    with set_current_vllm_config(cpu_config):
        layer, *_ = _layer("o", "overlap", prefix="badswitch.o")
        with pytest.raises(ValueError, match="QERL_LORA_SPLIT_ADD: expected true or false, got 'maybe'"):
            ldw.split_add(layer)


def test_an_unknown_layer_name_is_an_error_naming_it():
    with pytest.raises(RuntimeError, match="no LoRA layer named 'model.layers.99.mlp.down_proj'"):
        torch.ops.qerl.linear_lora_overlap(torch.zeros(1, 4), None, torch.zeros(1, 1, 2, 4),
                                           "model.layers.99.mlp.down_proj", 4)


@pytest.mark.parametrize("kind", ["gate_up", "o"])
def test_two_engines_with_the_same_layer_names_each_get_their_own_layer(cpu_config, kind):
    """Two engines in one process register the same names (``model.layers.0...``): each call must run the layer
    of the engine that made it (found by the LoRA-A tensor the call passes), compiled or not."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(cpu_config):
        first, base1, a1, b1 = _layer(kind, "overlap", prefix=f"twice.{kind}")
        second, base2, a2, b2 = _layer(kind, "overlap", prefix=f"twice.{kind}")
        second.base_layer.weight.data.mul_(-1.0)  # another base and adapter, so a mix-up shows in the output
        for stacked in second.lora_a_stacked:
            stacked.mul_(2.0)
        a2 = [ai * 2.0 for ai in a2]
        assert len(ldw._LAYERS[f"twice.{kind}"]) == 2
        for layer in (first, second):
            _torch_update(layer.punica_wrapper)
        x = torch.randn(5, 64)
        eager = [_call(layer, x) for layer in (first, second)]
        compiled = [torch.compile(lambda x, layer=layer: _call(layer, x), backend="eager", dynamic=True,
                                  fullgraph=True)(x) for layer in (first, second)]
    served = torch.tensor([True, True, False, True, True])
    for got, (base, a, b) in zip(eager, ((base1, a1, b1), (base2, a2, b2))):
        torch.testing.assert_close(got, _expected(base, a, b, x, served)[0], rtol=1e-5, atol=1e-4)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # a copy (as a compiler might pass) is found by its values; a tensor of neither engine is an error
    copy = first.lora_a_stacked[0].clone()
    assert ldw._registered(f"twice.{kind}", copy) is first
    with pytest.raises(RuntimeError, match="2 LoRA layers named .* and 0 hold the LoRA-A values"):
        ldw._registered(f"twice.{kind}", torch.zeros_like(copy))


def test_other_modes_keep_their_paths_and_register_nothing(cpu_config, monkeypatch):
    """fused: o_proj's apply is vLLM's (base GEMM, then the wrapper's add_lora_linear); no layer is registered,
    and the op is never called."""
    from vllm.config import set_current_vllm_config

    monkeypatch.setattr(ldw, "_apply_overlapped", lambda *a: pytest.fail("the overlap op ran in the fused mode"))
    with set_current_vllm_config(cpu_config):
        layer, base, a, b = _layer("o", "fused", prefix="fused.o_proj")
        calls = _torch_update(layer.punica_wrapper)
        x = torch.randn(5, 64)
        out = _call(layer, x)
    assert "fused.o_proj" not in ldw._LAYERS
    assert len(calls) == 1
    want, _ = _expected(base, a, b, x, torch.tensor([True, True, False, True, True]))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)


def _give_row_copy(base):  # noqa: ANN001, ANN202
    """``base`` (a LoRA layer's base layer) given decode_gemv's copy of its weight in the checkpoint layout and a real
    MarlinBackend (decode_gemv "all") that offers it through ``row_weights``; returns ``(the NVFP4 weight,
    backend)``."""
    from types import SimpleNamespace

    from qerl_plugin import nvfp4
    from vllm_ext.nvfp4_backends import MarlinBackend

    q = nvfp4.quantize(base.weight.data.to(torch.bfloat16))
    for name, t in (("qerl_gemv_packed", q.packed), ("qerl_gemv_scale", q.scale),
                    ("qerl_gemv_gscale", q.global_scale.reshape(1).float())):
        base.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    backend = MarlinBackend.__new__(MarlinBackend)  # its __init__ refuses a machine without CUDA
    backend.decode_gemv = "all"
    base.quant_method = SimpleNamespace(backend=backend, apply=base.quant_method.apply)
    return q, backend


ROW_SIZES = (256, [48, 80], (16, 4, 2), 96)  # in features a multiple of 128: the one-row kernel's tiles take them
ROW_ENV = "QERL_TEST_ROW_PATH"  # set by test_row_path_under_the_interpreter for its subprocess


@pytest.mark.skipif(os.environ.get(ROW_ENV) != "1", reason="runs in the subprocess of "
                    "test_row_path_under_the_interpreter (TRITON_INTERPRET must be set before Triton is imported)")
@pytest.mark.parametrize("kind", ["qkv", "gate_up", "o"])
def test_decode_gemv_one_row_calls_take_the_row_lora_path(cpu_config, monkeypatch, caplog, kind):
    """A layer whose backend has decode_gemv's copy of the weight (a real MarlinBackend's ``row_weights``): a
    one-row call in the overlap mode runs vllm_ext.nvfp4_gemv_lora (interpreted) and gives the in-order result
    (the dequantized weight's GEMM, then the adapter in torch) within float16 rounding; five rows run in order. The
    split op's one-row call returns the same output and the kernel's zeros."""
    import logging

    from vllm.config import set_current_vllm_config

    from qerl_plugin import nvfp4

    monkeypatch.setattr(ldw, "_LOGGED", set())
    caplog.set_level(logging.WARNING, logger="qerl.vllm.lora_dense")
    torch.manual_seed(11)  # the base weights (five random draws used at most a quarter of the tolerance)
    k = ROW_SIZES[0]
    with set_current_vllm_config(cpu_config):
        layer, base, a, b = _layer(kind, "overlap", prefix=f"row.{kind}", sizes=ROW_SIZES, dtype=torch.float16)
        _torch_update(layer.punica_wrapper)
        q, backend = _give_row_copy(base)
        base.weight.data.copy_(nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).half())
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(7)).half()
        one = _call(layer, x)
        assert "LoRA call with 1 tokens on the row+lora path" in caplog.text
        assert ldw.split_add(layer) is (kind != "qkv")
        # the split op on the row path: the whole output (the kernel adds the update) and the zeros it also writes
        out, update = torch.ops.qerl.linear_lora_overlap_split(x, getattr(base, "bias", None), layer.lora_a_stacked[0],
                                                               base.prefix, sum(layer.output_slices))
        assert torch.equal(update, torch.zeros_like(one)), update
        assert torch.equal(out, one), (out - one).abs().max()
        backend.decode_gemv = "off"  # no row copy offered: the same call in order
        in_order = _call(layer, x)
        caplog.clear()
        backend.decode_gemv = "all"
        five = _call(layer, torch.randn(5, k).half())
        assert "row+lora path" not in caplog.text and five.shape == (5, sum(layer.output_slices))
    assert one.shape == in_order.shape == (1, sum(layer.output_slices))
    # the two paths round the base result and the update separately, each in float16, and the in-order GEMM sums in
    # another order: a few float16 steps of the largest output (where base and update cancel, of the parts' size)
    diff = (one.float() - in_order.float()).abs()
    assert diff.max().item() <= 2.0**-8 * in_order.float().abs().max().item(), diff.max()


def test_a_row_call_the_kernel_refuses_says_why_and_runs_in_order(cpu_config, monkeypatch, caplog):
    """decode_gemv's copy is there but the call does not fit the row+lora path (a gate/up slice of 50 rows: blocks of 4
    would straddle the two slices): one warning naming the layer and the reason, and the in-order result. No kernel
    runs, so no interpreter."""
    import logging

    from vllm.config import set_current_vllm_config


    notices.forget(ldw.ROW_REFUSAL_KEY)
    monkeypatch.setattr(ldw, "_interpreting", lambda: True)  # reach the one-row branch on the CPU
    caplog.set_level(logging.WARNING, logger="qerl.vllm.lora_dense")
    with set_current_vllm_config(cpu_config):
        layer, base, a, b = _layer("gate_up", "overlap", prefix="refused.gate_up_proj",
                                   sizes=(256, [50, 78], (16, 4, 2), 96), dtype=torch.float16)
        calls = _torch_update(layer.punica_wrapper)
        _, backend = _give_row_copy(base)
        assert ldw.split_add(layer)  # a layer with decode_gemv's copy splits too (§4ai)
        x = torch.randn(1, ROW_SIZES[0]).half()
        outs = [_call(layer, x) for _ in range(2)]
    refusals = [r.getMessage() for r in caplog.records if "stays off the row+lora path" in r.getMessage()]
    assert refusals == ["qerl: a one-row LoRA call of refused.gate_up_proj stays off the row+lora path (slice sizes "
                        "[50] are not multiples of the row kernel's 4 rows per block); it runs the base GEMM and the "
                        "LoRA kernel"]
    assert len(calls) == 2  # in order: the wrapper's update, once per call
    xf = x.float()  # the float32 statement of the float16 layer and adapter
    want = xf @ base.weight.float().t() + torch.cat([(xf @ ai.float().t()) @ bi.float().t() for ai, bi in zip(a, b)], 1)
    for out in outs:
        assert (out.float() - want).abs().max().item() <= 2.0**-8 * want.abs().max().item()


def test_row_path_under_the_interpreter():
    """test_decode_gemv_one_row_calls_take_the_row_lora_path, in a subprocess with the Triton interpreter on."""
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1", **{ROW_ENV: "1"})
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          f"{__file__}::test_decode_gemv_one_row_calls_take_the_row_lora_path"],
                         capture_output=True, text=True, env=env, timeout=900, cwd=os.path.dirname(__file__))
    assert run.returncode == 0 and "3 passed" in run.stdout, (run.stdout + run.stderr)[-4000:]


def test_patches_are_idempotent_and_listed_upstream():
    import pkgutil

    from qerl_plugin import upstream

    ldw.route_merged_layers()
    ldw.route_merged_layers()
    targets = {e.target for e in upstream.SURFACE}
    for target in (ldw.MERGED_APPLY_TARGET, ldw.LINEAR_APPLY_TARGET, ldw.SET_MAPPING_TARGET):
        assert target in targets
        patched = pkgutil.resolve_name(target)
        assert patched.__qerl_patch__ and not getattr(patched.__wrapped__, "__qerl_patch__", False)


def test_a_stale_wrapper_id_finds_the_only_live_wrapper(monkeypatch):
    """vLLM loads its AOT-compiled graph in a later process with the compiling process's id() baked in."""
    live = ldw.QerlPunicaWrapper.__new__(ldw.QerlPunicaWrapper)
    monkeypatch.setattr(ldw, "_WRAPPERS", {id(live): live})
    assert ldw._wrapper(id(live)) is live
    assert ldw._wrapper(12345) is live
    assert ldw._wrapper(-1) is None  # tests and benchmarks: no wrapper asked for
    other = ldw.QerlPunicaWrapper.__new__(ldw.QerlPunicaWrapper)
    monkeypatch.setattr(ldw, "_WRAPPERS", {id(live): live, id(other): other})
    assert ldw._wrapper(12345) is None  # two engines in one process: no guess


# ---------------------------------------------------------------------------------------------------------
# GPU: the side stream, bf16, Qwen2.5-7B's LoRA linears, eager and in a CUDA graph

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (side streams, Triton kernels)")

def _gpu_layer(kind, mode, tokens, monkeypatch):
    """A 7B-sized bf16 LoRA layer (r32, as the recipes) on CUDA with a real QerlPunicaWrapper in ``mode``; every
    third token without the adapter."""
    import types

    import vllm.config
    from vllm.config.lora import LoRAConfig

    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none",
                        lambda: types.SimpleNamespace(additional_config={"qerl_lora": mode}))
    cfg = LoRAConfig(max_loras=1, max_lora_rank=32, lora_dtype=torch.bfloat16)
    w = ldw.QerlPunicaWrapper(1024, 256, device="cuda", lora_config=cfg)
    assert w.qerl_mode == mode
    mapping = tuple(0 if i % 3 == 2 else 1 for i in range(tokens))
    w.update_metadata(LoRAMapping(mapping, mapping, is_prefill=False), [1], 1, 32000)
    torch.manual_seed(tokens)
    layer, base, a, b = _layer("o" if kind == "down" else kind, mode, prefix=f"gpu.{mode}.{kind}.{tokens}",
                               sizes=_sizes_7b(kind), r=32, dtype=torch.bfloat16, device="cuda", wrapper=w)
    served = torch.tensor([m == 1 for m in mapping], device="cuda")
    return layer, base, a, b, served


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("tokens", [1, 8, 64, 65])
@pytest.mark.parametrize("kind", sorted(QWEN_7B))
def test_gpu_overlap_matches_fused_and_the_exact_result(cpu_config, monkeypatch, caplog, kind, tokens):
    import logging

    from vllm.config import set_current_vllm_config

    # the path lines are logged once per process and size: start from none logged, or an earlier test's line hides this one
    monkeypatch.setattr(ldw, "_LOGGED", set())
    caplog.set_level(logging.WARNING, logger="qerl.vllm.lora_dense")
    with set_current_vllm_config(cpu_config):
        outs = {}
        for mode in ("fused", "overlap"):
            layer, base, a, b, served = _gpu_layer(kind, mode, tokens, monkeypatch)
            x = torch.randn(tokens, QWEN_7B[kind], device="cuda", dtype=torch.bfloat16,
                            generator=torch.Generator("cuda").manual_seed(3))
            outs[mode] = _call(layer, x)
            if mode == "overlap" and tokens <= 64:  # the same call captured in a CUDA graph and replayed
                static = x.clone()
                _call(layer, static)  # warm-up outside the capture (Triton compiles)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    captured = _call(layer, static)
                replays = []
                for _ in range(3):
                    graph.replay()
                    torch.cuda.synchronize()
                    replays.append(captured.clone())
        xf = x.float()
        plain = xf @ base.weight.float().t() + (base.bias.float() if getattr(base, "bias", None) is not None else 0)
        delta = torch.cat([(xf @ ai.float().t()) @ bi.float().t() for ai, bi in zip(a, b)], dim=1)
        exact = torch.where(served[:, None], plain + delta, plain)
    fused, overlap = outs["fused"].float(), outs["overlap"].float()
    floor = (fused - exact).abs().max().item()  # the fused mode's own distance from the exact result
    assert (overlap - exact).abs().max().item() <= 1.5 * floor + 1e-2
    # the same kernel and the same rounding: the shrink's fp32 atomics may add in another order, nothing else. Where
    # that flips one bf16 rounding of the rank-r intermediate, a whole row of the update moves by about an ulp, so
    # the check is a closeness of ~2 bf16 ulps, not a count of identical elements
    torch.testing.assert_close(overlap, fused, rtol=2**-6, atol=2**-6)
    if tokens <= 64:
        assert f"LoRA call with {tokens} tokens on the overlap path" in caplog.text
        for rep in replays:
            assert (rep.float() - exact).abs().max().item() <= 1.5 * floor + 1e-2
    else:
        assert f"LoRA call with {tokens} tokens on the overlap path" not in caplog.text


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("tokens", [1, 8, 64])
@pytest.mark.parametrize("kind", sorted(QWEN_7B))
def test_gpu_split_add_gives_the_bits_of_the_add_inside_the_op(cpu_config, monkeypatch, kind, tokens):
    """Eagerly, the model's ``out + update`` is the op's own add: the same bits, with or without QERL_LORA_SPLIT_ADD,
    and in a CUDA graph replay (the side stream's join precedes the add either way)."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(cpu_config):
        outs = {}
        for split in ("0", "1"):
            monkeypatch.setenv(options.LORA_SPLIT_ADD_ENV, split)
            layer, base, a, b, served = _gpu_layer(kind, "overlap", tokens, monkeypatch)
            assert ldw.split_add(layer) is (split == "1" and kind != "qkv")
            x = torch.randn(tokens, QWEN_7B[kind], device="cuda", dtype=torch.bfloat16,
                            generator=torch.Generator("cuda").manual_seed(5))
            eager = _call(layer, x)
            static = x.clone()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = _call(layer, static)
            graph.replay()
            torch.cuda.synchronize()
            outs[split] = (eager, captured.clone())
    # the shrink's fp32 atomics may add in another order between launches (see above): ~2 bf16 ulps, not bits
    for one, other in zip(outs["0"], outs["1"]):
        torch.testing.assert_close(one.float(), other.float(), rtol=2**-6, atol=2**-6)


@pytest.mark.gpu
@cuda
def test_gpu_kernel_overwrite_mode_equals_adding_to_zero():
    from vllm_ext import lora_fused

    g = torch.Generator().manual_seed(1)
    k, r, slices, m = 3584, 32, (3584, 512, 512), 8
    x = torch.randn(m, k, generator=g).bfloat16().cuda()
    a = tuple((torch.randn(1, 1, r, k, generator=g) / k**0.5).bfloat16().cuda() for _ in slices)
    b = tuple((torch.randn(1, 1, n, r, generator=g) / r**0.5).bfloat16().cuda() for n in slices)
    idx = torch.tensor([0, 0, -1, 0, 0, -1, 0, 0], device="cuda")
    sync = lora_fused.new_sync("cuda")
    added = torch.zeros(m, sum(slices), dtype=torch.bfloat16, device="cuda")
    lora_fused.fused_lora_linear(added, x, a, b, 1.0, slices, idx, sync)
    written = torch.full_like(added, float("nan"))
    lora_fused.fused_lora_linear(written, x, a, b, 1.0, slices, idx, sync, add_inputs=False)
    assert not written.isnan().any()
    assert torch.equal(written[idx[:m] == -1], torch.zeros_like(written[idx[:m] == -1]))
    assert (written.float() - added.float()).abs().max().item() <= 2 ** -6 * added.float().abs().max().item()
    assert lora_fused.ready(sync)


def test_few_row_lora_switch_reads_its_variable(monkeypatch):
    """``QERL_FEW_ROW_LORA``: off unless set to a true value; a bad value is refused with the variable's name (the
    op reads it per call, so an engine that sets it wrongly fails at its first decode step, not silently)."""
    monkeypatch.delenv(options.FEW_ROW_LORA_ENV, raising=False)
    assert ldw.few_row_lora() is False
    for value, want in (("1", True), ("on", True), ("0", False), ("", False)):
        monkeypatch.setenv(options.FEW_ROW_LORA_ENV, value)
        assert ldw.few_row_lora() is want
    monkeypatch.setenv(options.FEW_ROW_LORA_ENV, "gluon")
    with pytest.raises(ValueError, match="QERL_FEW_ROW_LORA: expected true or false, got 'gluon'"):
        ldw.few_row_lora()
    assert options.FEW_ROW_LORA_MAX_TOKENS == 8


@pytest.mark.parametrize("kind", ["qkv", "gate_up", "o"])
def test_few_token_calls_take_the_gluon_path_only_when_asked(cpu_config, monkeypatch, caplog, kind):
    """``QERL_FEW_ROW_LORA=1`` and decode_gemv's copy: a 4-token call goes to vllm_ext.nvfp4_gluon_lora with the
    copy's tensors, the natural-order bias and, for the split add's layers, the zeros asked for. Gluon cannot run on
    a CPU, so its support check and launcher are replaced here by a recorder (the kernel's numerics are the GPU tests
    of tests/vllm_ext/test_nvfp4_gluon_lora.py). Without the switch nothing goes there; without the copy (decode_gemv
    off, or "shared", whose tensors are Marlin's) the call logs why once and runs in order."""
    import logging

    from vllm.config import set_current_vllm_config

    from vllm_ext import nvfp4_gluon_lora

    notices.forget(ldw.GLUON_REFUSAL_KEY)
    monkeypatch.setattr(ldw, "_LOGGED", set())
    caplog.set_level(logging.WARNING, logger="qerl.vllm.lora_dense")
    seen = []

    def launcher(x, packed, scale, gscale, a, b, lora_scale, slices, slots, bias=None, zeros=False):  # noqa: ANN001
        seen.append(dict(packed=packed, bias=bias, zeros=zeros, slices=slices, tokens=x.shape[0]))
        y = torch.full((x.shape[0], sum(slices)), 7.0, dtype=x.dtype)
        return (y, torch.zeros_like(y)) if zeros else y

    monkeypatch.setattr(nvfp4_gluon_lora, "supports", lambda *args, **kwargs: None)
    monkeypatch.setattr(nvfp4_gluon_lora, "launch_supported", launcher)
    with set_current_vllm_config(cpu_config):
        layer, base, a, b = _layer(kind, "overlap", prefix=f"gluon.{kind}", sizes=ROW_SIZES, dtype=torch.float16)
        calls = _torch_update(layer.punica_wrapper)
        _, backend = _give_row_copy(base)
        x = torch.randn(4, ROW_SIZES[0]).half()
        monkeypatch.delenv(options.FEW_ROW_LORA_ENV, raising=False)
        _call(layer, x)
        assert not seen and len(calls) == 1  # the switch is off: in order
        monkeypatch.setenv(options.FEW_ROW_LORA_ENV, "1")
        out = _call(layer, x)
        assert "LoRA call with 4 tokens on the gluon+lora path" in caplog.text
        assert len(seen) == 1 and seen[0]["packed"] is base.qerl_gemv_packed and seen[0]["tokens"] == 4
        assert seen[0]["zeros"] is ldw.split_add(layer) and seen[0]["slices"] == tuple(layer.output_slices)
        bias = getattr(base, "bias", None)
        assert (seen[0]["bias"] is None) if bias is None else torch.equal(seen[0]["bias"], bias)
        assert torch.equal(out, torch.full_like(out, 7.0))
        backend.decode_gemv = "off"  # no copy offered
        for _ in range(2):
            _call(layer, x)
    refusals = [r.getMessage() for r in caplog.records if "stays off the gluon+lora path" in r.getMessage()]
    assert refusals == [f"qerl: a LoRA call of gluon.{kind} stays off the gluon+lora path (the layer has no copy of "
                        "the checkpoint layout (decode_gemv \"all\" or \"small\" keeps one)); it runs the base GEMM "
                        "and the LoRA kernel"]
    assert len(seen) == 1 and len(calls) == 3
