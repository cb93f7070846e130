"""The one-launch LoRA kernel (vllm_ext.lora_fused) per 7B decode step, against an earlier version of it.

Needs a CUDA GPU, torch and Triton only (no vLLM). For each batch size, the LoRA of every linear of a decode
step (q/k/v, o, gate/up, down, r32, x the model's layers) is captured in one CUDA graph, in the model's order, so
consecutive launches have different shapes and share one state, as in the engine; each kernel version gets its
own graph and state, and the graphs are replayed in turn (A, B, A, B, ...) so that drift hits both alike.
Reported per version and batch: ms per step (median and range of the replays), and the error against an fp32
statement of the arithmetic on every linear, with the state checked after the launches.

    git show 1d0f2db:vllm_ext/lora_fused.py > /tmp/lora_fused_v2.py   # v2, the version before §4v's v3
    PYTHONPATH=. python3 scripts/gpu/lora_kernel_step.py --baseline /tmp/lora_fused_v2.py [--shape 7B]

Writes JSON lines to $OUT/lora_kernel_step.jsonl (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _groups(shape: str) -> tuple[dict[str, tuple[int, tuple[int, ...]]], int]:
    from vllm_ext.bench.shapes import shape_config

    c = shape_config(shape)
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head = hidden // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    groups = {"qkv": (hidden, (q, kv, kv)), "o": (q, (hidden,)), "gate_up": (hidden, (inter, inter)),
              "down": (inter, (hidden,))}
    return groups, c["num_hidden_layers"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="a file holding the earlier lora_fused module")
    ap.add_argument("--shape", default="7B")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--replays", type=int, default=20, help="timed replays per version and batch (after 3 warm-ups)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("lora_kernel_step: needs a CUDA GPU", file=sys.stderr)
        return 1
    from vllm_ext import lora_fused as new

    old = _load(args.baseline, "lora_fused_baseline")
    versions = {"baseline": old, "new": new}
    out = Path(args.out or os.environ.get("OUT") or ".out").expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "lora_kernel_step.jsonl").open("w")

    def emit(rec: dict) -> None:
        print(json.dumps(rec), flush=True)
        log.write(json.dumps(rec) + "\n")
        log.flush()

    dev, bf16, r = torch.device("cuda"), torch.bfloat16, args.rank
    groups, layers = _groups(args.shape)
    emit({"step": "env", "torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "shape": args.shape,
          "rank": r, "layers": layers, "baseline": args.baseline})
    g = torch.Generator(device="cpu").manual_seed(0)
    weights = {}
    for name, (k, slices) in groups.items():
        a = tuple((torch.randn(1, 1, r, k, generator=g) / k**0.5).to(bf16).to(dev) for _ in slices)
        b = tuple((torch.randn(1, 1, n, r, generator=g) / r**0.5).to(bf16).to(dev) for n in slices)
        weights[name] = (k, slices, a, b)
    rows = []
    for m in [int(v) for v in args.batches.split(",")]:
        idx = torch.zeros(64, dtype=torch.long, device=dev)
        xs = {name: (torch.randn(m, k, generator=g) * 0.5).to(bf16).to(dev) for name, (k, *_rest) in weights.items()}
        ys = {name: torch.zeros(m, sum(w[1]), dtype=bf16, device=dev) for name, w in weights.items()}
        exact = {}
        for name, (k, slices, a, b) in weights.items():
            x = xs[name].float()
            exact[name] = torch.cat([(x @ ai[0, 0].float().t()).to(bf16).float() @ bi[0, 0].float().t()
                                     for ai, bi in zip(a, b)], 1)
        graphs, states = {}, {}
        for vname, mod in versions.items():
            state = mod.new_sync(dev, max(16, r))
            states[vname] = state

            def step(mod=mod, state=state):
                for _ in range(layers):
                    for name, (k, slices, a, b) in weights.items():
                        mod.launch(ys[name], xs[name], a, b, 1.0, slices, idx, state, add_inputs=False)

            # correctness, eagerly: every linear once, against fp32
            for name, (k, slices, a, b) in weights.items():
                mod.launch(ys[name], xs[name], a, b, 1.0, slices, idx, state, add_inputs=False)
            torch.cuda.synchronize()
            err = {name: round((ys[name].float() - exact[name]).abs().max().item(), 5) for name in weights}
            scale = {name: round(exact[name].abs().max().item(), 4) for name in weights}
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            graphs[vname] = graph
            # a replay, then the same check: the graph reads the state as the eager launches left it
            graph.replay()
            torch.cuda.synchronize()
            err_graph = {name: round((ys[name].float() - exact[name]).abs().max().item(), 5) for name in weights}
            emit({"step": "check", "version": vname, "m": m, "max_abs_err": err, "max_abs_err_after_replay": err_graph,
                  "max_abs_exact": scale, "state_ready": bool(mod.ready(state)) if hasattr(mod, "ready")
                  else int(state.count_nonzero()) == 0})
        times: dict[str, list[float]] = {v: [] for v in versions}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for i in range(3 + args.replays):
            for vname in (versions if i % 2 == 0 else list(reversed(list(versions)))):
                start.record()
                graphs[vname].replay()
                end.record()
                end.synchronize()
                if i >= 3:
                    times[vname].append(start.elapsed_time(end))
        for vname, ts in times.items():
            rec = {"step": "time", "version": vname, "m": m, "launches": layers * len(weights),
                   "ms_per_step_median": round(statistics.median(ts), 4), "ms_min": round(min(ts), 4),
                   "ms_max": round(max(ts), 4), "us_per_launch": round(1000 * statistics.median(ts) / (layers * len(weights)), 2),
                   "replays": len(ts)}
            rows.append(rec)
            emit(rec)
        del graphs
    print(f"\n{'batch':>5} {'version':>9} {'ms/step':>9} {'range':>17} {'us/launch':>10}")
    for rec in rows:
        print(f"{rec['m']:>5} {rec['version']:>9} {rec['ms_per_step_median']:>9.4f} "
              f"{rec['ms_min']:>8.4f}-{rec['ms_max']:<8.4f} {rec['us_per_launch']:>10.2f}")
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
