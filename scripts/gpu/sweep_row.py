#!/usr/bin/env python3
"""GPU sweep of decode_gemv's one-row NVFP4 kernel (``vllm_ext.nvfp4_gemv``, ``words=True, xvec=True``, PTX
decode) over its tiles and the depth of its software-pipelined loop (``stages``; 0 is the kernel of §4j-§4m), on
the linears of the 7B and 32B decode steps, with the weights streamed from HBM. Needs only torch and Triton (no
vLLM): run from the repository root on the GPU machine,

    PYTHONPATH=. python3 scripts/gpu/sweep_row.py [--shapes 7B,32B] [--reps 5] [--kernel row|tma]

For each linear:
  1. every tile of the sweep (block_n x split_k x warps x stages, block_k 512) runs once and is checked against the
     float64 product with the exact (dequantized) weight: within the bf16 output's rounding (2^-8 relative, plus
     1e-4 of the largest value), and the same bits on a second call. Only correct tiles are timed.
  2. each correct tile is timed once: ``--iters`` calls in one CUDA graph, cycling through enough weight copies that
     one pass reads >= ``--cold-mib`` MiB (so the weights come from HBM, not the 50 MB L2).
  3. the fastest tile, the shipped tile (``decode_tile``) and §4m's tile unpipelined (the kernel measured in §4m,
     ``check_gemv.tile_4m``; "stages0" in the log) are timed ``--reps`` times each, interleaved: median and spread
     (max - min). Per decode step: the medians summed over the four linears times the layer count.

``--kernel tma`` sweeps ``vllm_ext.nvfp4_gemv_tma`` instead (the weight's tiles brought in by TMA; block_k from
``--block-k``, stages 1 or more), and step 3's "best" is its fastest tile, timed beside the same two row-kernel tiles
(docs/benchmarks.md §4ba).

"Faster" where the difference of the medians exceeds both spreads (the rule of docs/benchmarks.md). Writes
$OUT/sweep_row.jsonl (one JSON object per measurement) and prints the tables.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "scripts" / "gpu"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from check_gemv import (  # noqa: E402
    LAYERS, LINEARS, add_linear_args, jsonl_recorder, shape_steps, streamed_weight, tile_4m, tile_name,
    timed_interleaved, verdict)


def sweep_tiles(block_ns: list[int], splits: list[int], warps: list[int], stages: list[int]) -> list[dict[str, Any]]:
    """The one-row kernel's tiles tried (block_k 512, as every earlier sweep chose)."""
    return [dict(block_n=bn, block_k=512, split_k=sk, num_warps=w, stages=st, words=True, asm=True, xvec=True)
            for st, bn, sk, w in itertools.product(stages, block_ns, splits, warps)]


