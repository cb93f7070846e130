#!/usr/bin/env python3
"""Is this GPU running at its rated clocks? A short check under load before timed work.

    python3 scripts/gpu/gpu_clocks.py [--seconds 20] [--gpu N]    # BF16 matmuls for N s while sampling; rc 4: slowed

BF16 8192^3 matmuls for ``--seconds`` while nvidia-smi samples the card (qerl_plugin.gpu_clocks), then a 2 GiB device
copy. Prints one JSON line (busy samples' median SM clock, peak temperature, the share of busy samples with each
clock-event reason, the matmul's TFLOP/s and the copy's GB/s) and ends with rc 4 where the GPU slowed itself down (a
thermal, power-brake or hardware slowdown reason in more than 5 % of its busy samples): take another machine. On
2026-11-27 an H100 in that state did 188-274 TFLOP/s at 360-405 MHz and 87 °C, a healthy one 678 TFLOP/s
(docs/benchmarks.md §4x). Needs torch and a CUDA GPU; runs without the rest of the stack.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # qerl_plugin from this checkout when not installed
from qerl_plugin.gpu_clocks import Sampler, problem  # noqa: E402


def cuda_out(prog: str, out: Path | None) -> Path | None:
    """The output folder (``out``, else $OUT, else .), made; None, with a line saying so, where there is no CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        print(f"{prog}: needs a CUDA GPU (run it on the GPU machine)", file=sys.stderr)
        return None
    out = out or Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    return out


def check(seconds: float, gpu: int | None, out: Path) -> dict:
    """BF16 8192^3 matmuls for ``seconds`` while sampling, then a 2 GiB device copy: clocks under load, TFLOP/s,
    GB/s."""
    import torch

    dev = torch.device("cuda", 0)  # CUDA_VISIBLE_DEVICES picks the card; --gpu names it for nvidia-smi
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    with Sampler(out / "gpu_clocks.csv", gpu) as smp:
        t0, count = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            for _ in range(10):
                a @ b
            count += 10
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device=dev)
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    for _ in range(20):
        y.copy_(x)
    torch.cuda.synchronize()
    copy_s = time.perf_counter() - t1
    return {"gpu": torch.cuda.get_device_name(dev), "seconds": round(dt, 1),
            "matmul_tflops": round(2 * n**3 * count / dt / 1e12, 1),
            "copy_gb_s": round(2 * x.numel() * x.element_size() * 20 / copy_s / 1e9),
            **smp.summary()}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="how long to load the GPU while sampling (default 20)")
    ap.add_argument("--gpu", type=int, default=None, help="nvidia-smi's index of the card to sample (default: GPU 0)")
    ap.add_argument("--out", type=Path, default=None, help="folder for gpu_clocks.csv and .json (default: $OUT or .)")
    args = ap.parse_args(argv)
    if args.seconds <= 0:
        ap.error(f"--seconds must be positive, got {args.seconds}")
    out = cuda_out("gpu_clocks", args.out)
    if out is None:
        return 1
    rec = check(args.seconds, args.gpu, out)
    msg = problem(rec)
    rec["problem"] = msg
    (out / "gpu_clocks.json").write_text(json.dumps(rec) + "\n")
    print(json.dumps(rec))
    if msg:
        print(f"gpu_clocks: {msg}", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
