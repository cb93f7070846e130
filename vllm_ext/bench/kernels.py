"""``qerl bench kernels``: where the decode time of one layer goes (per-layer kernels timed in CUDA graphs)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from vllm_ext.bench.shapes import shape_config

__all__ = ["KERNELS_DOC", "run"]

KERNELS_DOC = """Per-layer decode kernels of a Qwen2.5 shape, each timed as GPU time inside a CUDA graph (no launch
overhead from Python), for every projection group (qkv, o, gate_up, down) and batch size:

  bf16          F.linear (cuBLAS), the BF16 base
  marlin        vLLM's Marlin FP4 GEMM on our NVFP4 bytes (apply_fp4_marlin_linear, fp32 reduce as vLLM)
  marlin_bf16r  the same with use_fp32_reduce=False
  lora_punica   vLLM's LoRA path for one adapter: fp32 buffer, lora_shrink (zeroes it, split-K) + lora_expand
  lora_dense    the same math as two cuBLAS calls: t = x @ A_cat^T, y += t @ B_blockdiag^T (no memset)
  lora_fused    qerl's one-launch kernel (vllm_ext.lora_fused): shrink and expand of all slices, one Triton launch
  serial        marlin then lora_punica on one stream (vLLM's default)
  overlap       marlin on the main stream, lora_punica on a second stream, joined (VLLM_LORA_ENABLE_DUAL_STREAM's idea)
  serial_fused  marlin then lora_fused on one stream (additional_config={"qerl_lora": "fused"})
  overlap_fused marlin on the main stream, lora_fused (overwrite mode) beside it on a second stream, joined, added
                (additional_config={"qerl_lora": "overlap"}); overlap_row the same beside gemv_row (m = 1)
  gemv          qerl's experimental Triton NVFP4 GEMM on the checkpoint layout (vllm_ext.nvfp4_gemv), tensor-core
                path, 64 output features per program; gemv_sk4 the same with the K tiles split over 4 programs (one
                launch, partials summed in a fixed order); gemv_row its one-row CUDA-core path as decode_gemv runs it
                in the engine (torch.ops.qerl.nvfp4_gemv_row: PTX decode, x once per word, decode_tile's tiles; m = 1)
  gluon         qerl's experimental Gluon GEMM's Hopper version (vllm_ext.nvfp4_gluon, wgmma) at §4r's tiles
  gluon_lora    the same with the adapter's expand in its epilogue after a shrink kernel, one launch each
                (vllm_ext.nvfp4_gluon_lora; programmatic dependent launches); on Hopper only, m <= 64

Per-step sums (x layers) estimate the linear-layer share of a decode step and what each LoRA strategy costs.
Writes $OUT/bench_kernels.json; prints the table last. Needs a CUDA GPU and vLLM's compiled ops.
"""


COLUMNS = ("bf16", "marlin", "marlin_bf16r", "gemv", "gemv_sk4", "gemv_row", "lora_punica", "lora_dense", "lora_fused",
           "serial", "serial_fused", "overlap", "overlap_fused", "overlap_row",
           "gluon", "gluon_lora")


def marlin_layer(packed, scale, global_scale, dtype=None):  # noqa: ANN001, ANN201
    """vLLM's Marlin FP4 layout of an NVFP4 triple (``packed`` uint8 ``[N, K/2]``, ``scale`` float8 ``[N, K/16]``,
    ``global_scale`` the divisor) for activations in ``dtype`` (default bfloat16), made by the nvfp4 backend's own
    :meth:`MarlinBackend._marlin`: a module with ``weight``, ``weight_scale``, ``weight_global_scale`` and
    ``workspace`` (new tensors: the inputs stay as they are)."""
    from types import SimpleNamespace

    import torch

    from vllm_ext.nvfp4_backends import MarlinBackend

    n, k = packed.shape[0], packed.shape[1] * 2
    shape = SimpleNamespace(params_dtype=dtype or torch.bfloat16, output_size_per_partition=n, input_size_per_partition=k)
    return MarlinBackend._marlin(shape, packed, scale, global_scale, None)


def marlin_linear(packed, scale, global_scale, dtype=None):  # noqa: ANN001, ANN201
    """:func:`marlin_layer`'s tensors and ``run(x, fp32_reduce=True) -> x @ W.T`` through the backend's
    :func:`marlin_gemm`."""
    from vllm_ext.nvfp4_backends import marlin_gemm

    n, k = packed.shape[0], packed.shape[1] * 2
    layer = marlin_layer(packed, scale, global_scale, dtype)

    def run(x, fp32_reduce: bool = True):  # noqa: ANN001, ANN202
        return marlin_gemm(x, layer.weight, layer.weight_scale, layer.weight_global_scale, layer.workspace, n, k, None,
                           fp32_reduce)

    return run


def humming_linear(packed, scale, global_scale, dtype=None, batch_invariant: bool = False):  # noqa: ANN001, ANN201
    """vLLM's humming W4A16 GEMM (the ``humming-kernels`` package, JIT-compiled on its first call) on an NVFP4 triple,
    made by the nvfp4 backend's own :meth:`HummingBackend._humming` (as vLLM 0.24's ``HummingLinearMethod`` sets a
    layer up: N padded to 256, K to 128) and run with vLLM's compute config: ``run(x) -> x @ W.T``. The inputs stay
    as they are. ``batch_invariant``: humming's batch-invariant mode (what ``VLLM_BATCH_INVARIANT=1`` asks of it;
    no stream-K)."""
    import torch

    from vllm_ext.nvfp4_backends import HummingBackend, humming_compute, humming_gemm

    n, k = packed.shape[0], packed.shape[1] * 2
    h = HummingBackend._humming(n, k, packed, scale, global_scale, dtype or torch.bfloat16)
    compute = humming_compute(batch_invariant)

    def run(x):  # noqa: ANN001, ANN202
        return humming_gemm(x, h.weight, h.weight_scale, h.global_scale, h.locks, h.config, compute)

    return run


def capture_graph(calls, iters: int, warmups: int = 1):  # noqa: ANN001, ANN201
    """A CUDA graph of ``iters`` calls cycling through ``calls``, each warmed up ``warmups`` times first (on a side
    stream, outside the capture: Triton compiles, allocators settle), replayed once before it is returned."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            for fn in calls:
                fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_us(graph, iters: int) -> float:  # noqa: ANN001
    """GPU microseconds per captured call of one replay of ``graph`` (``iters`` calls in it)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


def _graph_us(fn, iters: int, reps: int = 5) -> float:
    """GPU microseconds per call of ``fn``: ``iters`` calls captured in one CUDA graph, best of ``reps``."""
    graph = capture_graph([fn], iters, warmups=3)
    best = min(replay_us(graph, iters) for _ in range(reps))
    del graph
    return best


def run(args: argparse.Namespace) -> int:
    """Time every projection group of ``args.shape`` at each batch size; write and print the table."""
    import torch
    import torch.nn.functional as F

    out = Path(args.out or os.environ.get("OUT") or ".out").expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("qerl bench kernels: needs a CUDA GPU", file=sys.stderr)
        return 1
    from vllm.lora.ops.triton_ops import LoRAKernelMeta, lora_expand, lora_shrink
    from qerl_plugin import nvfp4
    from vllm_ext import lora_fused
    from vllm_ext.nvfp4_gemv import nvfp4_gemv_row, nvfp4_small_gemm
    from vllm_ext.nvfp4_gluon import GLUON_IMPORT_ERROR, nvfp4_gluon_gemm
    from vllm_ext.nvfp4_gluon_lora import MAX_TOKENS, gluon_lora_gemm, tile_for

    shp = shape_config(args.shape)
    hidden, inter, layers = shp["hidden_size"], shp["intermediate_size"], shp["num_hidden_layers"]
    head = hidden // shp["num_attention_heads"]
    q, kv = shp["num_attention_heads"] * head, shp["num_key_value_heads"] * head
    groups = {"qkv": (hidden, [q, kv, kv]), "o": (q, [hidden]), "gate_up": (hidden, [inter, inter]), "down": (inter, [hidden])}
    r, dev, bf16 = args.lora_rank, torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    for gname, (k_in, ns) in groups.items():
        n = sum(ns)
        weight = (torch.randn(n, k_in, device=dev) * 0.02).to(bf16)
        parts = nvfp4.quantize_fused(list(weight.split(ns)))
        packed_cat, scale_cat = torch.cat([p.packed for p in parts]), torch.cat([p.scale for p in parts])
        marlin_run = marlin_linear(packed_cat, scale_cat, parts[0].global_scale, bf16)
        lora_a = tuple(torch.randn(1, 1, r, k_in, device=dev, dtype=bf16) * 0.02 for _ in ns)
        lora_b = tuple(torch.randn(1, 1, ni, r, device=dev, dtype=bf16) * 0.02 for ni in ns)
        a_cat = torch.cat([a[0, 0] for a in lora_a])  # [S*r, K]
        b_bd = torch.zeros(n, len(ns) * r, device=dev, dtype=bf16)  # block-diagonal [N, S*r]
        off = 0
        for i, ni in enumerate(ns):
            b_bd[off:off + ni, i * r:(i + 1) * r] = lora_b[i][0, 0]
            off += ni
        for m in args.batches:
            x = torch.randn(m, k_in, device=dev, dtype=bf16)
            meta = LoRAKernelMeta.make(1, m, device=dev)
            meta.prepare_tensors(torch.zeros(m, dtype=torch.long, device=dev))
            margs = meta.meta_args(m, False)
            y = torch.empty(m, n, device=dev, dtype=bf16)

            def marlin(fp32_reduce=True):
                return marlin_run(x, fp32_reduce)

            def punica(target):
                buf = torch.empty(len(ns), m, r, dtype=torch.float32, device=dev)
                lora_shrink(x, lora_a, buf, *margs, 1.0)
                lora_expand(buf, lora_b, target, *margs, offset_start=0, add_inputs=True)

            slots = torch.zeros(m, dtype=torch.long, device=dev)
            sync = lora_fused.new_sync(dev)

            def fused(target):
                lora_fused.fused_lora_linear(target, x, lora_a, lora_b, 1.0, tuple(ns), slots, sync)

            def dense(target):
                target.addmm_(x @ a_cat.t(), b_bd.t())

            ev_fork, ev_join = torch.cuda.Event(), torch.cuda.Event()
            side = torch.cuda.Stream()

            def overlap():
                lora_out = torch.zeros(m, n, device=dev, dtype=bf16)
                ev_fork.record()
                with torch.cuda.stream(side):
                    side.wait_event(ev_fork)
                    buf = torch.empty(len(ns), m, r, dtype=torch.float32, device=dev)
                    lora_shrink(x, lora_a, buf, *margs, 1.0)
                    lora_expand(buf, lora_b, lora_out, *margs, offset_start=0, add_inputs=False)
                    ev_join.record()
                base = marlin()
                torch.cuda.current_stream().wait_event(ev_join)
                base.add_(lora_out)

            def serial():
                punica(marlin())

            beside = (lora_fused.new_sync(dev), torch.cuda.Stream(), torch.cuda.Event(), torch.cuda.Event())

            def fused_beside(base_fn):
                update = torch.empty(m, n, device=dev, dtype=bf16)
                return lora_fused.launch_beside(base_fn, update, x, lora_a, lora_b, 1.0, tuple(ns), slots, *beside)

            def one_row():  # not `row`: that name is the result dict below, which a late-bound lambda would call
                return nvfp4_gemv_row(x, packed_cat, scale_cat, parts[0].global_scale)

            gluon_ok = GLUON_IMPORT_ERROR is None and torch.cuda.get_device_capability()[0] == 9 and m <= MAX_TOKENS
            block_k, warps, nrep, split_k = tile_for(n, k_in, m)

            def gluon():
                return nvfp4_gluon_gemm(x, packed_cat, scale_cat, parts[0].global_scale, block_k=block_k, warps=warps,
                                        nrep=nrep, split_k=split_k, wgmma=True)

            def gluon_lora():
                return gluon_lora_gemm(x, packed_cat, scale_cat, parts[0].global_scale, lora_a, lora_b, 1.0, tuple(ns),
                                       slots)

            cases = {
                "bf16": lambda: F.linear(x, weight),
                "marlin": marlin,
                "marlin_bf16r": lambda: marlin(False),
                "gemv": lambda: nvfp4_small_gemm(x, packed_cat, scale_cat, parts[0].global_scale),
                "gemv_sk4": lambda: nvfp4_small_gemm(x, packed_cat, scale_cat, parts[0].global_scale, split_k=4),
                "gemv_row": one_row if m == 1 else None,
                "lora_punica": lambda: punica(y),
                "lora_dense": lambda: dense(y),
                "serial": serial,
                "overlap": overlap,
                "lora_fused": lambda: fused(y),
                "serial_fused": lambda: fused(marlin()),
                "overlap_fused": lambda: fused_beside(marlin),
                "overlap_row": (lambda: fused_beside(one_row)) if m == 1 else None,
                "gluon": gluon if gluon_ok else None,
                "gluon_lora": gluon_lora if gluon_ok else None,
            }
            row: dict[str, Any] = {"group": gname, "m": m, "n": n, "k": k_in}
            for cname, fn in cases.items():
                if fn is None:  # not defined at this batch size
                    row[cname] = None
                    continue
                try:
                    row[cname] = round(_graph_us(fn, args.iters), 2)
                except Exception as exc:  # one failing case must not hide the others
                    row[cname] = None
                    row[f"{cname}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)

    per_step: dict[str, dict[str, float | None]] = {}
    for m in args.batches:
        sel = [x for x in rows if x["m"] == m]
        per_step[str(m)] = {
            c: (round(layers * sum(x[c] for x in sel) / 1000.0, 3) if all(x.get(c) is not None for x in sel) else None)
            for c in COLUMNS
        }
    report = {"shape": args.shape, "rank": r, "device": torch.cuda.get_device_name(), "rows": rows,
              "per_step_ms": per_step}
    (out / "bench_kernels.json").write_text(json.dumps(report, indent=1))
    lines = ["", f"per-layer decode kernels, {args.shape}, LoRA r{r}, {report['device']} (GPU us per call in CUDA graphs)",
             f"{'group':<8}{'m':>4}" + "".join(f"{c:>13}" for c in COLUMNS)]
    for x in rows:
        lines.append(f"{x['group']:<8}{x['m']:>4}" + "".join(
            f"{x[c]:>13.1f}" if x.get(c) is not None else f"{'err' if x.get(c + '_error') else '-':>13}" for c in COLUMNS))
    lines.append(f"per decode step ({layers} layers, linears only, ms):")
    for m, v in per_step.items():
        lines.append(f"{'step':<8}{m:>4}" + "".join(f"{v[c]:>13.3f}" if v[c] is not None else f"{'-':>13}" for c in COLUMNS))
    print("\n".join(lines))
    return 0
