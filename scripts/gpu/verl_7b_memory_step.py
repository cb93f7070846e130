#!/usr/bin/env python3
"""GPU: Qwen2.5-7B shape through verl 0.9.1 main_ppo, LoRA r32: peak memory and step time, BF16-LoRA vs NVFP4-LoRA.

A Qwen2.5-7B-shaped model with random weights (std 0.02, built on the GPU, saved once as bf16 safetensors,
15 GB) and synthetic prompts; each precision is one short verl GRPO run (3 steps, 8 prompts x 4 samples,
responses forced to 512 tokens with ignore_eos) of the tiny example config with the 7B model swapped in:

  build   write $OUT/verl_7b/model (+ byte-level tokenizer) and data            (~2-4 min, once)
  bf16    16-bit LoRA base, no AQN                                               (~5-8 min)
  nvfp4   quantization=nvfp4 (both sides quantize at load), AQN on               (~5-8 min)

Per run it records (steps 2..3, step 1 includes warm-up): verl's timing_s/{gen,old_log_prob,update_actor,
update_weights,step}; the actor process's peak torch memory (perf/max_memory_allocated_gb / reserved, verl's);
the device's peak memory.used (nvidia-smi every 0.2 s, all processes: actor + vLLM) with the SM clock, temperature
and the driver's clock-event reasons (gpu_clocks.py: a run whose GPU slowed itself down is a problem, and a pair with
one gets no verdict); vLLM's own "Model loading took X GiB" and KV-cache size lines. Random weights: throughput and
memory only, no accuracy.
No time is measured with enforce_eager (CUDA graphs on; attention is sdpa in the actor, no flash-attn).

    bash scripts/gpu/verl_7b_memory_step.sh build
    bash scripts/gpu/verl_7b_memory_step.sh bf16
    bash scripts/gpu/verl_7b_memory_step.sh nvfp4      # then: ... summary  (or all phases in one call if time allows)

Writes $OUT/verl_7b/{<phase>/run.log, <phase>/metrics.jsonl, <phase>/smi.csv, results.jsonl} and prints a table.

--shape 32B (Qwen2.5-32B: 64 layers, hidden 5120, intermediate 27648; default folder $OUT/verl_32b): a BF16 copy
(~65 GB) does not fit the GPU machine's disk, so the build writes two checkpoints directly, tensor by tensor
(scripts/gpu/random_checkpoint.py, generated and quantized on the GPU, one shard in host memory at a time):

  model_nvfp4/        the NVFP4A16 checkpoint `qerl quantize` would make of the random BF16 model (~21 GB); the
                      nvfp4 run trains on it (the actor is built from the 4-bit bytes, vLLM loads it natively)
  model_bf16_sparse/  a BF16 checkpoint of the same config whose matrices are zeros stored as holes of sparse files
                      (only norms and biases take disk); the bf16 run trains on it (memory and time only)

Options for the 32B runs: --param-offload (verl's actor param + optimizer offload), --bf16-gpu-mem (the BF16 run's
rollout.gpu_memory_utilization; its weights alone take ~61 GiB). With the default --shape 7B nothing changes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import verl_grpo_tiny as tiny  # noqa: E402  (run_verl, read_metrics, preflight)

ROOT = HERE.parents[1]
PHASES = ("build", "bf16", "nvfp4", "summary")
from qerl_plugin.gpu_clocks import Sampler, visible_gpu  # noqa: E402  (memory peak, SM clocks, slowdown reasons)
from qerl_plugin.gpu_clocks import problem as clock_problem  # noqa: E402
from qerl_plugin.options import LORA_KEY, LORA_MODES, NVFP4_BACKENDS, NVFP4_KEY  # noqa: E402
# Qwen2.5-7B and -32B as `qerl bench rollout --shape` knows them, plus the fields a saved config needs
from vllm_ext.bench import SHAPES  # noqa: E402

MODEL_SHAPES = {k: dict(**SHAPES[k], max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
                for k in ("7B", "32B")}
QWEN25_7B, QWEN25_32B = MODEL_SHAPES["7B"], MODEL_SHAPES["32B"]
LOG_TAG = "verl_7b"  # verl_32b with --shape 32B


def log(msg):
    print(f"[{LOG_TAG}] {msg}", flush=True)


def default_out(shape: str) -> Path:
    return Path(os.environ.get("OUT", ".out")) / f"verl_{shape.lower()}"


def model_dir(name: str, out: Path, shape: str = "7B") -> Path:
    """The checkpoint a run trains on: 7B's model/ (BF16; both runs quantize at load as they need); 32B's
    model_nvfp4/ (the nvfp4 run) or model_bf16_sparse/ (the bf16 run)."""
    if shape == "7B":
        return out / "model"
    return out / ("model_nvfp4" if name == "nvfp4" else "model_bf16_sparse")


def build(out: Path, shape: str = "7B") -> dict:
    if shape != "7B":
        return build_direct(out, shape)
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    sys.path.insert(0, str(ROOT / "examples" / "tiny"))
    from make_tiny import byte_level_tokenizer

    from verl_ext.data import make_synthetic_arithmetic

    model_dir, data_dir = out / "model", out / "data"
    t0 = time.time()
    if not (model_dir / "config.json").exists():
        tok = byte_level_tokenizer()
        cfg = Qwen2Config(**QWEN25_7B, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
        with torch.device("cuda"):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        model.save_pretrained(model_dir, safe_serialization=True, max_shard_size="4GB")
        tok.save_pretrained(model_dir)
        del model
        torch.cuda.empty_cache()
    if not (data_dir / "train.parquet").exists():
        make_synthetic_arithmetic(data_dir, n_train=256, n_test=16, seed=0, difficulty=2)
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    return {"model_gb": round(size / 2**30, 2), "build_s": round(time.time() - t0, 1)}


def qwen2_config(shape: str, tok):
    from transformers import Qwen2Config

    return Qwen2Config(**MODEL_SHAPES[shape], eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       bos_token_id=None, architectures=["Qwen2ForCausalLM"], dtype="bfloat16")


def build_direct(out: Path, shape: str) -> dict:
    """The shape's NVFP4 checkpoint and sparse BF16 checkpoint, written directly (random_checkpoint), and the data;
    each folder only if its config.json is absent (a folder is renamed into place only when complete)."""
    import torch
    from transformers import GenerationConfig

    sys.path.insert(0, str(ROOT / "examples" / "tiny"))
    from make_tiny import byte_level_tokenizer

    if str(HERE) not in sys.path:  # when imported as a module by a caller that restored sys.path since
        sys.path.insert(0, str(HERE))
    import random_checkpoint as rc
    from verl_ext.data import make_synthetic_arithmetic

    t0 = time.time()
    tok = byte_level_tokenizer()
    cfg = qwen2_config(shape, tok)
    gen = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rec: dict = {"shape": shape, "device": device}
    for kind, name in (("nvfp4", "nvfp4"), ("bf16_sparse", "bf16")):
        target = model_dir(name, out, shape)
        if not (target / "config.json").exists():
            log(f"build: writing {target} ({kind}, on {device})")
            info = rc.write_checkpoint(target, cfg, kind, tokenizer=tok, generation_config=gen, seed=0, device=device,
                                       log=log)
            rec[f"{kind}_write_s"] = info["seconds"]
        files = sorted(target.glob("*.safetensors"))
        rec[f"{kind}_gb"] = round(sum(f.stat().st_size for f in files) / 2**30, 2)
        rec[f"{kind}_disk_gb"] = round(sum(rc.allocated_bytes(f) for f in files) / 2**30, 2)
        if device == "cuda":
            torch.cuda.empty_cache()
    data_dir = out / "data"
    if not (data_dir / "train.parquet").exists():
        make_synthetic_arithmetic(data_dir, n_train=256, n_test=16, seed=0, difficulty=2)
    rec["build_s"] = round(time.time() - t0, 1)
    return rec


def phase_key(name: str, tag: str) -> str:
    """The results key (and run folder) of a phase: the runs carry --tag, build and summary do not."""
    return name + tag if name in ("bf16", "nvfp4") else name


def overrides_for(name: str, out: Path, args) -> list[str]:
    """The main_ppo overrides of one run ("bf16" or "nvfp4") on the tiny example config."""
    model, data = model_dir(name, out, args.shape), out / "data"
    overrides = [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={data}/train.parquet",
        f"data.val_files={data}/test.parquet",
        "data.train_batch_size=8",
        "data.max_prompt_length=512",
        f"data.max_response_length={args.response}",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.ignore_eos=true",
        "actor_rollout_ref.model.lora_rank=32",
        "actor_rollout_ref.model.lora_alpha=32",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.ppo_micro}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.logprob_micro}",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={rollout_gpu_mem(name, args)}",
        "actor_rollout_ref.rollout.max_num_seqs=64",
        "actor_rollout_ref.rollout.max_num_batched_tokens=8192",
        f"trainer.total_training_steps={args.steps}",
        f"actor_rollout_ref.rollout.custom.qerl.aqn.num_stages={min(args.steps, 3)}",  # AQN on from step 2 (stage 0 is noise-free)
        "trainer.save_freq=-1",
    ]
    if args.max_token_len:  # verl's dynamic micro-batches: up to this many tokens each (the example recipes' 16k)
        overrides += [
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={args.max_token_len}",
        ]
    if args.chunked_entropy:  # verl's own switches: entropy over the vocabulary in chunks, recomputed in backward
        overrides += [
            "actor_rollout_ref.actor.entropy_from_logits_with_chunking=true",
            "actor_rollout_ref.actor.entropy_checkpointing=true",
        ]
    if args.param_offload:  # verl's own: the actor's parameters and optimizer state wait in host memory
        overrides += [
            "actor_rollout_ref.actor.fsdp_config.param_offload=true",
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
        ]
    if args.bypass:  # verl's bypass mode: the rollout's log-probs are the PPO anchor, no old-log-prob pass (both runs)
        overrides += ["algorithm.rollout_correction.bypass_mode=true"]
    if name == "bf16":
        overrides += ["actor_rollout_ref.rollout.quantization=null", "actor_rollout_ref.rollout.custom.qerl.aqn.enable=false"]
        if args.bypass and not args.bf16_vanilla_loss:
            # the actor loss qerl's normalisation gives the NVFP4 run (verl's bypass_mode loss with the
            # rollout-correction block), set by hand here: with qerl off, verl 0.9.1 leaves the workers on 'vanilla'
            overrides += [
                "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode",
                "+actor_rollout_ref.actor.policy_loss.rollout_correction={rollout_is:token,rollout_is_threshold:2.0,"
                "bypass_mode:true,loss_type:ppo_clip}",
            ]
    keep = args.bf16_keep if name == "bf16" else args.nvfp4_keep
    if keep:  # the actor's last N decoder layers keep their activations (qerl's key; docs/benchmarks.md §4u)
        overrides += [f"+actor_rollout_ref.rollout.custom.qerl.actor.no_recompute_layers={keep}"]
    extra = engine_extra(name, args)
    if extra:  # JSON text: verl hands engine_kwargs.vllm to vLLM's command line (qerl merges its keys into it first)
        overrides += [f"++actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config='{json.dumps(extra)}'"]
    return overrides + list(getattr(args, "override", []))  # --override: both runs alike, last


def lora_path(name: str, args) -> str | None:
    """A run's vLLM LoRA path: --bf16-lora for the bf16 run, --nvfp4-lora for the nvfp4 run (None: the plugin's default)."""
    return args.bf16_lora if name == "bf16" else args.nvfp4_lora


def engine_extra(name: str, args) -> dict:
    """The run's own vLLM additional_config entries: its LoRA path (--bf16-lora / --nvfp4-lora) and, for the nvfp4
    run, the nvfp4 backend (--nvfp4-backend); empty when the plugin's defaults apply."""
    extra = {}
    lora = lora_path(name, args)
    if lora:
        extra[LORA_KEY] = lora
    if name == "nvfp4" and args.nvfp4_backend:
        extra[NVFP4_KEY] = {"backend": args.nvfp4_backend}
    return extra


