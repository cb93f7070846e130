"""vllm_ext.nvfp4_gluon: the experimental few-row NVFP4 GEMM in Gluon.

Gluon does not run under the Triton interpreter, so on the CPU only the refusals and the compiled kernel's resources
are checked (compiled for sm_90 with Triton's own ptxas: no shared memory, no spills, at every tile the sweep tries).
The numerics are checked on the GPU against the float64 product with the exact weight.
"""

from __future__ import annotations

import re

import pytest
import torch

from qerl_plugin import nvfp4

ng = pytest.importorskip("vllm_ext.nvfp4_gluon")
if ng.GLUON_IMPORT_ERROR is not None:
    pytest.skip(f"Triton's Gluon is not importable ({ng.GLUON_IMPORT_ERROR})", allow_module_level=True)


def test_refusals_name_the_bad_input():
    q = nvfp4.quantize(torch.randn(32, 256).to(torch.bfloat16))
    x = torch.randn(2, 256).to(torch.bfloat16)
    with pytest.raises(ValueError, match="x on cpu .the kernel runs on CUDA only"):
        ng.nvfp4_gluon_gemm(x, q.packed, q.scale, q.global_scale)
    with pytest.raises(ValueError, match="activations in torch.float16 .bfloat16 supported."):
        ng.nvfp4_gluon_gemm(x.half(), q.packed, q.scale, q.global_scale)
    with pytest.raises(ValueError, match="65 rows .1 to 64."):
        ng.nvfp4_gluon_gemm(torch.randn(65, 256).to(torch.bfloat16), q.packed, q.scale, q.global_scale)
    with pytest.raises(ValueError, match="K=256 and block_k=96: block_k must be a multiple of 64 that divides K"):
        ng.nvfp4_gluon_gemm(x, q.packed, q.scale, q.global_scale, block_k=96)
    with pytest.raises(ValueError, match="warps=3 .1, 2, 4 or 8."):
        ng.nvfp4_gluon_gemm(x, q.packed, q.scale, q.global_scale, warps=3)
    with pytest.raises(ValueError, match=r"scale torch.uint8 \(32, 16\), expected float8_e4m3fn \(32, 16\)"):
        ng.nvfp4_gluon_gemm(x, q.packed, q.scale.view(torch.uint8), q.global_scale)
    with pytest.raises(ValueError, match=r"nrep=3 \(1, 2 or 4\)"):
        ng.nvfp4_gluon_gemm(x, q.packed, q.scale, q.global_scale, nrep=3)
    with pytest.raises(ValueError, match=r"split_k=0 \(1 to 16\)"):
        ng.nvfp4_gluon_gemm(x, q.packed, q.scale, q.global_scale, split_k=0)


def _compile_sm90(block_m: int, block_k: int, warps: int, nrep: int = 1, split_k: int = 1, prefetch: bool = False):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    consts = {"BLOCK_M": block_m, "BLOCK_K": block_k, "WARPS": warps, "NREP": nrep, "SPLIT_K": split_k,
              "PREFETCH": prefetch}
    sig = {"x_ptr": "*bf16", "sxm": "i32", "w_ptr": "*u8", "s_ptr": "*fp8e4nv", "g_ptr": "*fp32", "y_ptr": "*bf16",
           "sym": "i32", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
           **{name: "constexpr" for name in consts}}
    src = GluonASTSource(fn=ng._gluon_kernel, signature=sig, constexprs=consts,
                         attrs={(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 5, 6, 7, 8, 11)})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


@pytest.mark.parametrize("block_m,block_k,warps,nrep,prefetch", [(16, 128, 1, 1, False), (16, 256, 2, 1, False),
                                                                  (64, 128, 4, 1, False), (8, 256, 1, 1, True),
                                                                  (8, 128, 2, 2, True), (64, 64, 1, 4, True)])
def test_compiles_for_sm90_with_operands_in_registers_only(block_m, block_k, warps, nrep, prefetch):
    """The point of the kernel: compiled for Hopper, every operand of its tensor-core instructions stays in registers
    (no shared memory at all, no conversion through it or between lanes), with no spills; its SASS has the mma.sync
    instructions (HMMA) of one K tile per loop. Also with the next tile prefetched and several row blocks per warp."""
    ck, usage, ops = _compiled_sass(block_m, block_k, warps, nrep, 1, prefetch)
    assert ck.metadata.shared == 0
    assert re.search(r"LOCAL:0\b", usage), usage  # no spills
    assert "HMMA" in ops and not {"STS", "LDS", "LDSM", "SHFL"} & set(ops)  # no conversion through memory or lanes


