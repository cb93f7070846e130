"""vllm_ext.lora_fused: the one-launch single-adapter LoRA kernel.

On the CPU the kernel runs under the Triton interpreter (in a subprocess, since TRITON_INTERPRET must be set
before Triton is imported) in float16, against an independent torch statement of punica's arithmetic (up to the order of fp32 sums): fp32
``A @ x`` times ``scale``, rounded to the weight dtype, fp32 ``B @ h``, rounded, added to ``y``. Triton 3.6's
interpreter mishandles bfloat16 (its ``tl.dot`` of bf16 tiles returns garbage, its fp32->bf16 conversion
truncates), so bfloat16 is checked on the GPU, against vLLM's own punica Triton kernels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from qerl_plugin import options
from vllm_ext import lora_fused

pytest.importorskip("triton", reason="Triton is not installed: the kernel cannot run or be interpreted")

REFERENCE = textwrap.dedent(
    """
    import torch

    def reference(y, x, a, b, scale, slices, idx):
        '''punica's add_lora_linear for slot 0, in torch: y is updated in place.'''
        x2 = x.reshape(-1, x.shape[-1]).float()
        y2 = y.view(-1, y.shape[-1])
        keep = idx[: x2.shape[0]] == 0
        off = 0
        for A, B, n in zip(a, b, slices):
            h = (x2 @ A[0, 0].float().t()) * scale
            h = torch.where(keep[:, None], h, torch.zeros_like(h)).to(y.dtype)
            o = (h.float() @ B[0, 0].float().t()).to(y.dtype)
            y2[:, off:off + n] = (y2[:, off:off + n].float() + o.float()).to(y.dtype)
            off += n

    def case(m, k, r, slices, dtype, seed, skip_every=3):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(m, k, generator=g).to(dtype)
        y0 = torch.randn(m, sum(slices), generator=g).to(dtype)
        a = tuple((torch.randn(1, 1, r, k, generator=g) / k**0.5).to(dtype) for _ in slices)
        b = tuple((torch.randn(1, 1, n, r, generator=g) / r**0.5).to(dtype) for n in slices)
        # every third token has no adapter (slot -1); the mapping is longer than the batch, as vLLM's is
        idx = torch.tensor([-1 if skip_every and i % skip_every == skip_every - 1 else 0 for i in range(m)] + [7] * 5)
        return x, y0, a, b, idx
    """
)

INTERPRETED = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from vllm_ext import lora_fused as lf
    """
) + REFERENCE + textwrap.dedent(
    """
    out = {"cases": [], "errors": []}
    # (tokens, in features, rank, slices): several shrink chunks (k > 512, k not a multiple of 512), one to
    # three slices of sizes that are and are not multiples of the expand block, 1..64 tokens
    cases = [(1, 1100, 16, (48,)), (5, 600, 32, (130, 32, 40)), (17, 513, 16, (200, 70)),
             (64, 256, 32, (64,)), (3, 2048, 16, (256, 128))]
    sync = lf.new_sync("cpu")
    for i, (m, k, r, slices) in enumerate(cases):
        x, y0, a, b, idx = case(m, k, r, slices, torch.float16, i)
        for scale in (1.0, 0.37):
            got, ref = y0.clone(), y0.clone()
            lf.fused_lora_linear(got, x, a, b, scale, slices, idx, sync)
            reference(ref, x, a, b, scale, slices, idx)
            served = idx[:m] == 0
            diff = (got.float() - ref.float()).abs()
            ulp = torch.finfo(torch.float16).eps * ref.float().abs().clamp_min(2**-14)
            out["cases"].append({
                "case": [m, k, r, list(slices), scale],
                "differing": (diff > 0).float().mean().item(),
                "max_ulps": (diff / ulp).max().item(),
                "skipped_rows_untouched": torch.equal(got[~served].view(torch.int16), y0[~served].view(torch.int16)),
                "adapter_contributed": not torch.equal(got[served], y0[served]),
                "ready_after": lf.ready(sync),
            })
    # twice into the same output: each launch adds once (the counters really are reset between launches)
    x, y0, a, b, idx = case(4, 700, 16, (64, 64), torch.float16, 9, skip_every=0)
    got, ref = y0.clone(), y0.clone()
    lf.fused_lora_linear(got, x, a, b, 1.0, (64, 64), idx, sync)
    lf.fused_lora_linear(got, x, a, b, 1.0, (64, 64), idx, sync)
    reference(ref, x, a, b, 1.0, (64, 64), idx)
    reference(ref, x, a, b, 1.0, (64, 64), idx)
    out["twice_close"] = ((got.float() - ref.float()).abs() <= 8 * 2**-10 * ref.float().abs().clamp_min(2**-14)).all().item()
    # add_inputs=False (the overlap mode's scratch tensor): y is overwritten with the update alone, whatever it held
    x, y0, a, b, idx = case(7, 700, 16, (64, 40), torch.float16, 13)
    got = torch.full_like(y0, float("nan"))
    lf.fused_lora_linear(got, x, a, b, 0.5, (64, 40), idx, sync, add_inputs=False)
    ref = torch.zeros_like(y0)
    reference(ref, x, a, b, 0.5, (64, 40), idx)
    served = idx[:7] == 0
    out["overwrite_close"] = ((got.float() - ref.float()).abs() <= 8 * 2**-10 * ref.float().abs().clamp_min(2**-14)).all().item()
    out["overwrite_skipped_zero"] = bool((got[~served] == 0).all()) and not bool(got.isnan().any())
    # a 3-d input ([batch, seq, features], as some layers pass it) and a strided output view
    x, y0, a, b, idx = case(6, 300, 16, (32,), torch.float16, 10)
    wide = torch.zeros(6, 40, dtype=torch.float16)
    wide[:, :32] = y0
    got = wide[:, :32]
    lf.fused_lora_linear(got, x.view(2, 3, 300), a, b, 1.0, (32,), idx, sync)
    ref = y0.clone()
    reference(ref, x, a, b, 1.0, (32,), idx)
    out["views_close"] = ((got.float() - ref.float()).abs() <= 8 * 2**-10 * ref.float().abs().clamp_min(2**-14)).all().item()
    out["views_left_rest"] = bool((wide[:, 32:] == 0).all())
    # the engine's torch op (vllm_ext.lora_dense_wrapper): its schema (what it mutates) and fake kernel, checked
    # by torch itself, and its result (the kernel's, for a call the kernel supports)
    import vllm.utils.torch_utils as tu
    tu.PIN_MEMORY = False
    from vllm_ext import lora_dense_wrapper as w
    x, y0, a, b, idx = case(2, 96, 16, (32, 16), torch.float16, 11)
    try:
        torch.library.opcheck(w.lora_linear_fused, (y0.clone(), x, list(a), list(b), 1.0, [32, 16], idx, -1),
                              test_utils=("test_schema", "test_faketensor"))
        out["opcheck"] = "ok"
    except Exception as exc:
        out["opcheck"] = f"{type(exc).__name__}: {exc}"[:2000]
    got, ref = y0.clone(), y0.clone()
    torch.ops.qerl.lora_linear_fused(got, x, list(a), list(b), 1.0, [32, 16], idx, -1)
    lf.fused_lora_linear(ref, x, a, b, 1.0, (32, 16), idx, sync)
    out["op_equals_kernel"] = torch.equal(got, ref)
    # a call the kernel does not take (65 tokens) and no wrapper to fall back on: an error naming both
    x, y0, a, b, idx = case(65, 96, 16, (32,), torch.float16, 12)
    try:
        torch.ops.qerl.lora_linear_fused(y0, x, list(a), list(b), 1.0, [32], idx, -1)
        out["no_wrapper"] = "no error"
    except RuntimeError as exc:
        out["no_wrapper"] = str(exc)
    print("RESULT " + json.dumps(out))
    """
)


