#!/usr/bin/env python3
"""GPU check of the experimental W4A16 NVFP4 GEMM (``vllm_ext.nvfp4_gemv``) against vLLM's Marlin FP4 GEMM on the
linears of a 7B (or ``--shape 32B``) decode step: error, a tile sweep, and the time per call with the weights
streamed from HBM.

Run from the repository root on the GPU machine (vLLM installed):

    python3 scripts/gpu/check_gemv.py                       # 7B: qkv, o, gate_up, down at 1, 8, 64 rows
    python3 scripts/gpu/check_gemv.py --batches 1 --quick   # a few tiles only

For each linear and row count:
  1. every tile of the sweep (block_n x block_k x split_k x warps) runs once and its error is checked: max |y - ref|
     against ``ref`` = the fp32 product of ``x`` with the codec's dequantized weight, which must be at most 2 x
     Marlin's own error + 1e-2; split-K must give the same bits twice. Only correct tiles are timed.
  2. each correct tile is timed once: ``--iters`` calls captured in one CUDA graph that cycle through copies of the
     weight, enough copies that one pass reads >= ``--cold-mib`` MiB. So the weights come from HBM as in a decode
     step, not from the 50 MB L2 (a single copy of q/k/v, 9 MB, would stay in L2).
  3. the fastest tile, Marlin and BF16 cuBLAS are then timed ``--reps`` times each, interleaved; median and
     (max - min). Per decode step: the medians summed over the four linears times the layer count. At one row,
     the tile ``decode_tile`` ships for that linear (what decode_gemv runs) is timed with them, when it is not
     the fastest.

A tile is "faster than Marlin" for a linear where the difference of the medians exceeds both spreads.
Writes $OUT/check_gemv.jsonl (one JSON object per measurement) and prints the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Qwen2.5-7B / 32B: (input features, output features) of the fused projections, and the layer counts
LINEARS = {
    "7B": {"qkv": (3584, 4608), "o": (3584, 3584), "gate_up": (3584, 37888), "down": (18944, 3584)},
    "32B": {"qkv": (5120, 7168), "o": (5120, 5120), "gate_up": (5120, 55296), "down": (27648, 5120)},
}
LAYERS = {"7B": 28, "32B": 64}


def sweep_tiles(quick: bool = False, sweep: str = "tiles", m: int = 1) -> list[dict[str, int]]:
    """The tiles tried: block_n (tensor-core M), block_k, split_k, warps. ``sweep="diag"``: the one-row CUDA-core path
    (m = 1 only), per-group scale loads, larger K tiles and pipeline depths, to find what limits the kernel."""
    if sweep == "words":  # the one-row word kernel (m = 1 only)
        if m != 1:
            return []
        tiles = [dict(block_n=bn, block_k=bk, split_k=sk, num_warps=4, words=True)
                 for bn, bk, sk in itertools.product((8, 16, 32), (256, 512), (1, 2, 4, 8))]
        return tiles + [dict(block_n=8, block_k=bk, split_k=sk, num_warps=2, words=True)
                        for bk, sk in itertools.product((256, 512), (1, 2, 4, 8))]
    if sweep == "xvec":  # the one-row kernel, PTX decode, with x and scales loaded once per word/group (m = 1 only)
        if m != 1:
            return []
        tiles = [dict(block_n=bn, block_k=bk, split_k=sk, num_warps=w, words=True, asm=True, xvec=True)
                 for bn, bk, sk, w in itertools.product((4, 8, 16), (256, 512), (1, 2, 4, 8), (1, 2, 4))]
        return tiles + [dict(block_n=bn, block_k=512, split_k=sk, num_warps=1, words=True, asm=True)
                        for bn, sk in ((4, 1), (4, 2), (8, 4))]  # lease 5's best tiles on it
    if sweep == "asm":  # the one-row word kernel with the PTX decode (m = 1 only), and lease 4's best tiles without it
        if m != 1:
            return []
        tiles = [dict(block_n=bn, block_k=bk, split_k=sk, num_warps=w, words=True, asm=True)
                 for bn, bk, sk, w in itertools.product((4, 8, 16), (256, 512), (1, 2, 4, 8), (1, 2, 4))]
        return tiles + [dict(block_n=bn, block_k=512, split_k=sk, num_warps=w, words=True, asm=False)
                        for bn, sk, w in ((8, 1, 1), (8, 8, 1), (4, 1, 2), (8, 4, 1))]
    if sweep == "diag":
        tiles: list[dict[str, Any]] = []
        if m == 1:
            tiles += [dict(block_n=bn, block_k=bk, split_k=sk, num_warps=4, fma=True, group_scales=gs)
                      for gs, bn, bk, sk in itertools.product((False, True), (16, 32, 64), (256, 512), (1, 4))]
        tiles += [dict(block_n=64, block_k=bk, split_k=sk, num_warps=w, num_stages=st, group_scales=True)
                  for bk, sk, st, w in itertools.product((256, 512), (4, 8), (2, 4), (4, 8))]
        return tiles
    if quick:
        return [dict(block_n=64, block_k=128, split_k=s, num_warps=4) for s in (1, 4)]
    tiles = [dict(block_n=bn, block_k=bk, split_k=sk, num_warps=4)
             for bn, bk, sk in itertools.product((64, 128), (128, 256), (1, 2, 4, 8))]
    tiles += [dict(block_n=128, block_k=bk, split_k=sk, num_warps=8) for bk, sk in itertools.product((128, 256), (1, 4))]
    return tiles


def tile_name(t: dict[str, Any]) -> str:
    name = f"n{t['block_n']}k{t['block_k']}s{t['split_k']}w{t['num_warps']}"
    if t.get("num_stages") is not None:
        name += f"p{t['num_stages']}"
    name += ("F" if t.get("fma") else "") + ("G" if t.get("group_scales") else "") + ("W" if t.get("words") else "")
    name += {True: "A", False: "I"}.get(t.get("asm"), "")  # PTX decode / Triton integer decode
    name += "X" if t.get("xvec") else ""
    name += "M" if t.get("mma") else ""  # the few-row tensor-core kernel on words
    name += "L" if t.get("gluon") else ""  # vllm_ext.nvfp4_gluon (explicit layouts)
    name += "R" if t.get("prefetch") else ""  # vllm_ext.nvfp4_gluon loading the next K tile ahead
    name += "V" if t.get("wide") else ""  # vllm_ext.nvfp4_gluon's wide (16-byte) loads
    name += "B" if t.get("bits") else ""  # vllm_ext.nvfp4_gluon's E2M1 decode by moving bits
    name += "H" if t.get("wgmma") else ""  # vllm_ext.nvfp4_gluon's warpgroup-MMA (Hopper) version
    name += "Q" if t.get("marlin") else ""  # ... on Marlin's own tensors (nvfp4_gluon_marlin_gemm)
    name += "T" if t.get("tma") else ""  # vllm_ext.nvfp4_gemv_tma (the weight's tiles by TMA)
    return name + (f"S{t['stages']}" if t.get("stages") else "")  # a software-pipelined loop


def tile_4m(n: int, k: int) -> dict[str, int]:
    """decode_tile as §4m shipped it (before the pipelined loop of §4n): the baseline that sweep_row.py and
    check_row_lora.py time beside today's tiles."""
    if k > 8192:
        return dict(block_n=8, block_k=512, split_k=8 if k > 20480 else 4, num_warps=2)
    if n > 16384:
        return dict(block_n=8, block_k=512, split_k=1, num_warps=2)
    return dict(block_n=4, block_k=512, split_k=1, num_warps=4 if k <= 4096 else 2)


