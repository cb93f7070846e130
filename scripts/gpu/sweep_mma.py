#!/usr/bin/env python3
"""GPU sweep of a few-row NVFP4 tensor-core kernel against vLLM's Marlin FP4 GEMM and BF16 cuBLAS, at the batch
sizes of the issue's b8 / b64 decode rows: ``--kernel mma`` (default), ``vllm_ext.nvfp4_gemv``'s ``mma=True`` (the
weight read as int32 words, eight dots per K tile); ``--kernel gluon``, ``vllm_ext.nvfp4_gluon`` (operands laid out
in registers as mma.sync takes them); ``--kernel wgmma``, its warpgroup-MMA version; ``--kernel wgmma-marlin``, that
version on Marlin's own tensors (built by vllm_ext.bench.marlin_pack, so no vLLM is needed), timed beside the
checkpoint-layout version at ``nvfp4_gluon_lora.tile_for``'s tile (column ``ckpt``). At one row the shipped one-row
kernel (``decode_tile``'s tile, the checkpoint layout) is timed beside them (column ``row``). On the linears of the
7B (and 32B) decode step, with the weights streamed from HBM.
Run from the repository root on the GPU machine (Marlin needs the installed vLLM; without it the Marlin column is
left out and said so):

    PYTHONPATH=. python3 scripts/gpu/sweep_mma.py [--rows 8,64] [--shapes 7B] [--reps 5]

For each linear and row count:
  1. every tile (block_n x block_k x split_k x stages x warps) runs once and is checked against the float64
     product with the exact (dequantized) weight: within the bf16 output's rounding (2^-8 relative, plus 1e-4 of
     the largest value), and the same bits on a second call. Only correct tiles are timed.
  2. each correct tile is timed once (``--iters`` calls in one CUDA graph, cycling through enough weight copies that
     one pass reads >= ``--cold-mib`` MiB, so the weights come from HBM and not the 50 MB L2).
  3. the fastest tile, Marlin and BF16 cuBLAS are timed ``--reps`` times each, interleaved: median and spread
     (max - min). Per decode step: the medians summed over the four linears times the layer count.

"Faster" where the difference of the medians exceeds both spreads (the rule of docs/benchmarks.md). Writes
$OUT/sweep_<kernel>.jsonl (one JSON object per measurement) and prints the tables.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "scripts" / "gpu"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from check_gemv import (  # noqa: E402
    LAYERS, LINEARS, bf16_copies, bf16_graph, jsonl_recorder, per_step_ms, streamed_weight, tile_name,
    timed_interleaved, verdict)
from sweep_row import add_sweep_args, ints, precompile, run_tile, try_tiles  # noqa: E402
from vllm_ext.bench.marlin_pack import marlin_pack  # noqa: E402
from vllm_ext.nvfp4_gemv import decode_tile  # noqa: E402
from vllm_ext.nvfp4_gluon_lora import tile_for  # noqa: E402


def sweep_tiles(block_ns: list[int], block_ks: list[int], splits: list[int], stages: list[int],
                warps: list[int]) -> list[dict[str, Any]]:
    """The few-row Triton kernel's tiles tried."""
    return [dict(block_n=bn, block_k=bk, split_k=sk, num_warps=w, stages=st, mma=True)
            for st, bn, bk, sk, w in itertools.product(stages, block_ns, block_ks, splits, warps)]


