"""vllm_ext.l2_prefetch: the plan (regions, errors that name the region), the requests the kernels issue for it (every
byte of every region asked for, in UNIT-sized, 16-byte multiples), the bulk prefetch in the row kernel's SASS for
Hopper, and on a GPU the same bits with and without a plan."""

from __future__ import annotations

import re

import pytest
import torch

from vllm_ext import l2_prefetch as pf


def _regions_cover(plan: torch.Tensor, programs: int, threads: int) -> None:
    reqs = pf.units(plan, programs, threads)
    for addr, nbytes in plan.tolist():
        mine = sorted((a, n) for _, _, a, n in reqs if addr <= a < addr + nbytes)
        assert mine[0][0] == addr
        for (a, n), (b, _) in zip(mine, mine[1:]):
            assert b == a + n  # contiguous, no byte twice
        assert mine[-1][0] + mine[-1][1] == addr + nbytes
        assert all(n % 16 == 0 and 0 < n <= pf.UNIT for _, n in mine)
    assert {p for p, _, _, _ in reqs} <= set(range(programs))
    assert {lane for _, lane, _, _ in reqs} <= set(range(threads))


def test_plan_holds_addresses_and_bytes_of_whole_tensors_and_leading_rows():
    a = torch.zeros(100, 48, dtype=torch.uint8)
    b = torch.zeros(100, 6, dtype=torch.float32)
    plan = pf.prefetch_plan(a, (b, 40))
    assert plan.dtype == torch.int64 and plan.shape == (2, 2)
    assert plan.tolist() == [[a.data_ptr(), 4800], [b.data_ptr(), 40 * 6 * 4]]
    assert pf.plan_bytes(plan) == 4800 + 960


@pytest.mark.parametrize("nbytes,programs,threads", [(16, 1, 32), (4096, 3, 32), (4112, 2, 32), (1_000_000, 7, 64),
                                                     (7_340_032, 896, 128), (64 * 4096, 4, 16)])
def test_requests_cover_every_byte_once(nbytes, programs, threads):
    t = torch.zeros(nbytes, dtype=torch.uint8)
    _regions_cover(pf.prefetch_plan(t), programs, threads)


def test_requests_of_a_7b_o_and_gate_up_head_plan():
    o_codes = torch.zeros(3584, 1792, dtype=torch.uint8)
    o_scales = torch.zeros(3584, 224, dtype=torch.uint8)
    gu = torch.zeros(4096, 1792, dtype=torch.uint8)
    plan = pf.prefetch_plan(o_codes, o_scales, (gu, 1024))
    _regions_cover(plan, 1152, 128)  # q/k/v's programs and threads at the shipped tile
    assert pf.plan_bytes(plan) == 3584 * 2016 + 1024 * 1792


@pytest.mark.parametrize("bad,match", [
    (lambda: pf.prefetch_plan(), "no regions"),
    (lambda: pf.prefetch_plan(torch.zeros(10, 10)[:, :5]), "region 0 .* not contiguous"),
    (lambda: pf.prefetch_plan(torch.zeros(64), torch.zeros(3, dtype=torch.uint8)), "region 1 .* multiple of 16"),
    (lambda: pf.prefetch_plan((torch.zeros(4, 4), 5)), "region 0 asks for 5 rows"),
    (lambda: pf.prefetch_plan(torch.zeros(64)[1:]), "region 0 .* 16-byte aligned"),
])
def test_plan_refuses_what_the_instruction_cannot_take(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_kernel_unit_matches_the_module_constant():
    """The device code spells the unit as a literal (a Triton constexpr global would do too; the literal keeps the
    function self-contained): it must be UNIT."""
    import inspect

    src = inspect.getsource(getattr(pf._prefetch, "fn", pf._prefetch))
    assert set(re.findall(r"\b\d{3,}\b", src)) == {str(pf.UNIT - 1), str(pf.UNIT)}


def _row_sass(npf: int, warps: int) -> list[str]:
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm_ext.nvfp4_gemv import _nvfp4_row_kernel

    sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*fp8e4nv", "g_ptr": "*fp32", "y_ptr": "*bf16",
           "ws_ptr": "*fp32", "cnt_ptr": "*i32", "b_ptr": "*bf16", "pf_ptr": "*i64", "N": "i32", "K": "i32"}
    consts = dict(BLOCK_N=4, BLOCK_K=512, SPLIT_K=1, ASM=True, XVEC=True, HAS_BIAS=True, STAGES=0, PDL=True,
                  NPF=npf, THREADS=32 * warps)
    src = ASTSource(fn=_nvfp4_row_kernel, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts,
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(11)})
    try:
        ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
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
        sass = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True).stdout
    return re.findall(r"\*/\s+(?:@!?P\d\s+)?([A-Z][A-Z0-9.]*)", sass)


@pytest.mark.parametrize("npf", [1, 3])
def test_row_kernel_issues_one_bulk_prefetch_per_region_for_hopper(npf):
    """Compiled for sm_90: the plan's regions become Hopper's bulk L2 prefetch (UBLKPF.L2), one site per region, and
    without a plan there is none."""
    assert _row_sass(npf, 4).count("UBLKPF.L2") == npf
    assert "UBLKPF.L2" not in _row_sass(0, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a Hopper (or later) GPU: the bulk L2 prefetch is sm_90+")
@pytest.mark.parametrize("n,k", [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)])
def test_gpu_same_bits_with_a_prefetch_plan(n, k):
    from vllm_ext.nvfp4_gemv import decode_tile, nvfp4_small_gemm

    dev = torch.device("cuda")
    torch.manual_seed(0)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
    scale = (torch.rand(n, k // 16, device=dev) * 2 + 0.25).to(torch.float8_e4m3fn)
    g = torch.tensor([2688.0], device=dev)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    other = torch.randint(0, 256, (2048, 1792), dtype=torch.uint8, device=dev)
    plan = pf.prefetch_plan(other, (packed, 64), scale)
    tile = decode_tile(n, k)
    want = nvfp4_small_gemm(x, packed, scale, g, words=True, xvec=True, pdl=True, **tile)
    got = nvfp4_small_gemm(x, packed, scale, g, words=True, xvec=True, pdl=True, prefetch=plan, **tile)
    assert torch.equal(got, want)