def copies_for(nbytes: int, cold_mib: float, cap: int = 64) -> int:
    """How many weight copies one pass must cycle through to read at least ``cold_mib`` MiB."""
    return max(1, min(cap, math.ceil(cold_mib * 2**20 / max(nbytes, 1))))


def streamed_weight(n: int, k: int, cold_mib: float, device):  # noqa: ANN001, ANN201
    """The weight every GPU sweep here times: ``[n, k]`` bfloat16, N(0, 0.02) after ``torch.manual_seed(0)``; its
    NVFP4 triple; its NVFP4 bytes (codes + FP8 scales); and :func:`copies_for` copies of ``(packed, scale)``, so that
    one pass over them reads at least ``cold_mib`` MiB (from HBM, not the L2). Draws nothing else from the generator,
    so what a caller draws next is as before."""
    import torch

    from qerl_plugin import nvfp4

    torch.manual_seed(0)
    w = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)
    q = nvfp4.quantize(w)
    raw_bytes = q.packed.numel() + q.scale.numel()
    return w, q, raw_bytes, [(q.packed.clone(), q.scale.clone()) for _ in range(copies_for(raw_bytes, cold_mib))]


def fp8_decode_device(prog: str):  # noqa: ANN201
    """The CUDA device for a timing of the one-row kernels' decode modes, with ``QERL_ROW_DECODE`` cleared (each graph
    sets it); None, after a message naming ``prog``, without a CUDA GPU or without the decode through FP8 (compute
    capability 8.9 and later). Used by bench_decode.py."""
    import torch

    from vllm_ext.nvfp4_decode import DECODE_ENV, decode_mode

    if not torch.cuda.is_available():
        print(f"{prog}: needs a CUDA GPU", file=sys.stderr)
        return None
    dev = torch.device("cuda")
    os.environ.pop(DECODE_ENV, None)
    if decode_mode(dev) != 2:
        print(f"{prog}: the decode through FP8 needs compute capability 8.9 or later", file=sys.stderr)
        return None
    return dev