def gluon_tiles(block_ks: list[int], warps: list[int], nreps: list[int] = (1,), splits: list[int] = (1,),
                prefetch: list[int] = (0,), wide: list[int] = (0,), bits: list[int] = (0,),
                wgmma: bool = False, marlin: bool = False) -> list[dict[str, Any]]:
    """vllm_ext.nvfp4_gluon's tiles tried: ``16 * warps * nrep`` output features per program, ``split_k`` programs
    per output block, the next K tile loaded ahead or not, wide loads or not, the bit decode or Triton's; with
    ``wgmma``, the warpgroup-MMA version (4 or 8 warps; always wide and bit-decoded, no prefetch); with ``marlin``
    too, that version on Marlin's tensors."""
    if wgmma:
        return [dict(block_n=16 * w * r, block_k=bk, split_k=sk, num_warps=w, gluon=True, wgmma=True,
                     **({"marlin": True} if marlin else {}))
                for bk, w, r, sk in itertools.product(block_ks, warps, nreps, splits)]
    return [dict(block_n=16 * w * r, block_k=bk, split_k=sk, num_warps=w, gluon=True, prefetch=bool(pf),
                 wide=bool(wd), bits=bool(bt))
            for bt, wd, pf, bk, w, r, sk in itertools.product(bits, wide, prefetch, block_ks, warps, nreps, splits)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="8,64", help="rows of x per call (default 8,64)")
    p.add_argument("--kernel", choices=("mma", "gluon", "wgmma", "wgmma-marlin"), default="mma",
                   help="mma: nvfp4_small_gemm(mma=True) over --block-n/--split-k/--stages/--warps (default); gluon: "
                   "vllm_ext.nvfp4_gluon over --block-k and --gluon-*; wgmma: its warpgroup-MMA version (--gluon-warps "
                   "4,8, --gluon-nrep, --gluon-split-k); wgmma-marlin: that on Marlin's tensors")
    p.add_argument("--gluon-warps", default="1,2,4,8", help="warps per program for --kernel gluon (default 1,2,4,8)")
    p.add_argument("--gluon-nrep", default="1", help="16-feature row blocks per warp for --kernel gluon (default 1)")
    p.add_argument("--gluon-split-k", default="1", help="programs per output block for --kernel gluon (default 1)")
    p.add_argument("--gluon-prefetch", default="0", help="1: load the next K tile ahead, 0: not (default 0)")
    p.add_argument("--gluon-wide", default="0", help="1: 16-byte loads of permuted K, 0: the operand's own (default 0)")
    p.add_argument("--gluon-bits", default="0",
                   help="1: E2M1 decoded by moving bits, 0: by Triton's lookup (default 0)")
    p.add_argument("--block-k", default="128,256,512", help="input features per K tile (default 128,256,512)")
    add_sweep_args(p, shapes="7B", block_n="64,128", warps="4,8")
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("sweep_mma: needs a CUDA GPU", file=sys.stderr)
        return 1
    from qerl_plugin import nvfp4
    from vllm_ext.bench.kernels import capture_graph, replay_us

    record = jsonl_recorder(args.out, f"sweep_{args.kernel}.jsonl")
    try:
        from vllm_ext.bench.kernels import marlin_linear

        marlin_linear  # noqa: B018
        import vllm._custom_ops  # noqa: F401  (Marlin's kernels)
        marlin_why = None
    except Exception as exc:  # noqa: BLE001
        marlin_linear, marlin_why = None, f"{type(exc).__name__}: {exc}"[:300]

    marlin_layout = args.kernel == "wgmma-marlin"
    if args.kernel in ("wgmma", "wgmma-marlin"):
        tiles = gluon_tiles(ints(args.block_k), ints(args.gluon_warps), ints(args.gluon_nrep), ints(args.gluon_split_k),
                            wgmma=True, marlin=marlin_layout)
    elif args.kernel == "gluon":
        tiles = gluon_tiles(ints(args.block_k), ints(args.gluon_warps), ints(args.gluon_nrep),
                            ints(args.gluon_split_k), ints(args.gluon_prefetch), ints(args.gluon_wide),
                            ints(args.gluon_bits))
    else:
        tiles = sweep_tiles(ints(args.block_n), ints(args.block_k), ints(args.split_k), ints(args.stages),
                            ints(args.warps))
    rows_list = ints(args.rows)
    if args.jobs > 1:
        low = 16 if args.kernel == "mma" else 8  # the smallest row block each kernel pads x to
        # one kernel per row block (16, 32, 64), and one for a single row (Triton specializes M == 1)
        for rows in sorted({r if r == 1 else max(low, 1 << (r - 1).bit_length()) for r in rows_list}):
            precompile(tiles, args.jobs, rows=rows)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    record({"what": "setup", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "tiles": len(tiles), "rows": rows_list,
            "cold_mib": args.cold_mib, "shapes": args.shapes, "linears": args.linears, "marlin_missing": marlin_why})
    finals: list[dict[str, Any]] = []
    bad = 0
    for shape in args.shapes.split(","):
        for lname in args.linears.split(","):
            k, n = LINEARS[shape][lname]
            w, q, raw_bytes, raws = streamed_weight(n, k, args.cold_mib, dev)
            w_exact = nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double()
            copies = len(raws)
            marlins = [] if marlin_linear is None else [marlin_linear(p_, s_, q.global_scale, bf16) for p_, s_ in raws]
            ckpts, gscale = raws, q.global_scale
            if marlin_layout:  # the swept kernel reads Marlin's tensors; the checkpoint's copies time column ckpt
                packs = [marlin_pack(p_, s_, q.global_scale) for p_, s_ in raws]
                raws, gscale = [(qw, sb) for qw, sb, _ in packs], packs[0][2]
                del packs
            bf16s = bf16_copies(w, args.cold_mib)
            iters = max(args.iters, copies)
            record({"what": "linear", "shape": shape, "linear": lname, "n": n, "k": k, "nvfp4_bytes": raw_bytes,
                    "copies": copies, "bf16_copies": len(bf16s)})
            for rows in rows_list:
                x = torch.randn(rows, k, device=dev, dtype=bf16)
                exact = x.double() @ w_exact.t()

                def graph_of(t: dict[str, Any], copies_=raws, gs_=gscale):  # noqa: ANN202
                    return capture_graph([(lambda p_=p_, s_=s_: run_tile(x, p_, s_, gs_, t))
                                          for p_, s_ in copies_], iters)

                swept, refused = try_tiles(
                    tiles, lambda t: run_tile(x, *raws[0], gscale, t), exact,
                    lambda t: replay_us(graph_of(t), iters), record, {"shape": shape, "linear": lname, "rows": rows})
                bad += refused
                if not swept:
                    record({"what": "final", "shape": shape, "linear": lname, "rows": rows, "error": "no tile correct"})
                    continue
                record({"what": "top", "shape": shape, "linear": lname, "rows": rows,
                        "tiles": [[tile_name(t), us] for us, t in swept[:8]]})
                best = swept[0][1]
                graphs = {"mma": (graph_of(best), iters),
                          "bf16": bf16_graph(x, bf16s, args.iters)}
                if marlin_layout:
                    bk_, w_, r_, sk_ = tile_for(n, k, rows)
                    ckpt_tile = dict(block_n=16 * w_ * r_, block_k=bk_, split_k=sk_, num_warps=w_, gluon=True,
                                     wgmma=True)
                    graphs["ckpt"] = (graph_of(ckpt_tile, ckpts, q.global_scale), iters)
                if rows == 1 and not marlin_layout:  # the shipped one-row kernel (decode_gemv's), column row
                    row_tile = dict(decode_tile(n, k), words=True, xvec=True, asm=True)
                    graphs["row"] = (graph_of(row_tile, ckpts, q.global_scale), iters)
                if marlins:
                    marlin_err = ((marlins[0](x).double() - exact).abs() - 2.0**-8 * exact.abs()).max().item()
                    graphs["marlin"] = (capture_graph([(lambda r_=r_: r_(x)) for r_ in marlins], iters), iters)
                res = timed_interleaved(graphs, args.reps)
                del graphs
                fin = {"what": "final", "shape": shape, "linear": lname, "rows": rows, "tile": tile_name(best), **res,
                       "mma_gb_s": round(raw_bytes / res["mma"]["median_us"] / 1e3, 1),
                       "mma_vs_bf16": verdict(res["mma"], res["bf16"])}
                if "row" in res:
                    fin.update(row_tile=tile_name(row_tile), mma_vs_row=verdict(res["mma"], res["row"]))
                if "ckpt" in res:
                    fin.update(ckpt_tile=tile_name(ckpt_tile), mma_vs_ckpt=verdict(res["mma"], res["ckpt"]))
                if "marlin" in res:
                    fin.update(marlin_excess=marlin_err, mma_vs_marlin=verdict(res["mma"], res["marlin"]),
                               marlin_gb_s=round(raw_bytes / res["marlin"]["median_us"] / 1e3, 1),
                               marlin_over_mma=round(res["marlin"]["median_us"] / res["mma"]["median_us"], 3))
                record(fin)
                finals.append(fin)
            del raws, ckpts, marlins, bf16s, w_exact
            torch.cuda.empty_cache()

    keys = (("mma",) + (("ckpt",) if marlin_layout else ()) + (("row",) if 1 in rows_list and not marlin_layout else ())
            + (("marlin",) if marlin_linear is not None else ()) + ("bf16",))
    lines = ["", f"few-row NVFP4 tensor-core kernel ({args.kernel}), weights streamed from HBM: us per call, median of "
             f"{args.reps} (spread); GB/s = NVFP4 bytes (codes + FP8 scales) / time"
             + ("" if marlin_linear is not None else f"; Marlin not run ({marlin_why})"),
             f"{'shape':<5} {'linear':<8}{'rows':>5} {'best tile':<20}" + "".join(f"{k_:>17}" for k_ in keys)
             + f"{'GB/s':>7}  verdict"]
    for f in finals:
        cell = lambda r: f"{r['median_us']:>9.2f} ±{r['spread_us']:<5.2f}"  # noqa: E731
        lines.append(f"{f['shape']:<5} {f['linear']:<8}{f['rows']:>5} {f['tile']:<20}"
                     + "".join(cell(f[k_]) if k_ in f else " " * 17 for k_ in keys) + f"{f['mma_gb_s']:>7.0f}  "
                     + f.get("mma_vs_marlin", f["mma_vs_bf16"] + " (vs bf16)")
                     + (f"; {f['mma_vs_ckpt']} than ckpt ({f['ckpt_tile']})" if "mma_vs_ckpt" in f else "")
                     + (f"; {f['mma_vs_row']} than row ({f['row_tile']})" if "mma_vs_row" in f else ""))
    for shape in args.shapes.split(","):
        for rows in rows_list:
            sel = [f for f in finals if f["shape"] == shape and f["rows"] == rows]
            if len(sel) != len(args.linears.split(",")):
                continue
            present = tuple(k_ for k_ in keys if all(k_ in f for f in sel))
            step, spread = per_step_ms(sel, present, LAYERS[shape])
            record({"what": "per_step_ms", "shape": shape, "rows": rows, "median": step, "spread": spread})
            lines.append(f"per {shape} decode step (x{LAYERS[shape]}), {rows} rows: "
                         + ", ".join(f"{k_} {step[k_]:.3f} ms (±{spread[k_]:.3f})" for k_ in present))
    lines.append(f"tiles refused (error beyond the bf16 rounding, or not the same bits twice): {bad}")
    print("\n".join(lines), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
