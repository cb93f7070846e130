#!/usr/bin/env python3
"""GPU check of the actor's NVFP4 base: Triton dequant exactness and speed, NVFP4Linear+LoRA vs bf16+LoRA,
and the memory of a 7B-shaped model (random weights made on the GPU, nothing downloaded).

Run from the repository root on the GPU machine (needs torch, triton, transformers; peft for step 4):

    python3 scripts/gpu/check_actor_kernels.py                 # everything, ~3-6 min on an H100
    python3 scripts/gpu/check_actor_kernels.py --quick         # small shapes, ~1 min
    python3 scripts/gpu/check_actor_kernels.py --steps exact,dequant

Steps (each survives the failure of another; results go to $OUT, default ./.out):
  exact    Triton dequant == torch codec dequant, bit for bit, on Qwen2.5-7B projection shapes, bf16/fp16/fp32
           outputs, plus every FP8 scale byte and every E2M1 code
  dequant  GPU time and bandwidth of the Triton kernel (GB/s, % of the H100's 3.35 TB/s, next to a plain device
           copy; CUDA graphs of 20 calls, so the host's launch time is outside it), one lone call's time with it,
           its host launch time, and the torch codec (bf16 output)
  layer    forward+backward of NVFP4Linear + LoRA vs bf16 nn.Linear + LoRA, 7B layer shapes, tokens 4096 / 16384:
           time, the share spent decoding, peak memory; NVFP4 with the decoded weight kept for backward (the
           default) and decoded again (QERL_ACTOR_SAVED_WEIGHT_MIB=0)
  model    a 7B-shaped Qwen2 (28 layers; --shape 14b / 32b: 48 / 64 layers of those shapes) built on the GPU in
           bf16: weight memory, tokens/s and the peak of one LoRA forward+backward step (gradient checkpointing,
           sdpa; median of 5 after a warm-up), bf16 base vs NVFP4 base (kept weight / decoded again); --model-cases
           adds +keepN cases (the last N layers keep their activations) and the summary compares NVFP4 and BF16 at
           the same peak memory (§4u)

Writes $OUT/check_actor_kernels.jsonl (one JSON object per measurement), $OUT/check_actor_kernels.log, and
prints a summary table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Qwen2.5-7B: hidden 3584, intermediate 18944, 28 query heads / 4 kv heads of 128
SHAPES_7B = {
    "q_proj": (3584, 3584),
    "k_proj": (512, 3584),
    "o_proj": (3584, 3584),
    "gate_proj": (18944, 3584),
    "down_proj": (3584, 18944),
}
SHAPES_QUICK = {"q_proj": (1024, 1024), "k_proj": (256, 1024), "gate_proj": (2816, 1024), "down_proj": (1024, 2816)}
SHAPES_SMOKE = {"q_proj": (64, 128), "gate_proj": (96, 128)}
STEPS = ("exact", "dequant", "layer", "model", "tune", "profile")
DEFAULT_STEPS = ("exact", "dequant", "layer", "model")
DEVICE = "cuda"  # --smoke-cpu: "cpu", with the Triton interpreter (checks this script's plumbing, times nothing)


class Recorder:
    def __init__(self, out: Path):
        out.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(out / "check_actor_kernels.jsonl", "a")
        self.logf = open(out / "check_actor_kernels.log", "a")
        self.rows: list[dict] = []

    def log(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.logf.write(line + "\n")
        self.logf.flush()

    def record(self, **row) -> None:
        self.rows.append(row)
        self.jsonl.write(json.dumps(row, default=str) + "\n")
        self.jsonl.flush()
        self.log(json.dumps(row, default=str))


def _sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _reset_peak() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _allocated() -> int:
    import torch

    return torch.cuda.memory_allocated() if DEVICE == "cuda" else 0


def _peak() -> int:
    import torch

    return torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0


def _empty_cache() -> None:
    import torch

    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def cuda_times_ms(fn, warmup: int = 3, iters: int = 10) -> list[float]:
    """GPU time of each of ``iters`` calls after ``warmup`` calls (CUDA events), in ms."""
    import torch

    if DEVICE != "cuda":
        t0 = time.perf_counter()
        fn()
        return [(time.perf_counter() - t0) * 1e3]
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def cuda_time_ms(fn, warmup: int = 3, iters: int = 10) -> float:
    return statistics.median(cuda_times_ms(fn, warmup, iters))


def graph_times_ms(fn, calls: int = 20, reps: int = 7) -> list[float]:
    """GPU time per call of ``fn``, in ms, for each of ``reps`` replays of one CUDA graph of ``calls`` calls. Unlike
    :func:`cuda_times_ms` (events around one call), the host's launch time is not inside it: a lone call of the
    dequant kernel spends ~30-60 µs in Python and the launch while the GPU waits (§4k), as long as the kernel."""
    if DEVICE != "cuda":
        return cuda_times_ms(fn)
    from vllm_ext.bench.kernels import capture_graph, replay_us

    graph = capture_graph([fn], calls, warmups=3)
    times = [replay_us(graph, calls) / 1000.0 for _ in range(reps)]
    del graph
    return times


def launch_us(fn, calls: int = 200) -> float:
    """Host time per call of ``fn`` issued back to back (no sync between calls), in µs: the launch overhead when
    the GPU keeps up."""
    import torch

    fn()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t0
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return dt / calls * 1e6


def _set_budget(value: str | None) -> None:
    """QERL_ACTOR_SAVED_WEIGHT_MIB for the next NVFP4 forwards ("" = the default, "0" = decode again in backward)."""
    from verl_ext.nvfp4_linear import SAVED_WEIGHT_ENV

    if value is None or value == "":
        os.environ.pop(SAVED_WEIGHT_ENV, None)
    else:
        os.environ[SAVED_WEIGHT_ENV] = value


def random_nvfp4(shape, seed=0):
    import torch

    from qerl_plugin import nvfp4

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w = (torch.randn(shape, generator=g, device=DEVICE, dtype=torch.float32) * 0.02).to(torch.bfloat16)
    return nvfp4.quantize(w)


# ---------------------------------------------------------------------------------------------------------


def step_exact(rec: Recorder, shapes: dict) -> None:
    import torch

    from qerl_plugin import nvfp4
    from verl_ext import kernels

    for i, (name, shape) in enumerate(shapes.items()):
        q = random_nvfp4(shape, seed=i)
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            a = kernels.dequantize_nvfp4_triton(q.packed, q.scale, q.global_scale, dt)
            b = nvfp4.dequantize(q.packed, q.scale, q.global_scale, dt)
            iv = torch.int32 if dt == torch.float32 else torch.int16
            diff = int((a.view(iv) != b.view(iv)).sum())
            rec.record(step="exact", case=name, shape=list(shape), dtype=str(dt), mismatches=diff, ok=diff == 0)
            del a, b
    # every byte of packed (all code pairs) and of the FP8 scales, several global scales
    g = torch.Generator(device=DEVICE).manual_seed(1)
    rows = 1024 if DEVICE == "cuda" else 32
    packed = torch.randint(0, 256, (rows, 512), dtype=torch.uint8, device=DEVICE, generator=g)
    sbytes = (torch.arange(rows * 64, device=DEVICE) % 256).to(torch.uint8).reshape(rows, 64)
    for gs in (1.0, 2688.0, 1e-3, 3e7):
        gsc = torch.tensor([gs], device=DEVICE)
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            a = kernels.dequantize_nvfp4_triton(packed, sbytes.view(torch.float8_e4m3fn), gsc, dt)
            b = nvfp4.dequantize(packed, sbytes.view(torch.float8_e4m3fn), gsc, dt)
            iv = torch.int32 if dt == torch.float32 else torch.int16
            nan = torch.isnan(b)
            ok = torch.equal(torch.isnan(a), nan) and torch.equal(a.view(iv)[~nan], b.view(iv)[~nan])
            rec.record(step="exact", case=f"all-bytes gs={gs:g}", dtype=str(dt), ok=bool(ok))


HBM_PEAK_GBPS = 3350.0  # H100 SXM5 80GB HBM3, NVIDIA's datasheet figure (3.35 TB/s)


def dequant_bytes(n: int) -> int:
    """Bytes one bf16 decode of ``n`` values moves: packed codes and FP8 scales read, bf16 written."""
    return n // 2 + n // 16 + 2 * n


def step_dequant(rec: Recorder, shapes: dict) -> None:
    import torch

    from qerl_plugin import nvfp4
    from verl_ext import kernels

    for name, shape in shapes.items():
        q = random_nvfp4(shape)
        n = shape[0] * shape[1]
        out = torch.empty(shape, dtype=torch.bfloat16, device=DEVICE)
        tri = lambda: kernels.dequantize_nvfp4_triton(q.packed, q.scale, q.global_scale, torch.bfloat16, out=out)
        t_tri = graph_times_ms(tri)  # GPU time per call (CUDA graph of 20 calls, 7 replays)
        t_single = cuda_time_ms(tri, iters=20)  # one call between two events: the host's launch time included
        t_torch = cuda_time_ms(lambda: nvfp4.dequantize(q.packed, q.scale, q.global_scale, torch.bfloat16))
        # a plain device copy of an equally large bf16 tensor: what this GPU moves in practice (read + write)
        src = torch.empty(shape, dtype=torch.bfloat16, device=DEVICE)
        t_copy = statistics.median(graph_times_ms(lambda: out.copy_(src)))
        moved = dequant_bytes(n)
        med = statistics.median(t_tri)
        rec.record(
            step="dequant", case=name, shape=list(shape), timing="cuda graph of 20 calls, median of 7 replays",
            triton_ms=round(med, 4), triton_ms_min=round(min(t_tri), 4), triton_ms_max=round(max(t_tri), 4),
            single_call_ms=round(t_single, 4), torch_ms=round(t_torch, 4),
            triton_GBps=round(moved / med / 1e6, 1), torch_GBps=round(moved / t_torch / 1e6, 1),
            hbm_peak_GBps=HBM_PEAK_GBPS, triton_pct_of_peak=round(100 * moved / med / 1e6 / HBM_PEAK_GBPS, 1),
            copy_GBps=round(4 * n / t_copy / 1e6, 1), speedup=round(t_torch / med, 2),
            launch_us=round(launch_us(tri), 1),
        )
        del src, out


# the kernel's programs: runs of 4 packed bytes per program, warps (the [rows, groups] tile kernel it replaced is in
# §4k's lease-2 rows)
TUNE_CONFIGS = [(512, 4), (128, 4), (256, 4), (1024, 4), (256, 2), (1024, 8), (2048, 8), (4096, 8)]
# the decode variants (SHIFT_DECODE, HW_BF16) timed at the default program, same run: the current default, its
# bfloat16 rounding done by integer work, and the earlier integer E2M1 decode with it (§4e)
TUNE_DECODES = [(True, True), (True, False), (False, False)]
_TUNED = ("QUADS", "NUM_WARPS", "SHIFT_DECODE", "HW_BF16")


def tune_runs(defaults: dict, cpu: bool) -> list[dict]:
    """The settings step_tune times, each a dict of kernels' module settings (defaults for the rest)."""
    runs = [dict(defaults, QUADS=q, NUM_WARPS=w) for q, w in (TUNE_CONFIGS[:2] if cpu else TUNE_CONFIGS)]
    runs += [dict(defaults, SHIFT_DECODE=sh, HW_BF16=hw) for sh, hw in TUNE_DECODES
             if (sh, hw) != (defaults["SHIFT_DECODE"], defaults["HW_BF16"])]
    return runs


