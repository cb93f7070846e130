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
    with pytest.raises(ValueError, match=r"warps=2 \(4 or 8 with wgmma: one or two warpgroups\)"):
        ng.nvfp4_gluon_gemm(x, q.packed, q.scale, q.global_scale, warps=2, wgmma=True)
    with pytest.raises(ValueError, match=r"prefetch=True with wgmma=True .*drop prefetch"):
        ng.nvfp4_gluon_gemm(x, q.packed, q.scale, q.global_scale, warps=4, wgmma=True, prefetch=True)


@pytest.mark.parametrize("block_m,block_k,warps,nrep,split_k", [(64, 128, 4, 2, 1), (8, 128, 4, 1, 8),
                                                                (32, 256, 8, 1, 2)])
def test_wgmma_version_compiles_to_wgmma_with_only_x_in_shared_memory(block_m, block_k, warps, nrep, split_k):
    """``wgmma``, compiled for sm_90: warpgroup MMAs (HGMMA, block_k / 16 per tile and row block), no spills, and the
    only shared memory is the ``x`` tile (plus split-K's 4-byte arrival broadcast): the weight stays in registers."""
    consts = {"BLOCK_M": block_m, "BLOCK_K": block_k, "WARPS": warps, "NREP": nrep, "SPLIT_K": split_k, "EVEN_N": True,
              "LORA": False, "R": 16, "HP_M": 16, "KS_PAD": 16, "PDL": False, "HAS_BIAS": False, "ZEROS": False}
    ck = _compile_or_skip(ng._wgmma_kernel, consts, warps, _LORA_SIGNATURE)
    assert block_m * block_k * 2 <= ck.metadata.shared <= block_m * block_k * 2 + 16
    usage, ops = _sass(ck)
    assert re.search(r"LOCAL:0\b", usage), usage
    ops = [op.split(".")[0] for op in ops]
    assert ops.count("HGMMA") == block_k // 16 * nrep  # one per 16 K and 64-row block of each warpgroup
    assert "LDSM" not in ops and ops.count("LDS") <= 1  # the weight is never read back from shared memory


@pytest.mark.parametrize("block_k", [64, 128, 256])
def test_wide_loads_are_16_byte_loads(block_k):
    """The point of ``wide``: at 8 rows each thread reads its quarter of a weight row with one 16-byte load per 32
    bytes (8-byte loads at block_k 64), its scales as one load of its groups, and ``x`` in 16-byte loads; no byte-wise
    loads are left (the narrow loads read 4 bytes of codes and 1 of scales at a time)."""
    _, _, ops = _compiled_sass(8, block_k, 1, 1, 1, False, True)
    loads = [op for op in ops if op.startswith("LDG")]
    code_bytes, x_bytes = 2 * block_k // 8, block_k // 4 * 2  # per thread per tile: 2 weight rows, 8 x columns
    vec = 16 if block_k >= 128 else 8
    wide = loads.count("LDG.E.128") + (loads.count("LDG.E.64") if vec == 8 else 0)
    assert wide >= code_bytes // vec + x_bytes // 16
    assert "LDG.E.U8" not in loads or block_k == 64  # one scale group per quarter at 64: a byte
    _, _, narrow = _compiled_sass(8, block_k, 1, 1, 1, False, False)
    assert len(loads) < len([op for op in narrow if op.startswith("LDG")])


_SIGNATURE = {"x_ptr": "*bf16", "sxm": "i32", "w_ptr": "*u8", "s_ptr": "*fp8e4nv", "g_ptr": "*fp32", "y_ptr": "*bf16",
              "sym": "i32", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "KB": "i32",
              "KS": "i32"}  # the kernels' arguments before their constexprs
_DIVISIBLE = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 5, 6, 7, 8, 11, 12, 13)}  # as at the 7B shapes


_LORA_SIGNATURE = {**_SIGNATURE, "hp_ptr": "*fp32", "idx_ptr": "*i32", "b0": "*bf16", "b1": "*bf16", "b2": "*bf16",
                   "n0": "i32", "n1": "i32", "LKS": "i32", "lscale": "fp32", "bias_ptr": "*bf16", "z_ptr": "*bf16"}


