"""The one-row kernel's products in float16 pairs (``QERL_ROW_DECODE=hfma2``, ``vllm_ext.nvfp4_hfma2``,
docs/benchmarks.md §4bc).

On the CPU: the two PTX texts replayed by a small interpreter (Triton's interpreter cannot run inline PTX) against an
independent model of the sums they should form (the codec's E2M1 values, ``x`` in float16, each float16 operation
rounded once), the choice of the mode, its tiles, and the compiled loop's instruction count. On a GPU: the row kernel
and the row+lora kernel against the exact product, no worse than the weight dequantized to bfloat16; an ``x`` beyond
float16 falls back to exact float32 products.
"""

from __future__ import annotations

import os
import re
import subprocess

import numpy as np
import pytest
import torch

from qerl_plugin import nvfp4

pytest.importorskip("triton", reason="Triton is not installed: the kernels cannot compile")

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
_OPS = {"shl": lambda a, b: a << b, "shr": lambda a, b: a >> b, "and": lambda a, b: a & b,
        "or": lambda a, b: a | b}


def _h(bits: int) -> np.float64:
    """The float16 whose bits are ``bits`` (16 bits), as float64 (exact)."""
    return np.float64(np.array([bits & 0xFFFF], dtype=np.uint16).view(np.float16)[0])


def _hbits(v: float) -> int:
    """float64 ``v`` rounded once to float16 (round to nearest even), as its 16 bits."""
    return int(np.array([v], dtype=np.float64).astype(np.float16).view(np.uint16)[0])


def run_ptx(text: str, ins: dict[int, int], outs: int) -> list[int]:
    """Replay the instructions nvfp4_hfma2's PTX uses: b32 shifts and logic, prmt, the b32 <-> two b16 moves, the E4M3
    pair and float32 pair conversions to float16 pairs, mul/fma on float16 pairs (each half rounded once, from the
    exact float64 result: exact for these operands), cvt.f32.f16 and add.f32 (float32). ``ins``: operand number -> 32
    bits; returns the ``outs`` output operands' 32 bits."""
    regs: dict[str, int] = {f"${i}": v & 0xFFFFFFFF for i, v in ins.items()}
    val = lambda a: regs[a] if a in regs else int(a, 0)  # noqa: E731
    f32 = lambda bits: np.float64(np.array([bits], dtype=np.uint32).view(np.float32)[0])  # noqa: E731
    f32bits = lambda v: int(np.array([v], dtype=np.float32).view(np.uint32)[0])  # noqa: E731

    def pair(fn, *srcs):  # noqa: ANN001, ANN202 (float16-pair arithmetic, lane by lane)
        lanes = [_hbits(fn(*(_h(val(s) >> sh) for s in srcs))) for sh in (0, 16)]
        return lanes[0] | (lanes[1] << 16)

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        if m := re.fullmatch(r"mov\.b32 \{(\S+), (\S+)\}, (\S+)", line):
            regs[m[1]], regs[m[2]] = val(m[3]) & 0xFFFF, val(m[3]) >> 16
        elif m := re.fullmatch(r"cvt\.rn\.f16x2\.e4m3x2 (\S+), (\S+)", line):
            two = torch.tensor([val(m[2]) & 0xFF, (val(m[2]) >> 8) & 0xFF], dtype=torch.uint8)
            lo, hi = (_hbits(v) for v in two.view(torch.float8_e4m3fn).double().tolist())  # exact in float16
            regs[m[1]] = lo | (hi << 16)
        elif m := re.fullmatch(r"cvt\.rn\.f16x2\.f32 (\S+), (\S+), (\S+)", line):
            regs[m[1]] = _hbits(f32(val(m[3]))) | (_hbits(f32(val(m[2]))) << 16)  # the first source to the high half
        elif m := re.fullmatch(r"prmt\.b32 (\S+), (\S+), (\S+), (\S+)", line):
            src = val(m[2]) | (val(m[3]) << 32)
            sel = int(m[4], 0)
            regs[m[1]] = sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif m := re.fullmatch(r"mul\.rn\.f16x2 (\S+), (\S+), (\S+)", line):
            regs[m[1]] = pair(lambda a, b: a * b, m[2], m[3])
        elif m := re.fullmatch(r"fma\.rn\.f16x2 (\S+), (\S+), (\S+), (\S+)", line):
            regs[m[1]] = pair(lambda a, b, c: a * b + c, m[2], m[3], m[4])
        elif m := re.fullmatch(r"cvt\.f32\.f16 (\S+), (\S+)", line):
            regs[m[1]] = f32bits(_h(val(m[2])))
        elif m := re.fullmatch(r"add\.f32 (\S+), (\S+), (\S+)", line):
            regs[m[1]] = f32bits(np.float32(f32(val(m[2]))) + np.float32(f32(val(m[3]))))
        else:
            op, dst, a, b = re.fullmatch(r"(\w+)\.b32 (\S+), (\S+), (\S+)", line).groups()
            regs[dst] = _OPS[op](val(a), val(b)) & 0xFFFFFFFF
    return [regs[f"${i}"] for i in range(outs)]


