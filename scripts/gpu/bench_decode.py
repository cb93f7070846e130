#!/usr/bin/env python3
"""The one-row kernels with their E2M1 decode through FP8 (``QERL_ROW_DECODE=fp8``, the default on sm_89 and later
since docs/benchmarks.md §4ba) against the float16 bit moves before it (``f16``), as the engine calls them: the row
kernel on the checkpoint's layout (``torch.ops.qerl.nvfp4_gemv_row``, decode_gemv ``all``) and the kernel on Marlin's
tensors (``nvfp4_marlin_row``, decode_gemv ``shared``, the default on Hopper; its tensors built by marlin_pack), each
at its shipped tile, on the linears of the 7B and 32B decode steps with the weights streamed from HBM. Needs only
torch and Triton:

    PYTHONPATH=. python3 scripts/gpu/bench_decode.py [--shapes 7B,32B] [--reps 5]

Per linear: both decodes' outputs compared bit for bit (they must be equal), then the four CUDA graphs (2 kernels x 2
decodes) timed ``--reps`` times, interleaved. Writes $OUT/bench_decode.jsonl and prints per-linear and per-step
tables ("faster" where the medians differ by more than both spreads).

From §4bc to §4bk it also timed ``row_hfma2`` and ``row_hfma2-unguarded``, the row op with its products in float16
pairs; that decode was removed after it failed the real-model check (docs/benchmarks.md §4bk), and with it those
columns (their runs' raw files keep them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "scripts" / "gpu"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from check_gemv import (  # noqa: E402
    LINEARS, add_linear_args, decode_env, fp8_decode_device, jsonl_recorder, step_lines, streamed_weight,
    timed_interleaved, verdict)

KEYS = ("row_f16", "row_fp8", "shared_f16", "shared_fp8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_linear_args(p, "7B,32B")
    args = p.parse_args(argv)

    import torch

    dev = fp8_decode_device("bench_decode")
    if dev is None:
        return 1
    import triton

    from vllm_ext.bench.kernels import capture_graph
    from vllm_ext.bench.marlin_pack import marlin_pack
    from vllm_ext.nvfp4_gemv import nvfp4_gemv_row
    from vllm_ext.nvfp4_marlin_row import nvfp4_marlin_row

    bf16 = torch.bfloat16
    record = jsonl_recorder(args.out, "bench_decode.jsonl")
    record({"what": "setup", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "cold_mib": args.cold_mib, "shapes": args.shapes})
    finals: list[dict[str, Any]] = []
    unequal = 0
    for shape in args.shapes.split(","):
        for lname in args.linears.split(","):
            k, n = LINEARS[shape][lname]
            _, q, raw_bytes, raws = streamed_weight(n, k, args.cold_mib, dev)
            packs = [marlin_pack(p_, s_, q.global_scale)[:2] for p_, s_ in raws]
            div = marlin_pack(q.packed, q.scale, q.global_scale)[2]
            x = torch.randn(1, k, device=dev, dtype=bf16)
            gs = q.global_scale.reshape(1).float()
            iters = max(args.iters, len(raws))

            def row(p_, s_):  # noqa: ANN001, ANN202
                return nvfp4_gemv_row(x, p_, s_, gs)

            def shared(p_, s_):  # noqa: ANN001, ANN202
                return nvfp4_marlin_row(x, p_, s_, div)

            graphs, outs = {}, {}
            for key in KEYS:
                kernel, decode = key.split("_")
                fn, copies = (row, raws) if kernel == "row" else (shared, packs)
                with decode_env(decode):  # read at each launch: the graph keeps the kernel it captured
                    outs[key] = fn(*copies[0])
                    graphs[key] = (capture_graph([(lambda a=a, b=b, fn=fn: fn(a, b)) for a, b in copies], iters),
                                   iters)
            same = {kernel: bool(torch.equal(outs[f"{kernel}_f16"], outs[f"{kernel}_fp8"]))
                    for kernel in ("row", "shared")}
            unequal += sum(not v for v in same.values())
            res = timed_interleaved(graphs, args.reps)
            del graphs
            fin = {"what": "final", "shape": shape, "linear": lname, "n": n, "k": k, "nvfp4_bytes": raw_bytes,
                   "same_bits": same, **res,
                   "row_fp8_vs_f16": verdict(res["row_fp8"], res["row_f16"]),
                   "shared_fp8_vs_f16": verdict(res["shared_fp8"], res["shared_f16"]),
                   "gb_s": {key: round(raw_bytes / res[key]["median_us"] / 1e3, 1) for key in KEYS}}
            record(fin)
            finals.append(fin)
            del raws, packs
            torch.cuda.empty_cache()

    cell = lambda r: f"{r['median_us']:>8.2f} ±{r['spread_us']:<5.2f}"  # noqa: E731
    lines = ["", "one-row kernels, float16 decode (f16) against the decode through FP8 (fp8): µs per call, median of "
             f"{args.reps} (spread)", f"{'shape':<5} {'linear':<8}" + "".join(f"{key:>16}" for key in KEYS)
             + "  row fp8 / shared fp8 vs f16, same bits"]
    for f in finals:
        lines.append(f"{f['shape']:<5} {f['linear']:<8}" + "".join(cell(f[key]) for key in KEYS)
                     + f"  {f['row_fp8_vs_f16']} / {f['shared_fp8_vs_f16']}, {f['same_bits']}")
    lines += step_lines(finals, args.shapes, args.linears, KEYS, record)
    lines.append(f"outputs that differ between the two decodes: {unequal}")
    print("\n".join(lines), flush=True)
    return 1 if unequal else 0


if __name__ == "__main__":
    raise SystemExit(main())