@contextlib.contextmanager
def decode_env(mode: str):  # noqa: ANN201
    """``QERL_ROW_DECODE`` set to ``mode`` inside the block, as it was after it: the mode is read at each launch, and a
    captured CUDA graph keeps the kernel it launched. Shared by the scripts that time the decode modes side by side."""
    from vllm_ext.nvfp4_decode import DECODE_ENV

    had = os.environ.get(DECODE_ENV)
    os.environ[DECODE_ENV] = mode
    try:
        yield
    finally:
        if had is None:
            os.environ.pop(DECODE_ENV, None)
        else:
            os.environ[DECODE_ENV] = had


def bf16_copies(w, cold_mib: float) -> list:  # noqa: ANN001
    """The BF16 baseline's weight as the sweeps stream it: :func:`copies_for` clones of ``w``, so that one pass over
    them reads at least ``cold_mib`` MiB (as :func:`streamed_weight` gives the NVFP4 ones)."""
    return [w.clone() for _ in range(copies_for(w.numel() * w.element_size(), cold_mib))]


def bf16_graph(x, copies: list, iters: int):  # noqa: ANN001, ANN201
    """``(CUDA graph, calls)`` of ``F.linear(x, copy)`` cycling through :func:`bf16_copies`'s ``copies``, at least
    ``iters`` calls and one per copy: the BF16 row each sweep times beside its kernels (:func:`timed_interleaved`)."""
    import torch.nn.functional as F

    from vllm_ext.bench.kernels import capture_graph

    calls = max(iters, len(copies))
    return capture_graph([(lambda w_=w_: F.linear(x, w_)) for w_ in copies], calls), calls


def summarize(times_us: list[float]) -> dict[str, float]:
    return {"median_us": round(statistics.median(times_us), 2), "spread_us": round(max(times_us) - min(times_us), 2),
            "runs_us": [round(t, 2) for t in times_us]}


def timed_interleaved(graphs: dict[str, tuple[Any, int]], reps: int,
                      replay: Callable[[Any, int], float] | None = None) -> dict[str, dict[str, float]]:
    """Each CUDA graph of ``graphs`` (key -> (graph, calls in it)) replayed ``reps`` times, the keys interleaved in
    every repeat (so a drift of the GPU's clocks falls on all of them alike): key -> :func:`summarize` of the
    microseconds per call. ``replay`` defaults to :func:`vllm_ext.bench.kernels.replay_us`."""
    if replay is None:
        from vllm_ext.bench.kernels import replay_us as replay
    times: dict[str, list[float]] = {key: [] for key in graphs}
    for _ in range(reps):
        for key, (graph, iters) in graphs.items():
            times[key].append(replay(graph, iters))
    return {key: summarize(v) for key, v in times.items()}