def _bf16_bits(v: np.ndarray) -> np.ndarray:
    b16 = torch.from_numpy(np.asarray(v, dtype=np.float32)).to(torch.bfloat16)
    return b16.view(torch.int16).numpy().view(np.uint16)


def test_x_pairs_ptx_gives_the_decodes_order_in_float16():
    """bfloat16 x (converted, exact where float16 holds it) and float16 x (permuted): (x0, x2) and (x1, x3)."""
    from vllm_ext.nvfp4_hfma2 import _X_PAIRS_F16_PTX_TEXT, _X_PAIRS_PTX_TEXT

    rng = np.random.default_rng(1)
    for _ in range(300):
        x = rng.normal(size=4) * 10.0 ** rng.integers(-3, 4)
        b = _bf16_bits(x)
        r0, r1 = int(b[0]) | (int(b[1]) << 16), int(b[2]) | (int(b[3]) << 16)
        xb = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16).double().numpy()  # x as bfloat16
        p, q = run_ptx(_X_PAIRS_PTX_TEXT, {2: r0, 3: r1}, 2)
        assert [p & 0xFFFF, p >> 16, q & 0xFFFF, q >> 16] == [_hbits(xb[i]) for i in (0, 2, 1, 3)]
        h = x.astype(np.float16).view(np.uint16)
        p, q = run_ptx(_X_PAIRS_F16_PTX_TEXT, {2: int(h[0]) | (int(h[1]) << 16), 3: int(h[2]) | (int(h[3]) << 16)}, 2)
        assert [p & 0xFFFF, p >> 16, q & 0xFFFF, q >> 16] == [int(h[i]) for i in (0, 2, 1, 3)]


def _group_model(words: tuple[int, int], x16: np.ndarray) -> float:
    """The sum the group PTX should form, from the codec's E2M1 table (not the PTX's bit moves): two float16 lanes,
    lane 0 summing codes 0, 4, 1, 5 of each word times their x, lane 1 codes 2, 6, 3, 7, in that order, both words,
    each product and sum rounded to float16 once (the first is a product alone); then the lanes in float32."""
    lanes = []
    for order in ((0, 4, 1, 5), (2, 6, 3, 7)):
        acc = None
        for w, word in enumerate(words):
            for j in order:
                prod = E2M1[(word >> (4 * j)) & 15] * 2.0**-6 * x16[8 * w + j]
                acc = _h(_hbits(prod if acc is None else prod + acc))
        lanes.append(np.float32(acc))
    return float(np.float32(lanes[0] + lanes[1]))


