"""The one-row kernels' E2M1 decode through FP8 (``vllm_ext.nvfp4_decode.decode_mode`` 2, docs/benchmarks.md §4ba).

On the CPU: the PTX's bit moves replayed for every code at every position of a word (Triton's interpreter cannot run
inline PTX), the choice of decode and its refusals, and, compiled for sm_90, the conversion in the PTX and fewer
integer and logic instructions in the main loops. On a GPU: the row kernel, the row+lora kernel and the kernel on
Marlin's tensors give the same output bits with either PTX decode (the sums are the same sums, scaled by 2^8 exactly).
"""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest
import torch

from qerl_plugin import nvfp4

pytest.importorskip("triton", reason="Triton is not installed: the kernels cannot compile")

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
VALUES = E2M1 + [-v for v in E2M1]


def _bits(v: float) -> int:
    """The float32 bit pattern of ``v`` (so that -0.0 and 0.0 differ)."""
    return int(np.array([v], dtype=np.float32).view(np.uint32)[0])


def test_fp8_ptx_gives_every_code_its_value_at_every_position():
    """Each of the 8 positions, all 16 codes, with every other nibble 0 or 15: the code's value times 2^-6, bit for bit
    (negative zero for code 8), and no leak from its neighbours; words of eight different codes come out in order."""
    from test_nvfp4_gemv import _run_decode8_ptx

    from vllm_ext.nvfp4_decode import _DECODE8_FP8_PTX_TEXT

    for pos in range(8):
        for code in range(16):
            for full in (0x0, 0xF):  # the neighbours on both sides all zeros, or all ones
                word = code << (4 * pos)
                for other in range(8):
                    if other != pos:
                        word |= full << (4 * other)
                got = _run_decode8_ptx(_DECODE8_FP8_PTX_TEXT, word)
                assert _bits(got[pos]) == _bits(VALUES[code] * 2.0**-6), (pos, code, full, got)  # -0.0 for code 8
    assert _run_decode8_ptx(_DECODE8_FP8_PTX_TEXT, 0x76543210) == [v * 2.0**-6 for v in E2M1]
    assert [_bits(v) for v in _run_decode8_ptx(_DECODE8_FP8_PTX_TEXT, 0xFEDCBA98)] == [
        _bits(-v * 2.0**-6) for v in E2M1]


def test_both_ptx_decodes_differ_by_two_to_the_eight_exactly():
    """On 4 000 random words, each code of the FP8 decode is the float16 decode's times 2^8."""
    from test_nvfp4_gemv import _run_decode8_ptx

    from vllm_ext.nvfp4_decode import _DECODE8_FP8_PTX_TEXT, _DECODE8_PTX_TEXT

    rng = np.random.default_rng(0)
    for word in rng.integers(0, 2**32, size=4000, dtype=np.uint64):
        old = _run_decode8_ptx(_DECODE8_PTX_TEXT, int(word))
        new = _run_decode8_ptx(_DECODE8_FP8_PTX_TEXT, int(word))
        assert [_bits(v) for v in new] == [_bits(v * 256.0) for v in old], hex(int(word))  # signed zeros too


def test_decode_mode_picks_and_refuses(monkeypatch):
    from vllm_ext.nvfp4_decode import DECODE_ENV, decode_mode

    cpu = torch.device("cpu")
    monkeypatch.delenv(DECODE_ENV, raising=False)
    assert decode_mode(cpu) == 0  # off CUDA: Triton's integer operations
    assert decode_mode(cpu, asm=False) == 0
    assert decode_mode(cpu, asm=True) == 1  # PTX asked for, and no GPU to ask for FP8 conversions
    monkeypatch.setenv(DECODE_ENV, "f16")
    assert decode_mode(cpu, asm=True) == 1
    monkeypatch.setenv(DECODE_ENV, "bf16")
    with pytest.raises(ValueError, match=r"QERL_ROW_DECODE=.bf16.: use fp8 \(the default\) or f16$"):
        decode_mode(cpu, asm=True)
    with pytest.raises(ValueError, match="QERL_ROW_DECODE='bf16'"):
        decode_mode(cpu, asm=False)  # a bad value is an error at every launch, not only where PTX is asked for
    monkeypatch.delenv(DECODE_ENV)
    assert decode_mode(cpu, asm=0) == 0


