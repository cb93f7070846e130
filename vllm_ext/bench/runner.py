"""``qerl bench rollout``'s parent process: plan the engines (one per config x variant), run each in its own
child process (``python -m vllm_ext.bench _child``, see :mod:`vllm_ext.bench.child`) under a timeout, and
collect the results into the report. A hung or crashed engine is recorded and the run goes on."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qerl_plugin import options
from qerl_plugin.gpu_clocks import Sampler, visible_gpu
from qerl_plugin.gpu_clocks import problem as clock_problem
from vllm_ext.bench.matrix import CONFIGS, applies, parse_variant
from vllm_ext.bench.report import format_table, summarize
from vllm_ext.bench.shapes import model_dims, write_adapter, write_shape

__all__ = ["Run", "plan", "rollout"]


@dataclass
class Run:
    """One engine to start: the child's spec (engine arguments, batches, adapter) and its environment."""

    config: str
    variant: str
    spec: dict[str, Any]
    env: dict[str, str]

    @property
    def key(self) -> str:
        return f"{self.config}@{self.variant}"

    @property
    def file_stem(self) -> str:
        """The key as a file name of letters, digits, '.', '_' and '-' only (``@`` becomes ``--``, ``+`` ``_``): some transfer
        tools drop files with other characters in their names (the GPU runs of 2026-11-24 lost their engine logs)."""
        return re.sub(r"[^A-Za-z0-9._-]", "_", self.key.replace("@", "--"))


def _nf4_unavailable(cname: str, nf4_dir: Path | None) -> str | None:
    """Why an nf4 config cannot run here (a sentence naming the fix), else None."""
    import importlib.util

    if nf4_dir is None:
        return (f"{cname} needs --bf16-model: a BF16 checkpoint of the same shape (vLLM's bitsandbytes loader "
                "quantizes real files while loading, so dummy weights cannot serve; scripts/gpu/random_checkpoint.py's "
                "bf16 kind writes one of random weights)")
    if not (nf4_dir / "config.json").exists():
        return f"{cname}: --bf16-model {nf4_dir} has no config.json; pass a Hugging Face checkpoint folder"
    if importlib.util.find_spec("bitsandbytes") is None:
        return (f"{cname} needs the bitsandbytes package (vLLM 0.24 asks for >= 0.46.1): pip install bitsandbytes; "
                "on the GPU machine it travels as a wheel (scripts/gpu/session.sh bnb)")
    return None


def plan(args: argparse.Namespace, out: Path) -> tuple[list[Run], list[dict]]:
    """One engine per (config, variant) pair the variant applies to, and the skipped pairs with the reason."""
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    variants = {name: parse_variant(name) for name in args.variants}
    wanted = list(getattr(args, "runs", None) or [])
    grid = {f"{c}@{v}" for c in args.configs for v in variants}
    outside = [w for w in wanted if w not in grid]
    if outside:
        raise ValueError(f"--runs {','.join(outside)}: not a config@variant of --configs x --variants "
                         f"(choose from {sorted(grid)})")
    if any(b < 1 for b in args.batches) or args.prompt_len < 1 or args.new_tokens < 2:
        raise ValueError("--batches must be >= 1, --prompt-len >= 1 and --new-tokens >= 2")
    if getattr(args, "clock_interval", 1.0) < 0:
        raise ValueError(f"--clock-interval {args.clock_interval}: give seconds between GPU samples, or 0 for none")
    profile_tokens = getattr(args, "profile_tokens", 0) or 0
    if profile_tokens and not 3 <= profile_tokens <= 4096:
        raise ValueError(f"--profile-tokens {profile_tokens}: give 0 (off) or 3..4096 tokens (>= 2 decode steps)")
    work = Path(args.work).expanduser().resolve() if getattr(args, "work", None) else Path(tempfile.gettempdir()) / "qerl-bench"
    models = work / "models"
    if args.model:
        bf16_dir, dummy = Path(args.model).expanduser().resolve(), False
        if not (bf16_dir / "config.json").exists():
            raise ValueError(f"--model {bf16_dir}: no config.json there; pass a Hugging Face checkpoint folder")
    else:
        bf16_dir, dummy = write_shape(args.shape, models), True
    nvfp4_dir = Path(args.nvfp4_model).expanduser().resolve() if args.nvfp4_model else None
    nf4_dir = bf16_dir if not dummy else (
        Path(args.bf16_model).expanduser().resolve() if getattr(args, "bf16_model", None) else None)
    adapter = None
    if any(CONFIGS[c].lora for c in args.configs):
        adapter = write_adapter(bf16_dir, args.lora_rank, work / f"adapter-{bf16_dir.name}-r{args.lora_rank}")

    runs, skipped = [], []
    for vname, variant in variants.items():
        for cname in args.configs:
            cfg = CONFIGS[cname]
            if wanted and f"{cname}@{vname}" not in wanted:
                continue  # not asked for: --runs names the pairs to run
            if not applies(variant, cfg):
                skipped.append({"config": cname, "variant": vname, "reason": "the variant changes nothing for this config"})
                continue
            if cfg.quant in ("stock", "humming") and nvfp4_dir is None:
                # vLLM's own NVFP4A16 path (and humming) load a real checkpoint: on random weights vLLM's dummy loader
                # would fill weight_scale with random FP8 bytes, negative and NaN scales, NaN outputs (seen
                # 2026-11-24, docs/benchmarks.md §4i), so there would be no timing of a working model
                reason = f"{cname} needs --nvfp4-model: an NVFP4A16 checkpoint of the same model (`qerl quantize` output"
                if dummy:
                    reason += (", or of the same shape with random weights: scripts/gpu/random_checkpoint.py's nvfp4 "
                               "kind); on load_format=dummy its FP8 scales would be random bytes, negative and NaN "
                               "among them, and the outputs NaN")
                else:
                    reason += ")"
                skipped.append({"config": cname, "variant": vname, "reason": reason})
                continue
            if cfg.quant == "nf4":
                why = _nf4_unavailable(cname, nf4_dir)
                if why:
                    skipped.append({"config": cname, "variant": vname, "reason": why})
                    continue
            model_dir = {None: bf16_dir, options.METHOD: nvfp4_dir or bf16_dir, "stock": nvfp4_dir, "humming": nvfp4_dir,
                         "nf4": nf4_dir}[cfg.quant]
            engine: dict[str, Any] = dict(
                model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                max_model_len=args.prompt_len + args.new_tokens + 16, enforce_eager=False,
                gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tp,
                max_num_seqs=max(args.batches), enable_prefix_caching=False,
                load_format="auto" if (cfg.quant and nvfp4_dir) or not dummy else "dummy",
            )
            if cfg.quant in (options.METHOD, "humming"):
                engine["quantization"] = cfg.quant
            elif cfg.quant == "nf4":  # vLLM's bitsandbytes loader: NF4 (its in-flight quant_type), quantized at load
                engine.update(quantization="bitsandbytes", load_format="bitsandbytes")
            additional: dict[str, Any] = {}
            if cfg.lora:
                engine.update(enable_lora=True, max_loras=1, max_lora_rank=args.lora_rank)
            if cfg.aqn:
                additional.update(options.engine_config(aqn=True))
                engine["worker_extension_cls"] = options.WORKER_EXTENSION
            compilation: dict[str, Any] = {}
            if args.capture_sizes == "batches":
                compilation["cudagraph_capture_sizes"] = sorted(set(args.batches))
            engine.update(variant.engine)  # LoRA-only switches reach LoRA configs only (applies)
            compilation.update(variant.compilation)
            if variant.nvfp4 and cfg.quant == options.METHOD:
                additional[options.NVFP4_KEY] = dict(variant.nvfp4)
            if cfg.lora:
                additional.update(variant.additional)
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
                greedy_prompts=args.greedy_check, profile_tokens=profile_tokens,
            )
            runs.append(Run(cname, vname, spec, env))
    return runs, skipped