def test_group_ptx_sums_four_rows_as_the_float16_model_says():
    """4 rows' random groups against shared x: each output is the model's float32 bit for bit, and within 2^-10 of
    the group's largest partial sum of the exact product (8 roundings per lane, 2^-11 each)."""
    from vllm_ext.nvfp4_hfma2 import _GROUP_PTX_TEXT, ROWS

    rng = np.random.default_rng(2)
    for trial in range(60):
        x16 = (rng.normal(size=16) * (10.0 ** rng.integers(-2, 3))).astype(np.float16).astype(np.float64)
        pairs = []
        for w in range(2):  # each word's x pairs in the decode's order
            h = x16[8 * w:8 * w + 8].astype(np.float16).view(np.uint16).astype(int)
            pairs += [h[a] | (h[b] << 16) for a, b in ((0, 2), (4, 6), (1, 3), (5, 7))]
        words = [(int(rng.integers(0, 2**32)), int(rng.integers(0, 2**32))) for _ in range(ROWS)]
        if trial == 0:
            words[0] = (0x76543210, 0xFEDCBA98)  # every code once
        ins = {ROWS + i: w for i, w in enumerate(v for pair in words for v in pair)}
        ins.update({3 * ROWS + i: p for i, p in enumerate(pairs)})
        outs = run_ptx(_GROUP_PTX_TEXT, ins, ROWS)
        for r, (word_pair, out) in enumerate(zip(words, outs)):
            got = float(np.array([out], dtype=np.uint32).view(np.float32)[0])
            assert got == _group_model(word_pair, x16), (trial, r)
            codes = [E2M1[(word_pair[w] >> (4 * j)) & 15] * 2.0**-6 for w in range(2) for j in range(8)]
            exact = float(np.dot(codes, x16))
            assert abs(got - exact) <= 2.0**-10 * float(np.sum(np.abs(np.array(codes) * x16))) + 2.0**-24, (trial, r)


