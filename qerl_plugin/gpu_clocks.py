"""Is the GPU running at its rated clocks? nvidia-smi samples of memory, SM clock, temperature and the driver's
clock-event reasons around a timed run, and what they say.

On 2026-11-27 an H100 ran a whole end-to-end pair of this project's benchmarks at about half the speed of three other
H100s: under load its SM clock sat at 360-405 MHz of 1 980 at 87 °C with the driver's "SW thermal slowdown" reason
active, and nothing in the run's records said so (docs/benchmarks.md §4x). ``Sampler`` records those fields beside
any run; ``summarize`` tells a GPU that slowed itself down (heat, power brake, a hardware slowdown signal) from one
held at its power limit, which is how a loaded data-centre GPU normally runs; ``problem`` is the line a record
carries then. ``qerl bench rollout`` and the GPU scripts (scripts/gpu/gpu_clocks.py: a check under load) use it.

Imports only the standard library; calls ``nvidia-smi`` where there is one.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import NamedTuple

__all__ = ["FIELDS", "REASONS", "SLOWDOWN", "SLOWDOWN_LIMIT", "Sample", "Sampler", "parse", "problem", "read_csv",
           "reason_names", "reason_shares", "smi_command", "summarize", "visible_gpu"]

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


def reason_shares(summary: dict) -> str:
    """A summary's clock-event reasons with the share of busy samples carrying each ("SW power cap 8%, ..."), or
    "none"."""
    return ", ".join(f"{k} {v:.0%}" for k, v in summary["reasons"].items()) or "none"


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
    return (f"GPU slowed itself down in {summary['slowdown_share']:.0%} of busy samples ({reason_shares(summary)}; "
            f"median SM clock {summary['sm_mhz_median']} of {summary['sm_mhz_rated']} MHz, up to "
            f"{summary['temp_c_max']} C): its timings are not this GPU kind's; run again on another machine")


def visible_gpu(env: dict | None = None) -> int | None:
    """The one GPU a process may use, from CUDA_VISIBLE_DEVICES holding a single index (with
    CUDA_DEVICE_ORDER=PCI_BUS_ID, CUDA's index is nvidia-smi's); None when unset, a list or a UUID."""
    value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES", "").strip()
    return int(value) if value.isdigit() else None


class Sampler:
    """nvidia-smi every ``every`` s in the background, each sample a csv line (time, then FIELDS) in ``path``; keeps
    the peak memory.used (MiB) and the parsed samples. Of ``gpu``, else of GPU 0. Where there is no nvidia-smi, or
    ``every`` is 0, it samples nothing (``available`` False) and writes no file."""

    def __init__(self, path: Path, gpu: int | None = None, every: float = 0.2):
        self.path, self.every, self.peak, self.samples = path, every, 0, []
        self.command = smi_command(gpu)
        self.available = every > 0 and shutil.which("nvidia-smi") is not None
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
        if self.available:
            self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.available:
            self._t.join(timeout=10)