@pytest.mark.parametrize("block_m,block_k,warps,nrep,split_k", [(8, 512, 1, 1, 4), (16, 256, 2, 2, 8)])
def test_split_k_adds_only_the_arrival_broadcast(block_m, block_k, warps, nrep, split_k):
    """With split-K, the only shared memory is the epilogue's: the arrival counter's value, broadcast from the one
    thread that did the atomic add to the others (one store, one load, 4 bytes); the loop is as without it."""
    ck, usage, ops = _compiled_sass(block_m, block_k, warps, nrep, split_k, True)
    assert ck.metadata.shared <= 16
    assert re.search(r"LOCAL:0\b", usage), usage
    assert ops.count("STS") <= 1 and ops.count("LDS") <= 1 and "LDSM" not in ops
    assert {"ATOMG", "RED"} & set(ops) or "ATOM" in ops  # the arrival count


def _compiled_sass(block_m, block_k, warps, nrep, split_k, prefetch):  # noqa: ANN001, ANN202
    """The kernel compiled for sm_90, its resource usage (cuobjdump -res-usage) and its SASS opcodes."""
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    try:
        ck = _compile_sm90(block_m, block_k, warps, nrep, split_k, prefetch)
    except Exception as exc:  # noqa: BLE001 (no ptxas for sm_90 in this Triton build)
        pytest.skip(f"cannot compile for sm_90 here: {type(exc).__name__}: {exc}"[:200])
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        cuobjdump = shutil.which("cuobjdump")
        if cuobjdump is None:
            pytest.skip("no cuobjdump to read the SASS with")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True).stdout
    return ck, usage, re.findall(r"\*/\s+(?:@!?P\d\s+)?([A-Z][A-Z0-9]*)", sass)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Gluon has no interpreter)")
@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("n,k,block_k,warps", [(4608, 3584, 128, 1), (3584, 18944, 256, 2), (37888, 3584, 128, 4),
                                               (100, 3584, 64, 1)])
def test_gpu_matches_the_exact_product(rows, n, k, block_k, warps):
    """bfloat16 on the 7B q/k/v, down and gate/up shapes and a ragged N: within the bf16 output's rounding of the
    float64 product with the exact weight, and the same bits on a second call."""
    torch.manual_seed(rows + warps)
    q = nvfp4.quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16))
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    got = ng.nvfp4_gluon_gemm(x, q.packed, q.scale, q.global_scale, block_k=block_k, warps=warps)
    exact = x.double() @ nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double().t()
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    excess = ((got.double() - exact).abs() - 2.0**-8 * exact.abs()).max().item()
    assert excess <= 1e-4 * exact.abs().max().item()
    assert torch.equal(got, ng.nvfp4_gluon_gemm(x, q.packed, q.scale, q.global_scale, block_k=block_k, warps=warps))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Gluon has no interpreter)")
@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("n,k,block_k,warps,nrep,split_k,prefetch", [
    (4608, 3584, 256, 1, 2, 4, True), (3584, 18944, 512, 2, 1, 8, True), (37888, 3584, 128, 1, 4, 1, True),
    (100, 3584, 64, 1, 2, 3, False), (100, 3584, 512, 2, 2, 16, True)])
def test_gpu_variants_match_the_exact_product(rows, n, k, block_k, warps, nrep, split_k, prefetch):
    """Several row blocks per warp, split-K (3 over 56 tiles: unequal shares; 16 over 7 tiles: cut to 7) and the
    prefetched loop: within the bf16 output's rounding of the float64 product, and the same bits on a second call
    (which also needs split-K's counters reset by the first)."""
    torch.manual_seed(rows + 10 * split_k)
    q = nvfp4.quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16))
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    opts = dict(block_k=block_k, warps=warps, nrep=nrep, split_k=split_k, prefetch=prefetch)
    got = ng.nvfp4_gluon_gemm(x, q.packed, q.scale, q.global_scale, **opts)
    exact = x.double() @ nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double().t()
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    excess = ((got.double() - exact).abs() - 2.0**-8 * exact.abs()).max().item()
    assert excess <= 1e-4 * exact.abs().max().item()
    assert torch.equal(got, ng.nvfp4_gluon_gemm(x, q.packed, q.scale, q.global_scale, **opts))