@pytest.mark.parametrize("capability,mode", [((9, 0), 3), ((8, 9), 3), ((8, 6), 1)])
def test_decode_mode_hfma2(monkeypatch, capability, mode):
    """QERL_ROW_DECODE=hfma2 gives 3 where the GPU converts E4M3 pairs (the float16 PTX below); a bad value names the
    three. (The capability is stubbed: no GPU here.)"""
    from vllm_ext import nvfp4_decode

    dev = torch.device("cuda", 7)
    monkeypatch.setattr(nvfp4_decode, "_FP8_CVT", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(nvfp4_decode.DECODE_ENV, "hfma2")
    assert nvfp4_decode.decode_mode(dev) == mode
    assert nvfp4_decode.decode_mode(dev, asm=False) == 0
    monkeypatch.setenv(nvfp4_decode.DECODE_ENV, "hfma2-unguarded")  # for measuring the fallback's cost
    assert nvfp4_decode.decode_mode(dev) == (4 if mode == 3 else 1)
    monkeypatch.setenv(nvfp4_decode.DECODE_ENV, "bf16")
    with pytest.raises(ValueError, match=r"QERL_ROW_DECODE='bf16': use fp8 \(the default\), f16 or hfma2"):
        nvfp4_decode.decode_mode(dev)


def test_decode_mode_logs_hfma2_once_per_device(monkeypatch, caplog):
    """The first launch with QERL_ROW_DECODE=hfma2 on a device logs a warning naming the mode and the device (the
    evidence in a run's log that the mode was on); later launches, and the default mode, log nothing. (The capability
    is stubbed: no GPU here.)"""
    import logging

    from vllm_ext import nvfp4_decode

    monkeypatch.setattr(nvfp4_decode, "_FP8_CVT", {})
    monkeypatch.setattr(nvfp4_decode, "_HFMA2_LOGGED", set())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with caplog.at_level(logging.WARNING, logger="qerl.vllm.nvfp4"):
        monkeypatch.setenv(nvfp4_decode.DECODE_ENV, "fp8")
        assert nvfp4_decode.decode_mode(torch.device("cuda", 0)) == 2
        assert not caplog.records
        monkeypatch.setenv(nvfp4_decode.DECODE_ENV, "hfma2")
        for _ in range(3):
            assert nvfp4_decode.decode_mode(torch.device("cuda", 0)) == 3
        assert nvfp4_decode.decode_mode(torch.device("cuda", 1)) == 3
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [f"qerl: QERL_ROW_DECODE=hfma2 on cuda:{i}: the checkpoint layout's one-row kernels (row op, "
                        "row+lora) sum their products in float16 pairs, less exactly than the default decode (fp8): "
                        "on a real model 6 of 200 greedy responses changed (docs/benchmarks.md §4bi)" for i in (0, 1)]


def test_hfma2_tiles():
    """decode_tile's hfma2 table (§4bc call 1's best tiles) on the 7B and 32B linears; the row+lora kernel's (§4bg's
    sweep with the adapter, taken where faster than before: 7B gate/up and down, 32B q/k/v and down), whose rows
    row_tile halves where a block would straddle two slices."""
    from vllm_ext.nvfp4_gemv import decode_tile
    from vllm_ext.nvfp4_gemv_lora import row_tile

    name = lambda t: (t["block_n"], t["split_k"], t["num_warps"], t.get("stages", 0))  # noqa: E731
    assert [name(decode_tile(n, k, hfma2=True)) for n, k in
            ((4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944))] == [
                (4, 1, 1, 4), (4, 1, 1, 4), (32, 1, 2, 3), (8, 4, 2, 3)]
    assert [name(decode_tile(n, k, hfma2=True)) for n, k in
            ((7168, 5120), (5120, 5120), (55296, 5120), (5120, 27648))] == [
                (16, 1, 1, 3), (4, 1, 1, 4), (32, 1, 2, 3), (8, 4, 1, 3)]
    assert [name(decode_tile(n, k, lora=True, hfma2=True)) for n, k in
            ((4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944))] == [
                (4, 1, 1, 4), (4, 1, 1, 4), (16, 1, 2, 3), (16, 4, 1, 3)]
    assert [name(decode_tile(n, k, lora=True, hfma2=True)) for n, k in
            ((7168, 5120), (5120, 5120), (55296, 5120), (5120, 27648))] == [
                (4, 1, 1, 4), (4, 1, 1, 4), (32, 1, 2, 3), (16, 4, 1, 3)]
    assert row_tile(37888, 3584, slices=(18944, 18944), hfma2=True)["block_n"] == 16
    assert row_tile(55296, 5120, slices=(27648, 27648), hfma2=True)["block_n"] == 32
    assert row_tile(55296 - 16, 5120, slices=(27640, 27640), hfma2=True)["block_n"] == 8  # 27 640 = 8 x 3 455
    assert decode_tile(4608, 3500, hfma2=True) is None


def test_hfma2_refuses_a_block_k_of_32(monkeypatch):
    """nvfp4_small_gemm with the hfma2 mode and block_k 32: a clear error before any launch (the fallback's quarter
    tiles need a multiple of 64; the mode is stubbed: no GPU here)."""
    from vllm_ext import nvfp4_gemv

    monkeypatch.setattr(nvfp4_gemv, "decode_mode", lambda device, asm=None: 3)
    q = nvfp4.quantize(torch.randn(64, 256).to(torch.bfloat16))
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block_k=32 with QERL_ROW_DECODE=hfma2"):
        nvfp4_gemv.nvfp4_small_gemm(x, q.packed, q.scale, q.global_scale, block_n=8, block_k=32, words=True)


def test_compiled_for_hopper_the_loop_issues_fewer_instructions():
    """Compiled for sm_90 here: at the FP8 kernel's 7B gate/up tile the hfma2 loop issues at most 30 instructions per
    word (§4bb's gate; the FP8 loop 37.1) with HFMA2 and no FFMA per code; the kernel also has the small float32
    loop it falls back to."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kernel_sass", os.path.join(
        os.path.dirname(__file__), "..", "..", "scripts", "cpu", "kernel_sass.py"))
    sass = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sass)
    from vllm_ext import nvfp4_gemv
    from vllm_ext.triton_support import compile_sm90

    try:
        k = compile_sm90(nvfp4_gemv._nvfp4_row_kernel, sass.ROW_PTRS,
                         dict(BLOCK_N=8, BLOCK_K=512, SPLIT_K=1, ASM=3, XVEC=True, HAS_BIAS=False, STAGES=3,
                              PDL=False), 1, sass.ALIGNED)
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"Triton cannot compile for sm_90 here: {exc}")
    text = sass.disassemble(k.asm["cubin"])
    loop = sass.summary("row", sass.main_loop(text, "HFMA2"), 16)
    assert loop["per_word"] <= 30, loop
    assert loop["ffma_per_word"] <= 1, loop  # one FFMA per group and row (the scale), not one per code
    fallback = sass.summary("row", sass.main_loop(text, "FFMA"), 8 * 16 / 32)  # quarter tiles: 4 words a thread
    assert fallback["ffma_per_word"] == 8, fallback  # the fallback: the FP8 decode's float32 products
    assert "fma.rn.f16x2" in k.asm["ptx"]


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _need_hfma2(monkeypatch):  # noqa: ANN001, ANN202
    from vllm_ext.nvfp4_decode import DECODE_ENV, decode_mode

    monkeypatch.setenv(DECODE_ENV, "hfma2")
    if decode_mode(torch.device("cuda", torch.cuda.current_device())) != 3:
        pytest.skip("float16 pairs need the FP8 conversions of compute capability 8.9 or later")


def _errors(y: torch.Tensor, x: torch.Tensor, q, extra=None) -> tuple[float, float]:  # noqa: ANN001
    """The largest error of ``y`` against the exact product (plus ``extra``, e.g. a bias), and that of the product
    with the weight dequantized to bfloat16 (plus ``extra``, rounded to y's dtype): the bound the kernel must meet."""
    exact = x.double() @ nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double().t()
    w16 = nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.bfloat16).double()
    ref = x.double() @ w16.t()
    if extra is not None:
        exact, ref = exact + extra.double(), ref + extra.double()
    return (y.double() - exact).abs().max().item(), (ref.to(y.dtype).double() - exact).abs().max().item()


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(4608, 3584), (37888, 3584), (3584, 18944), (7168, 5120), (5120, 27648)])
def test_gpu_row_op_is_no_worse_than_the_bfloat16_weight(monkeypatch, n, k, dtype):
    """decode_gemv's row op with QERL_ROW_DECODE=hfma2 (its tiles: pipelined, split-K, 1-2 warps; 7B and 32B), with a
    bias: within the bf16-dequantized product's error, the same bits twice, and float16 pairs in the PTX."""
    from vllm_ext import nvfp4_gemv

    _need_hfma2(monkeypatch)
    torch.manual_seed(n + k)
    q = nvfp4.quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16))
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda").to(dtype)
    y = nvfp4_gemv.nvfp4_gemv_row(x, q.packed, q.scale, q.global_scale, bias)
    assert "fma.rn.f16x2" in nvfp4_gemv.LAST_COMPILED.asm["ptx"]
    assert torch.equal(y, nvfp4_gemv.nvfp4_gemv_row(x, q.packed, q.scale, q.global_scale, bias))
    err, ref = _errors(y, x, q, bias)
    assert err <= ref, (err, ref)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("tile", [dict(block_n=4, split_k=1, num_warps=1, stages=4),
                                  dict(block_n=32, split_k=1, num_warps=2, stages=3),
                                  dict(block_n=8, split_k=8, num_warps=1, stages=0),
                                  dict(block_n=16, split_k=2, num_warps=4, stages=3),
                                  dict(block_n=8, split_k=3, num_warps=2, stages=3)])
