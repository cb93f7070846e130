#!/usr/bin/env python3
"""The 7B gate/up projection at one row, for Nsight Compute: the shipped row kernel (``decode_tile``'s tile) and
vllm_ext.nvfp4_gluon's register kernel at §4ba's best one-row tile (block_k 256, 4 warps, split-K 4, ``wide``,
``bits``), ``--calls`` launches each. Needs only torch and Triton (docs/benchmarks.md §4ba):

    ncu --kernel-name regex:"row_kernel|gluon_kernel" --launch-skip 2 --launch-count 2 --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \\
        --section LaunchStats python3 scripts/gpu/ncu_gate_up.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2, help="launches of each kernel (default 2)")
    args = p.parse_args(argv)

    import torch

    from qerl_plugin import nvfp4
    from vllm_ext.nvfp4_gemv import decode_tile, nvfp4_small_gemm
    from vllm_ext.nvfp4_gluon import nvfp4_gluon_gemm

    n, k = 37888, 3584
    torch.manual_seed(0)
    q = nvfp4.quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(args.calls):  # the first launch of each compiles
        row = nvfp4_small_gemm(x, q.packed, q.scale, q.global_scale, words=True, xvec=True, **decode_tile(n, k))
    for _ in range(args.calls):
        glu = nvfp4_gluon_gemm(x, q.packed, q.scale, q.global_scale, block_k=256, warps=4, nrep=1, split_k=4,
                               wide=True, bits=True)
    torch.cuda.synchronize()
    print(f"row kernel and Gluon kernel agree within {(row.float() - glu.float()).abs().max().item():.4g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
