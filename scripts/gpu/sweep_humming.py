#!/usr/bin/env python3
"""vLLM's humming W4A16 GEMM against Marlin and BF16 cuBLAS on the linears of the 7B (and 32B) decode step, at the
issue's batch sizes (1, 8, 64 rows), with the weights streamed from HBM.

humming (the ``humming-kernels`` package, vLLM's ``--quantization humming``) JIT-compiles Hopper kernels with TMA,
warp specialisation and warpgroup MMA; Marlin, the NVFP4 default here, is an mma.sync kernel. Until this script no
run of this project had timed it (the bench's ``humming-*`` configs never ran: the wheel was not staged).
Run from the repository root on the GPU machine, with humming installed (``session.sh humming``):

    PYTHONPATH=. python3 scripts/gpu/sweep_humming.py [--rows 1,8,64] [--shapes 7B] [--reps 5]

For each linear and row count:
  1. humming and Marlin each run once on the same ``x``; their error against the float64 product with the exact
     (dequantized) weight is recorded as max |error| / max |exact|. humming counts as correct where its error is at
     most max(2 x Marlin's, 2^-8), and where two calls give the same bits; only then is it timed.
  2. humming, Marlin and BF16 cuBLAS are timed ``--reps`` times each, interleaved (``--iters`` calls per CUDA graph,
     cycling through weight copies so that one pass reads >= ``--cold-mib`` MiB): median and spread (max - min).
     Per decode step: the medians summed over the four linears times the layer count.

"Faster" where the difference of the medians exceeds both spreads (docs/benchmarks.md's rule). Writes
$OUT/sweep_humming.jsonl (one JSON object per measurement) and prints the table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "scripts" / "gpu"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from check_gemv import (  # noqa: E402
    LAYERS, LINEARS, add_linear_args, bf16_copies, bf16_graph, jsonl_recorder, shape_steps, streamed_weight,
    timed_interleaved, verdict)

KEYS = ("humming", "marlin", "bf16")


def rel_error(y, exact) -> float:  # noqa: ANN001
    """max |y - exact| / max |exact| (float64)."""
    return ((y.double() - exact).abs().max() / exact.abs().max()).item()


def correct(humming_err: float, marlin_err: float, same_bits: bool) -> bool:
    """humming's output is taken as correct: its error at most twice Marlin's on the same input, or within the bf16
    output's rounding (2^-8 relative), and the same bits on a second call."""
    return same_bits and humming_err <= max(2.0 * marlin_err, 2.0**-8)


GATE_ROWS = (8, 64)
GATE_MS = 0.10


def gate(path: str | Path, rows: tuple[int, ...] = GATE_ROWS, min_ms: float = GATE_MS) -> tuple[bool, str]:
    """§4ac's gate for an engine run, from a sweep's JSON lines: humming faster than Marlin per 7B step (beyond both
    summed spreads) by at least ``min_ms`` at one of ``rows``, with none of that step's linears refused by the
    correctness check (``--time-refused`` times those too). ``(passed, why)``."""
    import json

    steps = {}
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        if rec.get("what") == "per_step_ms" and rec.get("shape") == "7B":
            steps[rec["rows"]] = rec
    found = []
    for r in rows:
        rec = steps.get(r)
        if rec is None:
            found.append(f"{r} rows: not measured")
            continue
        gain = rec["median"]["marlin"] - rec["median"]["humming"]
        bad = rec.get("refused_cases", 0)
        found.append(f"{r} rows: humming {rec['median']['humming']:.3f} ms vs Marlin {rec['median']['marlin']:.3f} "
                     f"({rec['humming_vs_marlin']}, {gain:+.3f} ms" + (f"; {bad} linears refused)" if bad else ")"))
        if rec["humming_vs_marlin"] == "faster" and gain >= min_ms and not bad:
            return True, "gate passed: " + "; ".join(found)
    return False, f"gate not passed (humming faster by >= {min_ms} ms per 7B step at {' or '.join(map(str, rows))} " \
                  "rows): " + "; ".join(found)