def qerl_log_lines(text: str) -> list[str]:
    """The lines of a run's log that say which paths its vLLM engine took: the LoRA path and the nvfp4 backend
    (one of each per engine process; at most 8 distinct lines)."""
    seen: list[str] = []
    for line in text.splitlines():
        m = re.search(r"(qerl: LoRA linears on the .*|nvfp4: backend \w+)", line)
        if m and m.group(1).strip() not in seen:
            seen.append(m.group(1).strip())
    return seen[:8]


def rollout_gpu_mem(name: str, args) -> float:
    """rollout.gpu_memory_utilization of a run: --bf16-gpu-mem for the bf16 run when given, else --gpu-mem."""
    return args.bf16_gpu_mem if name == "bf16" and args.bf16_gpu_mem is not None else args.gpu_mem


def run(name: str, out: Path, args) -> dict:
    if not (model_dir(name, out, args.shape) / "config.json").exists():
        return {"problems": ["no model: run the build phase first"]}
    overrides = overrides_for(name, out, args)
    run_name = phase_key(name, args.tag)
    (out / run_name).mkdir(parents=True, exist_ok=True)
    gpu = visible_gpu()
    with Sampler(out / run_name / "smi.csv", gpu) as smi:
        rc, text, res = tiny.run_verl(run_name, out, out, overrides, args.timeout, eager=False)
    steps = res["steps"]
    timed = [d for s, d in sorted(steps.items()) if s >= 2] or list(steps.values())

    def mean(key):
        vals = [d[key] for d in timed if isinstance(d.get(key), (int, float))]
        return round(sum(vals) / len(vals), 3) if vals else None

    def spread(key):  # median, min, max over the timed steps
        vals = sorted(d[key] for d in timed if isinstance(d.get(key), (int, float)))
        if not vals:
            return None
        return {"median": round(statistics.median(vals), 3), "min": round(vals[0], 3), "max": round(vals[-1], 3),
                "n": len(vals)}

    def peak(key):
        vals = [d[key] for d in steps.values() if isinstance(d.get(key), (int, float))]
        return round(max(vals), 2) if vals else None

    loads = [float(x) for x in re.findall(r"Model loading took ([0-9.]+) GiB", text)]
    kv = [float(x) for x in re.findall(r"Available KV cache memory: ([0-9.]+) GiB", text)]
    rec = {
        "rc": rc,
        "settings": {"ppo_micro": args.ppo_micro, "max_token_len": args.max_token_len, "logprob_micro": args.logprob_micro,
                     "chunked_entropy": args.chunked_entropy, "response": args.response, "gpu_mem": args.gpu_mem,
                     "bypass": args.bypass, "steps": args.steps, "shape": args.shape,
                     "param_offload": args.param_offload, "bf16_gpu_mem": args.bf16_gpu_mem,
                     "rollout_gpu_mem": rollout_gpu_mem(name, args), "lora_path": lora_path(name, args) or "default",
                     "nvfp4_backend": (args.nvfp4_backend or "auto") if name == "nvfp4" else None,
                     "model": str(model_dir(name, out, args.shape)),
                     "gpu": gpu, "override": list(args.override)},
        "step_s_each": {s: d.get("timing_s/step") for s, d in sorted(steps.items())},
        "step_s_spread": spread("timing_s/step"),
        "gen_s_spread": spread("timing_s/gen"),
        "update_actor_s_spread": spread("timing_s/update_actor"),
        "steps_logged": len(steps),
        "gen_s": mean("timing_s/gen"),
        "old_log_prob_s": mean("timing_s/old_log_prob"),
        "ref_s": mean("timing_s/ref"),
        "update_actor_s": mean("timing_s/update_actor"),
        "update_weights_s": mean("timing_s/update_weights"),
        "step_s": mean("timing_s/step"),
        "actor_peak_alloc_gb": peak("actor/perf/max_memory_allocated_gb"),
        "actor_peak_reserved_gb": peak("actor/perf/max_memory_reserved_gb"),
        "device_peak_used_gb": round(smi.peak / 1024, 2),
        "vllm_weights_gib": loads[0] if loads else None,
        "vllm_kv_cache_gib": kv[0] if kv else None,
        "engine_paths_logged": qerl_log_lines(text),
        "run_s": res["seconds"],
        "gpu_clocks": smi.summary(),
        "sampled_gpu": gpu,  # nvidia-smi's index of the card sampled (CUDA_VISIBLE_DEVICES of one index), None: GPU 0
        "problems": [] if rc == 0 and len(steps) >= args.steps else [f"exit {rc}, {len(steps)} steps logged"],
    }
    msg = clock_problem(rec["gpu_clocks"])
    if msg:
        rec["problems"].append(msg)
    return rec