def tma_tiles(block_ns: list[int], block_ks: list[int], splits: list[int], warps: list[int],
              stages: list[int]) -> list[dict[str, Any]]:
    """vllm_ext.nvfp4_gemv_tma's tiles tried (its pipeline is at least one stage deep)."""
    return [dict(block_n=bn, block_k=bk, split_k=sk, num_warps=w, stages=st, tma=True)
            for st, bk, bn, sk, w in itertools.product(stages, block_ks, block_ns, splits, warps) if st >= 1]


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def run_tile(x, packed, scale, gscale, t: dict[str, Any]):  # noqa: ANN001, ANN201
    """One call of the kernel a sweep tile names: vllm_ext.nvfp4_gluon's (``gluon`` set: ``block_k``, ``num_warps``,
    ``split_k``, ``prefetch``, ``wide``, ``bits``, ``wgmma`` and ``block_n`` = 16 x warps x its ``nrep``; with
    ``marlin``, its version on Marlin's tensors, ``packed``/``scale``/``gscale`` then Marlin's ``qweight``, scale bytes
    and divisor), ``nvfp4_gemv_row_tma`` (``tma`` set) or ``nvfp4_small_gemm`` with the tile's options."""
    if t.get("tma"):
        from vllm_ext.nvfp4_gemv_tma import nvfp4_gemv_row_tma

        return nvfp4_gemv_row_tma(x, packed, scale, gscale, block_n=t["block_n"], block_k=t["block_k"],
                                  split_k=t["split_k"], num_warps=t["num_warps"], stages=t["stages"])
    if t.get("marlin"):
        from vllm_ext.nvfp4_gluon_marlin import nvfp4_gluon_marlin_gemm

        return nvfp4_gluon_marlin_gemm(x, packed, scale, gscale, block_k=t["block_k"], warps=t["num_warps"],
                                       nrep=t["block_n"] // (16 * t["num_warps"]), split_k=t["split_k"])
    if t.get("gluon"):
        from vllm_ext.nvfp4_gluon import nvfp4_gluon_gemm

        return nvfp4_gluon_gemm(x, packed, scale, gscale, block_k=t["block_k"], warps=t["num_warps"],
                                nrep=t["block_n"] // (16 * t["num_warps"]), split_k=t["split_k"],
                                prefetch=t.get("prefetch", False), wide=t.get("wide", False),
                                bits=t.get("bits", False), wgmma=t.get("wgmma", False))
    from vllm_ext.nvfp4_gemv import nvfp4_small_gemm

    return nvfp4_small_gemm(x, packed, scale, gscale, **t)


def _compile(tiles: list[dict[str, Any]], rows: int = 1) -> int:
    """Run each tile once on a small 7B-like call with ``rows`` rows of ``x``, in a worker process: Triton compiles
    it into its on-disk cache, which the sweep then finds (every linear swept has N and K divisible by 16, so one
    compiled kernel per tile and row block). Returns how many failed (the sweep records why)."""
    import torch

    dev = torch.device("cuda")
    packed = torch.randint(0, 256, (4608, 1792), dtype=torch.uint8, device=dev)
    scale = torch.ones(4608, 224, device=dev).to(torch.float8_e4m3fn)
    x = torch.randn(rows, 3584, device=dev, dtype=torch.bfloat16)
    qweight = torch.randint(-2**31, 2**31 - 1, (224, 9216), dtype=torch.int32, device=dev)  # Marlin's, for marlin tiles
    failed = 0
    for t in tiles:
        try:
            if t.get("marlin"):
                run_tile(x, qweight, scale.t().contiguous(), torch.ones(1, device=dev), t)
            else:
                run_tile(x, packed, scale, torch.ones(1, device=dev), t)
        except Exception:  # noqa: BLE001 (the sweep itself records the error)
            failed += 1
    torch.cuda.synchronize()
    return failed


def failures_in_pool(compile_chunk, tiles: list[dict[str, Any]], jobs: int) -> int:  # noqa: ANN001
    """``compile_chunk`` (a picklable function of a list of tiles, returning how many failed) over ``tiles`` dealt to
    ``jobs`` spawned processes at once (one Triton compile takes ~1 s of one core): the failures summed."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    chunks = [tiles[i::jobs] for i in range(jobs)]
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return sum(pool.map(compile_chunk, chunks))


def precompile(tiles: list[dict[str, Any]], jobs: int, rows: int = 1) -> None:
    """Compile the sweep's kernels for ``rows`` rows of ``x`` in ``jobs`` processes at once."""
    import functools

    failed = failures_in_pool(functools.partial(_compile, rows=rows), tiles, jobs)
    print(json.dumps({"what": "precompiled", "tiles": len(tiles), "rows": rows, "jobs": jobs, "failed": failed}),
          flush=True)


def add_sweep_args(p: argparse.ArgumentParser, shapes: str, block_n: str, warps: str) -> None:
    """The options sweep_row.py and sweep_mma.py share (their defaults for shapes, block_n and warps differ)."""
    add_linear_args(p, shapes)
    p.add_argument("--block-n", default=block_n, help=f"output features per program (default {block_n})")
    p.add_argument("--split-k", default="1,2,4,8", help="programs per output block (default 1,2,4,8)")
    p.add_argument("--warps", default=warps, help=f"warps per program (default {warps})")
    p.add_argument("--stages", default="0,2,3,4", help="pipeline depths; 0 = not pipelined (default 0,2,3,4)")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                   help="processes compiling the kernels before the sweep (default: up to 16; 1: none)")