def step_tune(rec: Recorder, shapes: dict) -> None:
    """Time the dequant kernel at several program sizes (runs of 4 packed bytes) and warps, and the decode variants,
    each checked bit for bit against the torch codec, in one run."""
    import torch

    from qerl_plugin import nvfp4
    from verl_ext import kernels

    saved = {k: getattr(kernels, k) for k in _TUNED}
    runs = tune_runs(saved, DEVICE != "cuda")
    try:
        for name, shape in shapes.items():
            if name not in ("q_proj", "gate_proj", "down_proj"):
                continue
            q = random_nvfp4(shape)
            ref = nvfp4.dequantize(q.packed, q.scale, q.global_scale, torch.bfloat16).view(torch.int16)
            out = torch.empty(shape, dtype=torch.bfloat16, device=DEVICE)
            n = shape[0] * shape[1]
            moved = dequant_bytes(n)
            for run in runs:
                for k, v in run.items():
                    setattr(kernels, k, v)
                fn = lambda: kernels.dequantize_nvfp4_triton(q.packed, q.scale, q.global_scale, torch.bfloat16, out=out)
                out.zero_()
                fn()
                exact = bool(torch.equal(out.view(torch.int16), ref))
                t = graph_times_ms(fn)
                ms = statistics.median(t)
                program = f"q{run['QUADS']} w{run['NUM_WARPS']}"
                rec.record(step="tune", case=name, program=program, shift_decode=run["SHIFT_DECODE"],
                           hw_bf16=run["HW_BF16"], exact=exact, ms=round(ms, 4), ms_min=round(min(t), 4),
                           ms_max=round(max(t), 4), GBps=round(moved / ms / 1e6, 1),
                           pct_of_peak=round(100 * moved / ms / 1e6 / HBM_PEAK_GBPS, 1), default=run == saved)
    finally:
        for k, v in saved.items():
            setattr(kernels, k, v)