def inherited_env(environ: dict[str, str], run_env: dict[str, str]) -> dict[str, str]:
    """The qerl variables (``QERL_*``) an engine inherits from the bench's own environment rather than from its
    variant, e.g. ``QERL_MARLIN_ROW_TILES`` set by a session step: recorded with each result, since they change what
    ran (before §4al's runs they went unrecorded)."""
    return {k: environ[k] for k in sorted(environ) if k.startswith("QERL_") and k not in run_env}


def _run_child(run_: Run, out: Path, timeout: float, clock_interval: float = 1.0) -> dict[str, Any]:
    """Run one engine in its own process (killed after ``timeout`` s); its result, a failed one included. Every
    ``clock_interval`` s (0: never) nvidia-smi samples the engine's GPU: the summary goes into ``gpu_clocks``, and a
    GPU that slowed itself down into ``gpu_problem``."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    spec_path = logs / f"{run_.file_stem}.spec.json"
    result_path = logs / f"{run_.file_stem}.result.json"
    log_path = logs / f"{run_.file_stem}.log"
    spec_path.write_text(json.dumps(run_.spec, indent=1))
    result_path.unlink(missing_ok=True)
    env = {**os.environ, **run_.env}
    started = time.time()
    sampler = Sampler(logs / f"{run_.file_stem}.smi.csv", visible_gpu(env), every=clock_interval)
    with open(log_path, "w") as log, sampler:
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
    inherited = inherited_env(dict(os.environ), run_.env)
    if inherited:
        result["inherited_env"] = inherited
    result["log"] = str(log_path)
    if sampler.available:
        result["gpu_clocks"] = sampler.summary()
        msg = clock_problem(result["gpu_clocks"])
        if msg:
            result["gpu_problem"] = msg
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
        res = _run_child(r, out, args.timeout, getattr(args, "clock_interval", 1.0))
        results.append(res)
        with open(jsonl, "a") as f:
            f.write(json.dumps(res) + "\n")
        status = "ok" if res.get("ok") else f"FAILED: {res.get('error')}"
        if res.get("gpu_problem"):
            status += f"; {res['gpu_problem']}"
        print(f"[{i}/{len(runs)}] {r.key}: {status} ({res['wall_s']} s)", flush=True)
    summary = summarize(results, args)
    report = {"args": {k: v for k, v in vars(args).items() if k != "func"}, "results": results,
              "skipped": skipped, "summary": summary}
    (out / "bench_rollout.json").write_text(json.dumps(report, indent=1, default=str))
    print(format_table(results, summary, args.batches))
    return 0 if results and all(r.get("ok") for r in results) else 1
