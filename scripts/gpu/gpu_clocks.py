#!/usr/bin/env python3
"""Is this GPU running at its rated clocks? A short check under load before timed work.

    python3 scripts/gpu/gpu_clocks.py [--seconds 20] [--gpu N]    # BF16 matmuls for N s while sampling; rc 4: slowed
    python3 scripts/gpu/gpu_clocks.py --gpu all                   # every GPU of the host at once, one process each

BF16 8192^3 matmuls for ``--seconds`` while nvidia-smi samples the card (qerl_plugin.gpu_clocks), then a 2 GiB device
copy. Prints one JSON line (busy samples' median SM clock, peak temperature, the share of busy samples with each
clock-event reason, the matmul's TFLOP/s and the copy's GB/s) and ends with rc 4 where the GPU slowed itself down (a
thermal, power-brake or hardware slowdown reason in more than 5 % of its busy samples): take another machine. On
2026-11-27 an H100 in that state did 188-274 TFLOP/s at 360-405 MHz and 87 °C, a healthy one 678 TFLOP/s
(docs/benchmarks.md §4x). ``--gpu all`` checks every card nvidia-smi lists at the same time (a two-GPU pair runs both
arms at once, so both cards heat together), each in its own process with CUDA_VISIBLE_DEVICES of its card in PCI order
and its files in <out>/gpu<N>/; rc 4 where any card slowed. Needs torch and a CUDA GPU; runs without the rest of the
stack.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # qerl_plugin from this checkout when not installed
from qerl_plugin.gpu_clocks import Sampler, problem  # noqa: E402


def out_folder(out: Path | None) -> Path:
    """The output folder: ``out``, else $OUT, else the current one."""
    return out or Path(os.environ.get("OUT", "."))


def cuda_out(prog: str, out: Path | None) -> Path | None:
    """The output folder (``out_folder``), made; None, with a line saying so, where there is no CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        print(f"{prog}: needs a CUDA GPU (run it on the GPU machine)", file=sys.stderr)
        return None
    out = out_folder(out)
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


def gpu_indices() -> list[int] | None:
    """nvidia-smi's indices of the host's GPUs; None, with a line saying so, where nvidia-smi is missing or fails."""
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"gpu_clocks: --gpu all needs nvidia-smi to list the GPUs ({exc})", file=sys.stderr)
        return None
    if res.returncode != 0:
        print(f"gpu_clocks: --gpu all: nvidia-smi failed (rc {res.returncode}): {res.stderr.strip()}", file=sys.stderr)
        return None
    return [int(x) for x in res.stdout.split() if x.strip().isdigit()]


def check_all(seconds: float, out: Path | None) -> int:
    """One check per GPU, all at once, each alone on its card; every child's lines prefixed with its card. rc 4 where
    any card slowed itself down, else the worst other rc (0 where all passed)."""
    gpus = gpu_indices()
    if not gpus:
        if gpus == []:
            print("gpu_clocks: --gpu all: nvidia-smi lists no GPU", file=sys.stderr)
        return 1
    base = out_folder(out)
    procs = []
    for i in gpus:
        env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": str(i)}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--seconds", str(seconds), "--gpu", str(i),
               "--out", str(base / f"gpu{i}")]
        procs.append((i, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    rcs = []
    for i, proc in procs:
        text, _ = proc.communicate()
        for line in text.splitlines():
            print(f"[gpu {i}] {line}")
        print(f"[gpu {i}] rc {proc.returncode}")
        rcs.append(proc.returncode)
    return 4 if 4 in rcs else max(rcs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="how long to load the GPU while sampling (default 20)")
    ap.add_argument("--gpu", default=None,
                    help="nvidia-smi's index of the card to sample (default: GPU 0), or 'all': every card at once")
    ap.add_argument("--out", type=Path, default=None, help="folder for gpu_clocks.csv and .json (default: $OUT or .)")
    args = ap.parse_args(argv)
    if args.seconds <= 0:
        ap.error(f"--seconds must be positive, got {args.seconds}")
    if args.gpu == "all":
        return check_all(args.seconds, args.out)
    if args.gpu is not None and not str(args.gpu).isdigit():
        ap.error(f"--gpu takes a GPU's index (0, 1, ...) or 'all', got {args.gpu!r}")
    gpu = None if args.gpu is None else int(args.gpu)
    out = cuda_out("gpu_clocks", args.out)
    if out is None:
        return 1
    rec = check(args.seconds, gpu, out)
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
