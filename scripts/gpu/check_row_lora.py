#!/usr/bin/env python3
"""GPU timing of one 7B (or 32B) decode step's linears at batch 1 with LoRA, four ways, each step captured in a CUDA
graph with every layer's own weights (so the 4-bit weights stream from HBM, as in the engine):

  row          decode_gemv's one-row kernel alone (torch.ops.qerl.nvfp4_gemv_row, as shipped: a programmatic
               dependent launch on Hopper since §4p): the LoRA-free floor
  row_nopdl    the same kernel and tile launched plainly (§4n's row)
  row+fused    the row kernel, then the one-launch LoRA kernel (vllm_ext.lora_fused) on one stream: decode_gemv with
               additional_config={"qerl_lora": "fused"}
  row||fused   the LoRA kernel on a second stream beside the row kernel, joined and added: decode_gemv with the
               overlap mode before vllm_ext.nvfp4_gemv_lora
  row_lora     vllm_ext.nvfp4_gemv_lora: a small shrink kernel, then the row kernel with the LoRA expand in its
               epilogue (two launches, no synchronisation between programs)
  row_lora_pdl the same with both launches programmatic dependent launches (Hopper, as shipped since §4p): the
               shrink waits for the kernel before it, then lets the row kernel start, which waits for the shrink only
               before reading its result
  row_lora_pdl1 only the row kernel a dependent launch (§4m-§4n's row+lora)
  row_s0, row_lora_pdl_s0
               row and row_lora_pdl with §4m's tiles and an unpipelined loop (stages 0), when decode_tile's tiles
               differ from them: the kernels before §4n, in the same run

Needs only torch and Triton (no vLLM): run from the repository root on the GPU machine,

    PYTHONPATH=. python3 scripts/gpu/check_row_lora.py [--shape 7B] [--reps 7] [--rank 32]

First every group's one-launch result is compared with row+fused on the same inputs (bf16 rounding steps). Then the
four step graphs are replayed ``--reps`` times, interleaved; per variant the median ms per step and the spread
(max - min). Verdict for row_lora against row+fused (the rule fixed in docs/benchmarks.md §4m before the run):
faster where the difference of the medians exceeds both spreads. Writes $OUT/check_row_lora.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "scripts" / "gpu"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from check_gemv import tile_4m  # noqa: E402

SHAPES = {  # hidden, intermediate, q features, kv features, layers (Qwen2.5)
    "7B": (3584, 18944, 3584, 512, 28),
    "32B": (5120, 27648, 5120, 1024, 64),
}
VARIANTS = ("row", "row+fused", "row||fused", "row_lora", "row_lora_pdl", "row_nopdl", "row_lora_pdl1")
OLD_VARIANTS = ("row_s0", "row_lora_pdl_s0")


def compare(a: dict, b: dict) -> tuple[float, str]:
    """How much faster ``a`` is than ``b`` (ms per step, medians) and the verdict: 'faster' / 'slower' where the
    medians differ by more than both spreads, else 'equal'."""
    diff = b["median_ms"] - a["median_ms"]
    if abs(diff) <= max(a["spread_ms"], b["spread_ms"]):
        return diff, "equal"
    return diff, "faster" if diff > 0 else "slower"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="7B", choices=sorted(SHAPES))
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--reps", type=int, default=7, help="timed replays of each step graph (default 7)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--groups", default="qkv,o,gate_up,down",
                   help="the linears of each layer to time (default all four: a whole step)")
    p.add_argument("--out", default=None, help="output folder (default $OUT or ./.out)")
    args = p.parse_args(argv)

    import torch

    from vllm_ext import lora_fused
    from vllm_ext import nvfp4_gemv_lora as rl
    from vllm_ext.bench.kernels import capture_graph
    from vllm_ext.nvfp4_gemv import decode_tile, nvfp4_gemv_row, nvfp4_small_gemm

    out_dir = Path(args.out or os.environ.get("OUT") or ".out").expanduser().resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    hidden, inter, qf, kvf, layers = SHAPES[args.shape]
    layers = args.layers or layers
    groups = {"qkv": (hidden, (qf, kvf, kvf), True), "o": (qf, (hidden,), False),
              "gate_up": (hidden, (inter, inter), False), "down": (inter, (hidden,), False)}
    groups = {name: groups[name] for name in args.groups.split(",")}
    dev, bf16, r = torch.device("cuda"), torch.bfloat16, args.rank
    torch.manual_seed(0)

    def nvfp4_triple(n: int, k: int):
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
        scale = (torch.rand(n, k // 16, device=dev) * 2 + 0.25).to(torch.float8_e4m3fn)
        return packed, scale, torch.tensor([448.0 * 6.0], device=dev)

    linears = []  # (group, x, packed, scale, gscale, bias, a, b, slices) per layer and group, in step order
    xs = {k: torch.randn(1, k, device=dev, dtype=bf16) for k in (hidden, qf, inter)}
    for _ in range(layers):
        for gname, (k, slices, has_bias) in groups.items():
            n = sum(slices)
            packed, scale, g = nvfp4_triple(n, k)
            bias = torch.randn(n, device=dev, dtype=bf16) if has_bias else None
            a = tuple((torch.randn(1, 1, r, k, device=dev) / k**0.5).to(bf16) for _ in slices)
            b = tuple((torch.randn(1, 1, s, r, device=dev) * 0.05).to(bf16) for s in slices)
            linears.append((gname, xs[k], packed, scale, g, bias, a, b, slices))
    idx = torch.zeros(8, dtype=torch.int32, device=dev)
    sync = lora_fused.new_sync(dev, max(16, r))
    side = (torch.cuda.Stream(device=dev), torch.cuda.Event(), torch.cuda.Event())
    updates = {L[0]: torch.empty(1, sum(L[8]), device=dev, dtype=bf16) for L in linears}
    weight_bytes = sum(L[2].numel() + L[3].numel() for L in linears)
    lora_bytes = sum(t.numel() * 2 for L in linears for t in (*L[6], *L[7]))

    def row(L):
        return nvfp4_gemv_row(L[1], L[2], L[3], L[4], L[5])

    def row_fused(L):
        y = row(L)
        lora_fused.launch(y, L[1], L[6], L[7], 1.0, L[8], idx, sync)
        return y

    def row_beside(L):
        return lora_fused.launch_beside(lambda: row(L), updates[L[0]], L[1], L[6], L[7], 1.0, L[8], idx, sync, *side)

    def one(L, pdl=False, pdl_first=None):
        return rl.launch(L[1], L[2], L[3], L[4], L[5], L[6], L[7], 1.0, L[8], idx, pdl=pdl, pdl_first=pdl_first)

    def one_pdl(L):
        return one(L, pdl=True, pdl_first=True)

    def one_pdl1(L):
        return one(L, pdl=True, pdl_first=False)

    def row_nopdl(L):
        return nvfp4_small_gemm(L[1], L[2], L[3], L[4], bias=L[5], words=True, xvec=True, pdl=False,
                                **decode_tile(L[2].shape[0], L[1].shape[-1]))

    def row_s0(L):
        return nvfp4_small_gemm(L[1], L[2], L[3], L[4], bias=L[5], words=True, xvec=True,
                                **tile_4m(L[2].shape[0], L[1].shape[-1]))

    def one_pdl_s0(L):
        return rl.launch_supported(L[1], L[2], L[3], L[4], L[5], L[6], L[7], 1.0, L[8], idx, pdl=True,
                                   tile=tile_4m(L[2].shape[0], L[1].shape[-1]), pdl_first=False)

    fns = {"row": row, "row+fused": row_fused, "row||fused": row_beside, "row_lora": one, "row_lora_pdl": one_pdl,
           "row_s0": row_s0, "row_lora_pdl_s0": one_pdl_s0, "row_nopdl": row_nopdl, "row_lora_pdl1": one_pdl1}
    variants = VARIANTS
    if any({**tile_4m(sum(sl), k), "stages": 0} != {"stages": 0, **decode_tile(sum(sl), k, lora=lora)}
           for k, sl, _ in groups.values() for lora in (False, True)):
        variants = VARIANTS + OLD_VARIANTS
    result: dict = {"shape": args.shape, "groups": list(groups), "layers": layers, "rank": r,
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__, "weight_gb": weight_bytes / 1e9, "lora_mb": lora_bytes / 1e6,
                    "tiles": {g: decode_tile(sum(s), k) for g, (k, s, _) in groups.items()},
                    "lora_tiles": {g: decode_tile(sum(s), k, lora=True) for g, (k, s, _) in groups.items()},
                    "check": {}}
    # 1. the one launch against the two it replaces, per group (the first layer's weights)
    for L in linears[:len(groups)]:
        want = row_fused(L)
        got = one(L)
        got_pdl = one_pdl(L)
        ulp = 2.0**-7 * want.double().abs().clamp_min(2.0**-126)
        again = torch.equal(got, one(L))
        idx.fill_(-1)
        plain, alone = one(L), row(L)
        idx.fill_(0)
        # steps of at least 1/256 of the largest value (a result near zero moves by many of its own tiny steps
        # when a float32 sum runs in another order)
        ulp_alone = 2.0**-7 * alone.double().abs().clamp_min(alone.double().abs().max().item() / 256)
        result["check"][L[0]] = {"max_ulps": ((got.double() - want.double()).abs() / ulp).max().item(),
                                 "differing": (got != want).double().mean().item(),
                                 "repeat_identical": again,
                                 "pdl_identical": torch.equal(got, got_pdl),
                                 "pdl1_identical": torch.equal(got, one_pdl1(L)),
                                 "row_pdl_identical": torch.equal(row(L), row_nopdl(L)),
                                 "pdl_max_ulps": ((got_pdl.double() - want.double()).abs() / ulp).max().item(),
                                 "no_adapter_max_ulps_vs_row": ((plain.double() - alone.double()).abs()
                                                                / ulp_alone).max().item(),
                                 "no_adapter_differing": (plain != alone).double().mean().item()}
    torch.cuda.synchronize()
    ok = all(c["max_ulps"] <= 1.0 and c["repeat_identical"] and c["pdl_max_ulps"] <= 1.0
             and c["pdl_identical"] and c["pdl1_identical"] and c["row_pdl_identical"]
             and c["no_adapter_max_ulps_vs_row"] <= 1.0
             for c in result["check"].values())
    result["check_ok"] = ok
    print(json.dumps(result["check"], indent=1), flush=True)

    # 2. one step of every variant in its own graph; replays interleaved
    graphs = {}
    for name in variants:
        step = [lambda L=L, f=fns[name]: f(L) for L in linears]
        graphs[name] = capture_graph(step, len(step), warmups=2)
    times: dict[str, list[float]] = {name: [] for name in variants}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):  # untimed replays
        for g in graphs.values():
            g.replay()
    torch.cuda.synchronize()
    for _ in range(args.reps):
        for name, g in graphs.items():
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    rows = {}
    for name in variants:
        t = times[name]
        rows[name] = {"median_ms": round(statistics.median(t), 4), "spread_ms": round(max(t) - min(t), 4),
                      "runs_ms": [round(v, 4) for v in t]}
    result["steps"] = rows
    diff, result["verdict"] = compare(rows["row_lora"], rows["row+fused"])
    result["row_lora_vs_row_fused_ms"] = round(diff, 4)
    pdiff, result["pdl_verdict"] = compare(rows["row_lora_pdl"], rows["row_lora"])
    result["pdl_vs_row_lora_ms"] = round(pdiff, 4)
    result["lora_cost_ms"] = {name: round(rows[name]["median_ms"] - rows["row"]["median_ms"], 4)
                              for name in ("row+fused", "row||fused", "row_lora", "row_lora_pdl", "row_lora_pdl1")}
    for new, old in (("row", "row_nopdl"), ("row_lora_pdl", "row_lora_pdl1")):  # §4p: the first launch dependent too
        d, v = compare(rows[new], rows[old])
        result[f"{new}_vs_{old}"] = {"ms": round(d, 4), "verdict": v}
    if "row_s0" in rows:  # §4n's verdicts: the shipped tiles against §4m's, same run
        for new, old in (("row", "row_s0"), ("row_lora_pdl", "row_lora_pdl_s0")):
            d, v = compare(rows[new], rows[old])
            result[f"{new}_vs_{old}"] = {"ms": round(d, 4), "verdict": v}
    result["row_tb_s"] = round(weight_bytes / (rows["row"]["median_ms"] * 1e-3) / 1e12, 3)
    (out_dir / "check_row_lora.json").write_text(json.dumps(result, indent=1))
    print(f"{args.shape}, {layers} layers, rank {r}, batch 1: 4-bit weights {weight_bytes / 1e9:.2f} GB, "
          f"LoRA {lora_bytes / 1e6:.0f} MB; per step, median of {args.reps} (spread)")
    for name in variants:
        extra = "" if name not in result["lora_cost_ms"] else f"   LoRA +{result['lora_cost_ms'][name]:.3f} ms"
        print(f"  {name:<11} {rows[name]['median_ms']:.4f} ms ({rows[name]['spread_ms']:.4f}){extra}")
    print(f"row kernel alone: {result['row_tb_s']} TB/s; row_lora vs row+fused: {diff:+.4f} ms -> {result['verdict']}; "
          f"row_lora_pdl vs row_lora: {pdiff:+.4f} ms -> {result['pdl_verdict']}; check {'ok' if ok else 'FAILED'}")
    for key in ("row_vs_row_s0", "row_lora_pdl_vs_row_lora_pdl_s0", "row_vs_row_nopdl", "row_lora_pdl_vs_row_lora_pdl1"):
        if key in result:
            print(f"{key}: {result[key]['ms']:+.4f} ms -> {result[key]['verdict']}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