def decode_step_lines(finals: list[dict[str, Any]], shapes: str, rows_list: list[int], linears: str,
                      record: Callable[..., None]) -> list[str]:
    """For each of ``shapes``, at each of ``rows_list``, whose ``linears`` all finished in ``finals``: its decode step
    over KEYS (:func:`check_gemv.shape_steps` on the finals at those rows) and humming's verdict against Marlin on it,
    recorded as a ``per_step_ms`` row with the count of its linears the check refused, and a line describing it."""
    lines = []
    for shape in shapes.split(","):
        for rows in rows_list:
            at_rows = [f for f in finals if f["rows"] == rows]
            for _, sel, step, spread in shape_steps(at_rows, shape, linears, KEYS):
                faster = verdict({"median_us": step["humming"], "spread_us": spread["humming"]},
                                 {"median_us": step["marlin"], "spread_us": spread["marlin"]})
                n_refused = sum(bool(f["refused"]) for f in sel)
                record({"what": "per_step_ms", "shape": shape, "rows": rows, "median": step, "spread": spread,
                        "humming_vs_marlin": faster, "refused_cases": n_refused})
                lines.append(f"per {shape} decode step (x{LAYERS[shape]}), {rows} rows: "
                             + ", ".join(f"{k_} {step[k_]:.3f} ms (±{spread[k_]:.3f})" for k_ in KEYS)
                             + f"; humming vs Marlin: {faster}"
                             + (f" ({n_refused} of its linears refused by the check)" if n_refused else ""))
    return lines


