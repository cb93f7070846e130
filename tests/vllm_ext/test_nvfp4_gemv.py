"""vllm_ext.nvfp4_gemv: the experimental W4A16 NVFP4 GEMM for decode-sized inputs.

On the CPU the kernel runs under the Triton interpreter (a subprocess: TRITON_INTERPRET must be set before Triton
is imported) in float16 against the codec's own dequantization (:func:`qerl_plugin.nvfp4.dequantize`, rounded to
float16) times ``x`` in float32. Triton 3.6's interpreter mishandles bfloat16, so bfloat16 is checked on the GPU,
where the kernel is also compared with vLLM's Marlin FP4 GEMM on the same weights.
"""

from __future__ import annotations

import json
import operator
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from qerl_plugin import nvfp4

pytest.importorskip("triton", reason="Triton is not installed: the kernel cannot run or be interpreted")

CASES = [  # (rows, N, K, block_k, split_k, variant): one and several rows, a ragged last N block, split-K (even and
    # uneven), and the one-row CUDA-core path and the per-group scale loads
    (1, 48, 256, 128, 1, {}),
    (5, 80, 384, 128, 1, {}),
    (3, 64, 512, 128, 2, {}),
    (16, 40, 256, 64, 1, {}),
    (2, 96, 768, 128, 4, {}),
    (1, 32, 640, 64, 3, {}),
    (1, 48, 512, 128, 2, {"fma": True}),
    (4, 80, 512, 256, 1, {"group_scales": True}),
    (1, 40, 384, 128, 3, {"fma": True, "group_scales": True}),
    (1, 48, 512, 128, 1, {"words": True}),
    (1, 40, 768, 256, 2, {"words": True}),
    (1, 24, 640, 64, 3, {"words": True, "block_n": 8}),
    (1, 40, 512, 128, 1, {"words": True, "xvec": True}),
    (1, 20, 768, 256, 3, {"words": True, "xvec": True, "block_n": 4}),
    (2, 96, 768, 128, 4, {"bias": True}),  # the bias added in the split-K epilogue, both kernels
    (1, 20, 768, 256, 3, {"words": True, "xvec": True, "block_n": 4, "bias": True}),
    (1, 40, 512, 128, 1, {"words": True, "xvec": True, "bias": True}),
    # the software-pipelined loop (stages > 0; the interpreter runs it as a plain loop, with its stride hints)
    (1, 40, 512, 128, 1, {"words": True, "xvec": True, "stages": 3}),
    (1, 20, 768, 256, 3, {"words": True, "xvec": True, "block_n": 4, "stages": 2, "bias": True}),
    # the few-row tensor-core kernel on words: one row, several, a ragged N block, split-K, the pipelined loop, a bias
    (1, 64, 256, 128, 1, {"mma": True, "block_n": 64}),
    (8, 96, 512, 128, 1, {"mma": True, "block_n": 64}),
    (3, 130, 768, 256, 2, {"mma": True, "block_n": 64, "stages": 2, "bias": True}),
    (33, 70, 256, 128, 2, {"mma": True, "block_n": 128}),
    (64, 64, 384, 128, 3, {"mma": True, "block_n": 64, "stages": 3}),
]

INTERPRETED = textwrap.dedent(
    """
    import json, sys
    import torch
    from qerl_plugin import nvfp4
    from vllm_ext.nvfp4_gemv import nvfp4_small_gemm

    out = []
    for m, n, k, bk, sk, var in json.loads(sys.argv[1]):
        g = torch.Generator().manual_seed(m * 1000 + n)
        w = torch.randn(n, k, generator=g) * 0.05
        w[0, :16] = 0.0  # an all-zero group (scale 0)
        q = nvfp4.quantize(w.to(torch.bfloat16))
        x = torch.randn(m, k, generator=g).to(torch.float16)
        var = {"block_n": 32, **var}
        bias = (torch.randn(n, generator=g) * 4).to(torch.float16) if var.pop("bias", False) else None
        var["bias"] = bias
        got = nvfp4_small_gemm(x, q.packed, q.scale, q.global_scale, block_k=bk, split_k=sk, **var)
        wq = nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float16)
        ref = x.float() @ wq.float().t() + (0.0 if bias is None else bias.float())
        err = (got.float() - ref).abs().max().item()
        scale = ref.abs().max().item()
        # the weight as the codec defines it, unrounded (float64): value * (scale / global_scale)
        w64 = nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double()
        ref64 = x.double() @ w64.t() + (0.0 if bias is None else bias.double())
        excess = ((got.double() - ref64).abs() - 2.0**-11 * ref64.abs()).max().item()
        again = nvfp4_small_gemm(x, q.packed, q.scale, q.global_scale, block_k=bk, split_k=sk, **var)
        var["bias"] = bias is not None
        out.append({"case": [m, n, k, bk, sk, var], "shape": list(got.shape), "dtype": str(got.dtype),
                    "max_err": err, "ref_max": scale, "excess_vs_exact": excess,
                    "repeat_identical": bool(torch.equal(got, again))})
    print(json.dumps(out))
    """
)


