#!/usr/bin/env python3
"""GPU sweep of the row+lora kernel's tiles (``vllm_ext.nvfp4_gemv_lora``: the one-row kernel with the LoRA expand in
its epilogue, after its shrink launch) with ``QERL_ROW_DECODE=hfma2`` and the adapter, on the linears of the 7B and
32B decode steps, the weights and every layer's adapter streamed from HBM (docs/benchmarks.md §4bf item 2, §4bg).
Until §4bg the hfma2 tiles were those of the row kernel's sweep without the adapter (§4bc), and with the adapter the
32B step gained 0.13 ms where the row op alone gained 0.59 (§4be call 4); row_tile takes §4bg's tiles since. Needs only torch and Triton (no vLLM): run from the repository root on the GPU,

    PYTHONPATH=. python3 scripts/gpu/sweep_row_lora.py [--shapes 7B,32B] [--reps 9] [--rank 32]

For each linear (Qwen2.5's slices: q/k/v with its bias, o, gate/up, down; LoRA scale 1):
  1. the bound: the largest error against the float64 result (the exact dequantized weight, the bias, the adapter)
     of the result with the weight rounded to bfloat16 through the kernel's roundings, plus one rounding of the
     largest output (:func:`exact_and_bound`).
     The FP8 row+lora path at its shipped tile (``row_tile``) must be within it and give the same bits twice, or
     the linear is not timed (the reference would be wrong) and the run exits 1;
  2. every hfma2 tile of the sweep (block_n x split_k x warps x stages, block_k 512, at least 4 rows) runs once and is
     checked the same way; each correct tile is timed once (``--iters`` calls in one CUDA graph, cycling through
     weight and adapter copies that one pass reads >= ``--cold-mib`` MiB of);
  3. ``fp8`` (FP8, shipped tile), ``hfma2`` (hfma2, shipped tile) and ``best`` (hfma2, the fastest tile) are timed
     ``--reps`` times each, interleaved: median and spread (max - min) of µs per call.
Per decode step the medians and spreads are summed over the four linears and times the layer count. The gate fixed
before the run (§4bf item 2): ``best`` at least 5 % under ``fp8`` per 7B or 32B step, by more than both spreads.
Writes $OUT/sweep_row_lora.jsonl (one JSON object per measurement; ``gate`` rows at the end) and prints the tables.
Exit 1 where a shipped tile's check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "scripts" / "gpu"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from check_gemv import (  # noqa: E402
    LINEARS, add_linear_args, decode_env, fp8_decode_device, jsonl_recorder, shape_steps, step_lines,
    streamed_weight, tile_name, timed_interleaved, verdict)
from sweep_row import failures_in_pool, ints, sweep_tiles, try_tiles  # noqa: E402

SLICES = {  # the output slices of each linear (their sum is LINEARS' N)
    "7B": {"qkv": (3584, 512, 512), "o": (3584,), "gate_up": (18944, 18944), "down": (3584,)},
    "32B": {"qkv": (5120, 1024, 1024), "o": (5120,), "gate_up": (27648, 27648), "down": (5120,)},
}
KEYS = ("fp8", "hfma2", "best")
GATE_FRACTION = 0.05


def lora_tiles(block_ns: list[int], splits: list[int], warps: list[int], stages: list[int]) -> list[dict[str, int]]:
    """The row+lora kernel's tiles tried: sweep_row's hfma2 grid (block_k 512, at least 4 rows) as ``row_tile`` spells
    a tile (block_n, block_k, split_k, num_warps, stages)."""
    keep = ("block_n", "block_k", "split_k", "num_warps", "stages")
    return [{k: t[k] for k in keep} for t in sweep_tiles(block_ns, splits, warps, stages, hfma2=True)]


def gate(step: dict[str, float], spread: dict[str, float], fraction: float = GATE_FRACTION) -> dict[str, Any]:
    """§4bf item 2's gate on one shape's per-step medians and spreads (ms): ``best`` at least ``fraction`` under
    ``fp8`` and by more than both spreads."""
    saved = step["fp8"] - step["best"]
    return {"saved_ms": round(saved, 4), "saved_fraction": round(saved / step["fp8"], 4),
            "beyond_spreads": saved > max(spread["fp8"], spread["best"]),
            "pass": saved >= fraction * step["fp8"] and saved > max(spread["fp8"], spread["best"])}


def adapter(slices: tuple[int, ...], k: int, rank: int, dev):  # noqa: ANN001, ANN201
    """One layer's adapter as the row+lora kernel takes it: per slice A ``[1, 1, R, K]`` (N(0, 1/K)) and B ``[1, 1,
    n_s, R]`` (N(0, 0.05²)), bfloat16 (scripts/gpu/check_row_lora.py's)."""
    import torch

    a = tuple((torch.randn(1, 1, rank, k, device=dev) / k**0.5).to(torch.bfloat16) for _ in slices)
    b = tuple((torch.randn(1, 1, s, rank, device=dev) * 0.05).to(torch.bfloat16) for s in slices)
    return a, b


def exact_and_bound(x, q, bias, a, b, slices):  # noqa: ANN001, ANN201
    """The float64 result with the exact (dequantized) weight, the bias and the adapter (scale 1); and the bound for
    hfma2: the largest error against it of the result with the weight rounded to bfloat16 (as vLLM's Marlin rounds
    each weight times its scale) through the kernel's roundings to bfloat16 (the base output with its bias, the
    adapter's ``h`` and update, their sum), as vLLM's BF16 path with punica rounds them, plus 2^-8 of the largest
    output (between a half and a full bfloat16 step there): the base output, rounded before the update is added, can
    land one bfloat16 away from the emulation's where the two differ before rounding; without it the FP8 path itself
    was refused (§4bg call 1, the 32B q/k/v: 0.0325 against 0.0303). The check catches a broken tile; it does not rank
    tiles (in §4bg every tile's largest error was the FP8 path's)."""
    import torch

    from qerl_plugin import nvfp4

    def bf16(t):  # noqa: ANN001, ANN202
        return t.to(torch.bfloat16).double()

    x64 = x.double()
    h = [a_[0, 0].double() @ x64.t() for a_ in a]
    lora = torch.cat([(b_[0, 0].double() @ h_).t() for h_, b_ in zip(h, b)], dim=-1)
    up16 = bf16(torch.cat([(b_[0, 0].double() @ bf16(h_)).t() for h_, b_ in zip(h, b)], dim=-1))
    bias64 = 0 if bias is None else bias.double()
    w = nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double()
    exact = x64 @ w.t() + bias64 + lora
    w16 = nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.bfloat16).double()
    bound = (bf16(bf16(x64 @ w16.t() + bias64) + up16) - exact).abs().max().item()
    bound += 2.0**-8 * exact.abs().max().item()
    assert lora.shape[-1] == sum(slices)
    return exact, bound