def _interpreted() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    line = [s for s in run.stdout.splitlines() if s.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return _interpreted()


def test_punicas_arithmetic_under_the_interpreter(interpreted):
    """The fp32 sums run in another order (KS partials vs one matmul), so where ``scale * (A @ x)`` lands on a
    float16 rounding boundary the rounded intermediate differs by one of its ulps, which B spreads over a few
    ulps of ``y``: rare (at most 1 % of the outputs) and small (at most 8 ulps); everything else is bit-equal."""
    assert interpreted["cases"]
    for c in interpreted["cases"]:
        assert c["differing"] <= 0.01 and c["max_ulps"] <= 8, c
        assert c["skipped_rows_untouched"], c  # slot -1 tokens: y as it was, as punica's kernels leave it
        assert c["adapter_contributed"], c
        assert c["ready_after"], c  # the launch left the next one's half of the workspace and its counters at zero


def test_overwrite_mode_writes_the_update_alone(interpreted):
    assert interpreted["overwrite_close"]
    assert interpreted["overwrite_skipped_zero"]


def test_each_launch_adds_once_and_views_work(interpreted):
    assert interpreted["twice_close"]
    assert interpreted["views_close"] and interpreted["views_left_rest"]


def test_the_engines_torch_op(interpreted):
    assert interpreted["opcheck"] == "ok"
    assert interpreted["op_equals_kernel"]
    assert "65 tokens > 64" in interpreted["no_wrapper"] and "no punica wrapper -1" in interpreted["no_wrapper"]


def _tensors(m, k, r, slices, dtype=torch.float16):
    x = torch.zeros(m, k, dtype=dtype)
    a = tuple(torch.zeros(1, 1, r, k, dtype=dtype) for _ in slices)
    b = tuple(torch.zeros(1, 1, n, r, dtype=dtype) for n in slices)
    return x, a, b


@pytest.mark.parametrize(
    "shape, dtype, why",
    [
        ((65, 64, 16, (32,)), torch.float16, "65 tokens > 64"),
        ((4, 64, 8, (32,)), torch.float16, "rank 8"),
        ((4, 64, 48, (32,)), torch.float16, "rank 48"),
        ((4, 64, 16, (32,)), torch.float32, "input dtype torch.float32"),
        ((4, 64, 16, (8, 8, 8, 8)), torch.float16, "4 slices"),
    ],
)
def test_unsupported_calls_say_why_and_refuse(shape, dtype, why):
    x, a, b = _tensors(*shape, dtype=dtype)
    assert why in lora_fused.supports(x, a, b, shape[3])
    with pytest.raises(lora_fused.FusedLoRAUnsupported, match=why):
        lora_fused.fused_lora_linear(torch.zeros(shape[0], sum(shape[3]), dtype=dtype), x, a, b, 1.0, shape[3],
                                     torch.zeros(shape[0], dtype=torch.long), lora_fused.new_sync("cpu"))


def test_unsupported_weights_say_why():
    x, a, b = _tensors(4, 64, 16, (32,))
    two_slots = (torch.zeros(2, 1, 16, 64, dtype=torch.float16),)
    assert "2 adapter slots" in lora_fused.supports(x, two_slots, b, (32,))
    assert "do not fit" in lora_fused.supports(x, a, b, (40,))
    assert "weights in torch.bfloat16" in lora_fused.supports(x, tuple(t.bfloat16() for t in a), b, (32,))
    assert lora_fused.supports(x, a, b, (32,)) is None
    # more programs than the ticket word counts below its parity bit: refused, so the engine's op takes punica
    wide = 128 * lora_fused.MAX_PROGRAMS  # output features (stride-0 views: no memory behind them)
    b_wide = (torch.zeros(1, 1, 1, 16, dtype=torch.float16).expand(1, 1, wide, 16),)
    assert f"at most {lora_fused.MAX_PROGRAMS}" in lora_fused.supports(x, a, b_wide, (wide,))


def test_a_state_too_small_for_the_rank_is_refused():
    x, a, b = _tensors(2, 64, 32, (32,))
    with pytest.raises(lora_fused.FusedLoRAUnsupported, match="too small for rank 32.*max_rank>=32"):
        lora_fused.fused_lora_linear(torch.zeros(2, 32, dtype=torch.float16), x, a, b, 1.0, (32,),
                                     torch.zeros(2, dtype=torch.long), lora_fused.new_sync("cpu", max_rank=16))


def test_path_lines_are_bounded(monkeypatch, caplog):
    """An eager engine sees every prefill length; the per-size lines stay few."""
    import logging

    from vllm_ext import lora_dense_wrapper as w

    monkeypatch.setattr(w, "_LOGGED", set())
    caplog.set_level(logging.WARNING, logger="qerl.vllm.lora_dense")
    for tokens in (1, 1, 8, 100, 200, 300, 400, 500, 600, 700):
        w._log_path("fused" if tokens <= 64 else "punica", tokens, None if tokens <= 64 else f"{tokens} tokens > 64")
    lines = [r.getMessage() for r in caplog.records if r.name == "qerl.vllm.lora_dense"]
    assert lines[:2] == ["qerl: LoRA call with 1 tokens on the fused path", "qerl: LoRA call with 8 tokens on the fused path"]
    assert lines[2:6] == [f"qerl: LoRA call with {n} tokens on the punica path ({n} tokens > 64)" for n in (100, 200, 300, 400)]
    assert lines[6:] == ["qerl: further LoRA call sizes on the punica path are not logged"]


def test_fused_is_a_lora_mode(monkeypatch):
    import types

    import vllm.config

    from vllm_ext import lora_dense

    assert options.lora_mode({"qerl_lora": " Fused "}) == "fused"
    # the default of an engine that names no mode (docs/benchmarks.md §4l lease 3: faster than fused at b1, b8, b64)
    assert options.lora_mode(None) == options.lora_mode({}) == options.LORA_DEFAULT == "overlap"
    assert options.lora_mode({"qerl_lora": "punica"}) == "punica"
    config = types.SimpleNamespace(additional_config={"qerl_lora": "fused"})
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: config)
    assert lora_dense.requested_mode() == "fused"
    with pytest.raises(ValueError, match="expected one of fused, punica, dense, overlap"):
        options.lora_mode({"qerl_lora": "cublas"})


