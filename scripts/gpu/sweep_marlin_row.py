#!/usr/bin/env python3
"""GPU sweep of decode_gemv's one-row kernel on Marlin's own tensors (``vllm_ext.nvfp4_marlin_row``, the
``decode_gemv: "shared"`` mode) over its tiles, on the linears of the 7B and 32B decode steps with the weights
streamed from HBM, against the checkpoint-layout row kernel as ``decode_gemv: "all"`` runs it (its shipped tile,
``torch.ops.qerl.nvfp4_gemv_row``) and vLLM's Marlin GEMM at one row. Run from the repository root on the GPU machine:

    PYTHONPATH=. python3 scripts/gpu/sweep_marlin_row.py [--shapes 7B,32B] [--reps 5] [--quick]

For each linear:
  1. every tile (hb x t x split_k x warps x stages) runs once on Marlin's tensors as ``MarlinBackend._marlin`` makes
     them (vLLM's CUDA repack) and is checked: against the float64 product with the codec's exact weight, at most
     Marlin's own error plus one bf16 step (2^-8) of the largest output, and the same bits on a second call. Only
     correct tiles are timed, once: ``--iters`` calls in one CUDA graph cycling through enough weight copies that one
     pass reads >= ``--cold-mib`` MiB (from HBM, not the L2).
  2. the fastest tile, the module's own rule (``marlin_row_tile`` without a tiles file), the checkpoint-layout row
     kernel and Marlin are timed ``--reps`` times each, interleaved: median and spread (max - min). Per decode step:
     the medians summed over the four linears times the layer count.

Without vLLM (a bare machine) Marlin's tensors come from ``vllm_ext.bench.marlin_pack`` (equal to vLLM's repack), a
tile's error is bounded as in sweep_row.py (the bf16 output's rounding of the exact product), and Marlin is not
timed (docs/benchmarks.md §4ba).

"Faster" where the difference of the medians exceeds both spreads. ``--gate FILE``: read a finished sweep's
``sweep_marlin_row.jsonl`` instead; exit 0 where its best 7B decode step is faster than Marlin's by that rule, else 3
(session.sh's ``bench_shared_if`` runs the engines only then; docs/benchmarks.md §4ai).

Writes $OUT/sweep_marlin_row.jsonl (one JSON object per measurement) and $OUT/marlin_row_tiles.json (the fastest
correct tile per weight shape, the file ``QERL_MARLIN_ROW_TILES`` takes), and prints the tables.
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
    LINEARS, add_linear_args, jsonl_recorder, step_lines, streamed_weight, timed_interleaved, verdict)


def sweep_tiles(quick: bool = False, grid: str = "first") -> list[dict[str, int]]:
    """The tiles tried, before :func:`fits` drops those a linear cannot take. ``grid="first"``: §4ah's first sweep
    (at most one chunk per program); ``"wide"``: programs of up to four whole chunks, shorter loop steps and larger
    split-K, unpipelined (the first sweep's best tiles all were): 270 tiles, more than one 300 s step compiles for one
    linear (§4ah call set B); ``"chunks"``: the part of it where call set B's ten fastest q/k/v tiles lay (one to four
    whole chunks, 8 or 16 groups per step, split-K 4-16, 2 or 4 warps), 36 tiles; ``"asum"``: the same 36 with each
    output's four words summed before its scale (``asum`` 1, §4ah's estimate); ``"asum2"``: the same 36 with that sum
    in registers (``asum`` 2); ``"forms"``: all three, 108 tiles; ``"asum3"``: the 36 with form 2's ``x`` read in
    4-byte pairs (``asum`` 3, §4ai after the runs); ``"forms3"``: forms 1, 2 and 3, 108 tiles; ``"asum4"``: the 36 with
    a group's ``x`` read as two 16-byte runs (``asum`` 4, §4aj after the runs); ``"forms4"``: forms 3 and 4, 72 tiles."""
    forms = {"chunks": (0,), "asum": (1,), "asum2": (2,), "forms": (0, 1, 2), "asum3": (3,), "forms3": (1, 2, 3),
             "asum4": (4,), "forms4": (3, 4)}
    if grid in forms:
        return [dict(hb=hb, t=t, split_k=sk, num_warps=w, stages=0, asum=a)
                for a, hb, t, sk, w in itertools.product(forms[grid], (8, 16, 32), (8, 16), (4, 8, 16), (2, 4))]
    if grid == "wide":
        return [dict(hb=hb, t=t, split_k=sk, num_warps=w, stages=0)
                for hb, t, sk, w in itertools.product((1, 2, 4, 8, 16, 32), (8, 16, 32), (1, 2, 4, 8, 16), (1, 2, 4))]
    hbs, ts, warps = ((1, 2), (32,), (1, 2)) if quick else ((1, 2, 4), (32,), (1, 2, 4))
    return [dict(hb=hb, t=t, split_k=sk, num_warps=w, stages=st)
            for st, hb, t, sk, w in itertools.product((0, 3), hbs, ts, (1, 2, 4, 8), warps)]