def add_timing_args(p: argparse.ArgumentParser) -> None:
    """The options of a kernel timing with cold weights: calls per graph, timed replays, MiB read per pass."""
    p.add_argument("--iters", type=int, default=64, help="calls per CUDA graph (at least the copy count)")
    p.add_argument("--reps", type=int, default=5, help="timed replays per kernel in the final comparison")
    p.add_argument("--cold-mib", type=float, default=256.0, help="MiB one pass of a graph reads (default 256)")


def add_linear_args(p: argparse.ArgumentParser, shapes: str) -> None:
    """The options of a timing over a decode step's linears: which shapes (default ``shapes``) and linears, the
    timing's (:func:`add_timing_args`), and the output folder."""
    p.add_argument("--shapes", default=shapes, help=f"Qwen2.5 shapes, from 7B and 32B (default {shapes})")
    p.add_argument("--linears", default="qkv,o,gate_up,down", help="from qkv, o, gate_up, down")
    add_timing_args(p)
    p.add_argument("--out", default=None, help="output folder (default $OUT or ./.out)")


def jsonl_recorder(out_arg: str | None, name: str) -> Callable[..., None]:
    """``record(obj, echo=True)``: append ``obj`` as one JSON line to ``name`` in ``out_arg`` (else $OUT, else
    ./.out), and print it unless ``echo`` is false."""
    out = Path(out_arg or os.environ.get("OUT") or ".out").expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = (out / name).open("a")

    def record(obj: dict[str, Any], echo: bool = True) -> None:
        log.write(json.dumps(obj) + "\n")
        log.flush()
        if echo:
            print(json.dumps(obj), flush=True)

    return record


def per_step_ms(finals: list[dict[str, Any]], keys: tuple[str, ...], layers: int) -> tuple[dict, dict]:
    """A decode step's time from one call per linear: for each of ``keys``, the sum over ``finals`` (one per linear)
    of the median and of the spread (µs per call), times ``layers``, in ms."""
    def total(key: str, stat: str) -> float:
        return round(layers * sum(f[key][stat] for f in finals) / 1000.0, 3)

    return {k: total(k, "median_us") for k in keys}, {k: total(k, "spread_us") for k in keys}


def shape_steps(finals: list[dict[str, Any]], shapes: str, linears: str,
                keys: tuple[str, ...]) -> list[tuple[str, list[dict[str, Any]], dict, dict]]:
    """``(shape, its finals, medians, spreads)`` for each of ``shapes`` whose ``linears`` all finished in ``finals``:
    its decode step over ``keys`` (:func:`per_step_ms`)."""
    out = []
    for shape in shapes.split(","):
        sel = [f for f in finals if f["shape"] == shape]
        if len(sel) == len(linears.split(",")):
            out.append((shape, sel, *per_step_ms(sel, keys, LAYERS[shape])))
    return out


def step_lines(finals: list[dict[str, Any]], shapes: str, linears: str, keys: tuple[str, ...],
               record: Callable[..., None], label: str = "step", unit: str = "") -> list[str]:
    """For each of ``shapes`` whose ``linears`` all finished in ``finals``: its decode step's medians and spreads over
    ``keys`` (:func:`shape_steps`), recorded as a ``per_step_ms`` row, and a line describing it: "per <shape> <label>
    (x<layers>): <key> <median><unit> (±<spread>), ..." (sweep_marlin_row: ``label`` "decode step", ``unit`` " ms")."""
    lines = []
    for shape, _, step, spread in shape_steps(finals, shapes, linears, keys):
        record({"what": "per_step_ms", "shape": shape, "median": step, "spread": spread})
        lines.append(f"per {shape} {label} (x{LAYERS[shape]}): " + ", ".join(
            f"{key} {step[key]:.3f}{unit} (±{spread[key]:.3f})" for key in keys))
    return lines


