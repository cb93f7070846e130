"""vllm_ext.nvfp4_gluon_lora: a few-row NVFP4 linear with its adapter's LoRA, the expand in the Gluon kernel's epilogue.

On the CPU the shrink runs under the Triton interpreter (a subprocess: TRITON_INTERPRET must be set before Triton is
imported) against float64 sums, the GEMM with the expand is compiled for sm_90 with Triton's own ptxas, and the
refusals are checked. The GEMM's numerics need a Hopper GPU (Gluon has no interpreter): there the result is checked
against the Gluon GEMM's own bits plus an independent float64 statement of punica's LoRA (``h`` = ``scale * A @ x``
rounded, ``B @ h`` rounded, added and rounded), within the rounding bound of sums run in other orders, tokens
without the adapter bit for bit equal to the GEMM alone, and the same bits on a second call and in a CUDA graph.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from qerl_plugin import nvfp4

gl_lora = pytest.importorskip("vllm_ext.nvfp4_gluon_lora")
ng = pytest.importorskip("vllm_ext.nvfp4_gluon")
if ng.GLUON_IMPORT_ERROR is not None:
    pytest.skip(f"Triton's Gluon is not importable ({ng.GLUON_IMPORT_ERROR})", allow_module_level=True)

SHRINK = textwrap.dedent(
    """
    import json, sys
    import torch
    from vllm_ext.nvfp4_gemv_lora import chunking
    from vllm_ext.nvfp4_gluon_lora import shrink_rows

    out = []
    for i, (rows, k, r, slices) in enumerate(json.loads(sys.argv[1])):
        g = torch.Generator().manual_seed(7 + i)
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        a = tuple((torch.randn(1, 1, r, k, generator=g) / k**0.5).to(torch.bfloat16) for _ in range(slices))
        hp = shrink_rows(x, a)
        per, ks = chunking(k)
        worst, past_rows = 0.0, 0.0
        for s in range(slices):
            for c in range(ks):
                xc, ac = x[:, c * per:(c + 1) * per].double(), a[s][0, 0][:, c * per:(c + 1) * per].double()
                bound = per * 2.0**-24 * (xc.abs() @ ac.abs().t())  # float32's bound for a sum of `per` products
                err = (hp[s, c, :rows].double() - xc @ ac.t()).abs()
                worst = max(worst, (err / bound).max().item())
            past_rows = max(past_rows, hp[s, :ks, rows:].abs().max().item() if hp.shape[2] > rows else 0.0)
        out.append({"shape": list(hp.shape), "ks": ks, "worst": worst, "past_rows": past_rows})
    print(json.dumps(out))
    """
)


def test_shrink_matches_float64_sums_per_chunk_under_the_interpreter():
    """Each chunk's partial ``x[:, chunk] @ A_s[:, chunk]^T`` is the float64 sum within float32's error bound for a
    sum of that many terms (the products of bf16 values are exact in float32), for 1, 3, 8 and 20 tokens, one to
    three slices and a K that takes 12 chunks of 768; rows past the tokens are zeros (the GEMM's epilogue masks them
    anyway)."""
    cases = [[1, 768, 16, 1], [3, 1024, 32, 3], [8, 8704, 16, 2], [20, 512, 64, 3]]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", SHRINK, json.dumps(cases)], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for (rows, k, r, slices), res in zip(cases, got):
        assert res["shape"] == [slices, 16, max(16, 1 << (rows - 1).bit_length()), r]
        assert res["ks"] == (12 if k == 8704 else -(-k // 256))
        assert res["worst"] <= 1.0, (rows, k, r, res)
        assert res["past_rows"] == 0.0


_SIGNATURE = {"x_ptr": "*bf16", "sxm": "i32", "w_ptr": "*u8", "s_ptr": "*fp8e4nv", "g_ptr": "*fp32", "y_ptr": "*bf16",
              "sym": "i32", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "KB": "i32",
              "KS": "i32", "hp_ptr": "*fp32", "idx_ptr": "*i64", "b0": "*bf16", "b1": "*bf16", "b2": "*bf16",
              "n0": "i32", "n1": "i32", "LKS": "i32", "lscale": "fp32", "bias_ptr": "*bf16", "z_ptr": "*bf16"}


@pytest.mark.parametrize("block_m,block_k,warps,split_k,rank,pdl,extras", [
    (8, 256, 4, 8, 32, True, True), (8, 256, 4, 2, 16, True, False), (64, 128, 8, 8, 64, False, True),
    (16, 64, 4, 1, 32, True, True)])
def test_gemm_with_the_expand_compiles_for_sm90(block_m, block_k, warps, split_k, rank, pdl, extras):
    """``_wgmma_kernel`` with ``LORA``, compiled for sm_90 (Triton's front end and bundled ptxas, no GPU): the main
    loop's warpgroup MMAs as in the GEMM alone (block_k / 16 per tile), the expand on the tensor cores (mma.sync, rank /
    16 per 16 weight rows of a warp and 8 tokens), ``griddepcontrol.wait`` exactly once with ``PDL`` (before the
    partials are read) and not at all without, and shared memory for the ``x`` tile only, which the epilogue's layout
    conversions reuse. ``extras``: with the bias and the split add's zeros."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    consts = dict(BLOCK_M=block_m, BLOCK_K=block_k, WARPS=warps, NREP=1, SPLIT_K=split_k, EVEN_N=True, LORA=True,
                  R=rank,
                  HP_M=max(16, block_m), KS_PAD=16, PDL=pdl, HAS_BIAS=extras, ZEROS=extras)
    src = GluonASTSource(fn=ng._wgmma_kernel, signature={**_SIGNATURE, **{k: "constexpr" for k in consts}},
                         constexprs=consts)
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        get_ptxas(90)
    except Exception as exc:  # noqa: BLE001 (a Triton build without its ptxas: nothing to compile sm_90 with)
        pytest.skip(f"no ptxas for sm_90 here: {type(exc).__name__}: {exc}"[:200])
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "launch_pdl": pdl})
    ptx = ck.asm["ptx"]
    assert ptx.count("wgmma.mma_async") == block_k // 16  # per warpgroup (one or two run the same code)
    assert ptx.count("mma.sync") == (rank // 16) * (block_m // 8)
    assert ptx.count("griddepcontrol.wait") == (1 if pdl else 0)
    assert block_m * block_k * 2 <= ck.metadata.shared <= max(block_m * block_k * 2 + 16, 16 * warps * rank * 2)


def test_tiles_and_refusals_name_the_bad_input():
    """The 7B tiles are §4r's (8-row tile up to 16 tokens, 64-row tile above); other shapes get a block_k that
    divides K. Each refusal names the bad input (the call's shapes are judged before the device, so all of them are
    checked here, on CPU tensors); a call that fits is refused on the CPU for want of a Hopper GPU."""
    assert gl_lora.tile_for(4608, 3584, 8) == (256, 4, 1, 8)
    assert gl_lora.tile_for(37888, 3584, 16) == (256, 4, 1, 2)
    assert gl_lora.tile_for(3584, 18944, 64) == (128, 8, 1, 8)
    assert gl_lora.tile_for(100, 640, 8) == (128, 4, 1, 8)
    q = nvfp4.quantize(torch.randn(192, 256).to(torch.bfloat16))
    x = torch.randn(2, 256).to(torch.bfloat16)

    def adapter(rank, slices):  # noqa: ANN001, ANN202
        return (tuple(torch.zeros(1, 1, rank, 256, dtype=torch.bfloat16) for _ in slices),
                tuple(torch.zeros(1, 1, s, rank, dtype=torch.bfloat16) for s in slices))

    a, b = adapter(16, (128, 64))
    assert gl_lora.supports(torch.randn(65, 256).to(torch.bfloat16), q.packed, a, b, (128, 64)) == "65 rows (1 to 64)"
    assert gl_lora.supports(x.half(), q.packed, *adapter(16, (128, 64)), (128, 64)) == (
        "weights in torch.bfloat16/torch.bfloat16 for input torch.float16")
    assert gl_lora.supports(x, q.packed, *adapter(256, (128, 64)), (128, 64)) == "rank 256 (at most 128)"
    marlin_like = torch.zeros(16, 384, dtype=torch.int32)
    assert gl_lora.supports(x, marlin_like, a, b, (128, 64)) == (
        "weight torch.int32 (16, 384) is not the checkpoint layout for input 256 and slices (128, 64)")
    assert gl_lora.supports(x, q.packed, *adapter(16, (96, 96)), (96, 96)) == (
        "slice sizes [96] are not multiples of the kernel's 64 rows per block")
    assert gl_lora.supports(x, q.packed, a, b, (128, 64), tile=(96, 3, 1, 0)) == (
        "tile K=256 and block_k=96: block_k must be a multiple of 64 that divides K; warps=3 (4 or 8 with wgmma: one "
        "or two warpgroups); split_k=0 (1 to 16)")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        assert gl_lora.supports(x, q.packed, a, b, (128, 64)) == (
            "x on cpu: the kernel needs a Hopper GPU (wgmma; Gluon has no interpreter)")
        with pytest.raises(Exception, match="needs a Hopper GPU"):
            gl_lora.gluon_lora_gemm(x, q.packed, q.scale, q.global_scale, a, b, 1.0, (128, 64), torch.zeros(2).long())


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (wgmma; Gluon has no interpreter)")


def _case(slices, k, rank, rows, seed, served=None):  # noqa: ANN001, ANN202
    """A random NVFP4 weight for ``slices``, adapter, ``x`` and slots (``served``: which tokens have slot 0; the
    others -1) on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = sum(slices)
    q = nvfp4.quantize((torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16))
    a = tuple((torch.randn(1, 1, rank, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16) for _ in slices)
    b = tuple((torch.randn(1, 1, s, rank, device="cuda", generator=g) * 0.05).to(torch.bfloat16) for s in slices)
    x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
    served = [True] * rows if served is None else served
    slots = torch.tensor([0 if s else -1 for s in served], device="cuda", dtype=torch.long)
    return q, a, b, x, slots


def _punica_f64(base, x, a, b, scale, slots):  # noqa: ANN001, ANN202
    """The GEMM's bits plus punica's update stated in float64: ``h = scale * A @ x`` rounded to bf16 (zero for a
    token whose slot is not 0), ``B @ h`` rounded, added and rounded. Also the bound on how far a kernel that sums
    ``h`` and ``B h`` in float32 in another order may land from it: where float32's ``h`` lies near a bf16 rounding
    boundary it may round to the neighbouring value (``|B| @ |h|`` times 2^-7 covers one step of every ``h``), and
    then ``B h`` and the sum may each round one step the other way (2^-7 of each, relative)."""
    ups, slack = [], []
    for a_s, b_s in zip(a, b):
        h = (x.double() @ a_s[0, 0].double().t()) * scale
        h = torch.where((slots == 0)[:, None], h, 0.0).to(torch.bfloat16).double()
        up = (h @ b_s[0, 0].double().t()).to(torch.bfloat16).double()
        ups.append(up)
        slack.append((h.abs() @ b_s[0, 0].double().abs().t()) * 2.0**-7 + up.abs() * 2.0**-7)
    ref = (base.double() + torch.cat(ups, dim=-1)).to(torch.bfloat16)
    return ref, torch.cat(slack, dim=-1) + ref.double().abs() * 2.0**-7


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("rows", [1, 8, 33, 64])
@pytest.mark.parametrize("slices,k,rank", [((3584, 512, 512), 3584, 32), ((3584,), 3584, 16),
                                           ((18944, 18944), 3584, 32), ((3584,), 18944, 64), ((256, 128), 1024, 32)])
def test_gpu_matches_the_gemm_plus_punica_in_float64(rows, slices, k, rank):
    """The 7B q/k/v, o, gate/up and down shapes and a small two-slice one, at each token count and the default tiles
    (split-K 8, 2, 4, 1, ...): within the rounding bound of the Gluon GEMM's own bits plus punica's update in
    float64 (:func:`_punica_f64`) and equal to it in at least 99 % of the outputs, tokens without the adapter equal
    to the GEMM alone bit for bit, and the same bits on a second call. (A first run checked 2 bf16 ulps: outputs
    near zero, where the base and the update cancel, were up to 64 ulps away, within this bound.)"""
    served = [i % 3 != 1 for i in range(rows)] if rows > 1 else [True]
    q, a, b, x, slots = _case(slices, k, rank, rows, seed=rows + k + rank, served=served)
    n = sum(slices)
    block_k, warps, nrep, split_k = gl_lora.tile_for(n, k, rows)
    base = ng.nvfp4_gluon_gemm(x, q.packed, q.scale, q.global_scale, block_k=block_k, warps=warps, nrep=nrep,
                               split_k=split_k, wgmma=True)
    got = gl_lora.gluon_lora_gemm(x, q.packed, q.scale, q.global_scale, a, b, 0.5, slices, slots)
    ref, bound = _punica_f64(base, x, a, b, 0.5, slots)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    err = (got.double() - ref.double()).abs()
    assert (err <= bound).all(), f"worst {(err / bound).max().item():.2f} of the bound"
    assert (got == ref).double().mean().item() >= 0.99  # nearly every output equal: only near-boundary cases differ
    off = ~torch.tensor(served, device="cuda")
    assert torch.equal(got[off], base[off])
    assert torch.equal(got, gl_lora.gluon_lora_gemm(x, q.packed, q.scale, q.global_scale, a, b, 0.5, slices, slots))


@pytest.mark.gpu
@needs_hopper
def test_gpu_same_bits_without_pdl_and_in_a_cuda_graph():
    """The programmatic dependent launches change nothing but when the programs start: the same bits with ``pdl``
    off, and replayed from a CUDA graph (where the next replay also needs split-K's counters reset), also after new
    inputs and slots are copied into the captured tensors."""
    slices, k = (3584, 512, 512), 3584
    q, a, b, x, slots = _case(slices, k, 32, 8, seed=5)
    want = gl_lora.gluon_lora_gemm(x, q.packed, q.scale, q.global_scale, a, b, 2.0, slices, slots)
    assert torch.equal(want, gl_lora.gluon_lora_gemm(x, q.packed, q.scale, q.global_scale, a, b, 2.0, slices, slots,
                                                     pdl=False))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # warm-up outside the capture (compilation)
        gl_lora.gluon_lora_gemm(x, q.packed, q.scale, q.global_scale, a, b, 2.0, slices, slots)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gl_lora.gluon_lora_gemm(x, q.packed, q.scale, q.global_scale, a, b, 2.0, slices, slots)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    _, _, _, x2, _ = _case(slices, k, 32, 8, seed=6, served=[i % 2 == 0 for i in range(8)])
    slots2 = torch.tensor([0, -1] * 4, device="cuda", dtype=torch.long)
    want2 = gl_lora.gluon_lora_gemm(x2, q.packed, q.scale, q.global_scale, a, b, 2.0, slices, slots2)
    x.copy_(x2)
    slots.copy_(slots2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want2) and not torch.equal(want2, want)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("rows", [2, 8])
def test_gpu_bias_and_the_split_adds_zeros(rows):
    """With a bias (q/k/v's): within the bf16 output's rounding of the float64 product with the exact weight plus the
    bias, plus the bound of :func:`_punica_f64` for the update. With ``zeros``: the same output bits, and a second
    tensor of zeros (the overlap op's split add)."""
    slices, k = (3584, 512, 512), 3584
    q, a, b, x, slots = _case(slices, k, 32, rows, seed=11 + rows)
    bias = torch.randn(sum(slices), device="cuda").to(torch.bfloat16)
    got = gl_lora.gluon_lora_gemm(x, q.packed, q.scale, q.global_scale, a, b, 1.0, slices, slots, bias=bias)
    exact = x.double() @ nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double().t()
    exact = exact + bias.double()
    update, bound = _punica_f64(torch.zeros_like(got), x, a, b, 1.0, slots)
    err = (got.double() - (exact + update.double())).abs()
    assert (err <= bound + 2.0**-7 * exact.abs() + 1e-4 * exact.abs().max()).all()  # two roundings: base, sum
    out, z = gl_lora.gluon_lora_gemm(x, q.packed, q.scale, q.global_scale, a, b, 1.0, slices, slots, bias=bias,
                                     zeros=True)
    assert torch.equal(out, got) and z.shape == got.shape and not z.any()