# issue 12's end-to-end targets, BF16-LoRA step time / NVFP4-LoRA step time, by response length
STEP_TARGETS = {512: 1.5, 2048: 1.8}


def latest_records(path: Path) -> dict[str, dict]:
    """The last record of each phase in a results.jsonl (``{"bf16-r512p": {...}, "build": {...}}``); {} where the file
    does not exist yet."""
    if not Path(path).exists():
        return {}
    return {r["phase"]: r for r in map(json.loads, Path(path).read_text().splitlines())}


def _median(rec: dict, key: str) -> float | None:
    """The median of a record's ``<key>`` spread (e.g. step_s_spread); None where it has none."""
    return (rec.get(key) or {}).get("median")


def _width(rec: dict, key: str) -> float | None:
    """max - min of a record's ``<key>`` spread; None where it has none."""
    return (rec[key]["max"] - rec[key]["min"]) if rec.get(key) else None


def pair_verdict(bf16: dict, nvfp4: dict, target: float | None = None) -> dict:
    """The pair's ratios from the two runs' records (medians of the timed steps), the verdict (NVFP4 faster or slower
    only where the step medians differ by more than both runs' min-max spreads) and what bounds the step ratio: the
    ratio with a rollout that took no time, and how much faster than BF16's the NVFP4 rollout would have to be for
    ``target`` with everything else as measured (None where no rollout speed reaches it)."""
    b_step, n_step = _median(bf16, "step_s_spread"), _median(nvfp4, "step_s_spread")
    b_gen, n_gen = _median(bf16, "gen_s_spread"), _median(nvfp4, "gen_s_spread")
    if None in (b_step, n_step, b_gen, n_gen):
        return {"problems": ["a run lacks timed steps"]}
    diff = b_step - n_step
    spreads = [round(_width(bf16, "step_s_spread"), 3), round(_width(nvfp4, "step_s_spread"), 3)]
    verdict = "no verdict" if abs(diff) <= max(spreads) else ("nvfp4 faster" if diff > 0 else "nvfp4 slower")
    slowed = [arm for arm, r in (("bf16", bf16), ("nvfp4", nvfp4)) if (r.get("gpu_clocks") or {}).get("slowed")]
    if slowed:  # a GPU that slowed itself down in either arm: the ratios are reported, no verdict is drawn from them
        verdict = f"no verdict: the GPU slowed itself down in the {' and '.join(slowed)} arm{'s' * (len(slowed) > 1)}"
    rest = n_step - n_gen  # NVFP4's step outside its rollout
    out = {"step_ratio": round(b_step / n_step, 3), "rollout_ratio": round(b_gen / n_gen, 3),
           "verdict": verdict, "spreads_s": spreads, "difference_s": round(diff, 3),
           "ratio_with_free_rollout": round(b_step / rest, 2) if rest > 0 else None}
    b_up, n_up = _median(bf16, "update_actor_s_spread"), _median(nvfp4, "update_actor_s_spread")
    if b_up and n_up:
        out["update_ratio"] = round(b_up / n_up, 3)
    if target:
        budget = b_step / target - rest  # the NVFP4 rollout time that would give the target
        out.update(target=target, met=verdict == "nvfp4 faster" and b_step / n_step >= target,
                   rollout_ratio_needed=round(b_gen / budget, 2) if budget > 0 else None)
    return out


