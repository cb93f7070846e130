#!/usr/bin/env python3
"""The one-row kernel (decode_gemv, as shipped: torch.ops.qerl.nvfp4_gemv_row's tiles, PDL off so each launch stands
alone) on the four 7B linears, ``--calls`` launches each, for Nsight Compute. Needs only torch and Triton:

    ncu --kernel-name regex:row_kernel --launch-skip 4 --launch-count 4 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats \\
        --section SchedulerStats --section ComputeWorkloadAnalysis python3 scripts/gpu/ncu_row.py

(the first launch of each linear compiles; ``--launch-skip 4`` skips one round). Without ncu it prints each
linear's time, CUDA events around ``--calls`` launches of the same weights (so not streamed from HBM).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args(argv)

    import torch

    from vllm_ext.nvfp4_gemv import decode_tile, nvfp4_small_gemm

    dev = torch.device("cuda")
    torch.manual_seed(0)
    ops = {}
    for name, (n, k) in SHAPES.items():
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
        scale = (torch.rand(n, k // 16, device=dev) * 2 + 0.25).to(torch.float8_e4m3fn)
        g = torch.tensor([2688.0], device=dev)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        tile = decode_tile(n, k)
        ops[name] = (lambda x=x, packed=packed, scale=scale, g=g, tile=tile:
                     nvfp4_small_gemm(x, packed, scale, g, words=True, xvec=True, **tile))
        print(name, n, k, tile, flush=True)
    for _ in range(args.calls):
        for fn in ops.values():
            fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for name, fn in ops.items():
        start.record()
        for _ in range(20):
            fn()
        end.record()
        end.synchronize()
        print(f"{name}: {start.elapsed_time(end) * 1000 / 20:.2f} us per call (host launches included, weights hot)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
