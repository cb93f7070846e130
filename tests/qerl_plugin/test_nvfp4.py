"""The NVFP4 codec against a float64 reference of the format and against compressed-tensors itself."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qerl_plugin import nvfp4
from qerl_plugin.nvfp4 import NVFP4Error

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ---------------------------------------------------------------------------------------------------------
# float64 reference of the NVFP4 definition, written independently of the codec (scalar Python arithmetic)


def ref_e2m1_round(v: float) -> float:
    """Nearest E2M1 magnitude, ties to the even code (the one with mantissa bit 0), saturating at 6."""
    a = min(abs(v), 6.0)
    best = min(range(8), key=lambda i: (abs(a - E2M1[i]), i % 2))
    return math.copysign(E2M1[best], v) if v != 0 else 0.0


def ref_fp8_e4m3(v: float) -> float:
    """Round a non-negative float to the nearest float8_e4m3fn value (ties to even mantissa), saturating."""
    if v == 0:
        return 0.0
    v = min(v, 448.0)
    e = max(math.floor(math.log2(v)), -6)  # subnormals below 2**-6
    step = 2.0 ** (e - 3)
    q = v / step
    lo = math.floor(q)
    frac = q - lo
    if frac > 0.5 or (frac == 0.5 and lo % 2 == 1):
        lo += 1
    return min(lo * step, 448.0)


def round_like(v: float, dtype: torch.dtype) -> float:
    """Round a float64 value to ``dtype``; half-precision ops compute in float32 first, then round."""
    t = torch.tensor(v, dtype=torch.float64).to(torch.float32)
    return t.to(dtype).double().item()


def ref_quantize_dequantize(w: torch.Tensor, gs_group: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, float]:
    """Float64 model of what an NVFP4A16 checkpoint decodes to; returns (decoded, global_scale)."""
    dt = w.dtype
    parts = gs_group if gs_group is not None else [w]
    amax = max(p.double().abs().max().item() for p in parts)
    # 2688 / amax is evaluated by torch as reciprocal(amax) * 2688, each rounded to the weight dtype
    gs = round_like(round_like(1.0 / amax, dt) * 2688.0, dt) if amax > 0 else 1.0
    if not math.isfinite(gs):  # overflow in the weight dtype: compressed-tensors falls back to 1.0
        gs = 1.0
    gs = round_like(gs, torch.float32)
    rows, cols = w.shape
    out = torch.empty(rows, cols, dtype=torch.float64)
    wd = w.double()
    for r in range(rows):
        for g in range(cols // 16):
            block = wd[r, g * 16 : (g + 1) * 16]
            gmax = round_like(block.abs().max().item() / 6.0, dt)
            s = ref_fp8_e4m3(round_like(gs * gmax, torch.float32))
            if s == 0:
                s = 0.125
            step = round_like(s / gs, torch.float32)
            for c in range(16):
                x = round_like(block[c].item() / step, torch.float32)
                out[r, g * 16 + c] = round_like(ref_e2m1_round(x) * step, torch.float32)
    return out, gs


def random_weight(rows, cols, dtype, seed, kind="normal"):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    if kind == "outliers":
        idx = torch.randint(0, rows * cols, (max(1, rows * cols // 50),), generator=g)
        w.view(-1)[idx] *= 100.0
    elif kind == "tiny":
        w *= 1e-30 if dtype == torch.float32 else 1e-6
    elif kind == "huge":
        w *= 1e30 if dtype == torch.float32 else 1e4
    elif kind == "zeros_mixed":
        w[:, :16] = 0.0
        w[::3] = 0.0
    elif kind == "lognormal":
        w = w.sign() * torch.exp(4 * torch.randn(rows, cols, generator=g, dtype=torch.float64))
    return (w * 0.02).to(dtype) if kind not in ("tiny", "huge", "lognormal") else w.to(dtype)


# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["normal", "outliers", "tiny", "huge", "zeros_mixed", "lognormal"])
def test_round_trip_matches_float64_reference(dtype, kind):
    if dtype == torch.float16 and kind in ("huge", "lognormal"):
        pytest.skip("values beyond the float16 range are not a float16 weight")
    seed = random.randrange(2**31)  # fresh inputs every run; the seed is in the failure message
    w = random_weight(6, 64, dtype, seed, kind)
    q = nvfp4.quantize(w)
    ref, gs = ref_quantize_dequantize(w)
    assert q.global_scale.item() == gs
    got = q.dequantize(torch.float32).double()
    torch.testing.assert_close(got, ref, rtol=0, atol=0, msg=f"seed {seed}")


def test_dequantize_error_is_bounded_by_half_a_step():
    w = random_weight(64, 256, torch.float32, 7)
    q = nvfp4.quantize(w)
    step = (q.scale.float() / q.global_scale).repeat_interleave(16, dim=1)
    err = (q.dequantize(torch.float32) - w).abs()
    # within the representable range the error is at most half the spacing of E2M1 (2 steps near 6)
    assert bool((err <= step * 1.0 + 1e-12).all())
    rel = (err.norm() / w.norm()).item()
    assert rel < 0.15, rel


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 5),
    groups=st.integers(1, 4),
    scale=st.floats(1e-6, 1e3),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
)
def test_round_trip_property(rows, groups, scale, seed, dtype):
    w = (torch.randn(rows, groups * 16, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)
    q = nvfp4.quantize(w)
    ref, _ = ref_quantize_dequantize(w)
    assert torch.equal(q.dequantize(torch.float32).double(), ref)


def test_e2m1_codes_every_edge_value():
    # exact E2M1 values, midpoints (ties -> even code), just above/below midpoints, saturation, signs
    cases = {
        0.0: 0, 0.25: 0, 0.2501: 1, 0.5: 1, 0.7499: 1, 0.75: 2, 1.0: 2, 1.25: 2, 1.2501: 3, 1.5: 3,
        1.75: 4, 2.0: 4, 2.5: 4, 2.5001: 5, 3.0: 5, 3.5: 6, 4.0: 6, 5.0: 6, 5.0001: 7, 6.0: 7, 7.0: 7, 1e9: 7,
    }
    x = torch.tensor(list(cases), dtype=torch.float32)
    assert nvfp4.e2m1_codes(x).tolist() == list(cases.values())
    neg = nvfp4.e2m1_codes(-x[1:])
    assert neg.tolist() == [c | 8 for c in list(cases.values())[1:]]
    for v in cases:
        assert E2M1[cases[v]] == ref_e2m1_round(min(v, 6.0)), v


def test_e2m1_negative_values_rounding_to_zero_keep_the_sign_bit_like_compressed_tensors():
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8

    x = torch.tensor([[-0.1, 0.1, -0.0, 0.0, -0.25, 0.25, -6.0, 6.0]])
    from compressed_tensors.quantization.quant_args import FP4_E2M1_DATA

    ct = pack_fp4_to_uint8(FP4_E2M1_DATA.cast_to_fp4(x.clone()))
    assert torch.equal(nvfp4.pack_codes(nvfp4.e2m1_codes(x)), ct)


def test_fp8_scale_edges():
    # 448 (e4m3 max), subnormal scales, and the all-zero group replaced by 0.125
    w = torch.zeros(3, 32, dtype=torch.float32)
    w[0, 0] = 1.0  # tensor amax -> group scale exactly 448
    w[1, :16] = 1.0 / 448 / 64  # group scale 2**-6 / 64 * 448/448: subnormal in e4m3 (2**-9 = smallest)
    w[1, 16] = 1e-12  # rounds to a zero fp8 scale -> replaced by 0.125
    q = nvfp4.quantize(w)
    s = q.scale.float()
    assert s[0, 0].item() == 448.0
    assert s[1, 0].item() == ref_fp8_e4m3(448.0 * w[1, 0].item())
    assert s[1, 1].item() == 0.125
    assert s[2, 0].item() == 0.125 and s[2, 1].item() == 0.125  # all-zero groups
    assert torch.equal(q.dequantize(torch.float32)[2], torch.zeros(32))
    for v in [448.0, 2.0**-9, 2.0**-10, 1.5 * 2**-9, 0.3, 17.0, 240.0]:
        got = torch.tensor(v).to(torch.float8_e4m3fn).float().item()
        assert got == ref_fp8_e4m3(v), v


def test_bit_identical_to_compressed_tensors_compressor():
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    for seed, kind in enumerate(["normal", "outliers", "zeros_mixed", "lognormal"]):
        w = random_weight(32, 128, torch.bfloat16, 100 + seed, kind)
        amax = w.abs().amax()
        gs = generate_gparam(-amax.reshape(1), amax.reshape(1))
        groups = w.reshape(32, 8, 16)
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=gs)
        ct = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs}, scheme)
        ours = nvfp4.quantize(w)
        assert torch.equal(ours.global_scale, gs)
        assert torch.equal(ours.packed, ct["weight_packed"]), kind
        assert torch.equal(ours.scale.view(torch.uint8), ct["weight_scale"].view(torch.uint8)), kind
        back = NVFP4PackedCompressor.decompress(ct, scheme)["weight"]
        assert torch.equal(back, ours.dequantize(back.dtype)), kind


def test_pack_layout_low_nibble_is_even_column():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = nvfp4.pack_codes(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(nvfp4.unpack_codes(packed), codes)
    allc = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(1, -1)
    assert torch.equal(nvfp4.pack_codes(nvfp4.unpack_codes(allc)), allc)


def test_fused_layers_share_the_largest_global_scale():
    q = random_weight(32, 64, torch.bfloat16, 1)
    k = random_weight(16, 64, torch.bfloat16, 2) * 10
    v = random_weight(16, 64, torch.bfloat16, 3)
    parts = nvfp4.quantize_fused([q, k, v], names=["q_proj", "k_proj", "v_proj"])
    gs = nvfp4.global_scale(q, k, v)
    assert all(torch.equal(p.global_scale, gs) for p in parts)
    assert gs.item() == nvfp4.global_scale(k).item()  # k holds the amax
    ref, _ = ref_quantize_dequantize(q, gs_group=[q, k, v])
    assert torch.equal(parts[0].dequantize(torch.float32).double(), ref)


def test_all_zero_weight_gets_global_scale_one():
    q = nvfp4.quantize(torch.zeros(4, 32, dtype=torch.bfloat16))
    assert q.global_scale.item() == 1.0
    assert torch.equal(q.dequantize(), torch.zeros(4, 32, dtype=torch.bfloat16))


def test_row_chunking_does_not_change_the_result(monkeypatch):
    w = random_weight(50, 64, torch.bfloat16, 11, "outliers")
    full = nvfp4.quantize(w)
    monkeypatch.setattr(nvfp4, "ROW_CHUNK", 7)
    chunked = nvfp4.quantize(w)
    assert torch.equal(full.packed, chunked.packed)
    assert torch.equal(full.scale.view(torch.uint8), chunked.scale.view(torch.uint8))


def test_tensors_and_sizes():
    q = nvfp4.quantize(random_weight(8, 32, torch.bfloat16, 5))
    t = q.tensors("model.layers.0.mlp.up_proj")
    assert set(t) == {
        "model.layers.0.mlp.up_proj.weight_packed",
        "model.layers.0.mlp.up_proj.weight_scale",
        "model.layers.0.mlp.up_proj.weight_global_scale",
    }
    assert q.shape == (8, 32)
    assert t["model.layers.0.mlp.up_proj.weight_packed"].dtype == torch.uint8
    assert t["model.layers.0.mlp.up_proj.weight_scale"].dtype == torch.float8_e4m3fn
    assert t["model.layers.0.mlp.up_proj.weight_global_scale"].dtype == torch.float32
    assert q.nbytes() == 8 * 16 + 8 * 2 + 4


# ---------------------------------------------------------------------------------------------------------
# bad input


def test_rejects_input_dim_not_divisible_by_16():
    with pytest.raises(NVFP4Error, match=r"model\.layers\.0\.mlp\.down_proj.*20.*group size 16.*ignore"):
        nvfp4.quantize(torch.randn(4, 20), name="model.layers.0.mlp.down_proj")


def test_check_finite_finds_the_first_bad_value_in_any_chunk(monkeypatch):
    monkeypatch.setattr(nvfp4, "FINITE_CHUNK", 7)
    t = torch.zeros(4, 6, dtype=torch.bfloat16)
    t[2, 3], t[3, 0] = float("-inf"), float("nan")  # flat index 15: the third chunk
    with pytest.raises(NVFP4Error, match=r"^w: contains NaN/Inf \(first at index \(2, 3\)\); .*re-export"):
        nvfp4.check_finite(t, "w")
    for value in (float("nan"), float("inf"), float("-inf")):  # alone, in the second chunk
        t = torch.zeros(4, 6, dtype=torch.float16)
        t[1, 2] = value
        with pytest.raises(NVFP4Error, match=r"first at index \(1, 2\)"):
            nvfp4.check_finite(t, "w")
    nvfp4.check_finite(torch.zeros(4, 6), "w")
    nvfp4.check_finite(torch.full((3,), 7, dtype=torch.int64), "ids")  # integers are always finite
    with pytest.raises(NVFP4Error, match=r"f8: contains NaN/Inf \(first at index \(1,\)\)"):
        nvfp4.check_finite(torch.tensor([1.0, float("nan")]).to(torch.float8_e4m3fn), "f8")
    with pytest.raises(NVFP4Error, match=r"scalar: contains NaN/Inf \(first at index \(\)\)"):
        nvfp4.check_finite(torch.tensor(float("nan")), "scalar")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_rejects_non_finite_weights_naming_the_tensor_and_index(bad):
    w = torch.randn(4, 32)
    w[2, 7] = bad
    with pytest.raises(NVFP4Error, match=r"q_proj.*NaN/Inf.*\(2, 7\)"):
        nvfp4.quantize(w, name="q_proj")


@pytest.mark.parametrize(
    "w, msg",
    [
        (torch.randn(32), "2-D"),
        (torch.randn(2, 4, 32), "2-D"),
        (torch.randint(0, 5, (4, 32)), "bf16/fp16/fp32"),
        (torch.zeros(4, 32, dtype=torch.uint8), "bf16/fp16/fp32"),
        (torch.zeros(4, 32).to(torch.float8_e4m3fn), "already quantized"),
    ],
)
def test_rejects_wrong_shapes_and_dtypes(w, msg):
    with pytest.raises(NVFP4Error, match=msg):
        nvfp4.quantize(w, name="some.weight")


def test_fused_parts_must_share_dtype():
    with pytest.raises(NVFP4Error, match="one dtype"):
        nvfp4.global_scale(torch.randn(2, 16), torch.randn(2, 16).bfloat16())


def test_dequantize_rejects_inconsistent_tensors():
    q = nvfp4.quantize(torch.randn(4, 32))
    with pytest.raises(NVFP4Error, match="weight_scale has shape"):
        nvfp4.dequantize(q.packed, q.scale[:, :1], q.global_scale)
    with pytest.raises(NVFP4Error, match="uint8"):
        nvfp4.dequantize(q.packed.to(torch.int16), q.scale, q.global_scale)
    with pytest.raises(NVFP4Error, match="one value"):
        nvfp4.dequantize(q.packed, q.scale, torch.ones(2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: checks GPU bits equal CPU bits")
def test_cuda_gives_the_same_bits_as_cpu():
    w = random_weight(256, 512, torch.bfloat16, 3, "outliers")
    cpu = nvfp4.quantize(w)
    gpu = nvfp4.quantize(w.cuda())
    assert torch.equal(cpu.packed, gpu.packed.cpu())
    assert torch.equal(cpu.scale.view(torch.uint8), gpu.scale.cpu().view(torch.uint8))
    assert torch.equal(cpu.dequantize(), gpu.dequantize().cpu())