def swap_check(pair: tuple[dict, dict], swapped: tuple[dict, dict]) -> dict:
    """A two-GPU pair against the same pair with the cards swapped (each a (bf16, nvfp4) record pair): both step ratios,
    how far apart they are (relative to the smaller) and the largest relative spread (max - min over median) of the four
    arms; the card assignments agree where the ratios are less far apart than that spread (benchmarks §4y's rule),
    otherwise no verdict is drawn from either pair."""
    key = "step_s_spread"
    if any(_median(r, key) is None for r in (*pair, *swapped)):
        return {"problems": ["an arm lacks timed steps"]}
    ratios = [_median(b, key) / _median(n, key) for b, n in (pair, swapped)]
    apart = abs(ratios[0] - ratios[1]) / min(ratios)
    widest = max(_width(r, key) / _median(r, key) for r in (*pair, *swapped))
    verdict = ("the card assignments agree" if apart < widest else
               f"no verdict: the card assignments' ratios are {apart:.1%} apart, more than the widest spread "
               f"({widest:.1%})")
    return {"step_ratios": [round(x, 3) for x in ratios], "apart": round(apart, 4), "widest_spread": round(widest, 4),
            "verdict": verdict}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phases", nargs="*", default=list(PHASES), help=f"any of {', '.join(PHASES)} (default: all)")
    p.add_argument("--shape", choices=tuple(MODEL_SHAPES), default="7B",
                   help="Qwen2.5 shape: 7B (one BF16 model/, both runs quantize at load) or 32B (the build writes "
                        "model_nvfp4/ for the nvfp4 run and a sparse all-zero model_bf16_sparse/ for the bf16 run)")
    p.add_argument("--out", type=Path, default=None, help="run folder (default: $OUT/verl_7b, or $OUT/verl_32b)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--response", type=int, default=512)
    p.add_argument("--gpu-mem", type=float, default=0.5,
                   help="rollout.gpu_memory_utilization (the same for both, unless --bf16-gpu-mem)")
    p.add_argument("--bf16-gpu-mem", type=float, default=None,
                   help="rollout.gpu_memory_utilization of the bf16 run only (default: --gpu-mem)")
    p.add_argument("--param-offload", action="store_true",
                   help="actor.fsdp_config.param_offload and optimizer_offload (both runs)")
    p.add_argument("--ppo-micro", type=int, default=4, help="actor.ppo_micro_batch_size_per_gpu")
    p.add_argument("--logprob-micro", type=int, default=8, help="rollout.log_prob_micro_batch_size_per_gpu")
    p.add_argument("--max-token-len", type=int, default=0,
                   help="actor.use_dynamic_bsz with ppo_max_token_len_per_gpu=N (0: fixed micro-batches of --ppo-micro)")
    p.add_argument("--chunked-entropy", action="store_true",
                   help="verl's entropy_from_logits_with_chunking + entropy_checkpointing (smaller logit peaks)")
    p.add_argument("--bypass", action="store_true",
                   help="algorithm.rollout_correction.bypass_mode=true for both runs (no old-log-prob pass)")
    p.add_argument("--bf16-vanilla-loss", action="store_true",
                   help="with --bypass, leave the BF16 run's actor loss on verl's 'vanilla' (as verl 0.9.1 does without "
                        "qerl; the run of 2026-11-24 fifth session's first pair)")
    p.add_argument("--bf16-lora", choices=LORA_MODES, default=None,
                   help="the BF16 run's vLLM LoRA path (additional_config qerl_lora); default: the plugin's default "
                        "(fused). 'punica' is vLLM's own, what a BF16 run without qerl gets")
    p.add_argument("--nvfp4-lora", choices=LORA_MODES, default=None,
                   help="the NVFP4 run's vLLM LoRA path, the same way (default: the plugin's default, overlap)")
    p.add_argument("--nvfp4-backend", choices=[b for b in NVFP4_BACKENDS if b != "emulation"], default=None,
                   help="the NVFP4 run's nvfp4 backend (additional_config qerl_nvfp4.backend); default: the plugin's "
                        "(auto: Marlin). 'humming' needs the humming-kernels package (docs/benchmarks.md §4ad)")
    p.add_argument("--nvfp4-keep", type=int, default=0, metavar="N",
                   help="the NVFP4 run's actor.no_recompute_layers: its last N layers keep their activations (default 0)")
    p.add_argument("--bf16-keep", type=int, default=0, metavar="N", help="the same for the BF16 run (default 0)")
    p.add_argument("--tag", default="", help="suffix of the run folders and result phases, e.g. -r2048")
    p.add_argument("--swap-of", default=None, metavar="TAG",
                   help="summary: this pair (--tag) is TAG's pair with the cards swapped (v7_pair_2gpu SWAP=1); also "
                        "print whether the two card assignments agree (benchmarks §4y)")
    p.add_argument("--timeout", type=int, default=570)
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="one more main_ppo override for both runs (repeatable), e.g. "
                        "+ray_kwargs.ray_init.include_dashboard=false when two runs share a host")
    return p