def _compile(fn, consts: dict, warps: int, signature: dict | None = None):  # noqa: ANN001, ANN202
    """``fn`` (one of the module's kernels) compiled for sm_90 with Triton's own ptxas, its arguments specialised as at
    the 7B shapes (``signature``: its non-constexpr arguments' types, default those of the kernels without LoRA)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    src = GluonASTSource(fn=fn, signature={**(signature or _SIGNATURE), **{name: "constexpr" for name in consts}},
                         constexprs=consts, attrs=_DIVISIBLE)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def _compile_or_skip(fn, consts: dict, warps: int, signature: dict | None = None):  # noqa: ANN001, ANN202
    try:
        return _compile(fn, consts, warps, signature)
    except Exception as exc:  # noqa: BLE001 (no ptxas for sm_90 in this Triton build)
        pytest.skip(f"cannot compile for sm_90 here: {type(exc).__name__}: {exc}"[:200])


@pytest.mark.parametrize("block_m,block_k,warps,nrep,prefetch,wide", [
    (16, 128, 1, 1, False, False), (16, 256, 2, 1, False, False), (64, 128, 4, 1, False, False),
    (8, 256, 1, 1, True, False), (8, 128, 2, 2, True, False), (64, 64, 1, 4, True, False),
    (8, 64, 1, 1, False, True), (8, 128, 1, 1, False, True), (16, 256, 2, 2, True, True), (64, 128, 1, 2, False, True)])
def test_compiles_for_sm90_with_operands_in_registers_only(block_m, block_k, warps, nrep, prefetch, wide):
    """The point of the kernel: compiled for Hopper, every operand of its tensor-core instructions stays in registers
    (no shared memory at all, no conversion through it or between lanes), with no spills; its SASS has the mma.sync
    instructions (HMMA) of one K tile per loop. Also with the next tile prefetched, several row blocks per warp, and
    the wide loads (whose reshapes, permutes and conversions only rename registers)."""
    ck, usage, ops = _compiled_sass(block_m, block_k, warps, nrep, 1, prefetch, wide)
    assert ck.metadata.shared == 0
    assert re.search(r"LOCAL:0\b", usage), usage  # no spills
    base = {op.split(".")[0] for op in ops}
    assert "HMMA" in base and not {"STS", "LDS", "LDSM", "SHFL"} & base  # no conversion through memory or lanes


def test_bit_decode_needs_fewer_instructions_than_the_lookup():
    """``bits``: compiled for sm_90 at 8 rows, block_k 128, wide loads: still no shared memory or spills, and fewer
    instructions than Triton's table-lookup upcast (which moves its tables into registers for every lookup)."""
    ck, usage, ops = _compiled_sass(8, 128, 1, 1, 1, False, True, bits=True)
    _, _, lookup = _compiled_sass(8, 128, 1, 1, 1, False, True, bits=False)
    assert ck.metadata.shared == 0 and re.search(r"LOCAL:0\b", usage), usage
    assert len(ops) < 0.9 * len(lookup)


def _prmt(a: int, sel: int) -> int:
    """PTX ``prmt.b32 d, a, 0, sel`` (default mode): byte i of d is byte ``sel``'s nibble i of the 8 bytes (a, 0)."""
    src = a.to_bytes(4, "little") + bytes(4)
    return int.from_bytes(bytes(src[(sel >> (4 * i)) & 7] for i in range(4)), "little")


def test_bit_decode_arithmetic_gives_every_code_times_2_to_the_minus_126():
    """The bit decode's arithmetic (:data:`vllm_ext.nvfp4_gluon._DECODE_ASM`, replayed here in Python on 32-bit
    integers) against the codec's E2M1 table: for every byte value in every byte position, each output half is the
    bf16 whose value is the code's value times 2^-126, in the order the kernel assumes (low nibbles of bytes 0-1 and
    2-3, then the high nibbles)."""
    import struct

    table = [(-1.0 if c & 8 else 1.0) * nvfp4.E2M1_VALUES[c & 7] for c in range(16)]  # sign bit, magnitude

    def bf16(bits: int) -> float:
        return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]

    def pair(t: int) -> tuple[float, float]:
        r = (t & 0x80008000) | ((t & 0x70007000) >> 6)
        return bf16(r), bf16(r >> 16)

    rng = torch.Generator().manual_seed(0)
    words = torch.randint(0, 2**32, (2000,), generator=rng, dtype=torch.int64).tolist()
    words += [b * 0x01010101 for b in range(256)]
    for q in words:
        t0, t1 = _prmt(q, 0x1404), _prmt(q, 0x3424)
        lo = pair((t0 << 4) & 0xFFFFFFFF) + pair((t1 << 4) & 0xFFFFFFFF)
        hi = pair(t0) + pair(t1)
        nib = [(q >> (8 * b)) & 0xF for b in range(4)], [(q >> (8 * b + 4)) & 0xF for b in range(4)]
        assert [v * 2.0**126 for v in lo] == [table[c] for c in nib[0]], hex(q)
        assert [v * 2.0**126 for v in hi] == [table[c] for c in nib[1]], hex(q)


