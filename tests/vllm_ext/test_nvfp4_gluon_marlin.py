"""vllm_ext.nvfp4_gluon_marlin: the wgmma GEMM on Marlin's own tensors (``nvfp4_gluon_marlin_gemm``), so that a layer
needs no copy in the checkpoint's layout.

Gluon has no interpreter. On the CPU: the refusals; the kernel's arithmetic (its byte and scale offsets, the reshapes
and permutes that make the wgmma operand, the powers of two its decode, scales and epilogue carry, the accumulator's
rows put in output order) copied by hand into float64 and checked against the exact product, on tensors from
vllm_ext.bench.marlin_pack, whose words are vLLM's (tests/vllm_ext/test_marlin_pack.py); a hand copy, so it checks the
design, and the GPU tests check the kernel; and the compiled kernel's loads (16-byte weight loads at ``nrep`` 4). On the
GPU:
the float64 product with the exact weight, every code read back bit for bit, and agreement with the checkpoint-layout
kernel. The Marlin tensors come from marlin_pack, so the GPU tests need no vLLM.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

from qerl_plugin import nvfp4
from vllm_ext.bench.marlin_pack import marlin_pack

ng = pytest.importorskip("vllm_ext.nvfp4_gluon")
if ng.GLUON_IMPORT_ERROR is not None:
    pytest.skip(f"Triton's Gluon is not importable ({ng.GLUON_IMPORT_ERROR})", allow_module_level=True)
ngm = pytest.importorskip("vllm_ext.nvfp4_gluon_marlin")

GPU = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                         reason="needs a Hopper GPU (wgmma; Gluon has no interpreter)")


def _weight(n: int, k: int, seed: int, device: str = "cpu"):  # noqa: ANN202
    torch.manual_seed(seed)
    q = nvfp4.quantize((torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16))
    exact = nvfp4.dequantize(q.packed, q.scale, torch.ones(1, device=device), dtype=torch.float32).double()
    return q, exact / q.global_scale.double()


def _emulate(x: torch.Tensor, qweight: torch.Tensor, sbytes: torch.Tensor, divisor: torch.Tensor, block_k: int,
             warps: int, nrep: int) -> torch.Tensor:
    """``_wgmma_marlin_acc`` and the kernel's epilogue scaling copied into float64: each program's byte and scale offsets,
    the masked loads, the decode (code times 2^-126), the scale bytes read as bfloat16 bits times 2^127, their
    reshape/permute and broadcast, the operand's permute to ``[rows, K]``, the accumulator's rows to output order, and
    the epilogue's 2^111 / divisor. Split-K is not copied: its fixed-order float32 sum changes roundings only."""
    n, k, m = sbytes.shape[1], x.shape[1], x.shape[0]
    t_, ch, jh = block_k // 16, warps * nrep // 4, 4 // nrep
    block_n = 16 * warps * nrep
    wb, sb = qweight.contiguous().view(torch.uint8).reshape(-1), sbytes.contiguous().view(torch.uint8).reshape(-1)
    kb, ks = 8 * n, n
    mags = torch.tensor(nvfp4.E2M1_VALUES, dtype=torch.float64)
    decode = lambda c: mags[c & 7] * (1.0 - 2.0 * (c >= 8)) * 2.0**-126  # noqa: E731  (the bit decode's values)
    out = torch.zeros(m, n, dtype=torch.float64)
    ar = torch.arange
    for pid in range(-(-n // block_n)):
        rc = pid * ch + ar(ch)
        w_offs = ((rc * 512)[:, None, None, None, None] + (ar(t_) * kb)[None, :, None, None, None]
                  + (ar(8) * 64)[None, None, :, None, None] + (ar(4) * 16)[None, None, None, :, None]
                  + ar(16)[None, None, None, None, :])
        w_ok = (rc * 64 < n)[:, None, None, None, None].expand_as(w_offs)
        s_offs = ((rc * 64)[:, None, None, None] + (ar(t_) * ks)[None, :, None, None] + (ar(8) * 8)[None, None, :, None]
                  + ar(8)[None, None, None, :])
        s_ok = (rc * 64 < n)[:, None, None, None].expand_as(s_offs)
        acc = torch.zeros(block_n, m, dtype=torch.float64)
        for t in range(k // block_k):
            wq = torch.where(w_ok, wb[(w_offs + t * t_ * kb).clamp(max=wb.numel() - 1)], 0).to(torch.int64)
            sq = torch.where(s_ok, sb[(s_offs + t * t_ * ks).clamp(max=sb.numel() - 1)], 0).to(torch.int32)
            w9 = torch.stack([decode(wq & 15), decode(wq >> 4)], dim=-1).reshape(ch, t_, 8, 4, jh, nrep, 2, 2, 2)
            sv = (sq << 4).to(torch.int16).view(torch.bfloat16).double() * 2.0**127
            s6 = sv.reshape(ch, t_, 8, 2, 2, 2).permute(0, 1, 2, 3, 5, 4).reshape(ch, t_, 8, jh, nrep, 2)
            w9 = w9 * s6[:, :, :, None, :, :, None, :, None]
            a = w9.permute(5, 0, 4, 7, 2, 1, 8, 3, 6).reshape(block_n, block_k)
            acc += a @ x[:, t * block_k:(t + 1) * block_k].double().t()
        if nrep > 1:
            acc = acc.reshape(nrep, ch, jh, 16, m).permute(1, 2, 0, 3, 4).reshape(block_n, m)
        rows = pid * block_n + ar(block_n)
        keep = rows < n
        out[:, rows[keep]] = acc[keep].t() * (2.0**111 / divisor.double())
    return out


@pytest.mark.parametrize("n,k,block_k,warps,nrep", [
    (64, 256, 64, 4, 1), (256, 512, 128, 4, 4), (192, 512, 256, 4, 4), (320, 256, 128, 4, 2), (512, 256, 64, 8, 4),
    (128, 512, 128, 8, 1), (384, 256, 64, 8, 2)])
def test_the_kernels_index_arithmetic_gives_the_exact_product(n, k, block_k, warps, nrep):
    """The kernel's offsets and permutes, transcribed in float64 on marlin_pack's tensors: the exact product (up to
    float64 rounding), for every program width, chunks past N (192 and 320 against 256-wide programs) and 8 warps."""
    q, exact_w = _weight(n, k, n + k)
    x = torch.randn(3, k).to(torch.bfloat16)
    got = _emulate(x, *marlin_pack(q.packed, q.scale, q.global_scale), block_k, warps, nrep)
    exact = x.double() @ exact_w.t()
    assert (got - exact).abs().max().item() <= 1e-12 * exact.abs().max().item()


def test_the_scale_bytes_bit_trick_is_exact():
    """The kernel reads a scale byte B as bfloat16 bits B << 4 times 2^127: for every byte Marlin or marlin_pack can
    hold (0, and 8 to 247: the float16 normals below infinity; Marlin's are 0 or at least 128, marlin_pack's at least
    104) that is exactly float16(B << 7) * 2^15, a bfloat16 normal from 2 to below 2^31 (2^13 and up from byte 104), so
    the scaled weights, code * 2^-126 times it, are normal and exact."""
    b = torch.tensor([0] + list(range(8, 248)), dtype=torch.int32)
    fast = (b << 4).to(torch.int16).view(torch.bfloat16).float() * 2.0**127
    assert torch.equal(fast.to(torch.bfloat16).float(), fast)  # the product itself is a bfloat16
    exact = (b << 7).to(torch.int16).view(torch.float16).double() * 2.0**15
    assert torch.equal(fast.double(), exact)
    assert fast[1:].min().item() == 2.0 and fast[b >= 104].min().item() == 2.0**13 and fast.max().item() < 2.0**31


def test_refusals_name_the_bad_input():
    q, _ = _weight(128, 256, 0)
    qw, sb, div = marlin_pack(q.packed, q.scale, q.global_scale)
    x = torch.randn(2, 256).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"x on cpu \(the kernel runs on CUDA only"):
        ngm.nvfp4_gluon_marlin_gemm(x, qw, sb, div)
    with pytest.raises(ValueError, match=r"activations in torch.float16 \(bfloat16 supported\)"):
        ngm.nvfp4_gluon_marlin_gemm(x.half(), qw, sb, div)
    with pytest.raises(ValueError, match=r"65 rows \(1 to 64\)"):
        ngm.nvfp4_gluon_marlin_gemm(torch.randn(65, 256).to(torch.bfloat16), qw, sb, div)
    with pytest.raises(ValueError, match=r"warps=2 \(4 or 8 with wgmma"):
        ngm.nvfp4_gluon_marlin_gemm(x, qw, sb, div, warps=2)
    with pytest.raises(ValueError, match=r"K=256 and block_k=512: block_k must be a multiple of 64 that divides K"):
        ngm.nvfp4_gluon_marlin_gemm(x, qw, sb, div, block_k=512)
    with pytest.raises(ValueError, match=r"are not Marlin's unpadded tensors for K=256 .*build them with "
                                         r"vllm_ext.bench.marlin_pack .for the checkpoint's layout, nvfp4_gluon_gemm"):
        ngm.nvfp4_gluon_marlin_gemm(x, q.packed, q.scale, div)  # the checkpoint's layout
    with pytest.raises(ValueError, match=r"are not Marlin's unpadded tensors for K=256"):
        ngm.nvfp4_gluon_marlin_gemm(x, qw, sb.view(torch.uint8), div)
    with pytest.raises(ValueError, match=r"divisor has 2 values, expected 1"):
        ngm.nvfp4_gluon_marlin_gemm(x, qw, sb, torch.ones(2))
    with pytest.raises(ValueError, match=r"qweight/scale/divisor on meta, x on cpu: move them to x's device"):
        ngm.nvfp4_gluon_marlin_gemm(x, qw, sb, div.to("meta"))


_SIGNATURE = {"x_ptr": "*bf16", "sxm": "i32", "w_ptr": "*u8", "s_ptr": "*u8", "g_ptr": "*fp32", "y_ptr": "*bf16",
              "sym": "i32", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "KB": "i32",
              "KS": "i32"}


def _compiled_ptx(block_m: int, block_k: int, warps: int, nrep: int, split_k: int) -> str:
    """The Marlin version compiled for sm_90 with Triton's own ptxas, its arguments specialised as the launcher's are
    at the 7B shapes (pointers, strides, N, K, KB = 8N and KS = N divisible by 16)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    consts = {"BLOCK_M": block_m, "BLOCK_K": block_k, "WARPS": warps, "NREP": nrep, "SPLIT_K": split_k, "EVEN_N": True}
    divisible = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 5, 6, 7, 8, 10, 11, 12, 13)}
    src = GluonASTSource(fn=ngm._wgmma_marlin_kernel, signature={**_SIGNATURE, **{c: "constexpr" for c in consts}},
                         constexprs=consts, attrs=divisible)
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]
    except Exception as exc:  # noqa: BLE001 (no ptxas for sm_90 in this Triton build)
        if "ptxas" in str(exc).lower():
            pytest.skip(f"cannot compile for sm_90 here: {type(exc).__name__}: {exc}"[:200])
        raise


@pytest.mark.parametrize("nrep,weight_load,scale_load", [(4, "v4.b32", "v2.b32"), (2, "v2.b32", "b32"),
                                                         (1, "b32", "b8")])
def test_compiled_loads_read_each_threads_words_at_once(nrep, weight_load, scale_load):
    """At 8 rows and block_k 256 (16 groups per tile), each thread reads its ``4 nrep`` bytes of words per group in one
    load (16 bytes at ``nrep`` 4) and its scales in one load per group (8 bytes at ``nrep`` 4); one wgmma per 16
    inputs and row block; no shuffles and no local memory."""
    ptx = _compiled_ptx(8, 256, 4, nrep, 8)
    loads = Counter(re.findall(r"ld\.global\.((?:v\d\.)?b\d+)", ptx))
    assert loads[weight_load] >= 16 and loads[scale_load] >= 16, loads
    if nrep == 4:
        assert "b8" not in loads  # no byte-wise loads left
    assert ptx.count("wgmma.mma_async") == 16 * nrep
    assert "shfl" not in ptx and "ld.local" not in ptx and "st.local" not in ptx


def _check_exact_product(rows: int, n: int, k: int, seed: int, **tile) -> None:
    q, exact_w = _weight(n, k, seed, "cuda")
    qw, sb, div = marlin_pack(q.packed, q.scale, q.global_scale)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    got = ngm.nvfp4_gluon_marlin_gemm(x, qw, sb, div, **tile)
    exact = x.double() @ exact_w.t()
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    excess = ((got.double() - exact).abs() - 2.0**-8 * exact.abs()).max().item()
    assert excess <= 1e-4 * exact.abs().max().item(), excess
    assert torch.equal(got, ngm.nvfp4_gluon_marlin_gemm(x, qw, sb, div, **tile))  # the same bits again
    ckpt = ng.nvfp4_gluon_gemm(x, q.packed, q.scale, q.global_scale, block_k=tile.get("block_k", 256), warps=4,
                               nrep=1, split_k=tile.get("split_k", 8), wgmma=True, wide=True, bits=True)
    both = ((got.double() - ckpt.double()).abs() - 2.0**-7 * exact.abs()).max().item()
    assert both <= 2e-4 * exact.abs().max().item(), both  # each within its rounding of the exact product


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("n,k,tile", [
    (4608, 3584, dict(block_k=256, warps=4, nrep=1, split_k=8)),  # the 7B q/k/v shape, TILES_7B's 8-row tile
    (3584, 18944, dict(block_k=256, warps=4, nrep=4, split_k=8)),  # 7B down, 16-byte loads
    (4608, 3584, dict(block_k=128, warps=8, nrep=2, split_k=4)),
    (192, 512, dict(block_k=64, warps=4, nrep=4, split_k=3)),  # chunks past N in a 256-wide program, split-K uneven
    (320, 1024, dict(block_k=128, warps=8, nrep=1, split_k=1)),
])
def test_gpu_matches_the_exact_product(rows, n, k, tile):
    """Within the bf16 output's rounding of the float64 product with the exact weight (2^-8 relative plus 1e-4 of the
    largest value), the same bits on a second call, and within both roundings of the checkpoint-layout kernel."""
    _check_exact_product(rows, n, k, rows + n, **tile)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("nrep", [1, 2, 4])
def test_gpu_decodes_every_code_and_scale_exactly(nrep):
    """Every weight of a ``[256, 512]`` NVFP4 weight with all 16 codes and E4M3 scales from 2^-9 to 448 (global scale
    1) read back bit for bit through one-hot rows of ``x``."""
    torch.manual_seed(7)
    n, k = 256, 512
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
    levels = torch.tensor([2.0**-9, 2.0**-6, 0.0234375, 0.5, 1.0, 3.25, 96.0, 448.0])
    scale = levels[torch.randint(0, len(levels), (n, k // 16))].to(torch.float8_e4m3fn).to("cuda")
    gs = torch.ones(1, device="cuda")
    w = nvfp4.dequantize(packed, scale, gs, dtype=torch.float32)
    assert torch.equal(w.to(torch.bfloat16).float(), w)
    qw, sb, div = marlin_pack(packed, scale, gs)
    for off in range(0, k, 64):
        x = torch.zeros(64, k, device="cuda", dtype=torch.bfloat16)
        x[torch.arange(64), off + torch.arange(64)] = 1.0
        got = ngm.nvfp4_gluon_marlin_gemm(x, qw, sb, div, block_k=128, warps=4, nrep=nrep, split_k=2)
        assert torch.equal(got.float(), w[:, off:off + 64].t()), f"columns {off}..{off + 63}"


def test_kernel_sass_counts_both_layouts_main_loops():
    """scripts/cpu/kernel_sass.py --wgmma (§4ay): each tile compiles for sm_90 here, with one HGMMA per 16 inputs and
    row block per trip; the Marlin version reads its words in one load per group at nrep 4 (as few loads per word as
    the checkpoint layout's 16-byte loads), and its loop since ``a26c0d8`` stays at or below 38 instructions per word at
    every tile (44 before it at nrep 1; the checkpoint layout's 27.2)."""
    import importlib.util
    import os
    import subprocess

    spec = importlib.util.spec_from_file_location("kernel_sass", os.path.join(
        os.path.dirname(__file__), "..", "..", "scripts", "cpu", "kernel_sass.py"))
    sass = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sass)
    try:
        rows = sass.run_wgmma()
    except (RuntimeError, subprocess.CalledProcessError) as exc:  # no ptxas or nvdisasm in this Triton
        pytest.skip(f"Triton cannot compile or disassemble for sm_90 here: {exc}")
    assert len(rows) == len(sass.WGMMA_TILES)
    ckpt, marlin = rows[0], rows[1:]
    for r, (_, block_k, _, nrep, _, _) in zip(rows, sass.WGMMA_TILES):
        assert r["hgmma_per_trip"] == block_k // 16 * nrep and r["loop_instructions"] > 100, r
    assert 20 <= ckpt["per_word"] <= 35, ckpt
    for r, (_, _, _, nrep, _, _) in zip(marlin, sass.WGMMA_TILES[1:]):
        assert r["per_word"] <= 38.0, r
        if nrep == 4:
            assert r["loads_per_word"] <= ckpt["loads_per_word"] + 0.05, r
