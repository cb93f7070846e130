#!/usr/bin/env python3
"""Is this GPU running at its rated clocks? nvidia-smi samples of SM clock, temperature and the driver's clock-event
reasons, summarized for a timed run; and a short check under load before one.

On 2026-11-27 (twenty-second session, docs/benchmarks.md §4x) an H100 ran a whole end-to-end pair at about half the
speed of three other H100s: under a BF16 matmul its SM clock sat at 360-405 MHz of 1980 at 87 °C with the driver's
"SW thermal slowdown" reason active. Nothing in the run's own records said so. This module is what says so now:

    python3 scripts/gpu/gpu_clocks.py [--seconds 20] [--gpu N]    # BF16 matmuls for N s while sampling; rc 4: slowed

prints one JSON line (busy samples' median SM clock, peak temperature, the share of busy samples with each reason,
the matmul's TFLOP/s and a device copy's GB/s) and ends with rc 4 where the GPU slowed itself down (a thermal,
power-brake or hardware slowdown reason in more than ``SLOWDOWN_LIMIT`` of its busy samples): take another machine.
``Sampler`` does the same sampling around any run (verl_7b_memory_step.py's arms) and keeps the device's peak
memory.used as before.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

# nvidia-smi --query-gpu fields, in the order of a sample (csv, noheader, nounits)
FIELDS = ("memory.used", "clocks.sm", "clocks.max.sm", "temperature.gpu", "clocks_event_reasons.active")
# NVML's clock-event reason bits (nvmlClocksEventReason*, nvml.h), by the names nvidia-smi -q prints
REASONS = {
    0x1: "idle",
    0x2: "applications clocks setting",
    0x4: "SW power cap",
    0x8: "HW slowdown",
    0x10: "sync boost",
    0x20: "SW thermal slowdown",
    0x40: "HW thermal slowdown",
    0x80: "HW power brake slowdown",
    0x100: "display clock setting",
}
IDLE = 0x1
# The reasons that mean the GPU is slowing itself down (heat, power brake, a hardware signal), as opposed to a busy
# GPU held at its power limit (SW power cap), which is how a loaded H100 normally runs
SLOWDOWN = 0x8 | 0x20 | 0x40 | 0x80
# A run counts as slowed where more than this share of its busy samples carry a SLOWDOWN reason (set after §4x's slowed
# pair, before the first run that used it)
SLOWDOWN_LIMIT = 0.05


class Sample(NamedTuple):
    used_mib: int
    sm_mhz: int
    max_mhz: int
    temp_c: int
    reasons: int


def smi_command(gpu: int | None) -> list[str]:
    """The sampling query: of ``gpu`` alone, or of every GPU (the first line is GPU 0's)."""
    return ["nvidia-smi", *([f"--id={gpu}"] if gpu is not None else []), f"--query-gpu={','.join(FIELDS)}",
            "--format=csv,noheader,nounits"]  # fmt: skip


def parse(line: str) -> Sample | None:
    """One line of ``smi_command``'s output; None for anything else ("[N/A]", an error, a blank)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(FIELDS):
        return None
    try:
        return Sample(*(int(p) for p in parts[:4]), int(parts[4], 16))
    except ValueError:
        return None


def reason_names(bits: int) -> list[str]:
    return [name for bit, name in REASONS.items() if bits & bit] or ["none"]


def read_csv(path: Path) -> list[Sample]:
    """The samples of a ``Sampler`` csv (each line: time, then FIELDS)."""
    rows = (parse(line.split(",", 1)[1]) for line in Path(path).read_text().splitlines() if "," in line)
    return [r for r in rows if r is not None]


def summarize(samples: list[Sample], limit: float = SLOWDOWN_LIMIT) -> dict:
    """What the samples say about the clocks while the GPU was busy (idle samples left out): median SM clock against
    the rated maximum, peak temperature, the share of busy samples carrying each reason, and whether the GPU slowed
    itself down in more than ``limit`` of them."""
    busy = [s for s in samples if not s.reasons & IDLE]
    out = {"samples": len(samples), "busy": len(busy), "temp_c_max": max((s.temp_c for s in samples), default=None)}
    if not busy:
        return {**out, "sm_mhz_median": None, "sm_mhz_rated": None, "reasons": {}, "slowdown_share": None,
                "slowed": False}  # fmt: skip
    share = lambda mask: round(sum(1 for s in busy if s.reasons & mask) / len(busy), 3)
    slowdown = share(SLOWDOWN)
    return {**out, "sm_mhz_median": statistics.median(s.sm_mhz for s in busy),
            "sm_mhz_rated": max(s.max_mhz for s in busy),
            "reasons": {name: share(bit) for bit, name in REASONS.items() if bit != IDLE and share(bit) > 0},
            "slowdown_share": slowdown, "slowed": slowdown > limit}  # fmt: skip


def problem(summary: dict) -> str | None:
    """The line a run's record carries where its GPU slowed itself down; None where it did not."""
    if not summary.get("slowed"):
        return None
    named = ", ".join(f"{k} {v:.0%}" for k, v in summary["reasons"].items())
    return (f"GPU slowed itself down in {summary['slowdown_share']:.0%} of busy samples ({named}; median SM clock "
            f"{summary['sm_mhz_median']} of {summary['sm_mhz_rated']} MHz, up to {summary['temp_c_max']} C): its "
            f"timings are not this GPU kind's; run again on another machine")


class Sampler:
    """nvidia-smi every ``every`` s in the background, each sample a csv line (time, then FIELDS) in ``path``; keeps
    the peak memory.used (MiB) and the parsed samples. Of ``gpu``, else of GPU 0."""

    def __init__(self, path: Path, gpu: int | None = None, every: float = 0.2):
        self.path, self.every, self.peak, self.samples = path, every, 0, []
        self.command = smi_command(gpu)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with open(self.path, "w") as fh:
            while not self._stop.is_set():
                try:
                    lines = subprocess.run(self.command, capture_output=True, text=True, timeout=5).stdout.splitlines()
                    s = parse(lines[0]) if lines else None
                    if s is not None:
                        self.samples.append(s)
                        self.peak = max(self.peak, s.used_mib)
                        fh.write(f"{time.time():.1f},{','.join(map(str, s[:4]))},{s.reasons:#x}\n")
                except Exception:
                    pass
                self._stop.wait(self.every)

    def summary(self) -> dict:
        return summarize(self.samples)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(timeout=10)


def check(seconds: float, gpu: int | None, out: Path | None) -> dict:
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
    path = (out or Path(".")) / "gpu_clocks.csv"
    with Sampler(path, gpu) as smp:
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
    import os

    import torch

    if not torch.cuda.is_available():
        print("gpu_clocks: needs a CUDA GPU (run it on the GPU machine)", file=sys.stderr)
        return 1
    out = args.out or Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
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