@pytest.mark.parametrize("block_m,block_k,warps,nrep,split_k", [(8, 512, 1, 1, 4), (16, 256, 2, 2, 8)])
def test_split_k_adds_only_the_arrival_broadcast(block_m, block_k, warps, nrep, split_k):
    """With split-K, the only shared memory is the epilogue's: the arrival counter's value, broadcast from the one
    thread that did the atomic add to the others (one store, one load, 4 bytes); the loop is as without it."""
    ck, usage, ops = _compiled_sass(block_m, block_k, warps, nrep, split_k, True)
    assert ck.metadata.shared <= 16
    assert re.search(r"LOCAL:0\b", usage), usage
    base = [op.split(".")[0] for op in ops]
    assert base.count("STS") <= 1 and base.count("LDS") <= 1 and "LDSM" not in base
    assert {"ATOMG", "RED", "ATOM"} & set(base)  # the arrival count


def _compiled_sass(block_m, block_k, warps, nrep, split_k, prefetch, wide=False, bits=False):  # noqa: ANN001, ANN202
    """The kernel compiled for sm_90, its resource usage (cuobjdump -res-usage) and its SASS opcodes."""
    consts = {"BLOCK_M": block_m, "BLOCK_K": block_k, "WARPS": warps, "NREP": nrep, "SPLIT_K": split_k,
              "PREFETCH": prefetch, "WIDE": wide, "BITS": bits, "EVEN_N": True}
    ck = _compile_or_skip(ng._gluon_kernel, consts, warps)
    return (ck, *_sass(ck))


def _sass(ck) -> tuple[str, list[str]]:  # noqa: ANN001
    """A compiled kernel's resource usage (cuobjdump -res-usage) and SASS opcodes, with their modifiers."""
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

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
    return usage, re.findall(r"\*/\s+(?:@!?P\d\s+)?([A-Z][A-Z0-9.]*)", sass)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Gluon has no interpreter)")
@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("n,k,block_k,warps", [(4608, 3584, 128, 1), (3584, 18944, 256, 2), (37888, 3584, 128, 4),
                                               (100, 3584, 64, 1)])
def test_gpu_matches_the_exact_product(rows, n, k, block_k, warps):
    """bfloat16 on the 7B q/k/v, down and gate/up shapes and a ragged N: within the bf16 output's rounding of the
    float64 product with the exact weight, and the same bits on a second call."""
    _check_exact_product(rows, n, k, rows + warps, block_k=block_k, warps=warps)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Gluon has no interpreter)")
@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("n,k,block_k,warps,nrep,split_k,prefetch,wide,bits", [
    (4608, 3584, 256, 1, 2, 4, True, False, False), (3584, 18944, 512, 2, 1, 8, True, False, False),
    (37888, 3584, 128, 1, 4, 1, True, False, False), (100, 3584, 64, 1, 2, 3, False, False, False),
    (100, 3584, 512, 2, 2, 16, True, False, False), (4608, 3584, 128, 1, 1, 1, False, True, False),
    (3584, 18944, 256, 2, 2, 8, True, True, False), (100, 3584, 64, 1, 2, 3, False, True, False),
    (37888, 3584, 512, 1, 1, 1, True, True, False), (4608, 3584, 128, 1, 1, 8, False, True, True),
    (37888, 3584, 128, 1, 1, 1, False, True, True), (3584, 18944, 256, 2, 2, 8, False, True, True),
    (100, 3584, 64, 1, 2, 3, True, True, True), (4608, 3584, 256, 2, 1, 2, False, False, True)])