@pytest.mark.parametrize("value", ["hfma2", "hfma2-unguarded", " HFMA2 "])
@pytest.mark.parametrize("asm", [None, False, True])
def test_decode_mode_refuses_the_removed_float16_pair_decode(monkeypatch, value, asm):
    """QERL_ROW_DECODE=hfma2 and hfma2-unguarded (decode_mode 3 and 4 until docs/benchmarks.md §4bl) were taken out
    after they failed the real-model check: on a CUDA device with the FP8 conversion, where they used to apply, and at
    every other launch too, an error names the value, says why it is gone and what to set instead. (The capability is
    stubbed: no GPU here.)"""
    from vllm_ext import nvfp4_decode

    monkeypatch.setattr(nvfp4_decode, "_FP8_CVT", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(nvfp4_decode.DECODE_ENV, value)
    for dev in (torch.device("cuda", 7), torch.device("cpu")):
        with pytest.raises(ValueError) as err:
            nvfp4_decode.decode_mode(dev, asm)
        assert str(err.value) == (f"QERL_ROW_DECODE={value!r}: the float16-pair decode was removed "
                                  "(docs/benchmarks.md §4bk: it failed its real-model check); use fp8 (the default) "
                                  "or f16")
    monkeypatch.setenv(nvfp4_decode.DECODE_ENV, "fp8")
    assert nvfp4_decode.decode_mode(torch.device("cuda", 7)) == 2  # the default, as before


@pytest.mark.parametrize("capability,mode", [((9, 0), 2), ((8, 9), 2), ((8, 6), 1), ((8, 0), 1)])
def test_decode_mode_follows_the_gpus_fp8_conversions(monkeypatch, capability, mode):
    """On CUDA devices: FP8 from compute capability 8.9 (the E4M3-pair conversion), the float16 PTX below it and with
    QERL_ROW_DECODE=f16; Triton's integer operations under the interpreter. (The capability is stubbed: no GPU here.)"""
    from vllm_ext import nvfp4_decode

    dev = torch.device("cuda", 7)
    monkeypatch.setattr(nvfp4_decode, "_FP8_CVT", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.delenv(nvfp4_decode.DECODE_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert nvfp4_decode.decode_mode(dev) == mode and nvfp4_decode.decode_mode(dev, asm=True) == mode
    monkeypatch.setenv(nvfp4_decode.DECODE_ENV, "f16")
    assert nvfp4_decode.decode_mode(dev) == 1
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert nvfp4_decode.decode_mode(dev) == 0


def test_compiled_for_hopper_the_loops_lose_integer_work():
    """Compiled for sm_90 here (the row kernel at the 7B gate/up tile, and the kernel on Marlin's tensors in its
    shipped form 4 at its gate/up tile): with the FP8 decode the PTX converts E4M3 pairs, and the main loop issues
    fewer integer and logic instructions per word (LOP3, SHF, PRMT, LEA, IADD3, SEL) than with the float16 one, and the
    same FFMAs."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kernel_sass", os.path.join(
        os.path.dirname(__file__), "..", "..", "scripts", "cpu", "kernel_sass.py"))
    sass = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sass)
    from vllm_ext import nvfp4_gemv, nvfp4_marlin_row
    from vllm_ext.triton_support import compile_sm90

    counts, cvts = {}, {}
    for asm in (1, 2):
        try:
            row = compile_sm90(nvfp4_gemv._nvfp4_row_kernel, sass.ROW_PTRS,
                               dict(BLOCK_N=8, BLOCK_K=512, SPLIT_K=1, ASM=asm, XVEC=True, HAS_BIAS=False, STAGES=3,
                                    PDL=False), 1, sass.ALIGNED)
            shared = compile_sm90(nvfp4_marlin_row._marlin_row_kernel, sass.MARLIN_PTRS,
                                  dict(HB=16, T=8, SPLIT_K=8, ASM=asm, HAS_BIAS=False, STAGES=0, PDL=False, ASUM=4),
                                  4, sass.ALIGNED)
        except (RuntimeError, subprocess.CalledProcessError) as exc:
            pytest.skip(f"Triton cannot compile for sm_90 here: {exc}")
        cvts[asm] = row.asm["ptx"].count("cvt.rn.f16x2.e4m3x2")  # the scales' conversions too, in both
        counts[asm] = [sass.summary(name, sass.main_loop(sass.disassemble(k.asm["cubin"])), words)
                       for name, k, words in (("row", row, 16), ("shared", shared, 16 * 8 * 16 / 128))]
    assert cvts[2] > cvts[1], cvts
    for old, new in zip(counts[1], counts[2]):
        assert new["int_logic_per_word"] <= 0.7 * old["int_logic_per_word"], (old, new)
        assert new["ffma_per_word"] == old["ffma_per_word"]  # the same products


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _both(monkeypatch, fn):  # noqa: ANN001, ANN202
    from vllm_ext.nvfp4_decode import DECODE_ENV, decode_mode

    dev = torch.device("cuda", torch.cuda.current_device())
    if decode_mode(dev) != 2:
        pytest.skip("the FP8 decode needs compute capability 8.9 or later")
    monkeypatch.setenv(DECODE_ENV, "f16")
    assert decode_mode(dev) == 1  # what every launcher asks at its launch (the runs below use two kernels)
    old = fn()
    monkeypatch.setenv(DECODE_ENV, "fp8")
    assert decode_mode(dev) == 2
    return old, fn()


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("n,k", [(4608, 3584), (37888, 3584), (3584, 18944), (7168, 5120), (5120, 27648)])
def test_gpu_row_kernel_gives_the_same_bits_with_either_decode(monkeypatch, n, k):
    """decode_gemv's row op (its shipped tiles: unpipelined, pipelined, split-K; 7B and 32B), with a bias."""
    from vllm_ext.nvfp4_gemv import nvfp4_gemv_row

    torch.manual_seed(n)
    q = nvfp4.quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    from vllm_ext import nvfp4_gemv

    cvts = []

    def run():  # noqa: ANN202
        y = nvfp4_gemv_row(x, q.packed, q.scale, q.global_scale, bias)
        cvts.append(nvfp4_gemv.LAST_COMPILED.asm["ptx"].count("cvt.rn.f16x2.e4m3x2"))
        return y

    old, new = _both(monkeypatch, run)
    assert cvts[1] > cvts[0]  # the second run compiled the FP8 decode (the first converts only scales)
    assert torch.equal(old, new)
    exact = (x.double() @ nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double().t()
             + bias.double())
    assert ((new.double() - exact).abs() - 2.0**-8 * exact.abs()).max().item() <= 1e-4 * exact.abs().max().item()


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("n,k", [(4608, 3584), (37888, 3584), (3584, 18944)])
def test_gpu_kernel_on_marlins_tensors_gives_the_same_bits_with_either_decode(monkeypatch, n, k):
    """decode_gemv: "shared"'s op (the default on Hopper) on Marlin's tensors built in torch (marlin_pack)."""
    from vllm_ext.bench.marlin_pack import marlin_pack
    from vllm_ext.nvfp4_marlin_row import nvfp4_marlin_row

    torch.manual_seed(n + 1)
    q = nvfp4.quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16))
    qw, s, d = marlin_pack(q.packed, q.scale, q.global_scale)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    old, new = _both(monkeypatch, lambda: nvfp4_marlin_row(x, qw, s, d))
    assert torch.equal(old, new)
    exact = x.double() @ nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double().t()
    assert ((new.double() - exact).abs() - 2.0**-8 * exact.abs()).max().item() <= 1e-4 * exact.abs().max().item()


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("marlin", [False, True])
@pytest.mark.parametrize("slices, k", [((3584, 512, 512), 3584), ((3584,), 18944)])
def test_gpu_row_lora_kernel_gives_the_same_bits_with_either_decode(monkeypatch, marlin, slices, k):
    """The row+lora kernel (rank 32), on the checkpoint's layout and on Marlin's tensors."""
    from vllm_ext import nvfp4_gemv_lora as rl
    from vllm_ext.bench.marlin_pack import marlin_pack

    torch.manual_seed(k)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    n = sum(slices)
    q = nvfp4.quantize((torch.randn(n, k, device=dev) * 0.02).to(bf16))
    w, s, g = marlin_pack(q.packed, q.scale, q.global_scale) if marlin else (q.packed, q.scale, q.global_scale)
    x = torch.randn(1, k, device=dev, dtype=bf16)
    a = tuple((torch.randn(1, 1, 32, k, device=dev) / k**0.5).to(bf16) for _ in slices)
    b = tuple((torch.randn(1, 1, sl, 32, device=dev) * 0.05).to(bf16) for sl in slices)
    idx = torch.zeros(1, dtype=torch.int32, device=dev)
    old, new = _both(monkeypatch, lambda: rl.launch(x, w, s, g, None, a, b, 1.0, slices, idx))
    assert torch.equal(old, new)
