#!/usr/bin/env python3
"""Does sampling the GPU with nvidia-smi (qerl_plugin.gpu_clocks.Sampler) slow a decode-like workload?

A stand-in for a 7B batch-1 decode step, torch only: one CUDA graph of the Qwen2.5-7B linears at one row (q/k/v,
o, gate/up, down, x 28 layers, BF16 weights, ~14 GiB streamed per replay), replayed back to back in windows of
``--window`` seconds. The windows rotate through the sampler off, every 1 s (``qerl bench rollout``'s default) and
every 0.2 s (the verl pair's), ``--rounds`` times; each window's ms per replay is recorded. Prints one JSON line per
window and a summary: per setting the median over windows and the spread ((max - min) / median), and each sampled
setting's cost against off.

    python3 scripts/gpu/clock_poll_cost.py [--window 4] [--rounds 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # qerl_plugin from this checkout when not installed
from qerl_plugin.gpu_clocks import Sampler  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_clocks import cuda_out  # noqa: E402  (scripts/gpu/gpu_clocks.py)

# Qwen2.5-7B: hidden 3584, intermediate 18944, 28 heads of 128, 4 KV heads, 28 layers; (in, out) per linear
LINEARS_7B = ((3584, 4608), (3584, 3584), (3584, 37888), (18944, 3584))
LAYERS_7B = 28
SETTINGS = (("off", 0.0), ("every 1 s", 1.0), ("every 0.2 s", 0.2))


def summarize(windows: list[dict]) -> dict:
    """Per setting: the median of its windows' ms per replay, their spread, and (sampled settings) the cost against
    off: (median - off's) / off's, with no verdict where either spread reaches it."""
    out = {}
    for name, _ in SETTINGS:
        ms = sorted(w["ms_per_replay"] for w in windows if w["setting"] == name)
        if ms:
            med = statistics.median(ms)
            out[name] = {"median_ms": round(med, 4), "spread": round((ms[-1] - ms[0]) / med, 4), "windows": len(ms)}
    base = out.get("off")
    for name, _ in SETTINGS[1:]:
        if base and name in out:
            cost = out[name]["median_ms"] / base["median_ms"] - 1
            out[name]["cost_vs_off"] = round(cost, 4)
            out[name]["verdict"] = ("no verdict" if abs(cost) <= max(out[name]["spread"], base["spread"])
                                    else ("slower" if cost > 0 else "faster"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=float, default=4.0, help="seconds of replays per window (default 4)")
    ap.add_argument("--rounds", type=int, default=4, help="windows per setting (default 4)")
    ap.add_argument("--out", type=Path, default=None, help="folder for clock_poll_cost.jsonl (default $OUT or .)")
    args = ap.parse_args(argv)
    if args.window <= 0 or args.rounds < 1:
        ap.error(f"--window must be positive and --rounds >= 1 (got {args.window}, {args.rounds})")
    out = cuda_out("clock_poll_cost", args.out)
    if out is None:
        return 1
    import torch

    dev = torch.device("cuda", 0)
    weights = [torch.randn(o, i, device=dev, dtype=torch.bfloat16) * 0.02
               for _ in range(LAYERS_7B) for i, o in LINEARS_7B]
    xs = {i: torch.randn(1, i, device=dev, dtype=torch.bfloat16) for i, _ in LINEARS_7B}
    ys = [None] * len(weights)

    def step():
        for k, w in enumerate(weights):
            ys[k] = torch.nn.functional.linear(xs[w.shape[1]], w)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    log = (out / "clock_poll_cost.jsonl").open("w")
    gib = sum(w.numel() * w.element_size() for w in weights) / 2**30
    log.write(json.dumps({"step": "env", "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                          "weights_gib": round(gib, 2), "launches": len(weights)}) + "\n")
    windows = []
    for r in range(args.rounds):
        for name, every in SETTINGS:
            with Sampler(out / f"smi-{r}-{every}.csv", every=every) as smp:
                torch.cuda.synchronize()
                t0, n = time.perf_counter(), 0
                while time.perf_counter() - t0 < args.window:
                    for _ in range(20):
                        graph.replay()
                    n += 20
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
            w = {"step": "window", "round": r, "setting": name, "replays": n, "ms_per_replay": round(dt / n * 1e3, 4),
                 "samples": len(smp.samples), "clocks": smp.summary()}
            windows.append(w)
            log.write(json.dumps(w) + "\n")
            log.flush()
            print(json.dumps({k: v for k, v in w.items() if k != "clocks"}), flush=True)
    summary = summarize(windows)
    log.write(json.dumps({"step": "summary", **summary}) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