def step_layer(rec: Recorder, shapes: dict, tokens_list: list[int], rank: int) -> None:
    import torch

    from qerl_plugin import nvfp4
    from verl_ext import kernels
    from verl_ext.nvfp4_linear import NVFP4Linear

    for name, (out_f, in_f) in shapes.items():
        g = torch.Generator(device=DEVICE).manual_seed(0)
        w = (torch.randn(out_f, in_f, generator=g, device=DEVICE) * 0.02).to(torch.bfloat16)
        dense = torch.nn.Linear(in_f, out_f, bias=False, device=DEVICE, dtype=torch.bfloat16)
        dense.weight.data.copy_(w)
        dense.weight.requires_grad_(False)
        quant = NVFP4Linear.from_weight(w, quant_dtype=None)
        del w
        a = torch.nn.Parameter(torch.randn(rank, in_f, device=DEVICE, dtype=torch.bfloat16) * 0.01)
        b = torch.nn.Parameter(torch.randn(out_f, rank, device=DEVICE, dtype=torch.bfloat16) * 0.01)
        for tokens in tokens_list:
            x = torch.randn(tokens, in_f, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
            gy = torch.randn(tokens, out_f, device=DEVICE, dtype=torch.bfloat16)
            row = {"step": "layer", "case": name, "shape": [out_f, in_f], "tokens": tokens, "rank": rank}
            for label, base, budget in (("bf16", dense, None), ("nvfp4", quant, ""), ("nvfp4_redecode", quant, "0")):
                _set_budget(budget)

                def fwd_bwd():
                    y = base(x) + (x @ a.T) @ b.T * 2.0
                    y.backward(gy)
                    x.grad = a.grad = b.grad = None

                def fwd_only():
                    with torch.no_grad():
                        base(x) + (x @ a.T) @ b.T * 2.0

                try:
                    _reset_peak()
                    base_mem = _allocated()
                    row[f"{label}_fwd_bwd_ms"] = round(cuda_time_ms(fwd_bwd), 3)
                    row[f"{label}_peak_extra_MiB"] = round((_peak() - base_mem) / 2**20, 1)
                    row[f"{label}_fwd_ms"] = round(cuda_time_ms(fwd_only), 3)
                except torch.OutOfMemoryError as exc:
                    row[f"{label}_error"] = f"OOM: {exc}"[:200]
                    _empty_cache()
            out = torch.empty(out_f, in_f, dtype=torch.bfloat16, device=DEVICE)
            t_deq = cuda_time_ms(lambda: kernels.dequantize_nvfp4_triton(quant.weight_packed, quant.weight_scale,
                                                                         quant.weight_global_scale, torch.bfloat16, out=out))
            row["dequant_ms"] = round(t_deq, 4)
            _set_budget("")
            if "nvfp4_fwd_bwd_ms" in row and "bf16_fwd_bwd_ms" in row:
                row["nvfp4_over_bf16"] = round(row["nvfp4_fwd_bwd_ms"] / row["bf16_fwd_bwd_ms"], 3)
                row["dequant_share_fwd_bwd"] = round(t_deq / row["nvfp4_fwd_bwd_ms"], 3)  # one decode (kept weight)
            if "nvfp4_redecode_fwd_bwd_ms" in row and "bf16_fwd_bwd_ms" in row:
                row["nvfp4_redecode_over_bf16"] = round(row["nvfp4_redecode_fwd_bwd_ms"] / row["bf16_fwd_bwd_ms"], 3)
            rec.record(**row)
            del x, gy, out
        del dense, quant, a, b
        _empty_cache()


def _lora_model(cfg, nvfp4: bool, rank: int, row: dict | None = None):
    """A model of ``cfg`` built on the device in bf16 (random weights), its linears NVFP4 when ``nvfp4``, PEFT LoRA
    on all linears, non-reentrant gradient checkpointing (as verl), in train mode; build facts go into ``row``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from verl_ext.nvfp4_replace import replace_linears_with_nvfp4

    row = {} if row is None else row
    t0 = time.time()
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    row["build_s"] = round(time.time() - t0, 1)
    if nvfp4:
        t1 = time.time()
        report = replace_linears_with_nvfp4(model, quant_dtype=None)
        row["quantize_s"] = round(time.time() - t1, 1)
        row["replaced"] = len(report.replaced)
    _empty_cache()
    row["weights_GiB"] = round(_allocated() / 2**30, 3)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.train()
    return model


def _train_step(model, ids):
    """One LoRA forward + backward on ``ids`` under bf16 autocast (labels = inputs), gradients dropped."""
    import torch

    def train_step():
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    return train_step


def step_profile(rec: Recorder, layers: int, tokens: int, rank: int, out: Path) -> None:
    """Where a LoRA forward+backward step's time goes, BF16 vs NVFP4 base: host time per call of one layer (tiny
    input, so the host is the bound), then the model step under torch.profiler (CPU and CUDA): wall time, the sum
    of GPU kernel time, and the top ops by host and by device time (tables in $OUT/profile_<variant>.txt)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from verl_ext.nvfp4_linear import NVFP4Linear

    # host microcosts of one 3584 x 3584 layer at 16 tokens
    w = (torch.randn(3584, 3584, device=DEVICE) * 0.02).to(torch.bfloat16)
    dense = torch.nn.Linear(3584, 3584, bias=False, device=DEVICE, dtype=torch.bfloat16).requires_grad_(False)
    quant = NVFP4Linear.from_weight(w, quant_dtype=None)
    x = torch.randn(16, 3584, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    row = {"step": "profile", "case": "host_us_per_call"}
    for label, layer in (("bf16", dense), ("nvfp4", quant)):
        def fb():
            layer(x).sum().backward()

        def fwd_autocast():
            with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
                layer(x)

        with torch.no_grad():
            row[f"{label}_fwd"] = round(launch_us(lambda: layer(x)), 1)
        row[f"{label}_fwd_autocast"] = round(launch_us(fwd_autocast), 1)
        row[f"{label}_fwd_bwd"] = round(launch_us(fb), 1)
    from verl_ext import kernels
    row["dequantize_call"] = round(launch_us(lambda: kernels.dequantize(quant.weight_packed, quant._buffers["weight_scale"],
                                                                       quant.weight_global_scale)), 1)
    rec.record(**row)
    del w, dense, quant, x

    cfg = _qwen2_config(layers)
    # (the fifth session's run at 88453c8 also had "nvfp4_scratch", an experiment since removed: docs/benchmarks.md §4e)
    for variant in ("bf16", "nvfp4"):
        _empty_cache()
        model = _lora_model(cfg, variant == "nvfp4", rank)
        train_step = _train_step(model, torch.randint(0, cfg.vocab_size, (1, tokens), device=DEVICE))
        for _ in range(2):
            train_step()
        _sync()
        mem0 = torch.cuda.memory_stats() if DEVICE == "cuda" else {}
        t_plain = cuda_times_ms(train_step, warmup=0, iters=3)
        mem1 = torch.cuda.memory_stats() if DEVICE == "cuda" else {}
        # the caching allocator's own calls into the driver over those 3 steps (cudaMalloc / cudaFree) and retries
        alloc = {k: mem1.get(k, 0) - mem0.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            train_step()
            _sync()
        wall = (time.perf_counter() - t0) * 1e3
        events = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        kernels_n = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        tables = [events.table(sort_by="self_cpu_time_total", row_limit=30),
                  events.table(sort_by="self_device_time_total", row_limit=30)]
        (out / f"profile_{variant}.txt").write_text("\n\n".join(tables))
        rec.record(step="profile", case=variant, tokens=tokens, layers=layers, profiled_wall_ms=round(wall, 1),
                   gpu_kernel_ms=round(gpu_us / 1e3, 1), gpu_kernels=kernels_n,
                   step_ms_unprofiled=[round(t, 1) for t in t_plain], allocator_calls_3_steps=alloc)
        model = None
        _empty_cache()


# Qwen2.5-7B, -14B and -32B: (hidden, intermediate, layers, query heads, kv heads)
MODEL_SHAPES = {"7b": (3584, 18944, 28, 28, 4), "14b": (5120, 13824, 48, 40, 8), "32b": (5120, 27648, 64, 40, 8)}


def _qwen2_config(layers: int, shape: str = "7b"):
    from transformers import Qwen2Config

    if DEVICE != "cuda":  # smoke: the same code path on a toy model
        return Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    hidden, inter, _, heads, kv = MODEL_SHAPES[shape]
    return Qwen2Config(
        vocab_size=152064, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=32768, rope_theta=1e6,
        tie_word_embeddings=False,
    )


MODEL_CASES = ("bf16", "nvfp4", "nvfp4_redecode")


def parse_model_case(case: str) -> tuple[str, int]:
    """``bf16`` / ``nvfp4`` / ``nvfp4_redecode``, optionally ``+keepN``: the last N decoder layers keep their
    activations instead of recomputing them (verl_ext.recompute, verl's ``actor.no_recompute_layers``)."""
    base, sep, keep = case.partition("+keep")
    if base not in MODEL_CASES or (sep and not keep.isdigit()):
        raise ValueError(
            f"model case {case!r}: expected one of {', '.join(MODEL_CASES)}, optionally +keepN (e.g. nvfp4+keep2)"
        )
    return base, int(keep or 0)


def step_model(rec: Recorder, layers: int, tokens: int, rank: int, cases=MODEL_CASES, iters: int = 5,
               shape: str = "7b") -> None:
    import torch

    try:
        import peft  # noqa: F401  (the LoRA wrapper of _lora_model)
    except ImportError as exc:
        rec.record(step="model", error=f"peft not importable: {exc}")
        return
    from verl_ext.recompute import keep_activations

    cfg = _qwen2_config(layers, shape)
    for case in cases:
        variant, keep = parse_model_case(case)
        _set_budget("0" if variant == "nvfp4_redecode" else "")
        train_step = model = None  # the previous case's model goes before this one is built
        _empty_cache()
        _reset_peak()
        row = {"step": "model", "case": case, "keep": keep, "shape": shape, "layers": layers, "tokens": tokens,
               "rank": rank}
        try:
            model = _lora_model(cfg, variant != "bf16", rank, row)
            row["kept_layers"] = keep_activations(model, keep)
            ids = torch.randint(0, cfg.vocab_size, (1, tokens), device=DEVICE)
            _reset_peak()
            start = _allocated()
            train_step = _train_step(model, ids)
            times = cuda_times_ms(train_step, warmup=1, iters=iters)
            row["step_ms"] = round(statistics.median(times), 1)
            row["step_ms_all"] = [round(t, 1) for t in times]
            row["tokens_per_s"] = round(tokens / (row["step_ms"] / 1e3), 1)
            row["step_peak_GiB"] = round(_peak() / 2**30, 3)
            row["step_extra_GiB"] = round((_peak() - start) / 2**30, 3)
        except Exception as exc:  # OOM or anything else: record, go on
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rec.log(traceback.format_exc())
        rec.record(**row)
        train_step = model = None
        _empty_cache()
    _set_budget("")


def same_memory_verdict(rows: list[dict]) -> str | None:
    """§4u's criterion: NVFP4 (kept weight) with the most kept layers whose step peak is at most BF16's (every layer
    recomputed) against that BF16 step: tokens/s ratio, and whether the step-time ranges are apart."""
    ok = [r for r in rows if r.get("step") == "model" and "step_ms" in r]
    bf16 = next((r for r in ok if r["case"] == "bf16"), None)
    if bf16 is None:
        return None
    fits = [r for r in ok if parse_model_case(r["case"])[0] == "nvfp4" and r["step_peak_GiB"] <= bf16["step_peak_GiB"]]
    if not fits:
        return "same peak memory: no NVFP4 case within BF16's step peak"
    best = max(fits, key=lambda r: (r.get("keep", 0), -r["step_ms"]))
    ratio = bf16["step_ms"] / best["step_ms"]
    if max(best["step_ms_all"]) < min(bf16["step_ms_all"]):
        verdict = "faster (ranges apart): " + ("PASS" if ratio >= 1.0 else "FAIL")
    elif min(best["step_ms_all"]) > max(bf16["step_ms_all"]):
        verdict = "slower (ranges apart): FAIL"
    else:
        verdict = "ranges overlap: no verdict"
    return (f"same peak memory: {best['case']} ({best['step_peak_GiB']} GiB) vs bf16 ({bf16['step_peak_GiB']} GiB): "
            f"tokens/s {ratio:.3f}x, {verdict}")


# ---------------------------------------------------------------------------------------------------------


def summary(rows: list[dict]) -> str:
    lines = ["", "=== check_actor_kernels summary ==="]
    exact = [r for r in rows if r.get("step") == "exact"]
    if exact:
        bad = [r for r in exact if not r.get("ok")]
        failed = f"  FAILED: {bad}" if bad else ""
        lines.append(f"exact:   {len(exact) - len(bad)}/{len(exact)} cases bit-identical{failed}")
    deq = [r for r in rows if r.get("step") == "dequant"]
    if deq:
        lines.append(f"{'dequant':10} {'shape':>14} {'triton ms':>10} {'GB/s':>8} {'% peak':>7} {'copy GB/s':>10} "
                     f"{'1 call ms':>10} {'launch us':>10} {'torch ms':>10} {'speedup':>8}")
        for r in deq:
            lines.append(
                f"{r['case']:10} {str(tuple(r['shape'])):>14} {r['triton_ms']:>10} {r['triton_GBps']:>8} "
                f"{r.get('triton_pct_of_peak', '-'):>7} {r.get('copy_GBps', '-'):>10} {r.get('single_call_ms', '-'):>10} "
                f"{r.get('launch_us', '-'):>10} {r['torch_ms']:>10} {r['speedup']:>8}"
            )
    tune = [r for r in rows if r.get("step") == "tune"]
    if tune:
        lines.append(f"{'tune':10} {'program':>18} {'decode':>14} {'ms':>8} {'GB/s':>8} {'% peak':>7}  exact")
        for r in tune:
            decode = ("shift" if r.get("shift_decode", True) else "integer") + ("+cvt" if r.get("hw_bf16", True) else "+int")
            lines.append(
                f"{r['case']:10} {r['program']:>18} {decode:>14} {r['ms']:>8} {r['GBps']:>8} {r.get('pct_of_peak', '-'):>7}"
                f"  {r['exact']}" + ("  (default)" if r.get("default") else "")
            )
    lay = [r for r in rows if r.get("step") == "layer"]
    if lay:
        lines.append(
            f"{'layer':10} {'tokens':>7} {'bf16 f+b ms':>12} {'nvfp4 f+b ms':>13} {'ratio':>6} {'redecode ms':>12} "
            f"{'ratio':>6} {'deq share':>9} {'bf16 MiB':>9} {'nvfp4 MiB':>10}"
        )
        for r in lay:
            lines.append(
                f"{r['case']:10} {r['tokens']:>7} {r.get('bf16_fwd_bwd_ms', '-'):>12} {r.get('nvfp4_fwd_bwd_ms', '-'):>13} "
                f"{r.get('nvfp4_over_bf16', '-'):>6} {r.get('nvfp4_redecode_fwd_bwd_ms', '-'):>12} "
                f"{r.get('nvfp4_redecode_over_bf16', '-'):>6} {r.get('dequant_share_fwd_bwd', '-'):>9} "
                f"{r.get('bf16_peak_extra_MiB', '-'):>9} {r.get('nvfp4_peak_extra_MiB', '-'):>10}"
            )
    mod = [r for r in rows if r.get("step") == "model"]
    if mod:
        bf16_ms = next((r["step_ms"] for r in mod if r["case"] == "bf16" and "step_ms" in r), None)
        lines.append(f"{'model':15} {'layers':>6} {'tokens':>7} {'weights GiB':>12} {'step peak GiB':>14} {'step ms':>9} "
                     f"{'runs ms':>30} {'time / bf16':>11}  error")
        for r in mod:
            ratio = round(r["step_ms"] / bf16_ms, 3) if bf16_ms and "step_ms" in r else "-"
            lines.append(
                f"{r['case']:15} {r.get('layers', '-'):>6} {r.get('tokens', '-'):>7} {r.get('weights_GiB', '-'):>12} "
                f"{r.get('step_peak_GiB', '-'):>14} {r.get('step_ms', '-'):>9} {str(r.get('step_ms_all', '-')):>30} "
                f"{ratio:>11}  {r.get('error', '')}"
            )
        verdict = same_memory_verdict(mod)
        if verdict:
            lines.append(verdict)
    errs = [r for r in rows if r.get("step") == "error"]
    for r in errs:
        lines.append(f"step {r['failed']} FAILED: {r['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", default=",".join(DEFAULT_STEPS),
                   help=f"comma list of {', '.join(STEPS)} (default: {','.join(DEFAULT_STEPS)})")
    p.add_argument("--quick", action="store_true", help="small shapes, 2 model layers, 1024 tokens")
    p.add_argument("--tokens", default="4096,16384", help="token counts for the layer step (default 4096,16384)")
    p.add_argument("--rank", type=int, default=32, help="LoRA rank (default 32)")
    p.add_argument("--shape", choices=sorted(MODEL_SHAPES), default="7b",
                   help="Qwen2.5 shape of the model step (default 7b)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers of the model step (default: the shape's, 28 / 48 / 64 for 7b / 14b / 32b)")
    p.add_argument("--model-tokens", type=int, default=4096, help="sequence length of the model step (default 4096)")
    p.add_argument("--model-cases", default=",".join(MODEL_CASES),
                   help="comma list of the model step's cases: bf16, nvfp4, nvfp4_redecode, each optionally +keepN (the "
                        f"last N layers keep their activations; e.g. nvfp4+keep2); default {','.join(MODEL_CASES)}")
    p.add_argument("--model-iters", type=int, default=5, help="timed steps per model case, after one warm-up (default 5)")
    p.add_argument("--out", default=os.environ.get("OUT", "./.out"), help="output folder (default $OUT or ./.out)")
    p.add_argument("--smoke-cpu", action="store_true",
                   help="every step on CPU with the Triton interpreter and toy shapes (checks the script, times nothing)")
    args = p.parse_args(argv)
    global DEVICE
    if args.smoke_cpu:
        DEVICE = "cpu"
        os.environ["TRITON_INTERPRET"] = "1"  # before verl_ext.kernels is imported

    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        p.error(f"unknown step(s) {unknown}; choose from {', '.join(STEPS)}")
    tokens = [int(t) for t in args.tokens.split(",")]
    shapes = SHAPES_SMOKE if args.smoke_cpu else SHAPES_QUICK if args.quick else SHAPES_7B
    layers = 2 if (args.quick or args.smoke_cpu) else args.layers or MODEL_SHAPES[args.shape][2]
    model_tokens = 32 if args.smoke_cpu else 1024 if args.quick else args.model_tokens
    try:
        model_cases = [c.strip() for c in args.model_cases.split(",") if c.strip()]
        for c in model_cases:
            parse_model_case(c)
    except ValueError as e:
        p.error(str(e))
    if args.quick:
        tokens = [min(t, 2048) for t in tokens]
    if args.smoke_cpu:
        tokens = [16]

    rec = Recorder(Path(args.out))
    import torch

    if DEVICE == "cuda" and not torch.cuda.is_available():
        rec.record(step="error", failed="setup", error="no CUDA GPU visible (use --smoke-cpu to check the script on CPU)")
        print(summary(rec.rows))
        return 2
    import triton

    rec.record(step="env", torch=torch.__version__, triton=triton.__version__, device=DEVICE,
               gpu=torch.cuda.get_device_name() if DEVICE == "cuda" else None, args=vars(args))
    for step in steps:
        rec.log(f"--- {step}")
        t0 = time.time()
        try:
            if step == "exact":
                step_exact(rec, shapes)
            elif step == "dequant":
                step_dequant(rec, shapes)
            elif step == "layer":
                step_layer(rec, shapes, tokens, args.rank)
            elif step == "model":
                step_model(rec, layers, model_tokens, args.rank, model_cases, args.model_iters, args.shape)
            elif step == "tune":
                step_tune(rec, shapes)
            elif step == "profile":
                step_profile(rec, layers, model_tokens, args.rank, Path(args.out))
        except Exception as exc:
            rec.log(traceback.format_exc())
            rec.record(step="error", failed=step, error=f"{type(exc).__name__}: {exc}"[:500])
        rec.log(f"--- {step} done in {time.time() - t0:.1f}s")
        _empty_cache()
    text = summary(rec.rows)
    print(text)
    rec.logf.write(text + "\n")
    failed = any(r.get("step") == "error" or (r.get("step") == "exact" and not r.get("ok"))
                 or (r.get("step") == "tune" and not r.get("exact")) for r in rec.rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