def try_tiles(tiles: list[dict[str, Any]], call, exact, time_us, record, base: dict[str, Any]):  # noqa: ANN001
    """Each tile once: ``call(tile)`` twice against the float64 product ``exact`` (within the bf16 output's rounding,
    2^-8 relative, plus 1e-4 of the largest value; the same bits twice), then ``time_us(tile)`` for a correct one.
    Records one row per tile (``base`` plus the findings); returns the correct tiles as ``[(us, tile)]``, fastest
    first, and how many were refused for their error or bits."""
    import torch

    floor = 1e-4 * exact.abs().max().item()
    swept, bad = [], 0
    for t in tiles:
        row: dict[str, Any] = {"what": "tile", **base, "tile": tile_name(t)}
        try:
            y1, y2 = call(t), call(t)
            excess = ((y1.double() - exact).abs() - 2.0**-8 * exact.abs()).max().item()
            row.update(excess=excess, repeat_identical=torch.equal(y1, y2))
            row["ok"] = excess <= floor and row["repeat_identical"]
            if row["ok"]:
                row["us"] = round(time_us(t), 2)
                swept.append((row["us"], t))
            else:
                bad += 1
        except Exception as exc:  # one tile that does not compile or fit must not hide the others
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        record(row, echo=False)
    swept.sort(key=lambda s: s[0])
    return swept, bad


