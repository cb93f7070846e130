"""Where a decode step's time goes: one engine's decode under ``torch.profiler``, summarised per step
(``qerl bench rollout --profile-tokens N``).

vLLM runs each decode step as one replay of a full CUDA graph (``cudaGraphLaunch``); the kernels of a replay share
the launch's correlation id in the trace. A step is the time from one decode replay's first kernel to the next
one's (GPU clock). Per step the summary gives the median of:

- ``period_ms``: the step, start to start;
- ``replay_span_ms`` / ``replay_busy_ms``: the graph replay's first-to-last extent and the union of its kernels;
- ``outside_busy_ms``: GPU work outside the replay (lm_head, sampling, input copies: vLLM runs these eagerly);
- ``idle_ms``: the step minus all GPU work, i.e. time the GPU waits for the host;
- ``by_category_ms``: GPU time per kernel family (``lora``, ``marlin``, ``w4a16`` for qerl's one-row kernel,
  ``attention``, ``gemm``, ``inductor`` for torch.compile's Triton kernels, ``copy`` for memcpy/memset, ``other``),
  inside and outside the replay;
- ``top_kernels``: the kernels with the most GPU time per step, with calls per step;
- ``top_host``: the host's events between the first and the last decode replay's launch (torch ops, Python
  functions, CUDA runtime calls: what the host does while the GPU waits in ``idle_ms``), by time per step, with
  calls per step. Nested events each count their whole duration, so the times overlap like a profile's
  cumulative column.

Kernel times are the profiler's (CUPTI) and include its small per-kernel overhead; compare engines profiled the
same way, not these times with un-profiled tokens/s."""

from __future__ import annotations

import gzip
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

__all__ = ["CATEGORIES", "category", "profile_call", "summarize_trace"]

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "python_function", "user_annotation", "cuda_runtime", "cuda_driver")
# first match wins; names lower-cased
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("lora", ("lora", "sgmv", "bgmv")),
    ("marlin", ("marlin",)),
    ("w4a16", ("_nvfp4_row_kernel", "_w4a16_kernel")),  # vllm_ext.nvfp4_gemv (decode_gemv)
    ("attention", ("flash", "attn", "fmha", "attention")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "gemv")),
)


