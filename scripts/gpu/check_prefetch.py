#!/usr/bin/env python3
"""GPU timing: does pulling the next linear's 4-bit weights into L2 ahead of time (vllm_ext.l2_prefetch) make a 7B
decode step's one-row linears faster? Each step (28 layers, every layer its own weights, so they stream from HBM as
in the engine) is captured in a CUDA graph:

    qkv -> [attention stand-in] -> o -> [norm stand-in] -> gate_up -> [activation stand-in] -> down -> [norm stand-in]

The linears are decode_gemv's one-row kernel (torch.ops.qerl.nvfp4_gemv_row's tiles and dependent launches, as
shipped); the stand-ins are one-program kernels that spin on the GPU's clock for ``--attn-us`` / ``--small-us``
microseconds and touch no memory (the engine's attention, norms and activation at batch 1 read little). Variants
(which kernel asks for which bytes):

    none         no prefetch (as shipped)
    o            qkv asks for o's weights (codes and scales)
    o+guX        qkv asks for o's weights and the first X MB of gate_up's (its first rows: the first programs')
    o,gu:X       qkv asks for o's; o asks for the first X MB of gate_up's
    qkv          down asks for the next layer's qkv
    o+guX,qkv    both

First every variant's 112 outputs are compared with ``none``'s (the same bits: the prefetch is a hint). Then the graphs
(and one of the stand-ins alone, for the fixed cost of the gaps) are replayed ``--reps`` times, interleaved; per
variant the median ms per step and the spread (max - min). Faster/slower where the medians differ by more than both
spreads, else equal. Needs only torch and Triton, run from the repository root:

    PYTHONPATH=. python3 scripts/gpu/check_prefetch.py [--reps 7] [--attn-us 12,4] [--small-us 3]

Writes $OUT/check_prefetch.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HIDDEN, INTER, QKV, LAYERS = 3584, 18944, 4608, 28  # Qwen2.5-7B

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the GPU machine has Triton
    triton = None

if triton is not None:

    @triton.jit
    def _spin(t_ptr, NS: tl.constexpr):
        """One program that waits ``NS`` nanoseconds on %globaltimer; it reads one int32 and stores nothing."""
        zero = tl.load(t_ptr)
        start = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [zero], dtype=tl.int64,
                                          is_pure=False, pack=1)
        now = start
        while now - start < NS:
            now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [zero], dtype=tl.int64,
                                            is_pure=False, pack=1)


def variants(gu_mb: list[int], one: bool) -> dict[str, dict[str, tuple[str, ...]]]:
    """Variant name -> {linear: the targets it prefetches}; a target is 'o', 'qkv+' (the next layer's qkv) or
    'guX' (X MB of gate_up). ``one``: each also with one request per program (name suffix '/1')."""
    out: dict[str, dict[str, tuple[str, ...]]] = {"none": {}, "o": {"qkv": ("o",)}, "qkv": {"down": ("qkv+",)}}
    for mb in gu_mb:
        out[f"o+gu{mb}"] = {"qkv": ("o", f"gu{mb}")}
        out[f"o,gu:{mb}"] = {"qkv": ("o",), "o": (f"gu{mb}",)}
        out[f"o+gu{mb},qkv"] = {"qkv": ("o", f"gu{mb}"), "down": ("qkv+",)}
    if one:
        out.update({f"{name}/1": spec for name, spec in out.items() if spec})
    return out


def compare(a: dict, b: dict) -> tuple[float, str]:
    """How much faster ``a`` is than ``b`` (ms, medians) and the verdict by the spread rule."""
    diff = b["median_ms"] - a["median_ms"]
    if abs(diff) <= max(a["spread_ms"], b["spread_ms"]):
        return diff, "equal"
    return diff, "faster" if diff > 0 else "slower"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--attn-us", default="12,4", help="attention stand-in, microseconds; a list runs each setting")
    p.add_argument("--small-us", type=float, default=3.0, help="norm / activation stand-ins, microseconds")
    p.add_argument("--gu-mb", default="8,16,24", help="MB of gate_up to prefetch, a list")
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--one", action="store_true", help="also each variant with one request per program ('/1')")
    p.add_argument("--diag", action="store_true",
                   help="also: o and qkv with weights hot in L2 against streamed, and q/k/v's cost of asking")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    from vllm_ext.bench.kernels import capture_graph
    from vllm_ext.l2_prefetch import plan_bytes, prefetch_plan
    from vllm_ext.nvfp4_gemv import decode_tile, nvfp4_small_gemm, pdl_supported

    out_dir = Path(args.out or os.environ.get("OUT") or ".out").expanduser().resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    pdl = pdl_supported(dev)

    def triple(n: int, k: int):
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
        scale = (torch.rand(n, k // 16, device=dev) * 2 + 0.25).to(torch.float8_e4m3fn)
        return packed, scale, torch.tensor([448.0 * 6.0], device=dev)

    shapes = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
    xs = {k: torch.randn(1, k, device=dev, dtype=bf16) for k in (HIDDEN, INTER)}
    layers = [{name: triple(n, k) for name, (n, k) in shapes.items()} for _ in range(args.layers)]
    biases = [torch.randn(QKV, device=dev, dtype=bf16) for _ in range(args.layers)]
    tiny = torch.zeros(1, device=dev, dtype=torch.int32)
    gu_mb = [int(v) for v in args.gu_mb.split(",") if v]
    attn_list = [float(v) for v in args.attn_us.split(",")]
    table = variants(gu_mb, args.one)

    def regions(li: int, target: str) -> list:
        if target == "o":
            return [layers[li]["o"][0], layers[li]["o"][1]]
        if target == "qkv+":
            nxt = layers[(li + 1) % args.layers]["qkv"]
            return [nxt[0], nxt[1]]
        mb = int(target[2:])
        packed, scale, _ = layers[li]["gate_up"]
        row_bytes = packed.shape[1] + scale.shape[1]
        rows = min(packed.shape[0], (mb * 2**20) // row_bytes // 8 * 8)
        return [(packed, rows), (scale, rows)]

    plans: dict[str, list[dict[str, torch.Tensor | None]]] = {}
    for vname, spec in table.items():
        per_layer = []
        for li in range(args.layers):
            d = {}
            for lin, targets in spec.items():
                d[lin] = prefetch_plan(*[r for t in targets for r in regions(li, t)])
            per_layer.append(d)
        plans[vname] = per_layer

    def linear(li: int, name: str, plan, one: bool = False):
        packed, scale, g = layers[li][name]
        k = packed.shape[1] * 2
        x = xs[k]
        bias = biases[li] if name == "qkv" else None
        return nvfp4_small_gemm(x, packed, scale, g, words=True, xvec=True, bias=bias, pdl=pdl, prefetch=plan,
                                prefetch_one=one, **decode_tile(packed.shape[0], k))

    def spin(us: float):
        _spin[(1,)](tiny, NS=int(us * 1000), num_warps=1)

    def step_calls(vname: str, attn_us: float, outs: list | None = None):
        calls = []
        for li in range(args.layers):
            for name, gap in (("qkv", attn_us), ("o", args.small_us), ("gate_up", args.small_us),
                              ("down", args.small_us)):
                plan = plans[vname][li].get(name)

                def call(li=li, name=name, plan=plan, one=vname.endswith("/1")):
                    y = linear(li, name, plan, one)
                    if outs is not None:
                        outs.append(y)
                calls.append(call)
                if gap > 0:
                    calls.append(lambda gap=gap: spin(gap))
        return calls

    # 1. the same bits with and without each plan
    ref: list = []
    for c in step_calls("none", 0.0, ref):
        c()
    check = {}
    for vname in table:
        got: list = []
        for c in step_calls(vname, 0.0, got):
            c()
        torch.cuda.synchronize()
        check[vname] = all(torch.equal(a, b) for a, b in zip(ref, got)) and len(got) == len(ref)
    print(json.dumps(check), flush=True)

    # 2. the step graphs, interleaved replays
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                    "layers": args.layers, "small_us": args.small_us, "pdl": pdl, "check": check,
                    "plan_mb": {v: {lin: plan_bytes(pl) / 2**20 for lin, pl in plans[v][0].items()} for v in table},
                    "weight_gb": sum(t.numel() * t.element_size() for L in layers for tr in L.values()
                                     for t in tr[:2]) / 1e9,
                    "settings": {}}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for attn_us in attn_list:
        graphs = {}
        for vname in table:
            calls = step_calls(vname, attn_us)
            graphs[vname] = capture_graph(calls, len(calls), warmups=2)
        gaps = [lambda: spin(attn_us)] + [lambda: spin(args.small_us)] * 3
        gaps = gaps * args.layers
        graphs["gaps only"] = capture_graph(gaps, len(gaps), warmups=1)
        if args.diag:  # per layer one kernel (or two) and the attention stand-in
            o_plans = plans["o"]
            diag = {
                "d:o streamed": lambda li: [lambda: linear(li, "o", None)],
                "d:o hot": lambda li: [lambda: linear(0, "o", None)],
                "d:qkv streamed": lambda li: [lambda: linear(li, "qkv", None)],
                "d:qkv hot": lambda li: [lambda: linear(0, "qkv", None)],
                "d:qkv asks o": lambda li: [lambda: linear(li, "qkv", o_plans[li]["qkv"])],
                "d:qkv asks o/1": lambda li: [lambda: linear(li, "qkv", o_plans[li]["qkv"], True)],
                "d:qkv,o": lambda li: [lambda: linear(li, "qkv", None), None, lambda: linear(li, "o", None)],
                "d:qkv asks o,o": lambda li: [lambda: linear(li, "qkv", o_plans[li]["qkv"]), None,
                                              lambda: linear(li, "o", None)],
                "d:qkv asks o/1,o": lambda li: [lambda: linear(li, "qkv", o_plans[li]["qkv"], True), None,
                                                lambda: linear(li, "o", None)],
            }
            for dname, make in diag.items():
                calls = []
                for li in range(args.layers):
                    seq = make(li)
                    calls += [c if c is not None else (lambda: spin(attn_us)) for c in seq]
                    if seq[-1] is not None:
                        calls.append(lambda: spin(attn_us))
                graphs[dname] = capture_graph(calls, len(calls), warmups=2)
            graphs["d:attn gaps only"] = capture_graph([lambda: spin(attn_us)], args.layers, warmups=1)
        times: dict[str, list[float]] = {v: [] for v in graphs}
        for _ in range(2):
            for g in graphs.values():
                g.replay()
        torch.cuda.synchronize()
        for _ in range(args.reps):
            for vname, g in graphs.items():
                start.record()
                g.replay()
                end.record()
                end.synchronize()
                times[vname].append(start.elapsed_time(end))
        rows = {v: {"median_ms": round(statistics.median(t), 4), "spread_ms": round(max(t) - min(t), 4),
                    "runs_ms": [round(x, 4) for x in t]} for v, t in times.items()}
        for v in table:
            diff, verdict = compare(rows[v], rows["none"])
            rows[v]["vs_none_ms"] = round(diff, 4)
            rows[v]["verdict"] = verdict
        result["settings"][str(attn_us)] = rows
        gap_ms = rows["gaps only"]["median_ms"]
        print(f"\nattention stand-in {attn_us} us, others {args.small_us} us; {args.layers} layers; ms per step, "
              f"median of {args.reps} (spread); gaps alone {gap_ms:.4f} ms")
        for v in table:
            r = rows[v]
            print(f"  {v:<14} {r['median_ms']:.4f} ({r['spread_ms']:.4f})  linears ~{r['median_ms'] - gap_ms:.4f}  "
                  f"vs none {r['vs_none_ms']:+.4f} ms -> {r['verdict']}")
        if args.diag:
            g1 = rows["d:attn gaps only"]["median_ms"]
            print(f"  diagnostics: {args.layers} x (kernels, one attention stand-in); us per layer after the gaps' "
                  f"{g1 * 1000 / args.layers:.2f}")
            for v in rows:
                if v.startswith("d:") and v != "d:attn gaps only":
                    r = rows[v]
                    gaps_here = 2 if v.endswith(",o") else 1
                    per = (r["median_ms"] - gaps_here * g1) * 1000 / args.layers
                    print(f"    {v[2:]:<18} {r['median_ms']:.4f} ms ({r['spread_ms']:.4f})  ~{per:.2f} us per layer")
    (out_dir / "check_prefetch.json").write_text(json.dumps(result, indent=1))
    ok = all(check.values())
    print("same bits as without prefetch:", "all" if ok else [v for v, c in check.items() if not c])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
