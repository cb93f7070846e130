#!/usr/bin/env python3
"""What limits decode_gemv's one-row kernel: the shipped kernel's tile run with parts of its work taken away, on the
7B (and 32B) linears with the weights streamed from HBM (docs/benchmarks.md §4ba). Needs only torch and Triton (no
vLLM): from the repository root on the GPU machine,

    PYTHONPATH=. python3 scripts/gpu/probe_row_limit.py [--shapes 7B] [--reps 5]

Per linear, at ``decode_tile``'s tile (block_n, block_k, split_k, warps, stages), timed interleaved ``--reps`` times:
  - ``shipped``: the row kernel as the engine runs it (``nvfp4_small_gemm(words, xvec, asm)``; since §4ba with the
    decode through FP8 on sm_89 and later, where ``full`` keeps the float16 decode);
  - ``full``: the probe kernel doing the same work (the same loads, decode and products), its split-K partials
    stored but not summed; it is checked against the exact product;
  - ``fp8``: ``full`` with the codes decoded through FP8 (``_decode8``'s ``ASM`` 2: fewer integer and logic
    operations per word); checked against the exact product too (``full`` keeps the float16 decode, ``ASM`` 1);
  - ``no_x``: the same loads of words and scales and the same decode, without ``x`` (the 8 codes summed, times the
    scale);
  - ``loads``: the same loads of words, scales and ``x``, with one multiply-add per word instead of the decode and
    the 8 products;
  - ``words``: the words alone (no scales, no ``x``): the tile's streaming rate;
  - ``words_best``: the words alone at the fastest of a small grid of tiles (block_n 8-64, warps 1-4, stages
    0/3/4), chosen by one timing each: what a kernel of this shape can stream.
If ``loads`` is much faster than ``full``, the decode and products (instructions) limit the kernel; if ``loads`` and
``words`` are as slow as ``full``, its loads do; if ``words_best`` is much faster than ``words``, the tile limits
what is in flight. Writes $OUT/probe_row_limit.jsonl and prints the table.
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
    LINEARS, add_linear_args, jsonl_recorder, step_lines, streamed_weight, timed_interleaved)

import torch  # noqa: E402

from vllm_ext.triton_support import tl, triton  # noqa: E402

MODES = {"full": 0, "no_x": 1, "loads": 2, "words": 3, "fp8": 4}

# ``fp8``: the decode through FP8 (vllm_ext.nvfp4_decode._decode8 with ASM 2; §4ba's call 7 ran this probe with its own
# copy of the same PTX text, before the decode moved into the kernels).

if triton is not None:
    from vllm_ext.nvfp4_decode import _decode8
    from vllm_ext.nvfp4_gemv import _xvec_sum

    @triton.jit
    def _probe_tile(x_ptr, w_ptr, s_ptr, rn, n_ok, t, kw, kg, BLOCK_N: tl.constexpr, WORDS: tl.constexpr,
                    MODE: tl.constexpr):
        cw = t * WORDS + tl.arange(0, WORDS)
        wv = tl.load(w_ptr + rn[:, None] * kw + cw[None, :], mask=n_ok[:, None], other=0)
        if MODE == 3:
            return wv.to(tl.float32)
        cg = t * (WORDS // 2) + tl.arange(0, WORDS // 2)
        sg = tl.load(s_ptr + rn[:, None] * kg + cg[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32)
        sc = tl.reshape(tl.join(sg, sg), (BLOCK_N, WORDS))
        if MODE == 0:
            return _xvec_sum(_decode8(wv, 1), x_ptr, cw, BLOCK_N, WORDS) * sc
        if MODE == 4:
            return _xvec_sum(_decode8(wv, 2), x_ptr, cw, BLOCK_N, WORDS) * sc
        if MODE == 1:
            c = _decode8(wv, 1)
            return (c[0] + c[1] + c[2] + c[3] + c[4] + c[5] + c[6] + c[7]) * sc
        xv = tl.load(x_ptr + 8 * cw[:, None] + tl.arange(0, 8)[None, :]).to(tl.float32)  # [WORDS, 8]
        return wv.to(tl.float32) * sc + tl.sum(xv, axis=1)[None, :]

    @triton.jit
    def _probe_kernel(x_ptr, w_ptr, s_ptr, ws_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SPLIT_K: tl.constexpr, STAGES: tl.constexpr, MODE: tl.constexpr):
        """The row kernel's loop (``_row_dot`` with ``xvec``) doing the work ``MODE`` names; stores its float32
        sums, before the global scale, at ``ws_ptr[pid_k, n]``."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        WORDS: tl.constexpr = BLOCK_K // 8
        kw = tl.multiple_of(K // 8, 16)
        kg = tl.multiple_of(K // 16, 8)
        acc = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        if STAGES > 0:
            for t in tl.range(pid_k, K // BLOCK_K, SPLIT_K, num_stages=STAGES):
                acc += _probe_tile(x_ptr, w_ptr, s_ptr, rn, n_ok, t, kw, kg, BLOCK_N, WORDS, MODE)
        else:
            for t in range(pid_k, K // BLOCK_K, SPLIT_K):
                acc += _probe_tile(x_ptr, w_ptr, s_ptr, rn, n_ok, t, kw, kg, BLOCK_N, WORDS, MODE)
        tl.store(ws_ptr + pid_k * N + rn, tl.sum(acc, axis=1), mask=n_ok)


def probe(x, packed, scale, ws, tile: dict[str, Any], mode: str):  # noqa: ANN001, ANN201
    """One launch of the probe kernel in ``mode`` at ``tile`` (decode_tile's keys); its partials go to ``ws``."""
    n, k = packed.shape[0], x.shape[-1]
    split_k = min(tile.get("split_k", 1), k // tile["block_k"])
    _probe_kernel[(triton.cdiv(n, tile["block_n"]), split_k)](
        x, packed.view(torch.int32), scale, ws, n, k, BLOCK_N=tile["block_n"], BLOCK_K=tile["block_k"],
        SPLIT_K=split_k, STAGES=tile.get("stages", 0), MODE=MODES[mode], num_warps=tile["num_warps"])
    return ws


def read_tiles(block_k: int) -> list[dict[str, int]]:
    """The small grid ``words_best`` is chosen from."""
    return [dict(block_n=bn, block_k=block_k, split_k=1, num_warps=w, stages=st)
            for bn, w, st in itertools.product((8, 16, 32, 64), (1, 2, 4), (0, 3, 4))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_linear_args(p, "7B")
    args = p.parse_args(argv)

    if not torch.cuda.is_available():
        print("probe_row_limit: needs a CUDA GPU", file=sys.stderr)
        return 1
    from qerl_plugin import nvfp4
    from vllm_ext.bench.kernels import capture_graph, replay_us
    from vllm_ext.nvfp4_gemv import decode_tile, nvfp4_small_gemm

    record = jsonl_recorder(args.out, "probe_row_limit.jsonl")
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    record({"what": "setup", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "cold_mib": args.cold_mib, "shapes": args.shapes})
    keys = ("shipped", "full", "fp8", "no_x", "loads", "words", "words_best")
    finals: list[dict[str, Any]] = []
    bad = 0
    for shape in args.shapes.split(","):
        for lname in args.linears.split(","):
            k, n = LINEARS[shape][lname]
            _, q, raw_bytes, raws = streamed_weight(n, k, args.cold_mib, dev)
            code_bytes = q.packed.numel()
            x = torch.randn(1, k, device=dev, dtype=bf16)
            tile = decode_tile(n, k)
            ws = torch.empty(tile["split_k"], n, device=dev, dtype=torch.float32)
            iters = max(args.iters, len(raws))
            # the probe's full mode against the exact product (its partials summed here)
            exact = x.double() @ nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double().t()
            err = 0.0
            for mode, up in (("full", 16384.0), ("fp8", 64.0)):  # their decodes: 2^-14 and 2^-6 times the value
                got = probe(x, q.packed, q.scale, ws, tile, mode).double().sum(0) * up / q.global_scale.double()
                err = max(err, ((got - exact[0]).abs() - 1e-5 * exact.abs().max()).max().item())
            ok = err <= 0.0
            bad += not ok

            def graph_of(fn):  # noqa: ANN001, ANN202
                return capture_graph([(lambda p_=p_, s_=s_: fn(p_, s_)) for p_, s_ in raws], iters)

            once = {}
            for t in read_tiles(tile["block_k"]):
                g = graph_of(lambda p_, s_, t=t: probe(x, p_, s_, ws, t, "words"))
                once[tuple(t.items())] = replay_us(g, iters)
                del g
            best_read = dict(min(once, key=once.get))
            graphs = {"shipped": graph_of(lambda p_, s_: nvfp4_small_gemm(x, p_, s_, q.global_scale, words=True,
                                                                          xvec=True, **tile))}
            for mode in MODES:
                graphs[mode] = graph_of(lambda p_, s_, m=mode: probe(x, p_, s_, ws, tile, m))
            graphs["words_best"] = graph_of(lambda p_, s_: probe(x, p_, s_, ws, best_read, "words"))
            res = timed_interleaved({key: (g, iters) for key, g in graphs.items()}, args.reps)
            del graphs
            fin = {"what": "final", "shape": shape, "linear": lname, "n": n, "k": k, "tile": tile,
                   "words_best_tile": best_read, "full_excess": err, "full_ok": ok, **res,
                   "gb_s": {key: round((code_bytes if key.startswith("words") else raw_bytes)
                                       / res[key]["median_us"] / 1e3, 1) for key in keys}}
            record(fin)
            finals.append(fin)
            del raws
            torch.cuda.empty_cache()

    lines = ["", f"one-row kernel with parts of its work taken away: µs per call, median of {args.reps} (spread), "
             "then GB/s (codes and scales; codes alone for the words columns)",
             f"{'shape':<5} {'linear':<8}" + "".join(f"{key:>16}" for key in keys)]
    for f in finals:
        lines.append(f"{f['shape']:<5} {f['linear']:<8}" + "".join(
            f"{f[key]['median_us']:>9.2f} ±{f[key]['spread_us']:<5.2f}" for key in keys))
        lines.append(f"{'':<5} {'GB/s':<8}" + "".join(f"{f['gb_s'][key]:>16.0f}" for key in keys))
    lines += step_lines(finals, args.shapes, args.linears, keys, record)
    lines.append(f"probe 'full' or 'fp8' beyond the exact product: {bad} linears")
    print("\n".join(lines), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