def test_gpu_variants_match_the_exact_product(rows, n, k, block_k, warps, nrep, split_k, prefetch, wide, bits):
    """Several row blocks per warp, split-K (3 over 56 tiles: unequal shares; 16 over 7 tiles: cut to 7), the
    prefetched loop, the wide loads (the K order permuted alike in both operands) and the decode by moving bits: within
    the bf16 output's rounding of the float64 product, and the same bits on a second call (which also needs split-K's
    counters reset by the first)."""
    _check_exact_product(rows, n, k, rows + 10 * split_k, block_k=block_k, warps=warps, nrep=nrep, split_k=split_k,
                         prefetch=prefetch, wide=wide, bits=bits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Gluon has no interpreter)")
@pytest.mark.parametrize("wide,bits", [(False, False), (True, False), (False, True), (True, True)])
def test_gpu_every_code_and_scale_is_decoded_exactly(wide, bits):
    """Every weight read back exactly: random bytes (all 16 codes in both nibbles) with FP8 scales from the smallest
    subnormal (2^-9) to the largest (448), global scale 1, and one-hot rows of ``x``, so each output is one weight's
    value and must equal the codec's dequantized weight bit for bit (every such value has at most 6 significant bits,
    so it is exact in bf16). This covers the bit decode's subnormal code (0.5) at the smallest scale."""
    _check_every_code(64, wide=wide, bits=bits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU (wgmma; Gluon has no interpreter)")
@pytest.mark.parametrize("rows", [1, 8, 33, 64])
@pytest.mark.parametrize("n,k,block_k,warps,nrep,split_k", [
    (4608, 3584, 128, 4, 1, 4), (3584, 18944, 256, 8, 1, 8), (37888, 3584, 128, 4, 2, 1), (100, 3584, 64, 4, 2, 3),
    (4608, 3584, 64, 8, 2, 2)])
def test_gpu_wgmma_matches_the_exact_product(rows, n, k, block_k, warps, nrep, split_k):
    """``wgmma``: within the bf16 output's rounding of the float64 product, the same bits on a second call."""
    _check_exact_product(rows, n, k, rows + 10 * split_k, block_k=block_k, warps=warps, nrep=nrep, split_k=split_k,
                         wgmma=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU (wgmma; Gluon has no interpreter)")
def test_gpu_wgmma_decodes_every_code_exactly():
    """As test_gpu_every_code_and_scale_is_decoded_exactly, through the wgmma version."""
    _check_every_code(128, warps=4, wgmma=True)


def _check_exact_product(rows: int, n: int, k: int, seed: int, device: str = "cuda", **opts) -> None:
    """``nvfp4_gluon_gemm(**opts)`` on a random ``[n, k]`` weight and ``[rows, k]`` ``x``: bfloat16 ``[rows, n]``
    within the bf16 output's rounding of the float64 product with the exact weight (2^-8 relative, plus 1e-4 of the
    largest value), and the same bits on a second call."""
    torch.manual_seed(seed)
    q = nvfp4.quantize((torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16))
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    got = ng.nvfp4_gluon_gemm(x, q.packed, q.scale, q.global_scale, **opts)
    exact = x.double() @ nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double().t()
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    excess = ((got.double() - exact).abs() - 2.0**-8 * exact.abs()).max().item()
    assert excess <= 1e-4 * exact.abs().max().item()
    assert torch.equal(got, ng.nvfp4_gluon_gemm(x, q.packed, q.scale, q.global_scale, **opts))


def _check_every_code(n: int, device: str = "cuda", **opts) -> None:
    """``nvfp4_gluon_gemm(**opts, block_k=128)`` reads back every weight of a random ``[n, 512]`` NVFP4 weight (all
    codes, scales 2^-9 to 448, global scale 1) bit for bit through one-hot rows of ``x``."""
    torch.manual_seed(7)
    k = 512
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
    levels = torch.tensor([2.0**-9, 2.0**-6, 0.0234375, 0.5, 1.0, 3.25, 96.0, 448.0])
    scale = levels[torch.randint(0, len(levels), (n, k // 16))].to(torch.float8_e4m3fn).to(device)
    gs = torch.ones(1, device=device)
    w = nvfp4.dequantize(packed, scale, gs, dtype=torch.float32)
    assert torch.equal(w.to(torch.bfloat16).float(), w)
    for off in range(0, k, 64):
        x = torch.zeros(64, k, device=device, dtype=torch.bfloat16)
        x[torch.arange(64), off + torch.arange(64)] = 1.0
        got = ng.nvfp4_gluon_gemm(x, packed, scale, gs, block_k=128, **opts)
        assert torch.equal(got.float(), w[:, off:off + 64].t()), f"columns {off}..{off + 63}"