def category(name: str, cat: str = "kernel") -> str:
    """The kernel family of a GPU event (see the module docstring)."""
    if cat != "kernel":
        return "copy"
    if name.startswith("triton_"):  # torch.compile's kernels, named after what they fuse ("..._marlin_gemm_2")
        return "inductor"
    low = name.lower()
    for label, keys in CATEGORIES:
        if any(k in low for k in keys):
            return label
    return "other"


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """Total length (ms) of the union of [start, end) intervals given in µs."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total / 1000.0


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 4) if values else float("nan")


def summarize_trace(trace: dict[str, Any], top: int = 15, min_kernels: int = 0) -> dict[str, Any]:
    """Per-step medians of a chrome trace written by ``torch.profiler`` (see the module docstring).

    Decode replays are the graph launches with at least ``min_kernels`` kernels (default: half of the largest
    launch's count, which separates full decode graphs from piecewise prefill pieces). Raises ``ValueError`` when
    the trace has no GPU kernels or fewer than two decode replays."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    if not gpu:
        raise ValueError("the trace has no GPU kernels: was it recorded with ProfilerActivity.CUDA on a GPU?")
    launch_events = {e.get("args", {}).get("correlation"): e for e in events
                     if e.get("ph") == "X" and e.get("name") in ("cudaGraphLaunch", "cuGraphLaunch")}
    launches = set(launch_events) - {None}
    groups: dict[Any, list[dict]] = defaultdict(list)
    for e in gpu:
        corr = e.get("args", {}).get("correlation")
        if corr in launches:
            groups[corr].append(e)
    if not groups:
        raise ValueError("the trace has no CUDA-graph replays: profile an engine with CUDA graphs (enforce_eager=False)")
    largest = max(len(g) for g in groups.values())
    floor = min_kernels or max(2, largest // 2)
    replays = sorted((g for g in groups.values() if len(g) >= floor), key=lambda g: min(e["ts"] for e in g))
    if len(replays) < 2:
        raise ValueError(f"need at least two decode graph replays (>= {floor} kernels each), found {len(replays)}")
    replay_ids = {id(e) for g in replays for e in g}
    starts = [min(e["ts"] for e in g) for g in replays]
    gpu_sorted = sorted(gpu, key=lambda e: e["ts"])

    rows = []
    per_kernel: dict[tuple[str, str, bool], list[float]] = defaultdict(list)  # (name, category, in replay) -> durs
    i_ev = 0
    for k in range(len(replays) - 1):
        t0, t1 = starts[k], starts[k + 1]
        while i_ev < len(gpu_sorted) and gpu_sorted[i_ev]["ts"] < t0:
            i_ev += 1
        j = i_ev
        inside, outside = [], []
        while j < len(gpu_sorted) and gpu_sorted[j]["ts"] < t1:
            e = gpu_sorted[j]
            (inside if id(e) in replay_ids else outside).append(e)
            j += 1
        own = replays[k]
        cats: dict[str, float] = defaultdict(float)
        for e, in_replay in [(e, True) for e in inside] + [(e, False) for e in outside]:
            family = category(e.get("name", ""), e.get("cat"))
            cats[("" if in_replay else "outside:") + family] += e["dur"] / 1000.0
            per_kernel[(e.get("name", "?"), family, in_replay)].append(e["dur"])
        busy_all = _union_ms([(e["ts"], e["ts"] + e["dur"]) for e in inside + outside])
        replay_busy = _union_ms([(e["ts"], e["ts"] + e["dur"]) for e in own])
        rows.append({
            "period_ms": (t1 - t0) / 1000.0,
            "replay_span_ms": (max(e["ts"] + e["dur"] for e in own) - t0) / 1000.0,
            "replay_busy_ms": replay_busy,
            "outside_busy_ms": busy_all - _union_ms([(e["ts"], e["ts"] + e["dur"]) for e in inside]),
            "idle_ms": (t1 - t0) / 1000.0 - busy_all,
            "replay_kernels": len(own),
            "outside_kernels": len(outside),
            "cats": cats,
        })
    steps = len(rows)
    names = sorted({c for r in rows for c in r["cats"]})
    kernels = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]
    # the host's events over the same steps: from the first decode replay's launch to the last one's
    first, last = (launch_events[g[0]["args"]["correlation"]]["ts"] for g in (replays[0], replays[-1]))
    per_host: dict[tuple[str, str], list[float]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in HOST_CATS and first <= e.get("ts", -1) < last:
            per_host[(e.get("name", "?"), e["cat"])].append(e.get("dur", 0.0))
    hosts = sorted(per_host.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "steps": steps,
        "replays_found": len(replays),
        "period_ms": _median([r["period_ms"] for r in rows]),
        "period_min_max_ms": [round(min(r["period_ms"] for r in rows), 4), round(max(r["period_ms"] for r in rows), 4)],
        "replay_span_ms": _median([r["replay_span_ms"] for r in rows]),
        "replay_busy_ms": _median([r["replay_busy_ms"] for r in rows]),
        "outside_busy_ms": _median([r["outside_busy_ms"] for r in rows]),
        "idle_ms": _median([r["idle_ms"] for r in rows]),
        "replay_kernels": int(statistics.median(r["replay_kernels"] for r in rows)),
        "outside_kernels": int(statistics.median(r["outside_kernels"] for r in rows)),
        "by_category_ms": {c: _median([r["cats"].get(c, 0.0) for r in rows]) for c in names},
        "top_kernels": [
            {"name": name[:120], "category": cat, "in_replay": inside, "calls_per_step": round(len(d) / steps, 2),
             "us_per_step": round(sum(d) / steps, 2)}
            for (name, cat, inside), d in kernels
        ],
        "top_host": [
            {"name": name[:120], "category": cat, "calls_per_step": round(len(d) / steps, 2),
             "us_per_step": round(sum(d) / steps, 2)}
            for (name, cat), d in hosts
        ],
    }


def profile_call(fn: Callable[[], Any], trace_path: Path | None = None, top: int = 15) -> dict[str, Any]:
    """Run ``fn`` under ``torch.profiler`` (CPU + CUDA), write the chrome trace to ``trace_path`` (gzip when it
    ends in .gz) and return :func:`summarize_trace` of it (with ``error`` instead when it cannot be summarised)."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    gpu = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
        fn()
        if gpu:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        text = raw.read_text()
        if trace_path is not None:
            trace_path = Path(trace_path)
            trace_path.parent.mkdir(parents=True, exist_ok=True)
            if trace_path.suffix == ".gz":
                with gzip.open(trace_path, "wt") as f:
                    f.write(text)
            else:
                trace_path.write_text(text)
    try:
        return summarize_trace(json.loads(text), top=top)
    except ValueError as exc:
        return {"error": str(exc)}
