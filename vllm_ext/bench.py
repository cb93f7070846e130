"""Benchmark rollouts in vLLM: decode tokens/s and memory of BF16 / NVFP4, with and without LoRA and AQN.

    qerl bench rollout --shape 7B                                  # the five configs, batch 1/8/64
    qerl bench rollout --shape 7B --configs bf16-lora,nvfp4-lora   # fit a short GPU slot
    qerl bench rollout --shape 7B --configs bf16-lora,nvfp4-lora --variants default,dual-stream,lora-tuned
    qerl bench rollout --model /path/to/bf16-checkpoint --batches 1,8

Each (config, variant) runs in its own Python process with its own vLLM engine (CUDA graphs + torch.compile,
never eager), so GPU memory is freed between them and a hung engine is killed after --timeout. Named
shapes are Qwen2.5 configs with random weights (load_format=dummy); NVFP4 configs quantize them while
loading (``--quantization nvfp4``). LoRA configs serve a random PEFT adapter (rank --lora-rank on
q/k/v/o/gate/up/down, non-zero B) written once to --work; every request uses it.

Per batch size: prompts of --prompt-len random tokens, --new-tokens generated with ignore_eos. Decode
tokens/s = batch * (new_tokens - 1) / (t(new_tokens) - t(1 token)), i.e. prefill removed; the best of
--repeats runs. Written to --out (default $OUT or ./.out): bench_rollout.json (all runs, ratios vs
bf16-lora of the same variant, LoRA overhead, target checks), bench_rollout.jsonl (one line per engine as
it finishes) and logs/<config>@<variant>.log. The table is printed last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CONFIGS", "SHAPES", "VARIANTS", "add_arguments", "run"]

HELP = "benchmark NVFP4 + LoRA rollouts in vLLM"

# ---------------------------------------------------------------------------------------------------
# model shapes (Qwen2.5 base/instruct configs as published; weights are random)

_QWEN25_COMMON = dict(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    hidden_act="silu",
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    attention_dropout=0.0,
    initializer_range=0.02,
    use_cache=True,
    use_sliding_window=False,
    sliding_window=None,
    max_window_layers=28,
    bos_token_id=151643,
    eos_token_id=151645,
    torch_dtype="bfloat16",
)
SHAPES: dict[str, dict[str, Any]] = {
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "3B": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "14B": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "32B": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# ---------------------------------------------------------------------------------------------------
# what is measured: configs (the thing compared) x variants (engine switches to try)


@dataclass(frozen=True)
class BenchConfig:
    quant: str | None  # None (BF16) | "nvfp4" (ours) | "stock" (vLLM's compressed-tensors NVFP4A16 path)
    #                    | "humming" (vLLM's humming JIT W4A16 kernels on the NVFP4A16 checkpoint)
    lora: bool = False
    aqn: bool = False


CONFIGS: dict[str, BenchConfig] = {
    "bf16": BenchConfig(None),
    "bf16-lora": BenchConfig(None, lora=True),
    "nvfp4": BenchConfig("nvfp4"),
    "nvfp4-lora": BenchConfig("nvfp4", lora=True),
    "nvfp4-lora-aqn": BenchConfig("nvfp4", lora=True, aqn=True),
    # vLLM's own compressed-tensors NVFP4A16 scheme (same Marlin kernel): the stock reference
    "stock-nvfp4": BenchConfig("stock"),
    "stock-nvfp4-lora": BenchConfig("stock", lora=True),
    # the same checkpoint through `--quantization humming` (JIT GEMMs, FP4 weights x BF16; needs nvcc):
    # a candidate faster small-batch kernel than Marlin, measured here before any integration
    "humming-nvfp4": BenchConfig("humming"),
    "humming-nvfp4-lora": BenchConfig("humming", lora=True),
}
DEFAULT_CONFIGS = "bf16,bf16-lora,nvfp4,nvfp4-lora,nvfp4-lora-aqn"
BASELINE = "bf16-lora"


@dataclass(frozen=True)
class Variant:
    """Engine switches. ``only`` limits it to configs where it changes something: "lora", "nvfp4" (our
    method) or "quant" (any NVFP4 config, stock included). A combination ("a+b") runs on every config
    that at least one part applies to (the other parts are no-ops there)."""

    help: str
    env: dict[str, str] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)  # LLM(...) keyword arguments
    compilation: dict[str, Any] = field(default_factory=dict)  # compilation_config entries
    nvfp4: dict[str, Any] = field(default_factory=dict)  # additional_config["qerl_nvfp4"] entries
    only: str | None = None  # None | "lora" | "nvfp4" | "quant"
    lora_tuned: bool = False
    parts: tuple[str, ...] = ()  # presets of a combination


VARIANTS: dict[str, Variant] = {
    "default": Variant("vLLM defaults; max_loras=1, max_lora_rank = adapter rank, capture sizes = --batches"),
    "dual-stream": Variant("LoRA shrink/expand on a second CUDA stream, overlapping the base GEMM (and PDL)",
                           env={"VLLM_LORA_ENABLE_DUAL_STREAM": "1"}, only="lora"),
    "lora-tuned": Variant("LoRA Triton kernels with shape-specific configs written by this bench "
                          "(split-K sized to K, one N tile for the rank) via VLLM_TUNED_CONFIG_FOLDER",
                          only="lora", lora_tuned=True),
    "specialize": Variant("LoRA kernel grids sized to the active adapter count (specialize_active_lora)",
                          engine={"specialize_active_lora": True}, only="lora"),
    "fully-sharded": Variant("fully_sharded_loras (matters only with tensor parallelism)",
                             engine={"fully_sharded_loras": True}, only="lora"),
    "rank64": Variant("max_lora_rank=64 with the rank-32 adapter (cost of a padded rank)",
                      engine={"max_lora_rank": 64}, only="lora"),
    "max-loras-4": Variant("max_loras=4 (RL needs 1)", engine={"max_loras": 4}, only="lora"),
    "no-fp32-reduce": Variant("Marlin reduces split-K partials in BF16 instead of FP32",
                              nvfp4={"fp32_reduce": False}, only="nvfp4"),
    "marlin-atomic": Variant("VLLM_MARLIN_USE_ATOMIC_ADD=1 (vLLM applies it only where n < 2048)",
                             env={"VLLM_MARLIN_USE_ATOMIC_ADD": "1"}, only="quant"),
    "piecewise": Variant("piecewise CUDA graphs only (no full decode graph)",
                         compilation={"cudagraph_mode": "PIECEWISE"}),
    "full-decode-only": Variant("full CUDA graphs for decode only", compilation={"cudagraph_mode": "FULL_DECODE_ONLY"}),
    "no-async": Variant("async scheduling off", engine={"async_scheduling": False}),
}

# Targets from the issue (ratios vs bf16-lora in the same run; LoRA overhead on NVFP4).
TARGETS = {"7B": {1: 2.5, 8: 2.2, 64: 1.3}, "32B": {1: 3.0}}
MAX_LORA_OVERHEAD = 0.10


def _variant(name: str) -> Variant:
    """A preset name, or presets joined with '+' (settings merged left to right)."""
    parts = [p.strip() for p in name.split("+") if p.strip()]
    unknown = [p for p in parts if p not in VARIANTS]
    if not parts or unknown:
        raise ValueError(f"unknown variant {name!r} (unknown: {unknown}); choose from {sorted(VARIANTS)} or join with '+'")
    if len(parts) == 1:
        return VARIANTS[parts[0]]
    merged = Variant(help=" + ".join(VARIANTS[p].help for p in parts))
    return Variant(
        help=merged.help,
        env={k: v for p in parts for k, v in VARIANTS[p].env.items()},
        engine={k: v for p in parts for k, v in VARIANTS[p].engine.items()},
        compilation={k: v for p in parts for k, v in VARIANTS[p].compilation.items()},
        nvfp4={k: v for p in parts for k, v in VARIANTS[p].nvfp4.items()},
        lora_tuned=any(VARIANTS[p].lora_tuned for p in parts),
        parts=tuple(parts),
    )


def _applies(variant: Variant, cfg: BenchConfig) -> bool:
    if variant.parts:
        return any(_applies(VARIANTS[p], cfg) for p in variant.parts)
    return (
        variant.only is None
        or (variant.only == "lora" and cfg.lora)
        or (variant.only == "nvfp4" and cfg.quant == "nvfp4")
        or (variant.only == "quant" and cfg.quant is not None)
    )


# ---------------------------------------------------------------------------------------------------
# CLI


def _csv(kind):
    def parse(text: str):
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        return [kind(x) for x in items]

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    p = sub.add_parser("rollout", help="decode tokens/s and memory per config (one vLLM engine each)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--shape", default="7B", choices=sorted(SHAPES, key=lambda s: float(s[:-1])),
                     help="Qwen2.5 shape with random weights (default 7B)")
    src.add_argument("--model", help="a BF16 Hugging Face checkpoint directory (real weights)")
    p.add_argument("--nvfp4-model", help="NVFP4A16 checkpoint (`qerl quantize` output) for the nvfp4/stock configs "
                   "instead of quantizing while loading (needed for stock-* with --model)")
    p.add_argument("--configs", type=_csv(str), default=_csv(str)(DEFAULT_CONFIGS),
                   help=f"comma list from {list(CONFIGS)} (default {DEFAULT_CONFIGS})")
    p.add_argument("--variants", type=_csv(str), default=["default"],
                   help="comma list of engine switch presets, '+' combines presets: "
                   + "; ".join(f"{k}: {v.help}" for k, v in VARIANTS.items()))
    p.add_argument("--batches", type=_csv(int), default=[1, 8, 64], help="batch sizes (default 1,8,64)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per batch size; the best is kept")
    p.add_argument("--lora-rank", type=int, default=32, help="adapter rank (max_lora_rank follows it)")
    p.add_argument("--aqn-sigma", type=float, default=1e-2, help="AQN noise sigma for *-aqn configs")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--capture-sizes", choices=["batches", "vllm"], default="batches",
                   help="CUDA-graph capture sizes: exactly --batches (fast start) or vLLM's default list")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per engine before it is killed")
    p.add_argument("--mp", action="store_true", help="use vLLM's engine subprocess (default: in-process engine, "
                   "VLLM_ENABLE_V1_MULTIPROCESSING=0, which avoided a LoRA start-up hang)")
    p.add_argument("--out", default=None, help="output folder for results and logs (default $OUT or ./.out)")
    p.add_argument("--work", default=None, help="folder for the generated model configs and LoRA adapter "
                   "(hundreds of MB for large shapes; default <tmp>/qerl-bench, reused across runs)")
    p.add_argument("--dry-run", action="store_true", help="write model config/adapter, print the plan, run nothing")

    k = sub.add_parser("kernels", help="per-layer decode kernels in CUDA graphs: BF16 GEMM, Marlin FP4, LoRA (vLLM "
                       "punica vs a dense alternative), base+LoRA serial vs overlapped on two streams",
                       description=KERNELS_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    k.add_argument("--shape", default="7B", choices=sorted(SHAPES, key=lambda s: float(s[:-1])))
    k.add_argument("--batches", type=_csv(int), default=[1, 8, 64])
    k.add_argument("--lora-rank", type=int, default=32)
    k.add_argument("--iters", type=int, default=50, help="kernel calls captured per CUDA graph")
    k.add_argument("--out", default=None, help="output folder (default $OUT or ./.out)")


def run(args: argparse.Namespace) -> int:
    command = getattr(args, "bench_command", None)
    if command == "rollout":
        return rollout(args)
    if command == "kernels":
        return kernels(args)
    print("usage: qerl bench {rollout,kernels} [options]  (see qerl bench rollout --help)", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------------------------------------
# preparation: model folder, adapter, plan


def write_shape(shape: str, root: Path, quantization_config: dict | None = None) -> Path:
    """A model folder with only config.json (weights come from load_format=dummy)."""
    cfg = {**_QWEN25_COMMON, **SHAPES[shape]}
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    path = root / (f"qwen2.5-{shape.lower()}" + ("-nvfp4a16" if quantization_config else ""))
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def model_dims(model_dir: Path) -> dict[str, int]:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    return dict(
        hidden=cfg["hidden_size"],
        inter=cfg["intermediate_size"],
        layers=cfg["num_hidden_layers"],
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab=cfg["vocab_size"],
    )


def write_adapter(model_dir: Path, rank: int, path: Path, seed: int = 0) -> Path:
    """A random PEFT LoRA adapter on all 7 projections (non-zero B), as PEFT saves it."""
    import torch
    from safetensors.torch import save_file

    d = model_dims(model_dir)
    marker = path / ".complete"
    if marker.exists() and json.loads(marker.read_text()) == {"dims": d, "rank": rank, "seed": seed}:
        return path
    path.mkdir(parents=True, exist_ok=True)
    q, kv = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    io = {"q_proj": (d["hidden"], q), "k_proj": (d["hidden"], kv), "v_proj": (d["hidden"], kv),
          "o_proj": (q, d["hidden"]), "gate_proj": (d["hidden"], d["inter"]),
          "up_proj": (d["hidden"], d["inter"]), "down_proj": (d["inter"], d["hidden"])}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(d["layers"]):
        for name, (fan_in, fan_out) in io.items():
            block = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            a = torch.randn(rank, fan_in, generator=gen) / math.sqrt(fan_in)
            b = torch.randn(fan_out, rank, generator=gen) * 1e-2
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": LORA_TARGETS, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
        "base_model_name_or_path": str(model_dir),
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=1))
    marker.write_text(json.dumps({"dims": d, "rank": rank, "seed": seed}))
    return path


@dataclass
class Run:
    config: str
    variant: str
    spec: dict[str, Any]
    env: dict[str, str]

    @property
    def key(self) -> str:
        return f"{self.config}@{self.variant}"


def plan(args: argparse.Namespace, out: Path) -> tuple[list[Run], list[dict]]:
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    variants = {name: _variant(name) for name in args.variants}
    if any(b < 1 for b in args.batches) or args.prompt_len < 1 or args.new_tokens < 2:
        raise ValueError("--batches must be >= 1, --prompt-len >= 1 and --new-tokens >= 2")
    work = Path(args.work).expanduser().resolve() if getattr(args, "work", None) else Path(tempfile.gettempdir()) / "qerl-bench"
    models = work / "models"
    if args.model:
        bf16_dir, dummy = Path(args.model).expanduser().resolve(), False
        if not (bf16_dir / "config.json").exists():
            raise ValueError(f"--model {bf16_dir}: no config.json there; pass a Hugging Face checkpoint folder")
    else:
        bf16_dir, dummy = write_shape(args.shape, models), True
    nvfp4_dir = Path(args.nvfp4_model).expanduser().resolve() if args.nvfp4_model else None
    stock_dir = nvfp4_dir
    if stock_dir is None and dummy:
        from qerl_plugin.format import quantization_config_dict

        stock_dir = write_shape(args.shape, models, quantization_config_dict(ignore=["lm_head"]))
    adapter = None
    if any(CONFIGS[c].lora for c in args.configs):
        adapter = write_adapter(bf16_dir, args.lora_rank, work / f"adapter-{bf16_dir.name}-r{args.lora_rank}")

    runs, skipped = [], []
    for vname, variant in variants.items():
        for cname in args.configs:
            cfg = CONFIGS[cname]
            if not _applies(variant, cfg):
                skipped.append({"config": cname, "variant": vname, "reason": "the variant changes nothing for this config"})
                continue
            if cfg.quant in ("stock", "humming") and stock_dir is None:
                skipped.append({"config": cname, "variant": vname, "reason": f"{cname} with --model needs --nvfp4-model"})
                continue
            model_dir = {None: bf16_dir, "nvfp4": nvfp4_dir or bf16_dir, "stock": stock_dir, "humming": stock_dir}[cfg.quant]
            engine: dict[str, Any] = dict(
                model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                max_model_len=args.prompt_len + args.new_tokens + 16, enforce_eager=False,
                gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tp,
                max_num_seqs=max(args.batches), enable_prefix_caching=False,
                load_format="auto" if (cfg.quant and nvfp4_dir) or not dummy else "dummy",
            )
            if cfg.quant in ("nvfp4", "humming"):
                engine["quantization"] = cfg.quant
            additional: dict[str, Any] = {}
            if cfg.lora:
                engine.update(enable_lora=True, max_loras=1, max_lora_rank=args.lora_rank)
            if cfg.aqn:
                additional["qerl_aqn"] = True
                engine["worker_extension_cls"] = "vllm_ext.worker_extension.QerlWorkerExtension"
            compilation: dict[str, Any] = {}
            if args.capture_sizes == "batches":
                compilation["cudagraph_capture_sizes"] = sorted(set(args.batches))
            engine.update(variant.engine)  # LoRA-only switches reach LoRA configs only (_applies)
            compilation.update(variant.compilation)
            if variant.nvfp4 and cfg.quant == "nvfp4":
                additional["qerl_nvfp4"] = dict(variant.nvfp4)
            if compilation:
                engine["compilation_config"] = compilation
            if additional:
                engine["additional_config"] = additional
            env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if args.mp else "0", "PYTHONUNBUFFERED": "1",
                   **variant.env}
            if args.mp:
                env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the memory probe is a callable
            tuned_dir = None
            if variant.lora_tuned and cfg.lora:
                tuned_dir = str(out / "lora_kernel_configs")
                env["VLLM_TUNED_CONFIG_FOLDER"] = tuned_dir
            spec = dict(
                config=cname, variant=vname, engine=engine, batches=list(args.batches), prompt_len=args.prompt_len,
                new_tokens=args.new_tokens, repeats=args.repeats, lora_path=str(adapter) if cfg.lora else None,
                lora_rank=args.lora_rank, aqn_sigma=args.aqn_sigma if cfg.aqn else None, tuned_dir=tuned_dir,
                dims=model_dims(model_dir), shape=None if args.model else args.shape, dummy=dummy,
            )
            runs.append(Run(cname, vname, spec, env))
    return runs, skipped


# ---------------------------------------------------------------------------------------------------
# parent: run each engine in its own process


def _run_child(run_: Run, out: Path, timeout: float) -> dict[str, Any]:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    spec_path = logs / f"{run_.key}.spec.json"
    result_path = logs / f"{run_.key}.result.json"
    log_path = logs / f"{run_.key}.log"
    spec_path.write_text(json.dumps(run_.spec, indent=1))
    result_path.unlink(missing_ok=True)
    env = {**os.environ, **run_.env}
    started = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_ext.bench", "_child", str(spec_path), str(result_path)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            code = None
    result: dict[str, Any] = {}
    if result_path.exists():
        try:
            result = json.loads(result_path.read_text())
        except json.JSONDecodeError:
            result = {}
    result.setdefault("config", run_.config)
    result.setdefault("variant", run_.variant)
    result["wall_s"] = round(time.time() - started, 1)
    result["env"] = run_.env
    result["log"] = str(log_path)
    if code is None:
        result["ok"] = False
        result["error"] = f"timed out after {timeout:.0f} s (engine killed); see {log_path}"
    elif code != 0 and result.get("ok", False) is not False:
        result["ok"] = False
        result.setdefault("error", f"exit status {code}; see {log_path}")
    elif not result:
        result.update(ok=False, error=f"exit status {code}, no result; see {log_path}")
    if not result.get("ok"):
        tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
        result["log_tail"] = tail
    return result


def rollout(args: argparse.Namespace) -> int:
    out = Path(args.out or os.environ.get("OUT") or ".out").expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs, skipped = plan(args, out)
    print(f"qerl bench rollout: {len(runs)} engine(s) -> {out}", flush=True)
    for r in runs:
        print(f"  {r.key:<34} {json.dumps(r.spec['engine'].get('compilation_config', {}))} env={r.env}", flush=True)
    for s in skipped:
        print(f"  skip {s['config']}@{s['variant']}: {s['reason']}", flush=True)
    if args.dry_run:
        return 0
    results = []
    jsonl = out / "bench_rollout.jsonl"
    for i, r in enumerate(runs, 1):
        print(f"[{i}/{len(runs)}] {r.key} ...", flush=True)
        res = _run_child(r, out, args.timeout)
        results.append(res)
        with open(jsonl, "a") as f:
            f.write(json.dumps(res) + "\n")
        status = "ok" if res.get("ok") else f"FAILED: {res.get('error')}"
        print(f"[{i}/{len(runs)}] {r.key}: {status} ({res['wall_s']} s)", flush=True)
    summary = summarize(results, args)
    report = {"args": {k: v for k, v in vars(args).items() if k != "func"}, "results": results,
              "skipped": skipped, "summary": summary}
    (out / "bench_rollout.json").write_text(json.dumps(report, indent=1, default=str))
    print(format_table(results, summary, args.batches))
    return 0 if results and all(r.get("ok") for r in results) else 1


def summarize(results: list[dict], args: argparse.Namespace) -> dict[str, Any]:
    """Ratios vs bf16-lora (same variant, else the default variant), LoRA overhead, target checks."""
    by = {(r["config"], r["variant"]): r for r in results if r.get("ok")}
    rows: dict[str, Any] = {}
    for (cname, vname), r in by.items():
        base = by.get((BASELINE, vname)) or by.get((BASELINE, "default"))
        row: dict[str, Any] = {"decode_tok_s": {}, "vs_bf16_lora": {}, "lora_overhead": {}}
        no_lora = by.get((cname.replace("-lora-aqn", "").replace("-lora", ""), vname)) if CONFIGS[cname].lora else None
        for b, m in r.get("batches", {}).items():
            tok = m.get("decode_tok_s")
            row["decode_tok_s"][b] = tok
            if base and tok and base["batches"].get(b, {}).get("decode_tok_s"):
                row["vs_bf16_lora"][b] = round(tok / base["batches"][b]["decode_tok_s"], 3)
            if no_lora and tok and no_lora["batches"].get(b, {}).get("decode_tok_s"):
                row["lora_overhead"][b] = round(1 - tok / no_lora["batches"][b]["decode_tok_s"], 3)
        rows[f"{cname}@{vname}"] = row
    checks = []
    shape = None if args.model else args.shape
    for key, row in rows.items():
        cname = key.split("@")[0]
        if cname != "nvfp4-lora":
            continue
        for b, target in TARGETS.get(shape, {}).items():
            got = row["vs_bf16_lora"].get(str(b), row["vs_bf16_lora"].get(b))
            if got is not None:
                checks.append({"run": key, "what": f"{shape} b{b} vs bf16-lora", "target": f">= {target}", "got": got,
                               "pass": got >= target})
        for b, ov in row["lora_overhead"].items():
            checks.append({"run": key, "what": f"LoRA overhead b{b}", "target": f"<= {MAX_LORA_OVERHEAD:.0%}",
                           "got": ov, "pass": ov <= MAX_LORA_OVERHEAD})
    return {"rows": rows, "checks": checks}


def _gib(n: Any) -> str:
    return f"{n / 2**30:.2f}" if isinstance(n, (int, float)) and n else "-"


def format_table(results: list[dict], summary: dict, batches: list[int]) -> str:
    lines = []
    head = f"{'run':<34}" + "".join(f"{'b' + str(b) + ' tok/s':>12}{'x':>7}" for b in batches)
    head += f"{'weights':>9}{'lora':>7}{'kv':>8}{'start s':>8}"
    lines += ["", "decode tokens/s (x = ratio vs bf16-lora of the same variant); memory in GiB", head, "-" * len(head)]
    for r in results:
        key = f"{r['config']}@{r['variant']}"
        if not r.get("ok"):
            lines.append(f"{key:<34} FAILED: {str(r.get('error'))[:150]}")
            continue
        row = summary["rows"].get(key, {})
        cells = ""
        for b in batches:
            tok = r["batches"].get(str(b), {}).get("decode_tok_s")
            ratio = row.get("vs_bf16_lora", {}).get(str(b))
            cells += f"{tok:>12.1f}" if tok else f"{'-':>12}"
            cells += f"{ratio:>7.2f}" if ratio else f"{'-':>7}"
        mem = r.get("memory", {})
        cells += f"{_gib(mem.get('weights_bytes')):>9}{_gib(mem.get('lora_buffers_bytes')):>7}"
        cells += f"{_gib(mem.get('kv_cache_bytes')):>8}{r.get('startup_s', 0):>8.0f}"
        lines.append(f"{key:<34}{cells}")
    overheads = [f"{k}: " + ", ".join(f"b{b} {v:.0%}" for b, v in row["lora_overhead"].items())
                 for k, row in summary["rows"].items() if row["lora_overhead"]]
    if overheads:
        lines += ["", "LoRA overhead (1 - tok/s with LoRA / without): " + "; ".join(overheads)]
    if summary["checks"]:
        lines += ["", "targets:"] + [
            f"  {'PASS' if c['pass'] else 'FAIL'} {c['run']} {c['what']}: {c['got']} (target {c['target']})"
            for c in summary["checks"]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# kernels: where the decode time of one layer goes

KERNELS_DOC = """Per-layer decode kernels of a Qwen2.5 shape, each timed as GPU time inside a CUDA graph (no launch
overhead from Python), for every projection group (qkv, o, gate_up, down) and batch size:

  bf16          F.linear (cuBLAS), the BF16 base
  marlin        vLLM's Marlin FP4 GEMM on our NVFP4 bytes (apply_fp4_marlin_linear, fp32 reduce as vLLM)
  marlin_bf16r  the same with use_fp32_reduce=False
  lora_punica   vLLM's LoRA path for one adapter: fp32 buffer, lora_shrink (zeroes it, split-K) + lora_expand
  lora_dense    the same math as two cuBLAS calls: t = x @ A_cat^T, y += t @ B_blockdiag^T (no memset)
  serial        marlin then lora_punica on one stream (what vLLM runs today)
  overlap       marlin on the main stream, lora_punica on a second stream, joined (VLLM_LORA_ENABLE_DUAL_STREAM's idea)

Per-step sums (x layers) estimate the linear-layer share of a decode step and what each LoRA strategy costs.
Writes $OUT/bench_kernels.json; prints the table last. Needs a CUDA GPU and vLLM's compiled ops.
"""


def _graph_us(fn, iters: int, reps: int = 5) -> float:
    """GPU microseconds per call of ``fn``: ``iters`` calls captured in one CUDA graph, best of ``reps``."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000.0 / iters)
    del graph
    return best


def kernels(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    out = Path(args.out or os.environ.get("OUT") or ".out").expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("qerl bench kernels: needs a CUDA GPU", file=sys.stderr)
        return 1
    from vllm.lora.ops.triton_ops import LoRAKernelMeta, lora_expand, lora_shrink
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import (
        apply_fp4_marlin_linear,
        prepare_fp4_layer_for_marlin,
    )

    from qerl_plugin import nvfp4

    shp = {**_QWEN25_COMMON, **SHAPES[args.shape]}
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
        scratch = torch.nn.Module()
        scratch.weight = torch.nn.Parameter(torch.cat([p.packed for p in parts]), requires_grad=False)
        scratch.weight_scale = torch.nn.Parameter(torch.cat([p.scale for p in parts]), requires_grad=False)
        scratch.weight_global_scale = torch.nn.Parameter(1.0 / parts[0].global_scale.max(), requires_grad=False)
        scratch.bias, scratch.params_dtype = None, bf16
        scratch.output_size_per_partition, scratch.input_size_per_partition = n, k_in
        prepare_fp4_layer_for_marlin(scratch)
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
                return apply_fp4_marlin_linear(input=x, weight=scratch.weight, weight_scale=scratch.weight_scale,
                                               weight_global_scale=scratch.weight_global_scale,
                                               workspace=scratch.workspace, size_n=n, size_k=k_in,
                                               use_fp32_reduce=fp32_reduce)

            def punica(target):
                buf = torch.empty(len(ns), m, r, dtype=torch.float32, device=dev)
                lora_shrink(x, lora_a, buf, *margs, 1.0)
                lora_expand(buf, lora_b, target, *margs, offset_start=0, add_inputs=True)

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

            cases = {
                "bf16": lambda: F.linear(x, weight),
                "marlin": marlin,
                "marlin_bf16r": lambda: marlin(False),
                "lora_punica": lambda: punica(y),
                "lora_dense": lambda: dense(y),
                "serial": serial,
                "overlap": overlap,
            }
            row: dict[str, Any] = {"group": gname, "m": m, "n": n, "k": k_in}
            for cname, fn in cases.items():
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
            for c in ("bf16", "marlin", "marlin_bf16r", "lora_punica", "lora_dense", "serial", "overlap")
        }
    report = {"shape": args.shape, "rank": r, "device": torch.cuda.get_device_name(), "rows": rows,
              "per_step_ms": per_step}
    (out / "bench_kernels.json").write_text(json.dumps(report, indent=1))
    cols = ("bf16", "marlin", "marlin_bf16r", "lora_punica", "lora_dense", "serial", "overlap")
    lines = ["", f"per-layer decode kernels, {args.shape}, LoRA r{r}, {report['device']} (GPU us per call in CUDA graphs)",
             f"{'group':<8}{'m':>4}" + "".join(f"{c:>13}" for c in cols)]
    for x in rows:
        lines.append(f"{x['group']:<8}{x['m']:>4}" + "".join(f"{x[c]:>13.1f}" if x.get(c) is not None else f"{'err':>13}" for c in cols))
    lines.append(f"per decode step ({layers} layers, linears only, ms):")
    for m, v in per_step.items():
        lines.append(f"{'step':<8}{m:>4}" + "".join(f"{v[c]:>13.3f}" if v[c] is not None else f"{'-':>13}" for c in cols))
    print("\n".join(lines))
    return 0


# ---------------------------------------------------------------------------------------------------
# child: one engine


def _worker_memory(worker: Any) -> dict[str, Any]:
    """Runs on each vLLM worker (collective_rpc): weight, LoRA-buffer and KV-cache bytes."""
    import torch

    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model

    def storage_bytes(tensors) -> int:
        seen, total = set(), 0
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        return total

    def flat(x):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            for y in x:
                yield from flat(y)
        elif isinstance(x, dict):
            for y in x.values():
                yield from flat(y)

    lora = []
    for m in model.modules():
        for attr in ("lora_a_stacked", "lora_b_stacked"):
            lora.extend(flat(getattr(m, attr, None)))
    free, total = torch.cuda.mem_get_info()
    return {
        "weights_bytes": storage_bytes(list(model.parameters()) + list(model.buffers())),
        "lora_buffers_bytes": storage_bytes(lora),
        "kv_cache_bytes": storage_bytes(flat(getattr(runner, "kv_caches", []))),
        "model_memory_usage": getattr(runner, "model_memory_usage", None),
        "max_allocated": torch.cuda.max_memory_allocated(),
        "free": free,
        "total": total,
        "device": torch.cuda.get_device_name(),
    }


def write_lora_kernel_configs(folder: Path, gpu_name: str, dims: dict[str, int], rank: int, batches: list[int],
                              max_loras: int) -> list[str]:
    """Shape-specific LoRA Triton configs for VLLM_TUNED_CONFIG_FOLDER (structure: README_TUNING.md of vLLM).

    Heuristics, to be measured: shrink with one N tile covering the rank and split-K so that
    block_k * split_k ~ K (vLLM's default split_k=64 x block_k=256 leaves most CTAs without work at K=3584);
    expand with block_k = rank (one K step). Large m (prefill) keeps vLLM's defaults.
    """
    q = dims["heads"] * dims["head_dim"]
    kv = dims["kv_heads"] * dims["head_dim"]
    ks = sorted({dims["hidden"], dims["inter"], q})
    ns = sorted({q, kv, dims["hidden"], dims["inter"]})
    ms = sorted(set(batches) | {max(batches) * 2, 256, 1024, 4096, 16384})
    bn_rank = 1 << max(4, (rank - 1).bit_length())

    def shrink(m: int, k: int) -> dict[str, Any]:
        if m > 128:
            return dict(block_m=32, block_n=16, block_k=32, split_k=8, num_warps=4, num_ctas=1, group_size_m=8,
                        num_stages=2, max_nreg=None)
        block_k = 128
        split_k = max(1, min(32, k // (block_k * 4)))
        return dict(block_m=16, block_n=min(bn_rank, 64), block_k=block_k, split_k=split_k, num_warps=4,
                    num_ctas=1, group_size_m=8, num_stages=2, max_nreg=None)

    def expand(m: int, n: int, slices: int) -> dict[str, Any]:
        if m > 128:
            return dict(block_m=64, block_n=64 if slices > 1 else 128, block_k=32, num_warps=4, num_ctas=1,
                        num_stages=2, max_nreg=None)
        return dict(block_m=16, block_n=128 if n >= 2048 else 64, block_k=max(16, min(rank, 64)), num_warps=4,
                    num_ctas=1, num_stages=2, max_nreg=None)

    loras = sorted({1, max_loras, max_loras + 1})
    shrink_cfg = {str(L): {str(s): {str(m): {str(k): {str(rank): shrink(m, k)} for k in ks} for m in ms}
                           for s in (1, 2, 3)} for L in loras}
    expand_cfg = {str(L): {str(s): {str(m): {str(rank): {str(n): expand(m, n, s) for n in ns}} for m in ms}
                           for s in (1, 2, 3)} for L in loras}
    folder.mkdir(parents=True, exist_ok=True)
    name = gpu_name.replace(" ", "_").replace("-", "_")
    written = []
    for fname, data in ((f"{name}_SHRINK.json", shrink_cfg), (f"{name}_EXPAND_TRUE.json", expand_cfg),
                        (f"{name}_EXPAND_FALSE.json", expand_cfg)):
        (folder / fname).write_text(json.dumps(data))
        written.append(str(folder / fname))
    return written


def _child(spec_path: str, result_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result: dict[str, Any] = {"config": spec["config"], "variant": spec["variant"], "ok": False,
                              "engine_args": spec["engine"], "batches": {}}

    def save() -> None:
        Path(result_path).write_text(json.dumps(result, indent=1, default=str))

    try:
        import random

        import torch

        if spec.get("tuned_dir"):
            result["tuned_configs"] = write_lora_kernel_configs(
                Path(spec["tuned_dir"]), torch.cuda.get_device_name(), spec["dims"], spec["lora_rank"],
                spec["batches"], spec["engine"].get("max_loras", 1))
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        llm = LLM(**spec["engine"])
        result["startup_s"] = round(time.perf_counter() - t0, 1)
        save()
        if spec.get("aqn_sigma") is not None:
            try:
                result["aqn"] = llm.collective_rpc("qerl_set_noise", args=(float(spec["aqn_sigma"]), 0, 0))
            except Exception as exc:
                raise RuntimeError(
                    f"AQN hook unavailable: collective_rpc('qerl_set_noise') failed ({type(exc).__name__}: {exc}); "
                    "it needs vllm_ext.worker_extension.QerlWorkerExtension and vllm_ext.noisy_norm"
                ) from exc
        lora = LoRARequest("bench-adapter", 1, spec["lora_path"]) if spec.get("lora_path") else None
        vocab = spec["dims"]["vocab"]
        rng = random.Random(0)

        def prompts(n: int) -> list[dict[str, list[int]]]:
            return [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(spec["prompt_len"])]}
                    for _ in range(n)]

        def timed(n: int, max_tokens: int) -> float:
            # RL-style sampling (temperature 1); no per-request seed: seeded requests take a slower sampler path
            params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=1.0)
            batch = prompts(n)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            outs = llm.generate(batch, params, lora_request=lora, use_tqdm=False)
            elapsed = time.perf_counter() - start
            got = [len(o.outputs[0].token_ids) for o in outs]
            if got != [max_tokens] * n:
                raise RuntimeError(f"expected {max_tokens} tokens per request, got {sorted(set(got))}")
            return elapsed

        new = spec["new_tokens"]
        for b in spec["batches"]:
            timed(b, 16)  # warm-up: this batch size's graphs, allocator, LoRA slot
            prefill = [timed(b, 1) for _ in range(spec["repeats"])]
            total = [timed(b, new) for _ in range(spec["repeats"])]
            t1, tn = min(prefill), min(total)
            decode = b * (new - 1) / (tn - t1) if tn > t1 else None
            result["batches"][str(b)] = {
                "decode_tok_s": round(decode, 2) if decode else None,
                "e2e_tok_s": round(b * new / tn, 2),
                "prefill_s": round(t1, 4),
                "total_s": [round(t, 4) for t in total],
                "prefill_runs_s": [round(t, 4) for t in prefill],
            }
            save()
        try:
            result["memory"] = llm.collective_rpc(_worker_memory)[0]
        except Exception as exc:  # memory is a nice-to-have; keep the timings
            result["memory_error"] = f"{type(exc).__name__}: {exc}"
        try:
            cache = llm.llm_engine.vllm_config.cache_config
            result["kv_blocks"] = cache.num_gpu_blocks
            if cache.num_gpu_blocks:
                fits = cache.num_gpu_blocks * cache.block_size // (spec["prompt_len"] + new)
                result["kv_max_concurrency"] = fits
                result["kv_fits_batches"] = fits >= max(spec["batches"])
        except Exception:
            pass
        result["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - report everything, including KeyboardInterrupt/SystemExit
        import traceback

        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
        save()
        traceback.print_exc()
        return 1
    save()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "_child":
        sys.exit(_child(sys.argv[2], sys.argv[3]))
    parser = argparse.ArgumentParser(prog="python -m vllm_ext.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
