"""vllm_ext.nvfp4_gemv_lora: one launch for a one-row NVFP4 linear and its adapter's LoRA.

On the CPU the kernel runs under the Triton interpreter (a subprocess: TRITON_INTERPRET must be set before Triton is
imported) in float16, against an independent float64 statement of the arithmetic it promises: the base product with
the codec's exact weight (``value * scale / global_scale``) plus the bias, rounded once; punica's LoRA for slot 0
(``A @ x`` times ``scale``, rounded, ``B @ h``, rounded); their sum, rounded. The kernel sums in float32, so a result
may sit one rounding step away where the float64 value lies near a rounding boundary: checked as at most 2 ulps. A
token without the adapter (slot -1) must give the row kernel's own bits. bfloat16 and the real 7B shapes are checked
on the GPU (``scripts/gpu/check_row_lora.py``, tests below).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed: the kernel cannot run or be interpreted")

# (N slices, K, rank, bias, split-K expected): one slice, q/k/v-like three, gate/up-like two with a ragged last
# block, and a long K that takes decode_tile's split-K (4 programs per block, K > 8192)
CASES = [
    ((48,), 512, 16, False),
    ((64, 16, 16), 1024, 32, True),
    ((24, 14), 768, 16, False),
    ((16,), 8704, 16, True),
]

INTERPRETED = textwrap.dedent(
    """
    import json, sys
    import torch
    from qerl_plugin import nvfp4
    from vllm_ext import lora_fused, nvfp4_gemv_lora as rl
    from vllm_ext.nvfp4_gemv import decode_tile, nvfp4_gemv_row

    def f64_reference(x, q, bias, a, b, scale, slices, served):
        w = nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double()
        base = x.double() @ w.t() + (0.0 if bias is None else bias.double())
        base = base.to(x.dtype).double()
        ups = []
        for A, B in zip(a, b):
            h = (x.double() @ A[0, 0].double().t()) * scale
            h = (h if served else torch.zeros_like(h)).to(x.dtype).double()
            ups.append((h @ B[0, 0].double().t()).to(x.dtype).double())
        return (base + torch.cat(ups, dim=-1)).to(x.dtype)

    out = []
    for i, (slices, k, r, with_bias) in enumerate(json.loads(sys.argv[1])):
        g = torch.Generator().manual_seed(100 + i)
        n = sum(slices)
        q = nvfp4.quantize((torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16))
        x = torch.randn(1, k, generator=g).to(torch.float16)
        bias = (torch.randn(n, generator=g)).to(torch.float16) if with_bias else None
        a = tuple((torch.randn(1, 1, r, k, generator=g) / k**0.5).to(torch.float16) for _ in slices)
        b = tuple((torch.randn(1, 1, s, r, generator=g) * 0.5).to(torch.float16) for s in slices)
        row = {"case": [list(slices), k, r, with_bias], "tile": decode_tile(n, k),
               "supports": rl.supports(x, q.packed, a, b, tuple(slices))}
        for slot, scale in ((0, 1.0), (0, 0.37), (-1, 1.0)):
            idx = torch.tensor([slot, 7, 7])
            got = rl.launch(x, q.packed, q.scale, q.global_scale, bias, a, b, scale, tuple(slices), idx)
            ref = f64_reference(x, q, bias, a, b, scale, slices, slot == 0)
            ulp = torch.finfo(torch.float16).eps * ref.double().abs().clamp_min(2**-14)
            diff = (got.double() - ref.double()).abs()
            plain = nvfp4_gemv_row(x, q.packed, q.scale, q.global_scale, bias)
            again = rl.launch(x, q.packed, q.scale, q.global_scale, bias, a, b, scale, tuple(slices), idx)
            row[f"slot{slot}_scale{scale}"] = {
                "shape": list(got.shape), "dtype": str(got.dtype),
                "max_ulps": (diff / ulp).max().item(), "differing": (diff > 0).double().mean().item(),
                "equals_row_kernel": torch.equal(got, plain),
                "repeat_identical": torch.equal(got, again),
                    }
        out.append(row)
    # refusals: a block across two slices and two rows; the shrink's chunking of the 7B and 32B input sizes
    g = torch.Generator().manual_seed(7)
    q = nvfp4.quantize((torch.randn(14, 512, generator=g) * 0.05).to(torch.bfloat16))
    x = torch.randn(1, 512, generator=g).to(torch.float16)
    a = tuple((torch.randn(1, 1, 16, 512, generator=g) / 20).to(torch.float16) for _ in range(2))
    b = tuple((torch.randn(1, 1, s, 16, generator=g)).to(torch.float16) for s in (6, 8))
    refusals = {"ragged": rl.supports(x, q.packed, a, b, (6, 8)),
                "two_rows": rl.supports(torch.cat([x, x]), q.packed, a, b, (8, 6))}
    try:
        rl.launch(x, q.packed, q.scale, q.global_scale, None, a, b, 1.0, (6, 8), torch.tensor([0]))
        refusals["launch_ragged"] = "no error"
    except lora_fused.FusedLoRAUnsupported as exc:
        refusals["launch_ragged"] = str(exc)
    refusals["chunking"] = [rl.chunking(k) for k in (256, 3584, 4096, 5120, 18944, 27648)]
    print("RESULT " + json.dumps({"cases": out, "refusals": refusals}))
    """
)


@pytest.fixture(scope="module")
def interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", INTERPRETED, json.dumps(CASES)], capture_output=True, text=True,
                         env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(ln for ln in reversed(run.stdout.splitlines()) if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_interpreted_kernel_matches_the_float64_statement(interpreted):
    assert len(interpreted["cases"]) == len(CASES)
    for case in interpreted["cases"]:
        assert case["supports"] is None, case
        for key in ("slot0_scale1.0", "slot0_scale0.37", "slot-1_scale1.0"):
            r = case[key]
            assert r["shape"] == [1, sum(case["case"][0])] and r["dtype"] == "torch.float16", (key, case)
            assert r["max_ulps"] <= 2.0, (key, case)  # float32 sums against float64: a boundary case at most
            assert r["differing"] <= 0.1, (key, case)
            assert r["repeat_identical"], (key, case)  # fixed-order sums: the same bits on every launch
        # the adapter changes the result; without it (slot -1) the update is exactly zero: the row kernel's bits
        assert not case["slot0_scale1.0"]["equals_row_kernel"], case
        assert case["slot-1_scale1.0"]["equals_row_kernel"], case


def test_the_cases_cover_split_k_and_several_slices(interpreted):
    tiles = [case["tile"] for case in interpreted["cases"]]
    assert any(t["split_k"] > 1 for t in tiles) and any(t["split_k"] == 1 for t in tiles)
    assert any(len(case["case"][0]) == 3 for case in interpreted["cases"])


def test_refusals_name_the_bad_input(interpreted):
    r = interpreted["refusals"]
    assert "slice sizes [6]" in r["ragged"] and "4 rows per block" in r["ragged"]
    assert r["two_rows"] == "2 rows (one supported)"
    assert "slice sizes [6]" in r["launch_ragged"]
    # (features per shrink program, programs): multiples of 256, at most 16 programs, covering K
    assert r["chunking"] == [[256, 1], [256, 14], [256, 16], [512, 10], [1280, 15], [1792, 16]]


def test_launch_names_a_scale_or_bias_of_the_wrong_shape():
    """Checked before anything is launched (no interpreter needed): the error names the tensor and the shape wanted."""
    from qerl_plugin import nvfp4
    from vllm_ext import nvfp4_gemv_lora as rl

    q = nvfp4.quantize((torch.randn(16, 256) * 0.05).to(torch.bfloat16))
    x = torch.randn(1, 256).half()
    a = ((torch.randn(1, 1, 16, 256) / 16).half(),)
    b = (torch.randn(1, 1, 16, 16).half(),)
    idx = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"scale torch.float8_e4m3fn \(16, 8\), expected float8_e4m3fn \(16, 16\)"):
        rl.launch(x, q.packed, q.scale[:, :8], q.global_scale, None, a, b, 1.0, (16,), idx)
    with pytest.raises(ValueError, match=r"bias \(15,\), expected \(16,\)"):
        rl.launch(x, q.packed, q.scale, q.global_scale, torch.zeros(15).half(), a, b, 1.0, (16,), idx)


def test_a_given_tile_must_fit_the_slices():
    """launch_supported's ``tile`` (scripts/gpu/check_row_lora.py times §4m's tiles with it): a block_n that would
    make an output block straddle two slices is refused before anything is launched, naming the slices."""
    from qerl_plugin import nvfp4
    from vllm_ext import nvfp4_gemv_lora as rl

    q = nvfp4.quantize((torch.randn(24, 256) * 0.05).to(torch.bfloat16))
    x = torch.randn(1, 256).half()
    a = tuple((torch.randn(1, 1, 16, 256) / 16).half() for _ in range(2))
    b = (torch.randn(1, 1, 12, 16).half(), torch.randn(1, 1, 12, 16).half())
    idx = torch.zeros(1, dtype=torch.int32)
    tile = dict(block_n=8, block_k=256, split_k=1, num_warps=1)
    with pytest.raises(ValueError, match=r"slices \(12, 12\) are not multiples of the given tile's 8 rows per block"):
        rl.launch_supported(x, q.packed, q.scale, q.global_scale, None, a, b, 1.0, (12, 12), idx, tile=tile)


def test_pdl_is_off_on_the_cpu_and_by_the_environment(monkeypatch):
    from vllm_ext import nvfp4_gemv_lora as rl

    assert rl.pdl_supported(torch.device("cpu")) is False
    monkeypatch.setenv(rl.NO_PDL_ENV, "yes")
    assert rl.pdl_supported(torch.device("cuda")) is False  # decided before the device is looked at
    monkeypatch.setenv(rl.NO_PDL_ENV, "sometimes")
    with pytest.raises(ValueError, match="QERL_NO_PDL: expected true or false, got 'sometimes'"):
        rl.pdl_supported(torch.device("cuda"))


def test_first_launch_pdl_follows_its_variable(monkeypatch):
    """QERL_PDL_FIRST (default on) decides whether the first launch of a decode_gemv linear is dependent too; a bad
    value is an error that names the variable; on the CPU no launch is dependent whatever it says."""
    from vllm_ext import nvfp4_gemv as g

    monkeypatch.delenv(g.PDL_FIRST_ENV, raising=False)
    assert g.pdl_first_allowed() is True
    monkeypatch.setenv(g.PDL_FIRST_ENV, "0")
    assert g.pdl_first_allowed() is False
    monkeypatch.setenv(g.PDL_FIRST_ENV, "maybe")
    with pytest.raises(ValueError, match="QERL_PDL_FIRST: expected true or false, got 'maybe'"):
        g.pdl_first_allowed()
    monkeypatch.setenv(g.PDL_FIRST_ENV, "1")
    assert g.pdl_supported(torch.device("cpu")) is False


def test_pdl_needs_the_word_kernel():
    from qerl_plugin import nvfp4
    from vllm_ext.nvfp4_gemv import nvfp4_small_gemm

    q = nvfp4.quantize(torch.randn(64, 256).to(torch.bfloat16))
    with pytest.raises(ValueError, match="pdl=True only with words=True"):
        nvfp4_small_gemm(torch.randn(2, 256).half(), q.packed, q.scale, q.global_scale, pdl=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bfloat16 and the 7B shapes)")
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("group", ["qkv", "o", "gate_up", "down"])
def test_gpu_7b_linears_match_row_kernel_then_fused_lora(group, pdl):
    """bfloat16 on the 7B shapes: the two launches against the two they replace (decode_gemv's row op, then the
    fused LoRA kernel): at most one bf16 rounding step apart (the float32 sums run in other orders), no further from
    the dequantized float64 reference than those, the same bits on
    a second call, and, for a token without the adapter, within one step of the row kernel alone (steps of at least
    1/256 of the largest value: lease 2 on an H200 saw 7.6 steps on a gate/up result near zero). With and without
    the row kernel as a programmatic dependent launch (Hopper), eagerly and replayed from a CUDA graph."""
    from qerl_plugin import nvfp4
    from vllm_ext import lora_fused
    from vllm_ext import nvfp4_gemv_lora as rl
    from vllm_ext.nvfp4_gemv import nvfp4_gemv_row

    if pdl and not rl.pdl_supported(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0")
    k, slices = {"qkv": (3584, (3584, 512, 512)), "o": (3584, (3584,)), "gate_up": (3584, (18944, 18944)),
                 "down": (18944, (3584,))}[group]
    torch.manual_seed(0)
    n, r, dev = sum(slices), 32, "cuda"
    q = nvfp4.quantize((torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16))
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16) if group == "qkv" else None
    a = tuple((torch.randn(1, 1, r, k, device=dev) / k**0.5).to(torch.bfloat16) for _ in slices)
    b = tuple((torch.randn(1, 1, s, r, device=dev) * 0.1).to(torch.bfloat16) for s in slices)
    idx = torch.zeros(4, dtype=torch.int32, device=dev)
    got = rl.launch(x, q.packed, q.scale, q.global_scale, bias, a, b, 1.0, slices, idx, pdl=pdl)
    two = nvfp4_gemv_row(x, q.packed, q.scale, q.global_scale, bias)
    lora_fused.launch(two, x, a, b, 1.0, slices, idx, lora_fused.new_sync(dev))

    def ulps(u, v):  # bf16 rounding steps of v, at least those of 1/256 of v's largest value: a float32 sum in
        # another order moves a result near zero (cancellation) by many of its own tiny steps, nothing by this measure
        v = v.double()
        return ((u.double() - v).abs() / (2.0**-7 * v.abs().clamp_min(v.abs().max().item() / 256))).max().item()

    assert ulps(got, two) <= 1.0
    assert (got != two).double().mean().item() <= 0.02
    # against the dequantized reference (float64: the codec's exact weight, the bias, the unrounded adapter): no
    # further from it than the two launches it replaces
    w64 = nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double()
    x64 = x.double()
    exact = x64 @ w64.t() + (0.0 if bias is None else bias.double())
    exact = exact + torch.cat([(x64 @ ai[0, 0].double().t()) @ bi[0, 0].double().t() for ai, bi in zip(a, b)], -1)
    floor = (two.double() - exact).abs().max().item()
    assert (got.double() - exact).abs().max().item() <= 1.5 * floor
    assert torch.equal(got, rl.launch(x, q.packed, q.scale, q.global_scale, bias, a, b, 1.0, slices, idx, pdl=pdl))
    # the overlap op's split add (§4ai): the same output, and zeros the kernel writes (NaN-filled blocks freed just
    # before, which the caching allocator is likely to hand back: zeros not written would likely show)
    for _ in range(2):
        torch.full((4 * sum(slices),), float("nan"), device=dev, dtype=x.dtype)
    split, zeros = rl.launch_supported(x, q.packed, q.scale, q.global_scale, bias, a, b, 1.0, slices, idx, pdl=pdl,
                                       zeros=True)
    assert torch.equal(split, got) and torch.equal(zeros, torch.zeros_like(got))
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = rl.launch(static, q.packed, q.scale, q.global_scale, bias, a, b, 1.0, slices, idx, pdl=pdl)
    for _ in range(3):
        captured.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, got)
    idx.fill_(-1)  # no adapter: the row kernel's result, its float32 sum possibly in another order
    plain = rl.launch(x, q.packed, q.scale, q.global_scale, bias, a, b, 1.0, slices, idx, pdl=pdl)
    assert ulps(plain, nvfp4_gemv_row(x, q.packed, q.scale, q.global_scale, bias)) <= 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bfloat16 and the 7B shapes)")
@pytest.mark.parametrize("path", ["row", "row_lora"])
def test_gpu_dependent_first_launch_reads_what_the_kernel_before_it_wrote(path):
    """With the first launch of a linear a programmatic dependent launch (the row kernel alone, or the shrink of
    row+lora), its input is written by the kernel right before it: in one CUDA graph, six times, a large elementwise
    kernel writes ``x`` at the end of its output, then the linear reads it. Every replay gives the bits of the same
    linears launched plainly, one by one."""
    from qerl_plugin import nvfp4
    from vllm_ext import nvfp4_gemv_lora as rl
    from vllm_ext.nvfp4_gemv import decode_tile, nvfp4_small_gemm

    if not rl.pdl_supported(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0")
    torch.manual_seed(1)
    dev, k, slices = "cuda", 3584, (3584, 512, 512)
    n, r = sum(slices), 32
    q = nvfp4.quantize((torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16))
    a = tuple((torch.randn(1, 1, r, k, device=dev) / k**0.5).to(torch.bfloat16) for _ in slices)
    b = tuple((torch.randn(1, 1, s, r, device=dev) * 0.1).to(torch.bfloat16) for s in slices)
    idx = torch.zeros(4, dtype=torch.int32, device=dev)
    tile = decode_tile(n, k)

    def linear(x, pdl):
        if path == "row":
            return nvfp4_small_gemm(x, q.packed, q.scale, q.global_scale, words=True, xvec=True, pdl=pdl, **tile)
        return rl.launch(x, q.packed, q.scale, q.global_scale, None, a, b, 1.0, slices, idx, pdl=pdl, pdl_first=pdl)

    big = 1 << 24  # the producer: 16 M elements, x in its last k
    sources = [torch.randn(big, device=dev, dtype=torch.bfloat16) for _ in range(6)]
    buf = torch.empty(big, device=dev, dtype=torch.bfloat16)
    x = buf[-k:].view(1, k)
    want = [linear(s[-k:].view(1, k).clone(), False) for s in sources]
    for s in sources:  # warm-up (compiles) outside the capture
        torch.mul(s, 1.0, out=buf)
        linear(x, True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = []
        for s in sources:
            torch.mul(s, 1.0, out=buf)
            outs.append(linear(x, True))
    for _ in range(3):
        for o in outs:
            o.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for got, ref in zip(outs, want):
            assert torch.equal(got, ref)