def fits(tile: dict[str, int], n: int, k: int) -> bool:
    """Whether the linear takes the tile: its loop step divides K, every split-K program has a step, and the grid
    stays below 32 768 programs."""
    steps = k // (16 * tile["t"])
    return (k % (16 * tile["t"]) == 0 and steps >= tile["split_k"] and n % (8 * tile["hb"]) == 0
            and n // (8 * tile["hb"]) * tile["split_k"] <= 32768)


def tile_name(t: dict[str, int]) -> str:
    name = f"h{t['hb']}t{t['t']}s{t['split_k']}w{t['num_warps']}" + (f"S{t['stages']}" if t["stages"] else "")
    return name + {0: "", 1: "A", 2: "A2", 3: "A3", 4: "A4"}[t.get("asum", 0)]


def marlin_tensors(packed, scale, gscale, dtype, have_vllm: bool = True):  # noqa: ANN001, ANN201
    """Marlin's tensors of one NVFP4 triple as the engine's backend makes them, and the row kernel's divisor; without
    vLLM, built by ``vllm_ext.bench.marlin_pack`` (equal to vLLM's repack, docs/benchmarks.md §4ay), as an object with
    ``weight`` and ``weight_scale`` only (no Marlin GEMM to time)."""
    if not have_vllm:
        from types import SimpleNamespace

        from vllm_ext.bench.marlin_pack import marlin_pack

        qw, s, d = marlin_pack(packed, scale, gscale)
        return SimpleNamespace(weight=qw, weight_scale=s), d
    from vllm_ext.bench.kernels import marlin_layer
    from vllm_ext.nvfp4_marlin_row import marlin_divisor

    m = marlin_layer(packed, scale, gscale, dtype)
    return m, marlin_divisor(m.weight_global_scale.data, dtype)


def gate(path: str | Path, shape: str = "7B") -> tuple[bool, str]:
    """Whether the sweep recorded in ``path`` found a ``shape`` decode step faster than Marlin's (the difference of the
    medians above both spreads), and a line saying so."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    steps = [r for r in rows if r.get("what") == "per_step_ms" and r.get("shape") == shape]
    if not steps:
        return False, f"{path}: no {shape} decode step recorded (the sweep did not finish its four linears)"
    med, spread = steps[-1]["median"], steps[-1]["spread"]
    if "marlin" not in med:
        return False, f"{path}: the sweep ran without vLLM, so Marlin was not timed"
    faster = verdict(*({"median_us": med[key], "spread_us": spread[key]} for key in ("best", "marlin"))) == "faster"
    return faster, (f"{shape} decode step: best tiles {med['best']:.3f} ms (±{spread['best']:.3f}), Marlin "
                    f"{med['marlin']:.3f} ms (±{spread['marlin']:.3f}), checkpoint row kernel "
                    f"{med['checkpoint_row']:.3f} ms: {'faster than Marlin' if faster else 'not faster than Marlin'}")


def decode_step_lines(finals: list[dict[str, Any]], shapes: str, linears: str, keys: tuple[str, ...],
                      record: Callable[..., None]) -> list[str]:
    """For each of ``shapes`` whose ``linears`` all finished in ``finals``: its decode step over ``keys``
    (:func:`check_gemv.step_lines`), recorded as a ``per_step_ms`` row, and a line describing it in ms."""
    return step_lines(finals, shapes, linears, keys, record, label="decode step", unit=" ms")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_linear_args(p, "7B,32B")
    p.add_argument("--quick", action="store_true", help="a smaller tile set (hb 1-2, 1-2 warps)")
    p.add_argument("--grid", choices=("first", "wide", "chunks", "asum", "asum2", "forms", "asum3", "forms3", "asum4",
                                      "forms4"),
                   default="first",
                   help="the tile set (see sweep_tiles)")
    p.add_argument("--gate", default=None, metavar="JSONL", help="only judge a finished sweep's record (see above)")
    args = p.parse_args(argv)
    if args.gate:
        faster, line = gate(args.gate)
        print(line, flush=True)
        return 0 if faster else 3

    import torch

    if not torch.cuda.is_available():
        print("sweep_marlin_row: needs a CUDA GPU", file=sys.stderr)
        return 1
    from qerl_plugin import nvfp4
    from vllm_ext.bench.kernels import capture_graph, replay_us
    from vllm_ext.nvfp4_marlin_row import TILES_ENV, marlin_row_gemm, marlin_row_tile

    try:  # Marlin's repack and GEMM; without them the tensors come from marlin_pack and Marlin is not timed
        import vllm._custom_ops  # noqa: F401

        from vllm_ext.nvfp4_backends import marlin_gemm
        have_vllm = True
    except ImportError:
        marlin_gemm, have_vllm = None, False

    os.environ.pop(TILES_ENV, None)  # marlin_row_tile's own rule is one of the rows timed
    record = jsonl_recorder(args.out, "sweep_marlin_row.jsonl")
    out_dir = Path(args.out or os.environ.get("OUT") or ".out").expanduser().resolve()
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    tiles = sweep_tiles(args.quick, args.grid)
    record({"what": "setup", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "tiles": len(tiles), "cold_mib": args.cold_mib, "iters": args.iters, "reps": args.reps,
            "marlin": have_vllm})
    best_tiles: dict[str, dict[str, int]] = {}
    finals: dict[str, list[dict[str, Any]]] = {}
    bad = 0
    for shape in args.shapes.split(","):
        for lname in args.linears.split(","):
            k, n = LINEARS[shape][lname]
            w, q, raw_bytes, raws = streamed_weight(n, k, args.cold_mib, dev)
            ms = [marlin_tensors(p_, s_, q.global_scale, bf16, have_vllm) for p_, s_ in raws]
            x = torch.randn(1, k, device=dev, dtype=bf16)
            exact = x.double() @ nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double().t()
            m0, d0 = ms[0]

            def marlin_call(m_):  # noqa: ANN001, ANN202
                return lambda: marlin_gemm(x, m_.weight, m_.weight_scale, m_.weight_global_scale, m_.workspace, n, k,
                                           None, True)

            if have_vllm:
                marlin_err = (marlin_call(m0)().double() - exact).abs().max().item()
                tol = marlin_err + 2.0**-8 * exact.abs().max().item()
            else:  # sweep_row.py's bound: the bf16 output's rounding of the exact product, and 1e-4 of its largest
                tol = None
            iters = max(args.iters, len(ms))

            def row_graph(tile):  # noqa: ANN001, ANN202
                return capture_graph([(lambda m_=m_, d_=d_: marlin_row_gemm(x, m_.weight, m_.weight_scale, d_, **tile))
                                      for m_, d_ in ms], iters)

            swept = []
            for tile in (t for t in tiles if fits(t, n, k)):
                row: dict[str, Any] = {"what": "tile", "shape": shape, "linear": lname, "tile": tile_name(tile)}
                try:
                    y1 = marlin_row_gemm(x, m0.weight, m0.weight_scale, d0, **tile)
                    y2 = marlin_row_gemm(x, m0.weight, m0.weight_scale, d0, **tile)
                    err = (y1.double() - exact).abs().max().item()
                    row.update(max_err=err, tol=tol, repeat_identical=torch.equal(y1, y2))
                    if tol is None:
                        excess = ((y1.double() - exact).abs() - 2.0**-8 * exact.abs()).max().item()
                        row.update(excess=excess)
                        within = excess <= 1e-4 * exact.abs().max().item()
                    else:
                        within = err <= tol
                    row["ok"] = within and row["repeat_identical"]
                    if row["ok"]:
                        g = row_graph(tile)
                        row["us"] = round(replay_us(g, iters), 2)
                        del g
                        swept.append((row["us"], tile))
                    else:
                        bad += 1
                except Exception as exc:  # a tile that does not compile must not hide the others
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                record(row, echo=False)
            if not swept:
                record({"what": "final", "shape": shape, "linear": lname, "error": "no tile correct"})
                continue
            best = min(swept, key=lambda s: s[0])[1]
            best_tiles[f"{n},{k}"] = best
            # after every linear: a run cut short still leaves the tiles it found
            (out_dir / "marlin_row_tiles.json").write_text(json.dumps(best_tiles, indent=1) + "\n")
            rule = marlin_row_tile(n, k)
            graphs = {"best": (row_graph(best), iters), "rule": (row_graph(rule), iters),
                      "checkpoint_row": (capture_graph([(lambda p_=p_, s_=s_: torch.ops.qerl.nvfp4_gemv_row(
                          x, p_, s_, q.global_scale.reshape(1).float())) for p_, s_ in raws], iters), iters)}
            if have_vllm:
                graphs["marlin"] = (capture_graph([marlin_call(m_) for m_, _ in ms], iters), iters)
            res = timed_interleaved(graphs, args.reps)
            del graphs
            fin = {"what": "final", "shape": shape, "linear": lname, "n": n, "k": k, "tile": tile_name(best),
                   "rule_tile": tile_name(rule), **res, "swept": len(swept),
                   "best_vs_checkpoint_row": verdict(res["best"], res["checkpoint_row"]),
                   "best_vs_rule": verdict(res["best"], res["rule"]),
                   "best_vs_marlin": verdict(res["best"], res["marlin"]) if have_vllm else "not run (no vLLM)",
                   "best_gb_s": round(raw_bytes / res["best"]["median_us"] / 1e3, 1)}
            record(fin)
            finals.setdefault(shape, []).append(fin)
            raws = ms = None  # the copies go before the next linear
            torch.cuda.empty_cache()
    lines = ["", "one row, weights streamed from HBM: us per call, median of "
             f"{args.reps} (spread = max - min)",
             f"{'shape':<6}{'linear':<9}{'best tile':<14}{'best':>15}{'rule':>15}{'ckpt row':>15}{'marlin':>15}"
             f"{'GB/s':>7}  vs ckpt row / vs marlin"]
    cell = lambda r: f"{r['median_us']:>9.2f} ±{r['spread_us']:<4.2f}"  # noqa: E731
    keys = ("best", "rule", "checkpoint_row") + (("marlin",) if have_vllm else ())
    for shape, sel in finals.items():
        for f in sel:
            lines.append(f"{shape:<6}{f['linear']:<9}{f['tile']:<14}{cell(f['best'])}{cell(f['rule'])}"
                         f"{cell(f['checkpoint_row'])}{cell(f['marlin']) if 'marlin' in f else ' ' * 15}"
                         f"{f['best_gb_s']:>7.0f}  {f['best_vs_checkpoint_row']} / {f['best_vs_marlin']}; "
                         f"{f['best_vs_rule']} than the rule ({f['rule_tile']})")
        lines += decode_step_lines(sel, shape, args.linears, keys, record)
    lines.append(f"tiles refused for error or non-reproducible split-K: {bad}; tiles file: "
                 f"{out_dir / 'marlin_row_tiles.json'}")
    print("\n".join(lines), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