def decode_step_lines(finals: list[dict[str, Any]], shapes: str, linears: str,
                      record: Callable[..., None]) -> list[str]:
    """For each of ``shapes`` whose ``linears`` all finished in ``finals``: its decode step over the fastest, the
    shipped and §4m's tiles (:func:`check_gemv.shape_steps`), recorded as a ``per_step_ms`` row, and a line describing
    it."""
    lines = []
    for shape, _, step, spread in shape_steps(finals, shapes, linears, ("best", "shipped", "stages0")):
        record({"what": "per_step_ms", "shape": shape, "median": step, "spread": spread})
        lines.append(f"per {shape} decode step (x{LAYERS[shape]}): best tiles {step['best']:.3f} ms "
                     f"(±{spread['best']:.3f}), shipped {step['shipped']:.3f} (±{spread['shipped']:.3f}), "
                     f"§4m kernel {step['stages0']:.3f} (±{spread['stages0']:.3f})")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_args(p, shapes="7B,32B", block_n="4,8,16", warps="1,2,4")
    p.add_argument("--kernel", choices=("row", "tma"), default="row",
                   help="row: nvfp4_small_gemm's one-row kernel; tma: vllm_ext.nvfp4_gemv_tma (default row)")
    p.add_argument("--block-k", default="512", help="with --kernel tma: inputs per loop step (default 512)")
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("sweep_row: needs a CUDA GPU", file=sys.stderr)
        return 1
    from qerl_plugin import nvfp4
    from vllm_ext.bench.kernels import capture_graph, replay_us
    from vllm_ext.nvfp4_gemv import decode_tile

    record = jsonl_recorder(args.out, "sweep_row.jsonl" if args.kernel == "row" else "sweep_row_tma.jsonl")

    if args.kernel == "tma":
        tiles = tma_tiles(ints(args.block_n), ints(args.block_k), ints(args.split_k), ints(args.warps),
                          ints(args.stages))
    else:
        tiles = sweep_tiles(ints(args.block_n), ints(args.split_k), ints(args.warps), ints(args.stages))
    if args.jobs > 1:
        precompile(tiles, args.jobs)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    record({"what": "setup", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "tiles": len(tiles), "cold_mib": args.cold_mib,
            "shapes": args.shapes, "linears": args.linears, "kernel": args.kernel})
    finals: list[dict[str, Any]] = []
    bad = 0
    for shape in args.shapes.split(","):
        for lname in args.linears.split(","):
            k, n = LINEARS[shape][lname]
            _, q, raw_bytes, raws = streamed_weight(n, k, args.cold_mib, dev)
            x = torch.randn(1, k, device=dev, dtype=bf16)
            exact = x.double() @ nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double().t()
            copies = len(raws)
            iters = max(args.iters, copies)
            record({"what": "linear", "shape": shape, "linear": lname, "n": n, "k": k, "nvfp4_bytes": raw_bytes,
                    "copies": copies})

            def graph_of(t: dict[str, Any]):  # noqa: ANN202
                return capture_graph([(lambda p_=p_, s_=s_: run_tile(x, p_, s_, q.global_scale, t))
                                      for p_, s_ in raws], iters)

            swept, refused = try_tiles(tiles, lambda t: run_tile(x, q.packed, q.scale, q.global_scale, t),
                                       exact, lambda t: replay_us(graph_of(t), iters), record,
                                       {"shape": shape, "linear": lname})
            bad += refused
            if not swept:
                record({"what": "final", "shape": shape, "linear": lname, "error": "no tile correct"})
                continue
            record({"what": "top", "shape": shape, "linear": lname,
                    "tiles": [[tile_name(t), us] for us, t in swept[:8]]})
            best = swept[0][1]
            shipped = dict(decode_tile(n, k), words=True, asm=True, xvec=True)
            before = dict(tile_4m(n, k), words=True, asm=True, xvec=True)  # §4m's kernel, whatever ships now
            variants = {"best": best, "shipped": shipped, "stages0": before}
            graphs = {key: graph_of(t) for key, t in variants.items()}
            res = timed_interleaved({key: (g, iters) for key, g in graphs.items()}, args.reps)
            del graphs
            fin = {"what": "final", "shape": shape, "linear": lname, **{f"{key}_tile": tile_name(t)
                                                                        for key, t in variants.items()},
                   **res, "best_vs_stages0": verdict(res["best"], res["stages0"]),
                   "shipped_vs_stages0": verdict(res["shipped"], res["stages0"]),
                   "best_vs_shipped": verdict(res["best"], res["shipped"]),
                   "best_gb_s": round(raw_bytes / res["best"]["median_us"] / 1e3, 1),
                   "stages0_gb_s": round(raw_bytes / res["stages0"]["median_us"] / 1e3, 1)}
            record(fin)
            finals.append(fin)
            del raws, exact
            torch.cuda.empty_cache()

    lines = ["", f"one-row NVFP4 kernel ({args.kernel}), weights streamed from HBM: us per call, median of "
             f"{args.reps} (spread); GB/s = NVFP4 bytes (codes + FP8 scales) / time",
             f"{'shape':<5} {'linear':<8} {'best tile':<18}{'best':>15}{'§4m kernel':>26}"
             f"{'shipped':>15}{'best GB/s':>10}{'was GB/s':>10}  verdict"]
    for f in finals:
        cell = lambda r: f"{r['median_us']:>8.2f} ±{r['spread_us']:<5.2f}"  # noqa: E731
        lines.append(f"{f['shape']:<5} {f['linear']:<8} {f['best_tile']:<18}{cell(f['best'])}{cell(f['stages0']):>26}"
                     f"{cell(f['shipped'])}{f['best_gb_s']:>10.0f}{f['stages0_gb_s']:>10.0f}  {f['best_vs_stages0']} "
                     f"(vs shipped: {f['best_vs_shipped']})")
    lines += decode_step_lines(finals, args.shapes, args.linears, record)
    lines.append(f"tiles refused (error beyond the bf16 rounding, or not the same bits twice): {bad}")
    print("\n".join(lines), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