def verdict(a: dict[str, float], b: dict[str, float]) -> str:
    """'faster' / 'slower' for ``a`` against ``b`` where the medians differ by more than both spreads, else 'equal'
    (a difference equal to the spread, up to float rounding, is 'equal')."""
    diff = b["median_us"] - a["median_us"]
    if abs(diff) <= max(a["spread_us"], b["spread_us"]) + 1e-9:
        return "equal"
    return "faster" if diff > 0 else "slower"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,64", help="rows per call (default 1,8,64)")
    p.add_argument("--shape", default="7B", choices=sorted(LINEARS), help="Qwen2.5 shape (default 7B)")
    p.add_argument("--linears", default="qkv,o,gate_up,down", help="from qkv, o, gate_up, down")
    add_timing_args(p)
    p.add_argument("--quick", action="store_true", help="two tiles instead of the sweep")
    p.add_argument("--sweep", choices=("tiles", "diag", "words", "asm", "xvec"), default="tiles",
                   help="tiles: block sizes, split-K and warps (default); diag: the kernel's variants; words: the "
                   "one-row word kernel; asm: that kernel with its PTX decode; xvec: and x loaded once per word (see sweep_tiles)")
    p.add_argument("--out", default=None, help="output folder (default $OUT or ./.out)")
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("check_gemv: needs a CUDA GPU", file=sys.stderr)
        return 1
    from qerl_plugin import nvfp4
    from vllm_ext.bench.kernels import capture_graph as _graph
    from vllm_ext.bench.kernels import marlin_linear
    from vllm_ext.bench.kernels import replay_us as _replay_us
    from vllm_ext import nvfp4_gemv as gemv_mod
    from vllm_ext.nvfp4_gemv import decode_tile, nvfp4_small_gemm

    record = jsonl_recorder(args.out, "check_gemv.jsonl")

    batches = [int(b) for b in args.batches.split(",")]
    tiles = sweep_tiles(args.quick, args.sweep, 1)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    record({"what": "setup", "shape": args.shape, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "tiles": [tile_name(t) for t in tiles], "batches": batches, "cold_mib": args.cold_mib})
    finals: list[dict[str, Any]] = []
    bad = 0
    for lname in args.linears.split(","):
        k, n = LINEARS[args.shape][lname]
        w, q, raw_bytes, raws = streamed_weight(n, k, args.cold_mib, dev)
        w_deq = nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32)
        c_raw = len(raws)
        marlins = [marlin_linear(q.packed, q.scale, q.global_scale, bf16) for _ in range(c_raw)]
        bf16s = bf16_copies(w, args.cold_mib)
        record({"what": "linear", "linear": lname, "n": n, "k": k, "nvfp4_bytes": raw_bytes, "copies": c_raw,
                "bf16_copies": len(bf16s)})
        for m in batches:
            x = torch.randn(m, k, device=dev, dtype=bf16)
            ref = x.float() @ w_deq.t()

            def marlin_call(run):
                return lambda: run(x)

            marlin_err = (marlin_call(marlins[0])().float() - ref).abs().max().item()
            iters = max(args.iters, c_raw)
            swept = []
            for t in sweep_tiles(args.quick, args.sweep, m):
                name = tile_name(t)
                try:
                    y1 = nvfp4_small_gemm(x, q.packed, q.scale, q.global_scale, **t)
                    y2 = nvfp4_small_gemm(x, q.packed, q.scale, q.global_scale, **t)
                    err = (y1.float() - ref).abs().max().item()
                    ok = err <= 2 * marlin_err + 1e-2 and torch.equal(y1, y2)
                    row: dict[str, Any] = {"what": "tile", "linear": lname, "m": m, "tile": name, "max_err": err,
                                           "marlin_err": marlin_err, "repeat_identical": torch.equal(y1, y2), "ok": ok}
                    ck = gemv_mod.LAST_COMPILED
                    for attr in ("n_regs", "n_spills"):
                        row[attr] = getattr(ck, attr, None)
                    row["shared"] = getattr(getattr(ck, "metadata", None), "shared", None)
                    if ok:
                        calls = [(lambda p_=p_, s_=s_: nvfp4_small_gemm(x, p_, s_, q.global_scale, **t)) for p_, s_ in raws]
                        g = _graph(calls, iters)
                        row["us"] = round(_replay_us(g, iters), 2)
                        del g
                        swept.append((row["us"], t))
                    else:
                        bad += 1
                except Exception as exc:  # one tile that does not compile or fit must not hide the others
                    row = {"what": "tile", "linear": lname, "m": m, "tile": name, "error": f"{type(exc).__name__}: {exc}"[:300]}
                record(row)
            if not swept:
                record({"what": "final", "linear": lname, "m": m, "error": "no tile swept or none correct"})
                continue
            best = min(swept, key=lambda s: s[0])[1]
            tile = decode_tile(n, k) if m == 1 else None
            # the shipped tile as torch.ops.qerl.nvfp4_gemv_row runs it
            shipped = None if tile is None else dict(tile, words=True, asm=True, xvec=True)

            def gemv_graph(t):  # noqa: ANN001, ANN202
                return _graph([(lambda p_=p_, s_=s_: nvfp4_small_gemm(x, p_, s_, q.global_scale, **t))
                               for p_, s_ in raws], iters)

            bf16_g, bf16_calls = bf16_graph(x, bf16s, args.iters)
            graphs = {"gemv": gemv_graph(best), "marlin": _graph([marlin_call(ml) for ml in marlins], iters),
                      "bf16": bf16_g}
            its = {"gemv": iters, "marlin": iters, "bf16": bf16_calls}
            if shipped is not None and tile_name(shipped) != tile_name(best):
                graphs["shipped"] = gemv_graph(shipped)
                its["shipped"] = iters
            res = timed_interleaved({key: (g, its[key]) for key, g in graphs.items()}, args.reps)
            del graphs
            fin = {"what": "final", "linear": lname, "m": m, "tile": tile_name(best), **{key: res[key] for key in res},
                   "gemv_vs_marlin": verdict(res["gemv"], res["marlin"]),
                   "marlin_over_gemv": round(res["marlin"]["median_us"] / res["gemv"]["median_us"], 3),
                   "gemv_gb_s": round(raw_bytes / res["gemv"]["median_us"] / 1e3, 1),
                   "marlin_gb_s": round(raw_bytes / res["marlin"]["median_us"] / 1e3, 1)}
            if shipped is not None:
                fin["shipped_tile"] = tile_name(shipped)
                fin["shipped"] = res.get("shipped", res["gemv"])
                fin["best_vs_shipped"] = verdict(res["gemv"], fin["shipped"]) if "shipped" in res else "same tile"
            record(fin)
            finals.append(fin)
        del raws, marlins, bf16s
        torch.cuda.empty_cache()

    lines = ["", "W4A16 GEMM vs Marlin, weights streamed from HBM (us per call, median of "
             f"{args.reps}, spread = max - min); GB/s = NVFP4 bytes (codes + FP8 scales) / time",
             f"{'linear':<8}{'m':>4}  {'tile':<14}{'gemv':>16}{'marlin':>16}{'bf16':>16}{'marlin/gemv':>12}"
             f"{'gemv GB/s':>10}{'marlin GB/s':>12}  verdict"]
    for f in finals:
        cell = lambda r: f"{r['median_us']:>9.1f} ±{r['spread_us']:<5.1f}"  # noqa: E731
        lines.append(f"{f['linear']:<8}{f['m']:>4}  {f['tile']:<14}{cell(f['gemv'])}{cell(f['marlin'])}{cell(f['bf16'])}"
                     f"{f['marlin_over_gemv']:>12.3f}{f['gemv_gb_s']:>10.0f}{f['marlin_gb_s']:>12.0f}  {f['gemv_vs_marlin']}")
    for m in batches:
        sel = [f for f in finals if f["m"] == m]
        if len(sel) == len(args.linears.split(",")):
            layers = LAYERS[args.shape]
            keys = ("gemv", "marlin", "bf16") + (("shipped",) if all("shipped" in f for f in sel) else ())
            step, spread = per_step_ms(sel, keys, layers)
            record({"what": "per_step_ms", "shape": args.shape, "m": m, "median": step, "spread": spread})
            lines.append(f"per {args.shape} decode step (x{layers}), m={m}: gemv (best tiles) {step['gemv']:.3f} ms "
                         f"(±{spread['gemv']:.3f}), marlin {step['marlin']:.3f} (±{spread['marlin']:.3f}), bf16 "
                         f"{step['bf16']:.3f} (±{spread['bf16']:.3f})"
                         + (f", shipped tiles {step['shipped']:.3f} (±{spread['shipped']:.3f})" if "shipped" in step else ""))
    lines.append(f"tiles refused for error or non-reproducible split-K: {bad}")
    print("\n".join(lines), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