def main() -> int:
    p = parser()
    args = p.parse_args()
    bad = [x for x in args.phases if x not in PHASES]
    if bad:
        p.error(f"unknown phase(s) {bad}; choose from {', '.join(PHASES)}")
    global LOG_TAG
    LOG_TAG = f"verl_{args.shape.lower()}"
    out = (args.out or default_out(args.shape)).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results_file = out / "results.jsonl"
    if any(x in ("bf16", "nvfp4") for x in args.phases):
        log(f"preflight: {tiny.preflight()}")
    for name in args.phases:
        if name == "summary":
            continue
        try:
            rec = build(out, args.shape) if name == "build" else run(name, out, args)
        except Exception as e:
            rec = {"problems": [f"{type(e).__name__}: {e}"]}
        rec = {"phase": phase_key(name, args.tag), **rec}
        with open(results_file, "a") as fh:
            fh.write(json.dumps(rec) + "\n")
        log(json.dumps(rec))

    latest = latest_records(results_file)
    cols = ("gen_s", "old_log_prob_s", "update_actor_s", "update_weights_s", "step_s", "actor_peak_alloc_gb",
            "device_peak_used_gb", "vllm_weights_gib", "vllm_kv_cache_gib")  # fmt: skip
    print("\n" + "=" * 110)
    print(f"{'run':6} " + " ".join(f"{c:>16}" for c in cols))
    for name in (phase_key("bf16", args.tag), phase_key("nvfp4", args.tag)):
        r = latest.get(name)
        if r:
            print(f"{name:6} " + " ".join(f"{str(r.get(c, '-')):>16}" for c in cols))
            if r.get("step_s_spread"):
                print(f"    step s over steps 2..: {r['step_s_spread']}  each: {r.get('step_s_each')}")
            for prob in r.get("problems", []):
                print(f"    ! {prob}")
    arms = lambda tag: [latest.get(phase_key(n, tag)) for n in ("bf16", "nvfp4")]
    pair = arms(args.tag)
    if all(pair):
        print(f"pair: {json.dumps(pair_verdict(*pair, STEP_TARGETS.get(args.response)))}")
    if args.swap_of is not None:
        other = arms(args.swap_of)
        if all(pair) and all(other):
            print(f"swap ({args.swap_of} / {args.tag}): {json.dumps(swap_check(tuple(other), tuple(pair)))}")
        else:
            print(f"swap: no check, the runs of both {args.swap_of} and {args.tag} are needed in {results_file}")
    if "build" in latest:
        print(f"model: {latest['build']}")
    print(f"results: {results_file}")
    ran = [latest[phase_key(n, args.tag)] for n in args.phases if phase_key(n, args.tag) in latest]
    return 0 if all(not r.get("problems") for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
