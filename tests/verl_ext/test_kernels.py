"""verl_ext.kernels: the Triton dequant kernel under the Triton interpreter (CPU) and on CUDA (gpu marker), and
scripts/gpu/check_actor_kernels.py's plumbing on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from qerl_plugin import nvfp4
from verl_ext import kernels


# ---------------------------------------------------------------------------------------------------------
# the Triton kernel


KERNEL_CHECK = textwrap.dedent(
    """
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from qerl_plugin import nvfp4
    from verl_ext import kernels
    assert kernels.triton_interpreting()
    g = torch.Generator().manual_seed(0)
    bad = []
    cases = [(16, 32, 1.0), (37, 96, 2688.0), (5, 528, 1e-3), (64, 256, 3.0e7), (3, 4096, 0.37)]
    for (rows, cols, gs), shift in [(c, True) for c in cases] + [(c, False) for c in cases[:2]]:
        kernels.SHIFT_DECODE = shift  # the float16-bits decode (default) and the earlier integer one
        packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
        sbytes = torch.randint(0, 256, (rows, cols // 16), dtype=torch.uint8, generator=g)
        sbytes.view(-1)[: min(256, sbytes.numel())] = torch.arange(min(256, sbytes.numel()), dtype=torch.uint8)
        scale = sbytes.view(torch.float8_e4m3fn)
        gscale = torch.tensor([gs], dtype=torch.float32)
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            a = kernels.dequantize_nvfp4_triton(packed, scale, gscale, dt)
            b = nvfp4.dequantize(packed, scale, gscale, dt)
            iv = torch.int32 if dt == torch.float32 else torch.int16
            nan = torch.isnan(b)
            if not (torch.equal(torch.isnan(a), nan) and torch.equal(a.view(iv)[~nan], b.view(iv)[~nan])):
                bad.append((rows, cols, gs, str(dt), shift))
    kernels.SHIFT_DECODE = True
    # a real quantized weight, through the dispatcher with backend="triton"
    w = torch.randn(48, 160, generator=g).to(torch.bfloat16)
    q = nvfp4.quantize(w)
    a = kernels.dequantize(q.packed, q.scale, q.global_scale, torch.bfloat16, backend="triton")
    if not torch.equal(a.view(torch.int16), q.dequantize(torch.bfloat16).view(torch.int16)):
        bad.append("quantized weight")
    # the 64-bit-offset variant (tensors of 2**31 words and more), forced on small inputs: the same bits
    kernels._WIDE_FROM = 0
    for dt in (torch.float32, torch.bfloat16):
        a = kernels.dequantize_nvfp4_triton(q.packed, q.scale, q.global_scale, dt)
        iv = torch.int32 if dt == torch.float32 else torch.int16
        if not torch.equal(a.view(iv), q.dequantize(dt).view(iv)):
            bad.append("64-bit offsets " + str(dt))
    kernels._WIDE_FROM = 2**31
    # a non-contiguous input (a column slice of a wider packed tensor) is made contiguous first: the same bits
    wide_packed = torch.cat([q.packed, q.packed], dim=1)[:, : q.packed.shape[1]]
    a = kernels.dequantize_nvfp4_triton(wide_packed, q.scale, q.global_scale, torch.bfloat16)
    if not torch.equal(a.view(torch.int16), q.dequantize(torch.bfloat16).view(torch.int16)):
        bad.append("non-contiguous packed")
    # into a caller's buffer (reused scratch), and a buffer that starts at an odd element is refused
    buf = torch.full((48, 160), 7.0, dtype=torch.bfloat16)
    kernels.dequantize_nvfp4_triton(q.packed, q.scale, q.global_scale, torch.bfloat16, out=buf)
    if not torch.equal(buf.view(torch.int16), q.dequantize(torch.bfloat16).view(torch.int16)):
        bad.append("out= buffer")
    odd = torch.empty(48 * 160 + 1, dtype=torch.bfloat16)[1:].view(48, 160)
    try:
        kernels.dequantize_nvfp4_triton(q.packed, q.scale, q.global_scale, torch.bfloat16, out=odd)
        bad.append("odd out accepted")
    except nvfp4.NVFP4Error as e:
        if "even element" not in str(e):
            bad.append("odd out message: " + str(e))
    print("BAD", bad)
    sys.exit(1 if bad else 0)
    """
)


def test_triton_kernel_is_bit_exact_under_the_interpreter():
    """The kernel's arithmetic (E2M1/FP8 decoding, IEEE division, bf16 rounding) on CPU, every code and
    every FP8 scale byte (subnormals, negative zero, NaN), several global scales and output dtypes."""
    pytest.importorskip("triton", reason="Triton is not installed: the kernel cannot be interpreted")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", KERNEL_CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]


# ---------------------------------------------------------------------------------------------------------
# GPU


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton kernel and CUDA matmuls)")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("shape", [(16, 16), (37, 96), (512, 3584), (3584, 18944), (4608, 3584), (1000, 5136)])
def test_gpu_triton_equals_torch_codec(shape):
    g = torch.Generator().manual_seed(shape[0])
    w = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16).cuda()
    q = nvfp4.quantize(w)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        a = kernels.dequantize_nvfp4_triton(q.packed, q.scale, q.global_scale, dt)
        b = nvfp4.dequantize(q.packed, q.scale, q.global_scale, dt)
        iv = torch.int32 if dt == torch.float32 else torch.int16
        assert torch.equal(a.view(iv), b.view(iv)), (shape, dt)
        assert torch.equal(a.cpu().view(iv), nvfp4.dequantize(q.packed.cpu(), q.scale.cpu(), q.global_scale.cpu(), dt).view(iv))
    # every byte value of packed and scale
    packed = torch.randint(0, 256, (64, 128), dtype=torch.uint8, generator=g).cuda()
    sb = (torch.arange(64 * 16) % 256).to(torch.uint8).reshape(64, 16).cuda()  # every FP8 byte (256 inputs = 16 groups)
    for gs in (1.0, 2688.0, 1e-3, 3e7):
        gsc = torch.tensor([gs], device="cuda")
        a = kernels.dequantize_nvfp4_triton(packed, sb.view(torch.float8_e4m3fn), gsc, torch.bfloat16)
        b = nvfp4.dequantize(packed, sb.view(torch.float8_e4m3fn), gsc, torch.bfloat16)
        nan = torch.isnan(b)
        assert torch.equal(torch.isnan(a), nan) and torch.equal(a.view(torch.int16)[~nan], b.view(torch.int16)[~nan])


def test_gpu_check_script_runs_on_cpu(tmp_path):
    """scripts/gpu/check_actor_kernels.py --smoke-cpu: the lead's GPU script, its plumbing checked here."""
    pytest.importorskip("triton", reason="the script's kernel steps need Triton (interpreted on CPU)")
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "gpu", "check_actor_kernels.py")
    out = subprocess.run(
        [sys.executable, script, "--smoke-cpu", "--steps", "exact,dequant,layer", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "check_actor_kernels.jsonl").read_text().splitlines()]
    steps = {r["step"] for r in rows}
    assert {"env", "exact", "dequant", "layer"} <= steps and "error" not in steps
    assert all(r["ok"] for r in rows if r["step"] == "exact")
    assert "=== check_actor_kernels summary ===" in out.stdout
