"""vllm_ext.nvfp4_gemv_tma: the one-row NVFP4 kernel with the weight's tiles brought in by TMA (an experiment, §4ba).

On the CPU it runs under the Triton interpreter (a subprocess: TRITON_INTERPRET must be set before Triton is
imported) in float16, against the product with the codec's exact weight in float64 (the interpreter mishandles
bfloat16); it is also compiled for sm_90 here, to check that its loads became TMA copies. On a GPU: bfloat16 on the
7B shapes against the same exact product, and against the row kernel it copies.
"""

from __future__ import annotations

import re
import textwrap

import pytest
import torch

from qerl_plugin import nvfp4

pytest.importorskip("triton", reason="Triton is not installed: the kernel cannot run or be interpreted")

CASES = [  # (N, K, block_n, block_k, split_k, stages, bias): a ragged last block (rows past N come back as the TMA's
    # zeros), split-K even and uneven, every block_k, deep and shallow pipelines, a bias
    (40, 1024, 16, 512, 1, 2, False),
    (40, 1024, 32, 256, 2, 3, True),
    (24, 2048, 8, 1024, 3, 1, False),
    (64, 4096, 64, 2048, 2, 2, False),
    (13, 768, 4, 256, 1, 4, True),
]

INTERPRETED = textwrap.dedent(
    """
    import json, sys
    import torch
    from qerl_plugin import nvfp4
    from vllm_ext.nvfp4_gemv_tma import nvfp4_gemv_row_tma

    out = []
    for n, k, bn, bk, sk, st, has_bias in json.loads(sys.argv[1]):
        g = torch.Generator().manual_seed(n * 1000 + k)
        w = torch.randn(n, k, generator=g) * 0.05
        w[0, :16] = 0.0  # an all-zero group (scale 0)
        w[n - 1, 32:48] *= 40.0  # a group with a large scale
        q = nvfp4.quantize(w.to(torch.bfloat16))
        x = torch.randn(1, k, generator=g).to(torch.float16)
        bias = (torch.randn(n, generator=g) * 4).to(torch.float16) if has_bias else None
        kw = dict(block_n=bn, block_k=bk, split_k=sk, stages=st, bias=bias)
        got = nvfp4_gemv_row_tma(x, q.packed, q.scale, q.global_scale, **kw)
        w64 = nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double()
        ref64 = x.double() @ w64.t() + (0.0 if bias is None else bias.double())
        excess = ((got.double() - ref64).abs() - 2.0**-11 * ref64.abs()).max().item()
        again = nvfp4_gemv_row_tma(x, q.packed, q.scale, q.global_scale, **kw)
        out.append({"case": [n, k, bn, bk, sk, st, has_bias], "shape": list(got.shape), "dtype": str(got.dtype),
                    "ref_max": ref64.abs().max().item(), "excess_vs_exact": excess,
                    "repeat_identical": bool(torch.equal(got, again))})
    print(json.dumps(out))
    """
)


def test_interpreted_kernel_gives_the_exact_product():
    from test_nvfp4_gemv import run_interpreted

    for r in run_interpreted(INTERPRETED, CASES):
        assert r["shape"] == [1, r["case"][0]] and r["dtype"] == "torch.float16", r
        # the weight is never rounded: only the float16 output's rounding (2^-11 relative) and float32 sums remain
        assert r["excess_vs_exact"] <= 1e-5 * r["ref_max"], r
        assert r["repeat_identical"], r  # split-K sums its partials in a fixed order


def test_refusals_name_the_input_and_the_fix():
    from vllm_ext.nvfp4_gemv_tma import nvfp4_gemv_row_tma

    q = nvfp4.quantize(torch.randn(32, 1024).to(torch.bfloat16))
    x = torch.randn(1, 1024).half()
    cases = [
        (dict(x=torch.randn(1, 1024)), "activations in torch.float32: pass bfloat16 or float16"),
        (dict(x=torch.randn(2, 1024).half()), "2 rows of x: this kernel takes one"),
        (dict(block_k=128), r"block_k=128: use one of \(256, 512, 1024, 2048\)"),
        (dict(block_k=2048), "K=1024 is not a multiple of block_k=2048: take a block_k that divides it"),
        (dict(block_n=24), "block_n=24: use a power of two up to 256"),
        (dict(block_n=512), "block_n=512: use a power of two up to 256"),
        (dict(split_k=0), "split_k=0: use 1 or more"),
        (dict(stages=0), r"stages=0: use 1 or more \(the depth of the TMA pipeline\)"),
        (dict(scale=q.scale.float()), r"scale torch.float32 \(32, 64\): expected float8_e4m3fn \(32, 64\)"),
        (dict(packed=q.packed[:, :256]), r"packed torch.uint8 \(32, 256\): expected uint8 \(32, 512\)"),
        (dict(global_scale=torch.ones(2)), "global_scale has 2 values: expected 1"),
        (dict(bias=torch.zeros(3).half()), r"bias \(3,\) on cpu: expected \(32,\) on cpu"),
    ]
    for change, message in cases:
        args = {**dict(x=x, packed=q.packed, scale=q.scale, global_scale=q.global_scale), **change}
        with pytest.raises(ValueError, match=message):
            nvfp4_gemv_row_tma(**args)
    odd = torch.empty(32 * 512 + 1, dtype=torch.uint8)[1:].view(32, 512)  # starts one byte past an aligned one
    odd.copy_(q.packed)
    with pytest.raises(ValueError, match="packed starts at an address not 16-byte aligned"):
        nvfp4_gemv_row_tma(x, odd, q.scale, q.global_scale)


