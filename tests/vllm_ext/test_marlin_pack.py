"""vllm_ext.bench.marlin_pack (Marlin's NVFP4 tensors in plain torch, for the GPU tools and tests that run where vLLM
is not installed) against vLLM's own pure-torch repack (tests/vllm_ext/marlin_reference.py) and against the
checkpoint's weight."""

from __future__ import annotations

import pytest
import torch

from qerl_plugin import nvfp4
from vllm_ext.bench.marlin_pack import marlin_pack


def _exact(packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """The checkpoint's weight in float64, unrounded: code x scale (exact in float32) / global scale."""
    one = torch.ones(1)
    return nvfp4.dequantize(packed, scale, one, dtype=torch.float32).double() / gs.double()


def _marlin_weight(qweight: torch.Tensor, sbytes: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """The float64 ``[N, K]`` weight Marlin's tensors hold, decoded from the layout as vllm_ext.nvfp4_marlin_row states
    it (word ``16 h + 4 a + j`` of chunk ``c``, nibble ``q``; scale byte ``8 h + 4 (j // 2) + (j % 2) + 2 b``)."""
    t, n = sbytes.shape
    words = qweight.to(torch.int64) & 0xFFFFFFFF
    mags = torch.tensor(nvfp4.E2M1_VALUES, dtype=torch.float64)
    w = torch.zeros(n, 16 * t, dtype=torch.float64)
    half = (sbytes.view(torch.uint8).to(torch.int32) << 7).to(torch.int16).view(torch.float16).double()
    for c in range(n // 64):
        for h in range(8):
            for a in range(4):
                for j in range(4):
                    word = words[:, 128 * c + 16 * h + 4 * a + j]  # [t]
                    for q in range(8):
                        b, r = (q >> 1) & 1, 2 * a + (q >> 2) + 8 * (q & 1)
                        code = (word >> (4 * q)) & 15
                        val = mags[code & 7] * torch.where(code >= 8, -1.0, 1.0)
                        out = 64 * c + 16 * j + 8 * b + h
                        sc = half[:, 64 * c + 8 * h + 4 * (j // 2) + (j % 2) + 2 * b]
                        w[out, 16 * torch.arange(t) + r] = val * sc
    return w / divisor.double()


@pytest.mark.parametrize("n,k", [(64, 128), (192, 256), (128, 320)])
def test_words_are_vllms_and_the_weight_is_the_checkpoints(n, k):
    """The words equal vLLM's reference repack bit for bit; the scale bytes equal vLLM's where its per-layer factor
    is 1 (these weights); the weight decoded from the three tensors is the checkpoint's exactly."""
    vllm_ref = pytest.importorskip("marlin_reference", reason="tests/vllm_ext on the path")
    pytest.importorskip("vllm", reason="vLLM's reference repack is the independent check")
    torch.manual_seed(n + k)
    q = nvfp4.quantize((torch.randn(n, k) * 0.02).to(torch.bfloat16))
    qweight, sbytes, divisor = marlin_pack(q.packed, q.scale, q.global_scale)
    ref_q, ref_s, _ = vllm_ref.marlin_tensors(q.packed, q.scale, q.global_scale, torch.bfloat16)
    assert qweight.dtype == torch.int32 and sbytes.dtype == torch.float8_e4m3fn and divisor.dtype == torch.float32
    assert torch.equal(qweight, ref_q)
    assert torch.equal(sbytes.view(torch.uint8), ref_s.view(torch.uint8))
    assert torch.equal(_marlin_weight(qweight, sbytes, divisor), _exact(q.packed, q.scale, q.global_scale))


def test_every_code_and_a_wide_range_of_scales_survive():
    """All 16 codes and E4M3 scales from 2^-9 to 448 (the float16 form holds each times 2^7 exactly)."""
    torch.manual_seed(3)
    n, k = 64, 256
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    levels = torch.tensor([2.0**-9, 2.0**-6, 0.0234375, 0.5, 1.0, 3.25, 96.0, 448.0])
    scale = levels[torch.randint(0, len(levels), (n, k // 16))].to(torch.float8_e4m3fn)
    gs = torch.tensor([3.0])
    assert torch.equal(_marlin_weight(*marlin_pack(packed, scale, gs)), _exact(packed, scale, gs))


def test_refuses_what_vllm_would_pad_and_other_dtypes():
    q = nvfp4.quantize(torch.randn(96, 64).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"unpadded for Marlin \(N a multiple of 64 and K of 128, or N of 128"):
        marlin_pack(q.packed, q.scale, q.global_scale)
    q = nvfp4.quantize(torch.randn(64, 64).to(torch.bfloat16))  # N 64 with K 64: Marlin pads it
    with pytest.raises(ValueError, match="unpadded for Marlin"):
        marlin_pack(q.packed, q.scale, q.global_scale)
    q = nvfp4.quantize(torch.randn(64, 128).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"scale torch.uint8 \(64, 8\): expected uint8 \[N, K/2\] and float8"):
        marlin_pack(q.packed, q.scale.view(torch.uint8), q.global_scale)