def test_gpu_an_x_beyond_float16_falls_back(monkeypatch, tile):
    """One x of 1e5 (float16 stops at 65 504): the programs whose K tiles hold it sum exact float32 products instead
    (the fallback), so the output is finite. Without split-K every program does: the output is then within the
    bf16 output's rounding of the exact product, as the FP8 kernel's; with split-K the other programs keep their
    float16 pairs, and the output is within the bf16 weight's error. An x within float16 does not fall back: the same
    bits as without the guard (QERL_ROW_DECODE=hfma2-unguarded). Split-K 3 over 8 K tiles gives programs 3, 3 and 2
    tiles; a second x of -7e4, in K tile 6 (program 0 of 3 tiles there; with split-K 2 the same program as the first,
    so the other keeps its float16 pairs), makes a program of 3 tiles fall back too."""
    from vllm_ext.nvfp4_decode import DECODE_ENV
    from vllm_ext.nvfp4_gemv import nvfp4_small_gemm

    _need_hfma2(monkeypatch)
    torch.manual_seed(3)
    n, k = 1024, 4096
    q = nvfp4.quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

    def run():  # noqa: ANN202
        return nvfp4_small_gemm(x, q.packed, q.scale, q.global_scale, block_k=512, words=True, xvec=True, **tile)

    h2 = run()
    monkeypatch.setenv(DECODE_ENV, "hfma2-unguarded")
    assert torch.equal(h2, run())
    monkeypatch.setenv(DECODE_ENV, "hfma2")
    x[0, 1234] = 1e5
    x[0, 3300] = -7e4
    h2 = run()
    assert torch.isfinite(h2).all()
    err, ref = _errors(h2, x, q)
    assert err <= ref, (err, ref)
    if tile["split_k"] == 1:
        exact = x.double() @ nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double().t()
        excess = ((h2.double() - exact).abs() - 2.0**-8 * exact.abs()).max().item()
        assert excess <= 1e-4 * exact.abs().max().item()