@pytest.mark.parametrize("block_n,block_k,stages,warps", [(16, 512, 4, 4), (8, 256, 2, 1), (32, 1024, 3, 2)])
def test_compiled_for_hopper_the_weight_comes_by_tma(block_n, block_k, stages, warps):
    """Compiled for sm_90 without a GPU: the words and scales are TMA copies (``cp.async.bulk.tensor``, counted on
    mbarriers), one per operand per pipeline stage in flight; ``x`` alone still comes by ``cp.async``."""
    from vllm_ext.nvfp4_gemv_tma import _tma_row_kernel
    from vllm_ext.triton_support import compile_sm90

    types = {"x_ptr": "*bf16", "w_desc": f"tensordesc<i32[{block_n}, {block_k // 8}]>",
             "s_desc": f"tensordesc<u8[{block_n}, {block_k // 16}]>", "g_ptr": "*fp32", "y_ptr": "*bf16",
             "ws_ptr": "*fp32", "cnt_ptr": "*i32", "b_ptr": "*bf16"}
    consts = dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=1, ASM=2, HAS_BIAS=False, STAGES=stages, PDL=True)
    ptx = compile_sm90(_tma_row_kernel, types, consts, warps, aligned=("x_ptr", "y_ptr", "ws_ptr", "K")).asm["ptx"]
    tma = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\.mbarrier", ptx)
    assert len(tma) >= 2 * max(stages - 1, 1), len(tma)  # the prologue's copies and the loop's, both operands
    assert "mbarrier.try_wait" in ptx
    assert "griddepcontrol.wait" in ptx  # PDL: it waits for the previous kernel before its first copy
    assert ptx.index("griddepcontrol.wait") < ptx.index("cp.async.bulk.tensor")


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with TMA (Hopper or later)")


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("n,k,block_n,block_k,split_k,stages,warps", [
    (4608, 3584, 16, 512, 1, 4, 4),  # 7B q/k/v
    (37888, 3584, 32, 256, 1, 6, 4),  # 7B gate/up
    (3584, 18944, 8, 512, 4, 3, 1),  # 7B down, split-K
    (3584, 18944, 16, 512, 3, 2, 2),  # uneven split-K (37 tiles)
    (1000, 3584, 64, 512, 2, 2, 4),  # a ragged last block
])
def test_gpu_bf16_gives_the_exact_product(n, k, block_n, block_k, split_k, stages, warps):
    """bfloat16 on the GPU: within the bf16 output's rounding of the product with the exact (float64) weight, the
    same bits on a second call, and equal to the row kernel it copies (``nvfp4_small_gemm``'s, ``xvec``) within one
    bf16 step (their sums may be split between threads differently)."""
    from vllm_ext.nvfp4_gemv import nvfp4_small_gemm
    from vllm_ext.nvfp4_gemv_tma import nvfp4_gemv_row_tma

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9.0 or later")
    torch.manual_seed(n + k)
    q = nvfp4.quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    kw = dict(block_n=block_n, block_k=block_k, split_k=split_k, stages=stages, num_warps=warps)
    got = nvfp4_gemv_row_tma(x, q.packed, q.scale, q.global_scale, **kw)
    exact = x.double() @ nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double().t()
    excess = ((got.double() - exact).abs() - 2.0**-8 * exact.abs()).max().item()
    assert excess <= 1e-4 * exact.abs().max().item()
    assert torch.equal(got, nvfp4_gemv_row_tma(x, q.packed, q.scale, q.global_scale, **kw))
    row = nvfp4_small_gemm(x, q.packed, q.scale, q.global_scale, words=True, xvec=True, block_n=16,
                           block_k=block_k, split_k=split_k)
    assert ((got.float() - row.float()).abs() <= 2.0**-7 * row.float().abs() + 1e-6).all()


@pytest.mark.gpu
@GPU
def test_gpu_bias_and_dependent_launch():
    """With a bias (added in float32 before the one rounding) and as a programmatic dependent launch."""
    from vllm_ext.nvfp4_gemv_tma import nvfp4_gemv_row_tma

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA and programmatic dependent launch need compute capability 9.0 or later")
    torch.manual_seed(7)
    n, k = 3584, 3584
    q = nvfp4.quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    got = nvfp4_gemv_row_tma(x, q.packed, q.scale, q.global_scale, bias=bias, pdl=True, split_k=2)
    exact = (x.double() @ nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double().t()
             + bias.double())
    excess = ((got.double() - exact).abs() - 2.0**-8 * exact.abs()).max().item()
    assert excess <= 1e-4 * exact.abs().max().item()