def run_interpreted(script: str, cases: list) -> list[dict]:
    """``script`` run with ``cases`` (JSON, its argv[1]) under the Triton interpreter in a subprocess (TRITON_INTERPRET
    must be set before Triton is imported); its last output line, parsed: one result per case."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(results) == len(cases)
    return results


def test_interpreted_kernel_matches_the_codec():
    for r in run_interpreted(INTERPRETED, CASES):
        m, n, k, _, _, _ = r["case"]
        assert r["shape"] == [m, n] and r["dtype"] == "torch.float16"
        # against the float16-rounded weight: within that rounding
        assert r["max_err"] <= 1e-3 * r["ref_max"] + 1e-3, r
        # against the exact weight: the kernel never rounds the weight, so only the float16 output's rounding
        # (2^-11 relative) and float32 sums (far smaller here) remain
        assert r["excess_vs_exact"] <= 1e-5 * r["ref_max"], r
        assert r["repeat_identical"], r  # split-K sums its partials in a fixed order


def test_refusals_name_the_bad_input():
    from vllm_ext.nvfp4_gemv import nvfp4_small_gemm

    q = nvfp4.quantize(torch.randn(32, 256).to(torch.bfloat16))
    with pytest.raises(ValueError, match="activations in torch.float32"):
        nvfp4_small_gemm(torch.randn(1, 256), q.packed, q.scale, q.global_scale)
    with pytest.raises(ValueError, match="65 rows > 64"):
        nvfp4_small_gemm(torch.randn(65, 256).half(), q.packed, q.scale, q.global_scale)
    with pytest.raises(ValueError, match="K=256 is not a multiple of block_k=96"):
        nvfp4_small_gemm(torch.randn(1, 256).half(), q.packed, q.scale, q.global_scale, block_k=96)
    with pytest.raises(ValueError, match="fma=True takes one row, got 2"):
        nvfp4_small_gemm(torch.randn(2, 256).half(), q.packed, q.scale, q.global_scale, fma=True)
    with pytest.raises(ValueError, match="words=True takes one row, got 3"):
        nvfp4_small_gemm(torch.randn(3, 256).half(), q.packed, q.scale, q.global_scale, words=True)
    with pytest.raises(ValueError, match="block_n=8 .16, 32, 64 or 128; 4 and 8 also with words=True."):
        nvfp4_small_gemm(torch.randn(1, 256).half(), q.packed, q.scale, q.global_scale, block_n=8)
    with pytest.raises(ValueError, match="block_n=48 .16, 32, 64 or 128"):
        nvfp4_small_gemm(torch.randn(1, 256).half(), q.packed, q.scale, q.global_scale, block_n=48)
    with pytest.raises(ValueError, match=r"packed torch.uint8 \(32, 128\), expected uint8 \(32, 64\)"):
        nvfp4_small_gemm(torch.randn(1, 128).half(), q.packed, q.scale, q.global_scale)
    with pytest.raises(ValueError, match=r"bias \(3,\) on cpu, expected \(32,\) on cpu"):
        nvfp4_small_gemm(torch.randn(1, 256).half(), q.packed, q.scale, q.global_scale, bias=torch.zeros(3).half())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the kernel and vLLM's Marlin FP4 GEMM)")
@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("split_k", [1, 4])
def test_gpu_bf16_matches_dequantized_reference_and_marlin(m, split_k):
    pytest.importorskip("vllm", reason="needs vLLM (its Marlin FP4 GEMM is the reference; not installed here)")
    from vllm_ext.bench.kernels import marlin_linear
    from vllm_ext.nvfp4_gemv import nvfp4_small_gemm

    torch.manual_seed(m)
    n, k = 4608, 3584  # the 7B q/k/v projection
    q = nvfp4.quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got = nvfp4_small_gemm(x, q.packed, q.scale, q.global_scale, split_k=split_k)
    exact = x.float() @ nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.bfloat16).float().t()
    marlin = marlin_linear(q.packed, q.scale, q.global_scale)(x)
    floor = (marlin.float() - exact).abs().max()
    assert (got.float() - exact).abs().max() <= 2 * floor + 1e-2
    assert torch.equal(got, nvfp4_small_gemm(x, q.packed, q.scale, q.global_scale, split_k=split_k))  # fixed order


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the kernel and vLLM's Marlin FP4 GEMM)")
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("asm,xvec", [(True, False), (False, False), (True, True)])
def test_gpu_one_row_word_kernel_matches_the_exact_product(split_k, asm, xvec):
    """The one-row CUDA-core path (words=True), with the PTX decode and without, in bf16 on the 7B down projection
    (the longest K): within the bf16 output's rounding of the product with the exact (float64) weight, and the same
    bits on a second call."""
    from vllm_ext.nvfp4_gemv import nvfp4_small_gemm

    torch.manual_seed(split_k)
    n, k = 3584, 18944
    q = nvfp4.quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    got = nvfp4_small_gemm(x, q.packed, q.scale, q.global_scale, words=True, block_n=16, block_k=256,
                           split_k=split_k, asm=asm, xvec=xvec)
    exact = x.double() @ nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double().t()
    excess = ((got.double() - exact).abs() - 2.0**-8 * exact.abs()).max().item()
    assert excess <= 1e-4 * exact.abs().max().item()
    assert torch.equal(got, nvfp4_small_gemm(x, q.packed, q.scale, q.global_scale, words=True, block_n=16,
                                             block_k=256, split_k=split_k, asm=asm, xvec=xvec))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the kernel and vLLM's Marlin FP4 GEMM)")
@pytest.mark.parametrize("n,k", [(4608, 3584), (3584, 18944)])  # q/k/v (split-K 1), down (split-K 4)
def test_gpu_marlin_or_row_with_bias(n, k):
    """decode_gemv's op on real Marlin tensors: one row on the row kernel with the natural-order bias in its epilogue,
    4 rows on Marlin with its permuted bias; both against the dequantized float32 product plus the bias."""
    from types import SimpleNamespace

    pytest.importorskip("vllm", reason="needs vLLM (Marlin's tensors and GEMM; not installed here)")
    from vllm_ext.nvfp4_backends import MarlinBackend, nvfp4_marlin_or_row

    torch.manual_seed(n)
    q = nvfp4.quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16))
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    shape = SimpleNamespace(params_dtype=torch.bfloat16, output_size_per_partition=n, input_size_per_partition=k)
    m = MarlinBackend._marlin(shape, q.packed, q.scale, q.global_scale, bias)
    w = nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32)
    for rows in (1, 4):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        got = nvfp4_marlin_or_row(x, m.weight, m.weight_scale, m.weight_global_scale, m.workspace, n, k, m.bias, True,
                                  q.packed, q.scale, q.global_scale.reshape(1).float(), bias)
        ref = x.float() @ w.t() + bias.float()
        tol = 2.0**-7 * ref.abs().max().item() + 1e-2  # bf16 output rounding and float32 sums in a different order
        assert got.shape == (rows, n) and (got.float() - ref).abs().max().item() <= tol, rows


def test_mma_refuses_tiles_it_has_no_kernel_for():
    """The few-row tensor-core kernel takes 64 or 128 output features per program (a tensor-core M dimension) and K
    tiles of 16 words or more; each refusal names the values."""
    from vllm_ext.nvfp4_gemv import nvfp4_small_gemm

    q = nvfp4.quantize(torch.randn(64, 512).to(torch.bfloat16))
    x = torch.randn(8, 512).half()
    with pytest.raises(ValueError, match="mma=True takes block_n 64 or 128 and block_k a multiple of 128, got 32 / 128"):
        nvfp4_small_gemm(x, q.packed, q.scale, q.global_scale, mma=True, block_n=32)
    with pytest.raises(ValueError, match="got 64 / 64"):
        nvfp4_small_gemm(x, q.packed, q.scale, q.global_scale, mma=True, block_n=64, block_k=64)
    with pytest.raises(ValueError, match="mma=True is its own kernel: not with words or fma"):
        nvfp4_small_gemm(x[:1], q.packed, q.scale, q.global_scale, mma=True, words=True, block_n=64)
    with pytest.raises(ValueError, match="stages=2 needs K a multiple of 128, got K=192"):
        q2 = nvfp4.quantize(torch.randn(64, 192).to(torch.bfloat16))
        nvfp4_small_gemm(torch.randn(2, 192).half(), q2.packed, q2.scale, q2.global_scale, mma=True, block_n=64,
                         block_k=64, stages=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bfloat16 tensor-core dots)")
@pytest.mark.parametrize("rows", [2, 8, 64])
@pytest.mark.parametrize("n,k,block_n,block_k,split_k,stages", [(4608, 3584, 64, 256, 2, 3), (3584, 18944, 64, 512, 4, 0),
                                                                (37888, 3584, 128, 256, 1, 4)])
def test_gpu_mma_kernel_matches_the_exact_product(rows, n, k, block_n, block_k, split_k, stages):
    """The few-row tensor-core kernel in bfloat16 on the 7B q/k/v, down and gate/up shapes: within the bf16 output's
    rounding of the float64 product with the exact weight (the decoded weight is exact in bf16 and the dots sum in
    float32), and the same bits on a second call."""
    from vllm_ext.nvfp4_gemv import nvfp4_small_gemm

    torch.manual_seed(rows + split_k)
    q = nvfp4.quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16))
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    tile = dict(mma=True, block_n=block_n, block_k=block_k, split_k=split_k, stages=stages,
                num_warps=8 if block_n == 128 else 4)
    got = nvfp4_small_gemm(x, q.packed, q.scale, q.global_scale, **tile)
    exact = x.double() @ nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double().t()
    excess = ((got.double() - exact).abs() - 2.0**-8 * exact.abs()).max().item()
    assert excess <= 1e-4 * exact.abs().max().item()
    assert torch.equal(got, nvfp4_small_gemm(x, q.packed, q.scale, q.global_scale, **tile))


def test_stages_need_the_word_kernel_and_k_a_multiple_of_128():
    """The pipelined loop declares the rows' strides multiples of 16 words: a K it would be wrong for is refused, as
    is ``stages`` on a kernel without that loop; both errors name the value."""
    from vllm_ext.nvfp4_gemv import nvfp4_small_gemm

    q = nvfp4.quantize(torch.randn(32, 192).to(torch.bfloat16))
    x = torch.randn(1, 192).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"stages=2 needs K a multiple of 128, got K=192"):
        nvfp4_small_gemm(x, q.packed, q.scale, q.global_scale, words=True, block_k=64, stages=2)
    q = nvfp4.quantize(torch.randn(32, 256).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"stages=2 \(>= 0, and only with words=True or mma=True\)"):
        nvfp4_small_gemm(torch.randn(1, 256).to(torch.bfloat16), q.packed, q.scale, q.global_scale, stages=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bfloat16 and the PTX decode)")
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("n,k,block_n,split_k,warps", [(4608, 3584, 4, 1, 4), (3584, 18944, 8, 4, 2),
                                                        (37888, 3584, 8, 1, 2)])
def test_gpu_pipelined_row_kernel_matches_the_exact_product(stages, n, k, block_n, split_k, warps):
    """The pipelined one-row loop on the 7B q/k/v, down and gate/up shapes with their tiles: within the bf16 output's
    rounding of the float64 product with the exact weight, the same bits on a second call, and at most one bf16
    step from the unpipelined kernel (the same products, the final per-tile sum split between threads differently)."""
    from vllm_ext.nvfp4_gemv import nvfp4_small_gemm

    torch.manual_seed(stages * 7 + split_k)
    q = nvfp4.quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    tile = dict(words=True, xvec=True, asm=True, block_n=block_n, block_k=512, split_k=split_k, num_warps=warps)
    got = nvfp4_small_gemm(x, q.packed, q.scale, q.global_scale, stages=stages, **tile)
    exact = x.double() @ nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double().t()
    excess = ((got.double() - exact).abs() - 2.0**-8 * exact.abs()).max().item()
    assert excess <= 1e-4 * exact.abs().max().item()
    assert torch.equal(got, nvfp4_small_gemm(x, q.packed, q.scale, q.global_scale, stages=stages, **tile))
    plain = nvfp4_small_gemm(x, q.packed, q.scale, q.global_scale, **tile).double()
    step = 2.0**-7 * plain.abs().clamp_min(plain.abs().max().item() / 256)
    assert ((got.double() - plain).abs() / step).max().item() <= 1.0


def test_decode_tiles_of_the_7b_and_32b_linears():
    """The tiles the H100 sweeps chose (§4j lease 7, §4k lease 5, §4n lease 1): each linear of the 7B and 32B steps."""
    from vllm_ext.nvfp4_gemv import decode_tile

    # 7B: q/k/v and down unpipelined as before (§4n: no faster tile); o and gate/up pipelined
    assert decode_tile(4608, 3584) == dict(block_n=4, block_k=512, split_k=1, num_warps=4)
    assert decode_tile(3584, 3584) == dict(block_n=4, block_k=512, split_k=1, num_warps=1, stages=4)
    assert decode_tile(37888, 3584) == dict(block_n=8, block_k=512, split_k=1, num_warps=1, stages=3)
    assert decode_tile(3584, 18944) == dict(block_n=8, block_k=512, split_k=4, num_warps=2)
    # 32B: every linear pipelined, 3 stages
    assert decode_tile(7168, 5120) == dict(block_n=8, block_k=512, split_k=1, num_warps=1, stages=3)
    assert decode_tile(5120, 5120) == dict(block_n=8, block_k=512, split_k=1, num_warps=2, stages=3)
    assert decode_tile(55296, 5120) == dict(block_n=8, block_k=512, split_k=1, num_warps=1, stages=3)
    assert decode_tile(5120, 27648) == dict(block_n=16, block_k=512, split_k=4, num_warps=2, stages=3)
    assert decode_tile(64, 384)["block_k"] == 128 and decode_tile(64, 200) is None
    # the row+lora kernel keeps §4m's unpipelined tile on the 32B down projection (§4n lease 2), elsewhere the same
    assert decode_tile(5120, 27648, lora=True) == dict(block_n=8, block_k=512, split_k=8, num_warps=2)
    for n, k in ((4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (7168, 5120), (55296, 5120)):
        assert decode_tile(n, k, lora=True) == decode_tile(n, k)


def test_small_linears_are_the_attention_projections():
    """decode_gemv="small" gives the row kernel q/k/v and o (K <= 8192, N <= 16384) and leaves the MLPs to Marlin:
    Qwen2.5-7B, -32B and -72B, Llama-3-8B; every linear of Qwen2.5-0.5B; and nothing without a decode tile."""
    from vllm_ext.nvfp4_gemv import small_linear

    shapes = {  # (q/k/v, o, gate/up, down) as [N, K]
        "qwen2.5-7b": ((4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)),
        "qwen2.5-32b": ((7168, 5120), (5120, 5120), (55296, 5120), (5120, 27648)),
        "qwen2.5-72b": ((10240, 8192), (8192, 8192), (59136, 8192), (8192, 29568)),
        "llama-3-8b": ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)),
        "qwen2.5-1.5b": ((2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)),
    }
    for name, (qkv, o, gate_up, down) in shapes.items():
        assert small_linear(*qkv) and small_linear(*o), name
        assert not small_linear(*gate_up) and not small_linear(*down), name
    assert all(small_linear(n, k) for n, k in ((1152, 896), (896, 896), (9728, 896), (896, 4864)))  # Qwen2.5-0.5B
    assert not small_linear(64, 200)  # K not a multiple of 128: no tile, Marlin


@pytest.mark.parametrize("mode, copied", [("off", set()), (False, set()), ("small", {"qkv", "o"}),
                                          ("all", {"qkv", "o", "gate_up", "down"}),
                                          (True, {"qkv", "o", "gate_up", "down"})])
def test_decode_gemv_mode_picks_the_layers_that_keep_a_row_copy(mode, copied):
    """Which layers' one-row calls a MarlinBackend sends to the row kernel (and so copy), per decode_gemv mode, on the
    7B shapes; a layer without the copy offers no row weights, whatever the mode."""
    pytest.importorskip("vllm")
    from qerl_plugin import options
    from vllm_ext.nvfp4_backends import MarlinBackend

    backend = object.__new__(MarlinBackend)  # no CUDA here: the Marlin checks of __init__ are skipped
    backend.decode_gemv = options.parse_decode_gemv(mode, "decode_gemv")  # as __init__ stores it
    layers = {}
    shapes = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
    for name, (n, k) in shapes.items():
        layers[name] = torch.nn.Module()
        layers[name].output_size_per_partition, layers[name].input_size_per_partition = n, k
    assert {name for name, layer in layers.items() if backend._gemv_ok(layer)} == copied
    assert backend.row_weights(layers["qkv"], None) is None  # nothing installed on these stand-ins


BACKEND_DISPATCH = textwrap.dedent(
    """
    import json
    import torch
    import torch.nn.functional as F
    from qerl_plugin import nvfp4
    from vllm_ext import nvfp4_backends
    from vllm_ext.nvfp4_backends import MarlinBackend

    g = torch.Generator().manual_seed(0)
    n, k = 24, 512
    q = nvfp4.quantize((torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16))
    w = nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32)
    layer = torch.nn.Module()
    for name, t in (("qerl_gemv_packed", q.packed), ("qerl_gemv_scale", q.scale),
                    ("qerl_gemv_gscale", q.global_scale.reshape(1).float()), ("qerl_gemv_bias", torch.randn(n, generator=g).half()),
                    ("weight", torch.zeros(1)), ("weight_scale", torch.zeros(1)), ("weight_global_scale", torch.zeros(1)),
                    ("workspace", torch.zeros(1))):
        layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    layer.output_size_per_partition, layer.input_size_per_partition = n, k
    permuted = torch.full((n,), 1e4).half()  # stands for Marlin's permuted bias: must not be the one the row kernel adds
    # Marlin's FP4 GEMM needs a GPU. Here a stand-in takes its place (the dequantized weight through F.linear, plus the
    # bias it is handed); it records that it ran, which is what the run-time choice below is checked by.
    marlin_calls = []
    def stand_in(x, weight, weight_scale, weight_global_scale, workspace, size_n, size_k, bias, fp32_reduce):
        marlin_calls.append(x.shape[0])
        return F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)
    nvfp4_backends.marlin_gemm = stand_in
    backend = object.__new__(MarlinBackend)  # no CUDA here: the Marlin checks of __init__ are skipped
    backend.decode_gemv, backend.fp32_reduce = "all", True
    x = torch.randn(1, k, generator=g).half()
    ref = x.float() @ w.t()
    got = backend.apply(layer, x, permuted)
    no_bias = backend.apply(layer, x, None)
    eager_marlin = list(marlin_calls)
    # compiled as vLLM compiles a model: dynamic token count, traced at 8 rows, guards dropped; then one row
    compiled = torch.compile(lambda t: backend.apply(layer, t, permuted), backend="aot_eager", dynamic=True,
                             options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe})
    x8 = torch.randn(8, k, generator=g).half()
    torch._dynamo.mark_dynamic(x8, 0)
    many = compiled(x8)
    one = compiled(x)
    print(json.dumps({"shape": list(got.shape), "eager_marlin": eager_marlin, "compiled_marlin": marlin_calls[len(eager_marlin):],
                      "err_bias": (got.float() - ref - layer.qerl_gemv_bias.float()).abs().max().item(),
                      "err_plain": (no_bias.float() - ref).abs().max().item(), "ref_max": ref.abs().max().item(),
                      "compiled_one_vs_eager": (one.float() - got.float()).abs().max().item(),
                      "compiled_many_err": (many.float() - (x8.float() @ w.t() + permuted.float())).abs().max().item()}))
    """
)


def test_decode_gemv_dispatch_adds_the_natural_order_bias():
    """MarlinBackend.apply with decode_gemv: a one-row call goes to torch.ops.qerl.nvfp4_gemv_row (the interpreted
    kernel here), which adds the layer's natural-order bias in its epilogue, not the permuted one it is handed; no
    bias, none added. Under torch.compile as vLLM runs it (traced at 8 rows, guards dropped) the choice is still
    made per call: 8 rows go to Marlin (a CPU stand-in here), the one-row call to the row kernel."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", BACKEND_DISPATCH], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["shape"] == [1, 24]
    assert r["eager_marlin"] == [] and r["compiled_marlin"] == [8]
    assert r["err_bias"] <= 2e-3 * (r["ref_max"] + 4) and r["err_plain"] <= 2e-3 * r["ref_max"]
    assert r["compiled_one_vs_eager"] == 0.0
    assert r["compiled_many_err"] <= 2e-3 * (r["ref_max"] + 1e4)