# ---------------------------------------------------------------------------------------------------------
# GPU: bfloat16 against vLLM's punica Triton kernels, 7B shapes, eager and replayed in a CUDA graph

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the kernel and vLLM's punica kernels)")

# Qwen2.5-7B's LoRA linears: (in features, output slices)
SHAPES_7B = {"qkv": (3584, (3584, 512, 512)), "o": (3584, (3584,)), "gate_up": (3584, (18944, 18944)),
             "down": (18944, (3584,))}


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("tokens", [1, 8, 64])
@pytest.mark.parametrize("group", sorted(SHAPES_7B))
def test_gpu_fused_matches_punica_triton_bf16(group, tokens):
    from vllm.config.lora import LoRAConfig
    from vllm.lora.layers import LoRAMapping
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    ns: dict = {}
    exec(REFERENCE, ns)  # noqa: S102 - the test's own reference code, shared with the interpreted check
    k, slices = SHAPES_7B[group]
    r = 32
    x, y0, a, b, idx = ns["case"](tokens, k, r, slices, torch.bfloat16, tokens + k)
    x, y0, a, b = x.cuda(), y0.cuda(), tuple(t.cuda() for t in a), tuple(t.cuda() for t in b)
    cfg = LoRAConfig(max_loras=1, max_lora_rank=r, lora_dtype=torch.bfloat16)
    w = PunicaWrapperGPU(1024, 256, device="cuda", lora_config=cfg)
    mapping = tuple(1 if int(i) == 0 else 0 for i in idx[:tokens])  # adapter id 1 in slot 0; 0: no adapter
    w.update_metadata(LoRAMapping(mapping, mapping, is_prefill=False), [1], 1, 32000)
    slots = w._token_lora_indices
    assert slots[:tokens].tolist() == idx[:tokens].tolist()
    punica = y0.clone()
    w.add_lora_linear(punica, x, a, b, 1.0, slices)
    sync = lora_fused.new_sync("cuda")
    fused = y0.clone()
    lora_fused.fused_lora_linear(fused, x, a, b, 1.0, slices, slots, sync)
    served = idx[:tokens].cuda() == 0
    exact = y0.float() + torch.cat([(x.float() @ a[i][0, 0].float().t()) @ b[i][0, 0].float().t()
                                    for i in range(len(slices))], 1)
    floor = (punica.float() - exact)[served].abs().max() if served.any() else torch.tensor(0.0)
    assert (fused.float() - exact)[served].abs().max() <= 2 * floor + 1e-2
    assert torch.equal(fused[~served], y0[~served])
    assert lora_fused.ready(sync)
    # the same launch captured in a CUDA graph and replayed: each replay adds the same update to a fresh y
    target = y0.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_fused.fused_lora_linear(target, x, a, b, 1.0, slices, slots, sync)
    for _ in range(3):
        target.copy_(y0)
        graph.replay()
        torch.cuda.synchronize()
        assert (target.float() - exact)[served].abs().max() <= 2 * floor + 1e-2
        assert torch.equal(target[~served], y0[~served])
    assert lora_fused.ready(sync)


