#!/usr/bin/env python3
"""The one-row kernel (decode_gemv, as shipped: torch.ops.qerl.nvfp4_gemv_row's tiles, PDL off so each launch stands
alone) on the four 7B linears, ``--calls`` launches each, for Nsight Compute. Needs only torch and Triton:

    ncu --kernel-name regex:row_kernel --launch-skip 4 --launch-count 4 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats \\
        --section SchedulerStats --section ComputeWorkloadAnalysis python3 scripts/gpu/ncu_row.py

(the first launch of each linear compiles; ``--launch-skip 4`` skips one round). Without ncu it prints each
linear's time, CUDA events around ``--calls`` launches of the same weights (so not streamed from HBM).

``--shared``: ``decode_gemv: "shared"``'s kernel instead (``vllm_ext.nvfp4_marlin_row``, on Marlin's tensors made by
the engine's backend, so vLLM is needed; its tiles: ``QERL_MARLIN_ROW_TILES``'s file where set, else the shipped
rule; ``--asum 0-4``: that ``asum`` form in place of the tiles'), for
``ncu --kernel-name regex:marlin_row_kernel`` (docs/benchmarks.md §4ah: what binds it, the instruction count by the
estimate there, or its reads).
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
    from vllm_ext.nvfp4_marlin_row import ASUM_FORMS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--shared", action="store_true", help="the kernel on Marlin's own tensors (decode_gemv shared)")
    p.add_argument("--asum", type=int, choices=ASUM_FORMS, default=None,
                   help="with --shared: this asum form instead of the tile's")
    args = p.parse_args(argv)

    import torch

    from vllm_ext.nvfp4_gemv import decode_tile, nvfp4_small_gemm

    if args.shared:
        return _shared(args.calls, args.asum)

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
    _timed(ops, args.calls)
    return 0


def _timed(ops: dict, calls: int) -> None:
    """``calls`` rounds of every op (compiles, warms up), then each op's time per call from CUDA events."""
    import torch

    for _ in range(calls):
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


def _shared(calls: int, asum: int | None) -> int:
    """``--shared``: the Marlin-layout kernel on the four 7B linears, random NVFP4 weights through the backend's
    ``MarlinBackend._marlin``, ``marlin_row_tile``'s tile (``asum`` replaced where given), PDL off."""
    import torch

    from qerl_plugin import nvfp4
    from vllm_ext.bench.kernels import marlin_layer
    from vllm_ext.nvfp4_marlin_row import marlin_divisor, marlin_row_gemm, marlin_row_tile

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    ops = {}
    for name, (n, k) in SHAPES.items():
        q = nvfp4.quantize((torch.randn(n, k, device=dev) * 0.02).to(bf16))
        m = marlin_layer(q.packed, q.scale, q.global_scale, bf16)
        d = marlin_divisor(m.weight_global_scale.data, bf16)
        x = torch.randn(1, k, device=dev, dtype=bf16)
        tile = marlin_row_tile(n, k)
        if asum is not None:
            tile["asum"] = asum
        ops[name] = (lambda x=x, m=m, d=d, tile=tile: marlin_row_gemm(x, m.weight, m.weight_scale, d, **tile))
        print(name, n, k, tile, flush=True)
    _timed(ops, calls)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