@pytest.mark.gpu
@GPU
def test_gpu_row_op_in_a_cuda_graph_from_an_odd_row(monkeypatch):
    """In a CUDA graph, with x a row of a larger tensor starting 2 bytes past a 4-byte boundary (copied, since the
    pairs are read as int32s): the same output as outside."""
    from vllm_ext.bench.kernels import capture_graph
    from vllm_ext.nvfp4_gemv import nvfp4_small_gemm

    _need_hfma2(monkeypatch)
    torch.manual_seed(4)
    n, k = 2048, 3584
    q = nvfp4.quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16))
    big = torch.randn(k + 1, device="cuda", dtype=torch.bfloat16)
    x = big[1:].reshape(1, k)
    assert x.data_ptr() % 4 == 2
    tile = dict(block_n=4, block_k=512, split_k=1, num_warps=1, stages=4, words=True, xvec=True)
    want = nvfp4_small_gemm(x.clone(), q.packed, q.scale, q.global_scale, **tile)
    outs = []
    g = capture_graph([lambda: outs.append(nvfp4_small_gemm(x, q.packed, q.scale, q.global_scale, **tile))], 1)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(outs[-1], want)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("slices, k", [((3584, 512, 512), 3584), ((18944, 18944), 3584), ((3584,), 18944),
                                       ((5120, 1024, 1024), 5120), ((5120,), 27648)])
def test_gpu_row_lora_kernel_with_float16_pairs(monkeypatch, slices, k):
    """The row+lora kernel (rank 32, checkpoint layout, its hfma2 tiles): with the adapter's B zero it gives the bits
    of the row kernel at the same tile; with a real adapter its error against the exact
    product (base plus adapter, float64) exceeds the FP8 row+lora kernel's by at most the two row ops' largest
    difference plus a bfloat16 step (the kernel rounds the base before adding the adapter, in both modes)."""
    from vllm_ext import nvfp4_gemv_lora as rl
    from vllm_ext.nvfp4_decode import DECODE_ENV
    from vllm_ext.nvfp4_gemv import nvfp4_gemv_row, nvfp4_small_gemm

    _need_hfma2(monkeypatch)
    torch.manual_seed(k + len(slices))
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    n = sum(slices)
    q = nvfp4.quantize((torch.randn(n, k, device=dev) * 0.02).to(bf16))
    x = torch.randn(1, k, device=dev, dtype=bf16)
    a = tuple((torch.randn(1, 1, 32, k, device=dev) / k**0.5).to(bf16) for _ in slices)
    b = tuple((torch.randn(1, 1, sl, 32, device=dev) * 0.05).to(bf16) for sl in slices)
    idx = torch.zeros(1, dtype=torch.int32, device=dev)
    zero_b = tuple(torch.zeros_like(bi) for bi in b)
    row_h2 = nvfp4_gemv_row(x, q.packed, q.scale, q.global_scale)
    same_tile = nvfp4_small_gemm(x, q.packed, q.scale, q.global_scale, words=True, xvec=True,
                                 **rl.row_tile(n, k, slices=slices, hfma2=True))
    assert torch.equal(rl.launch(x, q.packed, q.scale, q.global_scale, None, a, zero_b, 1.0, slices, idx), same_tile)
    y_h2 = rl.launch(x, q.packed, q.scale, q.global_scale, None, a, b, 1.0, slices, idx)
    monkeypatch.setenv(DECODE_ENV, "fp8")
    y_fp8 = rl.launch(x, q.packed, q.scale, q.global_scale, None, a, b, 1.0, slices, idx)
    row_fp8 = nvfp4_gemv_row(x, q.packed, q.scale, q.global_scale)
    lora = torch.cat([(x.double() @ ai[0, 0].double().t()) @ bi[0, 0].double().t() for ai, bi in zip(a, b)], dim=-1)
    err_h2, _ = _errors(y_h2, x, q, lora)
    err_fp8, _ = _errors(y_fp8, x, q, lora)
    base_diff = (row_h2.double() - row_fp8.double()).abs().max().item()
    assert err_h2 <= err_fp8 + base_diff + 2.0**-8 * y_fp8.double().abs().max().item(), (err_h2, err_fp8, base_diff)