def probe() -> int:
    """What humming's JIT finds on this machine, then one small GEMM through it (compiles its launcher and kernels)."""
    import shutil

    import torch

    for tool in ("nvcc", "g++", "ninja"):
        print(f"{tool}: {shutil.which(tool) or 'missing'}")
    import humming
    from humming.utils.cuda import filter_cuda_paths

    from qerl_plugin import nvfp4
    from vllm_ext.bench.kernels import humming_linear

    env = filter_cuda_paths(required_headers=["cuda.h", "crt/host_defines.h", "cuda/std/cstdint", "nvrtc.h"])
    print(f"humming {humming.__version__}: CUDA {env['major']} from {env['source']} {env['path']}")
    torch.manual_seed(0)
    w = (torch.randn(512, 1024, device="cuda") * 0.02).to(torch.bfloat16)
    q = nvfp4.quantize(w)
    x = torch.randn(2, 1024, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    y = humming_linear(q.packed, q.scale, q.global_scale)(x)
    torch.cuda.synchronize()
    exact = x.double() @ nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double().t()
    err = rel_error(y, exact)
    print(f"one humming GEMM (2 x 1024 @ 1024 x 512) in {time.perf_counter() - t0:.1f} s with its compilation: "
          f"max |error| / max |exact| = {err:.2e}")
    return 0 if err <= 2.0**-7 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,64", help="rows of x per call (default 1,8,64)")
    add_linear_args(p, "7B")
    p.add_argument("--batch-invariant", action="store_true",
                   help="humming's batch-invariant mode (no stream-K), as VLLM_BATCH_INVARIANT=1 runs it; writes "
                   "sweep_humming_bi.jsonl")
    p.add_argument("--time-refused", action="store_true",
                   help="time the cases the correctness check refused too (marked refused; the gate ignores them)")
    p.add_argument("--probe", action="store_true",
                   help="only say what humming compiles with (nvcc, g++, ninja, the CUDA headers it picks) and run one "
                   "small GEMM (2 rows, 512 x 1024) against the dequantized weight")
    p.add_argument("--gate", default=None, metavar="JSONL",
                   help="only judge a finished sweep's JSON lines by §4ac's gate for an engine run: exit 0 if "
                   "passed, 6 if not")
    args = p.parse_args(argv)
    if args.probe:
        return probe()
    if args.gate:
        passed, why = gate(args.gate)
        print(why, flush=True)
        return 0 if passed else 6

    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("sweep_humming: needs a CUDA GPU", file=sys.stderr)
        return 1
    try:
        import humming
    except ImportError as exc:
        print(f"sweep_humming: humming is not installed ({exc}); install the humming-kernels wheel first "
              "(scripts/gpu/session.sh humming)", file=sys.stderr)
        return 1
    import vllm._custom_ops  # noqa: F401  (Marlin's kernels)

    from qerl_plugin import nvfp4
    from vllm_ext.bench.kernels import capture_graph, humming_linear, marlin_linear

    record = jsonl_recorder(args.out, "sweep_humming_bi.jsonl" if args.batch_invariant else "sweep_humming.jsonl")
    rows_list = [int(r) for r in args.rows.split(",")]
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    record({"what": "setup", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "humming": humming.__version__, "vllm": __import__("vllm").__version__, "rows": rows_list,
            "cold_mib": args.cold_mib, "iters": args.iters, "reps": args.reps, "shapes": args.shapes,
            "linears": args.linears, "batch_invariant": args.batch_invariant, "time_refused": args.time_refused})
    finals: list[dict[str, Any]] = []
    refused = 0
    for shape in args.shapes.split(","):
        for lname in args.linears.split(","):
            k, n = LINEARS[shape][lname]
            w, q, raw_bytes, raws = streamed_weight(n, k, args.cold_mib, dev)
            w_exact = nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double()
            t0 = time.perf_counter()
            hums = [humming_linear(p_, s_, q.global_scale, bf16, batch_invariant=args.batch_invariant)
                    for p_, s_ in raws]
            marlins = [marlin_linear(p_, s_, q.global_scale, bf16) for p_, s_ in raws]
            bf16s = bf16_copies(w, args.cold_mib)
            iters = max(args.iters, len(raws))
            record({"what": "linear", "shape": shape, "linear": lname, "n": n, "k": k, "nvfp4_bytes": raw_bytes,
                    "copies": len(raws), "bf16_copies": len(bf16s), "setup_s": round(time.perf_counter() - t0, 1)})
            for rows in rows_list:
                x = torch.randn(rows, k, device=dev, dtype=bf16)
                exact = x.double() @ w_exact.t()
                t0 = time.perf_counter()
                y1 = hums[0](x)
                first_s = time.perf_counter() - t0  # the first call of a row count compiles humming's kernels
                y2 = hums[0](x)
                torch.cuda.synchronize()
                errs = {"humming": rel_error(y1, exact), "marlin": rel_error(marlins[0](x), exact),
                        "bf16": rel_error(F.linear(x, w), exact)}
                same = bool(torch.equal(y1, y2))
                case = {"shape": shape, "linear": lname, "rows": rows}
                record({"what": "check", **case, "rel_error": errs, "same_bits": same,
                        "humming_first_call_s": round(first_s, 2)})
                ok = correct(errs["humming"], errs["marlin"], same)
                if not ok:
                    refused += 1
                    record({"what": "final", **case, "error": "humming refused: error beyond 2 x Marlin's and the "
                            "bf16 rounding, or not the same bits twice", "rel_error": errs, "same_bits": same})
                    if not args.time_refused:
                        continue
                graphs = {"humming": (capture_graph([(lambda h_=h_: h_(x)) for h_ in hums], iters), iters),
                          "marlin": (capture_graph([(lambda r_=r_: r_(x)) for r_ in marlins], iters), iters),
                          "bf16": bf16_graph(x, bf16s, args.iters)}
                res = timed_interleaved(graphs, args.reps)
                del graphs
                fin = {"what": "final" if ok else "timed_refused", "refused": not ok, **case, **res,
                       "rel_error": errs, "same_bits": same,
                       "humming_gb_s": round(raw_bytes / res["humming"]["median_us"] / 1e3, 1),
                       "marlin_gb_s": round(raw_bytes / res["marlin"]["median_us"] / 1e3, 1),
                       "humming_vs_marlin": verdict(res["humming"], res["marlin"]),
                       "marlin_over_humming": round(res["marlin"]["median_us"] / res["humming"]["median_us"], 3)}
                record(fin)
                finals.append(fin)
            del raws, hums, marlins, bf16s, w_exact
            torch.cuda.empty_cache()

    lines = ["", "humming vs Marlin (NVFP4) and BF16 cuBLAS, weights streamed from HBM: us per call, median of "
             f"{args.reps} (spread); GB/s = NVFP4 bytes (codes + FP8 scales) / time",
             f"{'shape':<5} {'linear':<8}{'rows':>5}" + "".join(f"{k_:>17}" for k_ in KEYS)
             + f"{'hum GB/s':>9}{'mar GB/s':>9}  humming vs Marlin"]
    for f in finals:
        cell = lambda r: f"{r['median_us']:>9.2f} ±{r['spread_us']:<5.2f}"  # noqa: E731
        lines.append(f"{f['shape']:<5} {f['linear']:<8}{f['rows']:>5}" + "".join(cell(f[k_]) for k_ in KEYS)
                     + f"{f['humming_gb_s']:>9.0f}{f['marlin_gb_s']:>9.0f}  {f['humming_vs_marlin']}"
                     + f" ({f['marlin_over_humming']:.3f}x)" + (" [refused]" if f["refused"] else ""))
    lines += decode_step_lines(finals, args.shapes, rows_list, args.linears, record)
    lines.append(f"cases refused (humming's error beyond 2 x Marlin's and the bf16 rounding, or bits differing): "
                 f"{refused}")
    print("\n".join(lines), flush=True)
    return 1 if refused else 0


if __name__ == "__main__":
    raise SystemExit(main())