_PTX_OPS = {"shl": operator.lshift, "shr": operator.rshift, "and": operator.and_, "or": operator.or_}


def _run_decode8_ptx(text: str, word: int) -> list[float]:
    """A tiny interpreter for the instructions the decode PTXs use (shl/shr/and/or on b32, the b32 -> two b16 split,
    cvt.f32.f16, and the FP8 decode's cvt.rn.f16x2.e4m3x2: the low byte to the low float16), so their bit moves are
    checked on the CPU, where Triton's interpreter cannot run inline PTX."""
    import re as _re

    import numpy as np

    regs: dict[str, int] = {"$8": word & 0xFFFFFFFF}
    out = [0.0] * 8
    val = lambda a: regs[a] if a in regs else int(a, 0)  # noqa: E731
    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        if m := _re.fullmatch(r"mov\.b32 \{(\w+), (\w+)\}, (\w+)", line):
            regs[m[1]], regs[m[2]] = regs[m[3]] & 0xFFFF, regs[m[3]] >> 16
            continue
        if m := _re.fullmatch(r"cvt\.rn\.f16x2\.e4m3x2 (\w+), (\w+)", line):
            pair = torch.tensor([regs[m[2]] & 0xFF, regs[m[2]] >> 8], dtype=torch.uint8).view(torch.float8_e4m3fn)
            halves = pair.float().numpy().astype(np.float16).view(np.uint16)  # exact: E4M3 values fit float16
            regs[m[1]] = int(halves[0]) | (int(halves[1]) << 16)
            continue
        if m := _re.fullmatch(r"cvt\.f32\.f16 \$(\d), (\w+)", line):
            out[int(m[1])] = float(np.array([regs[m[2]]], dtype=np.uint16).view(np.float16)[0])
            continue
        op, dst, a, b = _re.fullmatch(r"(\w+)\.b32 (\S+), (\S+), (\S+)", line).groups()
        x, y = val(a), val(b)
        regs[dst] = _PTX_OPS[op](x, y) & 0xFFFFFFFF
    return out


def test_decode8_ptx_moves_every_code_to_its_value():
    """The PTX decode (run on the GPU as asm=True): each of the 8 positions of a word, for all 16 E2M1 codes, gives
    the code's value times 2^-14, and its neighbours do not leak in."""
    from vllm_ext.nvfp4_decode import _DECODE8_PTX_TEXT

    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    values = e2m1 + [-v for v in e2m1]
    for pos in range(8):
        for code in range(16):
            word = (code << (4 * pos)) | (0xF << (4 * ((pos + 1) % 8)) if pos < 7 else code << 28)
            got = _run_decode8_ptx(_DECODE8_PTX_TEXT, word)
            assert got[pos] == values[code] * 2.0**-14, (pos, code, got)
    word = 0x76543210  # codes 0..7 at positions 0..7
    assert _run_decode8_ptx(_DECODE8_PTX_TEXT, word) == [v * 2.0**-14 for v in e2m1]