def _compile(tiles: list[dict[str, int]], rank: int) -> int:
    """Run each tile once with hfma2 on every swept linear's K (with its bias where it has one and its slice count, N
    cut to 512 outputs per slice), in a worker process: Triton compiles into its on-disk cache, which the sweep then
    finds. Returns how many calls failed (the sweep records why)."""
    import torch

    from vllm_ext import nvfp4_gemv_lora as rl

    dev = torch.device("cuda")
    idx = torch.zeros(8, dtype=torch.int32, device=dev)
    kinds = {(LINEARS[s][lin][0], len(SLICES[s][lin]), lin == "qkv") for s in SLICES for lin in SLICES[s]}
    failed = 0
    with decode_env("hfma2"):
        for k, count, has_bias in sorted(kinds):
            slices = (512,) * count
            n = sum(slices)
            packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
            scale = torch.ones(n, k // 16, device=dev).to(torch.float8_e4m3fn)
            x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
            bias = torch.zeros(n, device=dev, dtype=torch.bfloat16) if has_bias else None
            a, b = adapter(slices, k, rank, dev)
            for t in tiles:
                try:
                    rl.launch_supported(x, packed, scale, torch.ones(1, device=dev), bias, a, b, 1.0, slices, idx,
                                        tile=t)
                except Exception:  # noqa: BLE001 (the sweep itself records the error)
                    failed += 1
    torch.cuda.synchronize()
    return failed


def precompile(tiles: list[dict[str, int]], jobs: int, rank: int) -> None:
    """:func:`_compile` over ``tiles`` in ``jobs`` processes at once."""
    import functools

    failed = failures_in_pool(functools.partial(_compile, rank=rank), tiles, jobs)
    print(json.dumps({"what": "precompiled", "tiles": len(tiles), "jobs": jobs, "failed_calls": failed}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_linear_args(p, "7B,32B")
    p.add_argument("--rank", type=int, default=32, help="LoRA rank (default 32)")
    p.add_argument("--block-n", default="4,8,16,32", help="rows per program (default 4,8,16,32)")
    p.add_argument("--split-k", default="1,2,4,8", help="programs per output block (default 1,2,4,8)")
    p.add_argument("--warps", default="1,2", help="warps per program (default 1,2)")
    p.add_argument("--stages", default="0,3,4", help="pipeline depths; 0 = not pipelined (default 0,3,4)")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                   help="processes compiling the kernels before the sweep (default: up to 16; 1: none)")
    args = p.parse_args(argv)
    bad_names = [s for s in args.shapes.split(",") if s not in SLICES] + [
        lin for lin in args.linears.split(",") if lin not in SLICES["7B"]]
    if bad_names:
        print(f"sweep_row_lora: unknown shape or linear {bad_names}: shapes from {sorted(SLICES)}, linears from "
              f"{list(SLICES['7B'])}", file=sys.stderr)
        return 2
    dev = fp8_decode_device("sweep_row_lora")
    if dev is None:
        return 1
    import torch

    from vllm_ext import nvfp4_gemv_lora as rl
    from vllm_ext.bench.kernels import capture_graph, replay_us

    tiles = lora_tiles(ints(args.block_n), ints(args.split_k), ints(args.warps), ints(args.stages))
    if args.jobs > 1:
        precompile(tiles, args.jobs, args.rank)
    record = jsonl_recorder(args.out, "sweep_row_lora.jsonl")
    record({"what": "setup", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "tiles": len(tiles), "cold_mib": args.cold_mib,
            "shapes": args.shapes, "linears": args.linears, "rank": args.rank, "reps": args.reps})
    idx = torch.zeros(8, dtype=torch.int32, device=dev)
    finals: list[dict[str, Any]] = []
    refused, broken = 0, []
    for shape in args.shapes.split(","):
        for lname in args.linears.split(","):
            k, n = LINEARS[shape][lname]
            slices = SLICES[shape][lname]
            assert sum(slices) == n, (shape, lname)
            _, q, raw_bytes, raws = streamed_weight(n, k, args.cold_mib, dev)
            x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
            bias = torch.randn(n, device=dev, dtype=torch.bfloat16) if lname == "qkv" else None
            adapters = [adapter(slices, k, args.rank, dev) for _ in raws]  # each copy its own, as each layer has
            gs = q.global_scale.reshape(1).float()
            exact, bound = exact_and_bound(x, q, bias, *adapters[0], slices)
            iters = max(args.iters, len(raws))

            def call(t, mode, i=0):  # noqa: ANN001, ANN202
                with decode_env(mode):
                    return rl.launch_supported(x, *raws[i], gs, bias, *adapters[i], 1.0, slices, idx, tile=t)

            def graph_of(t, mode):  # noqa: ANN001, ANN202
                with decode_env(mode):  # warm-up and capture both launch
                    return capture_graph([(lambda i=i: call(t, mode, i)) for i in range(len(raws))], iters)

            base = {"shape": shape, "linear": lname}
            shipped = {mode: rl.row_tile(n, k, slices=slices, hfma2=mode == "hfma2") for mode in ("fp8", "hfma2")}
            record({"what": "linear", **base, "n": n, "k": k, "slices": list(slices), "nvfp4_bytes": raw_bytes,
                    "copies": len(raws), "bias": bias is not None, "ref_err": bound, "shipped": shipped})
            # 1. the FP8 path at its shipped tile, against the same bound (a wrong reference fails here)
            fp8_ok, _ = try_tiles([shipped["fp8"]], lambda t: call(t, "fp8"), exact, lambda t: 0.0, record,
                                  {**base, "mode": "fp8_shipped"}, bound)
            if not fp8_ok:
                broken.append(f"{shape} {lname}")
                continue
            # 2. the hfma2 tiles
            swept, bad = try_tiles(tiles, lambda t: call(t, "hfma2"), exact,
                                   lambda t: replay_us(graph_of(t, "hfma2"), iters), record,
                                   {**base, "mode": "hfma2"}, bound)
            refused += bad
            if not swept:
                record({"what": "final", **base, "error": "no hfma2 tile correct", "ref_err": bound})
                continue
            record({"what": "top", **base, "tiles": [[tile_name(t), us] for us, t in swept[:8]]})
            best = swept[0][1]
            variants = {"fp8": (shipped["fp8"], "fp8"), "hfma2": (shipped["hfma2"], "hfma2"), "best": (best, "hfma2")}
            graphs = {key: (graph_of(t, mode), iters) for key, (t, mode) in variants.items()}
            res = timed_interleaved(graphs, args.reps)
            del graphs
            fin = {"what": "final", **base, "best_tile": best, "best_tile_name": tile_name(best), **res,
                   "best_vs_fp8": verdict(res["best"], res["fp8"]), "hfma2_vs_fp8": verdict(res["hfma2"], res["fp8"]),
                   "best_vs_hfma2": verdict(res["best"], res["hfma2"])}
            record(fin)
            finals.append(fin)
            torch.cuda.empty_cache()

    cell = lambda r: f"{r['median_us']:>9.2f} ±{r['spread_us']:<5.2f}"  # noqa: E731
    lines = ["", f"row+lora kernel, rank {args.rank}, weights and adapters streamed from HBM: µs per call, median of "
             f"{args.reps} (spread)",
             f"{'shape':<5} {'linear':<8} {'best hfma2 tile':<18}{'fp8':>16}{'hfma2':>16}{'best':>16}"
             "  best vs fp8; hfma2 vs fp8; best vs hfma2"]
    for f in finals:
        lines.append(f"{f['shape']:<5} {f['linear']:<8} {f['best_tile_name']:<18}"
                     + "".join(cell(f[key]) for key in KEYS)
                     + f"  {f['best_vs_fp8']}; {f['hfma2_vs_fp8']}; {f['best_vs_hfma2']}")
    lines += step_lines(finals, args.shapes, args.linears, KEYS, record)
    for shape, sel, step, spread in shape_steps(finals, args.shapes, args.linears, KEYS):
        g = {"what": "gate", "shape": shape, **gate(step, spread), "tiles": {f["linear"]: f["best_tile"] for f in sel}}
        record(g)
        lines.append(f"gate, per {shape} step: best hfma2 tiles {100 * g['saved_fraction']:+.1f} % under fp8 "
                     f"({g['saved_ms']:+.3f} ms; beyond both spreads: {g['beyond_spreads']}) -> "
                     f"{'pass' if g['pass'] else 'fail'}")
    lines.append(f"hfma2 tiles refused (error beyond the bound, or not the same bits twice): {refused}")
    if broken:
        lines.append(f"FP8 at its shipped tile failed the check (no timing): {', '.join(broken)}")
    print("\n".join(lines), flush=True)
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
