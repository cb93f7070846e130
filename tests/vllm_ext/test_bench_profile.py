"""``vllm_ext.bench.profile``: the per-step summary of a decode trace, on hand-built traces whose answer is known,
and a real ``torch.profiler`` trace on the CPU (no GPU kernels: a clear error, no summary)."""

from __future__ import annotations

import gzip
import json

import pytest

from vllm_ext.bench import profile


def _trace(steps: int = 4, period: float = 1000.0) -> dict:
    """``steps`` decode replays ``period`` µs apart: Marlin 2 x 100 µs, the fused LoRA kernel 50, attention 20
    inside each graph replay; then an eager lm_head GEMM of 300 µs and a 5 µs copy. A one-kernel piecewise
    prefill replay comes first and must not count as a decode step."""
    ev = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 5, "args": {"correlation": 1}},
          {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_0", "ts": 10, "dur": 400, "args": {"correlation": 1}}]
    corr = 100
    for k in range(steps):
        t = 1000.0 + k * period
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t - 20, "dur": 8,
                   "args": {"correlation": corr}})
        s = t
        for name, dur in (("void marlin::Marlin<bf16>", 100), ("_fused_lora_kernel", 50),
                          ("void marlin::Marlin<bf16>", 100), ("flash_fwd_splitkv_kernel", 20)):
            ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": s, "dur": dur, "args": {"correlation": corr}})
            s += dur
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": s, "dur": 4,
                   "args": {"correlation": corr + 1}})
        ev.append({"ph": "X", "cat": "kernel", "name": "nvjet_tst_128x64", "ts": s + 10, "dur": 300,
                   "args": {"correlation": corr + 1}})
        ev.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": s + 320, "dur": 5,
                   "args": {"correlation": corr + 2}})
        corr += 10
    return {"traceEvents": ev}


def test_summary_of_a_known_trace():
    got = profile.summarize_trace(_trace())
    assert got["steps"] == 3 and got["replays_found"] == 4  # the prefill piece is not a decode replay
    assert got["period_ms"] == pytest.approx(1.0)
    assert got["replay_busy_ms"] == pytest.approx(0.27) and got["replay_span_ms"] == pytest.approx(0.27)
    assert got["outside_busy_ms"] == pytest.approx(0.305)
    assert got["idle_ms"] == pytest.approx(1.0 - 0.27 - 0.305)
    assert got["by_category_ms"] == pytest.approx({"marlin": 0.2, "lora": 0.05, "attention": 0.02,
                                                   "outside:gemm": 0.3, "outside:copy": 0.005})
    assert (got["replay_kernels"], got["outside_kernels"]) == (4, 2)
    top = got["top_kernels"][0]
    assert (top["category"], top["in_replay"], top["calls_per_step"], top["us_per_step"]) == ("gemm", False, 1, 300)
    marlin = next(k for k in got["top_kernels"] if k["category"] == "marlin")
    assert (marlin["calls_per_step"], marlin["us_per_step"]) == (2, 200)


def test_overlapping_kernels_are_counted_once_in_busy_time():
    tr = _trace()
    for e in tr["traceEvents"]:  # the copy now runs under the GEMM: busy time must not grow
        if e.get("cat") == "gpu_memcpy":
            e["ts"] -= 100
    got = profile.summarize_trace(tr)
    assert got["outside_busy_ms"] == pytest.approx(0.3)
    assert got["by_category_ms"]["outside:copy"] == pytest.approx(0.005)  # categories sum kernel times


@pytest.mark.parametrize("name,cat,want", [
    ("_lora_shrink_kernel", "kernel", "lora"), ("_fused_lora_kernel", "kernel", "lora"),
    ("void marlin::Marlin<(vllm::ScalarTypeId)5>", "kernel", "marlin"), ("flash_fwd_kernel", "kernel", "attention"),
    ("sm90_xmma_gemm_bf16bf16", "kernel", "gemm"), ("_nvfp4_row_kernel", "kernel", "w4a16"), ("triton_red_fused_add_rms_norm_1", "kernel", "inductor"),
    ("triton_red_fused_fused_add_rms_norm_marlin_gemm_2", "kernel", "inductor"),
    ("Memset (Device)", "gpu_memset", "copy"), ("void at::native::vectorized_elementwise_kernel", "kernel", "other"),
])
def test_categories(name, cat, want):
    assert profile.category(name, cat) == want


def test_errors_name_what_is_missing():
    with pytest.raises(ValueError, match="no GPU kernels"):
        profile.summarize_trace({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1}]})
    eager = [e for e in _trace()["traceEvents"] if e["name"] != "cudaGraphLaunch"]
    with pytest.raises(ValueError, match="no CUDA-graph replays"):
        profile.summarize_trace({"traceEvents": eager})
    one = _trace(steps=1)
    with pytest.raises(ValueError, match="at least two decode graph replays"):
        profile.summarize_trace(one, min_kernels=3)


def test_profile_call_on_cpu_writes_the_trace_and_reports_no_gpu(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only answer; the GPU path runs in `qerl bench rollout --profile-tokens`")
    path = tmp_path / "t.trace.json.gz"
    got = profile.profile_call(lambda: torch.randn(64, 64) @ torch.randn(64, 64), path)
    assert "no GPU kernels" in got["error"]
    events = json.loads(gzip.open(path, "rt").read())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)


def test_host_events_between_the_decode_launches_per_step():
    """``top_host``: the host's events from the first decode replay's launch to the last one's, per step: the graph
    launches and eager kernel launches of three steps, and one slow Python function in one of them; the prefill's
    launch, the last step's events and GPU kernels are left out."""
    tr = _trace()
    tr["traceEvents"].append({"ph": "X", "cat": "python_function", "name": "scheduler.py(123): schedule", "ts": 2100,
                              "dur": 300})
    tr["traceEvents"].append({"ph": "X", "cat": "cpu_op", "name": "aten::empty", "ts": 4500, "dur": 50})  # after
    got = {h["name"]: (h["category"], h["calls_per_step"], h["us_per_step"])
           for h in profile.summarize_trace(tr)["top_host"]}
    assert got == {"scheduler.py(123): schedule": ("python_function", 0.33, 100.0),
                   "cudaGraphLaunch": ("cuda_runtime", 1.0, 8.0), "cudaLaunchKernel": ("cuda_runtime", 1.0, 4.0)}
    assert list(got)[0] == "scheduler.py(123): schedule"  # the most host time per step first
