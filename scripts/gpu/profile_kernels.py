#!/usr/bin/env python3
"""The NVFP4 kernels under Nsight Compute: what bounds each one (memory, issue, latency, occupancy).

Launches, on 7B shapes with random weights, each kernel ``--calls`` times after one warm-up (Triton compiles on
the first call): the actor's dequant kernel (``verl_ext.kernels``, gate_proj 18 944 x 3 584, bf16 out), vLLM's
Marlin FP4 GEMM at one row (gate_up, 37 888 x 3 584), and the one-row W4A16 kernel as decode_gemv runs it
(``torch.ops.qerl.nvfp4_gemv_row``, same shape). Meant to run under ``ncu``, e.g. (session.sh ``ncu_kernels``):

    ncu --kernel-name regex:'dequant|marlin|row_kernel' --launch-count 16 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \\
        --section LaunchStats --section ComputeWorkloadAnalysis python3 scripts/gpu/profile_kernels.py

Without ncu it prints each kernel's time (CUDA events around one call, median of --calls: the host's launch time
is inside it, so this is an upper bound; ``check_actor_kernels.py`` times the dequant in CUDA graphs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=3, help="timed calls per kernel after the warm-up (default 3)")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("profile_kernels: needs a CUDA GPU", file=sys.stderr)
        return 1
    from qerl_plugin import nvfp4
    from vllm_ext.bench.kernels import marlin_linear
    from verl_ext.kernels import dequantize_nvfp4_triton
    from vllm_ext.nvfp4_gemv import nvfp4_gemv_row

    torch.manual_seed(0)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    gate = nvfp4.quantize((torch.randn(18944, 3584, device=dev) * 0.02).to(bf16))
    n, k = 37888, 3584
    gu = nvfp4.quantize((torch.randn(n, k, device=dev) * 0.02).to(bf16))
    marlin = marlin_linear(gu.packed, gu.scale, gu.global_scale, bf16)
    x = torch.randn(1, k, device=dev, dtype=bf16)
    out = torch.empty(18944, 3584, device=dev, dtype=bf16)
    dq_bytes = gate.packed.numel() + gate.scale.numel() + out.numel() * 2
    kernels = {
        "dequant gate_proj -> bf16": (lambda: dequantize_nvfp4_triton(gate.packed, gate.scale, gate.global_scale,
                                                                      out=out), dq_bytes),
        "marlin gate_up m=1": (lambda: marlin(x), gu.packed.numel() + gu.scale.numel()),
        "row kernel gate_up m=1 (decode_gemv's op)": (lambda: nvfp4_gemv_row(x, gu.packed, gu.scale, gu.global_scale),
                                                      gu.packed.numel() + gu.scale.numel()),
    }
    for name, (fn, nbytes) in kernels.items():
        fn()  # warm-up: compiles the Triton kernels
        torch.cuda.synchronize()
        times = []
        for _ in range(args.calls):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0)
        us = statistics.median(times)
        print(f"{name}: {us:.1f} us (median of {args.calls}, one weight copy: partly L2-resident), "
              f"{nbytes / us / 1e3:.0f} GB/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