@pytest.mark.gpu
@cuda
def test_gpu_wrapper_takes_fused_for_small_calls_and_punica_above_under_torch_compile(monkeypatch, caplog):
    """The engine's path: QerlPunicaWrapper in mode ``fused`` inside a torch.compile'd function whose token count
    is symbolic (as vLLM compiles models). Small calls must take the kernel and large ones punica, decided per
    call, and both must match vLLM's punica wrapper."""
    import logging
    import types

    import vllm.config
    from vllm.config.lora import LoRAConfig
    from vllm.lora.layers import LoRAMapping
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    import vllm_ext.lora_dense_wrapper
    from vllm_ext.lora_dense_wrapper import QerlPunicaWrapper

    config = types.SimpleNamespace(additional_config={"qerl_lora": "fused"})
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: config)
    cfg = LoRAConfig(max_loras=1, max_lora_rank=32, lora_dtype=torch.bfloat16)
    k, slices, r = 3584, (3584, 512, 512), 32
    g = torch.Generator().manual_seed(5)
    a = tuple((torch.randn(1, 1, r, k, generator=g) / k**0.5).bfloat16().cuda() for _ in slices)
    b = tuple((torch.randn(1, 1, n, r, generator=g) / r**0.5).bfloat16().cuda() for n in slices)
    monkeypatch.setattr(vllm_ext.lora_dense_wrapper, "_LOGGED", set())  # logged once per process and size
    caplog.set_level(logging.INFO, logger="qerl.vllm.lora_dense")
    for tokens in (300, 8):
        ours = QerlPunicaWrapper(1024, 256, device="cuda", lora_config=cfg)
        stock = PunicaWrapperGPU(1024, 256, device="cuda", lora_config=cfg)
        assert ours.qerl_mode == "fused"
        mapping = (1,) * tokens
        for w in (ours, stock):
            w.update_metadata(LoRAMapping(mapping, mapping, is_prefill=False), [1], 1, 32000)
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        y0 = torch.randn(tokens, sum(slices), device="cuda", dtype=torch.bfloat16)

        def step(y, x):
            ours.add_lora_linear(y, x, a, b, 1.0, slices)
            return y

        compiled = torch.compile(step, dynamic=True, fullgraph=True)
        got = compiled(y0.clone(), x)
        ref = y0.clone()
        stock.add_lora_linear(ref, x, a, b, 1.0, slices)
        exact = y0.float() + torch.cat([(x.float() @ a[i][0, 0].float().t()) @ b[i][0, 0].float().t()
                                        for i in range(3)], 1)
        floor = (ref.float() - exact).abs().max()
        assert (got.float() - exact).abs().max() <= 2 * floor + 1e-2
    text = caplog.text
    assert "LoRA call with 8 tokens on the fused path" in text
    assert "LoRA call with 300 tokens on the punica path (300 tokens > 64)" in text
