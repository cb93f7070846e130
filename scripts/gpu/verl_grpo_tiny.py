#!/usr/bin/env python3
"""GPU: unmodified verl 0.9.1 `main_ppo` GRPO/DAPO on a tiny Qwen2 model with qerl (NVFP4 + LoRA + AQN).

Every phase runs `python -m verl.trainer.main_ppo --config-path examples/tiny --config-name config [overrides]`
in a child process (qerl acts only through its entry points) and then checks its logs and metrics:

  nvfp4   20 GRPO steps, quantization=nvfp4, AQN 1e-2 -> 1e-4 over 5 stages, checkpoint every 10 steps.
          Checks: 20 steps logged; finite pg_loss/grad_norm; qerl/aqn_sigma of every step equals the schedule;
          one AQN RPC and one adapter sync per weight sync (21 = 1 initial + 20); vLLM confirmed each noise set.
  bf16    the same 20 steps with a 16-bit LoRA base, no AQN (the baseline; also proves verl's own adapter sync
          works with qerl's collect_lora_params fix). Checks: steps, finite losses.
  dapo    4 DAPO steps (token-mean loss, clip-higher 0.28, no KL, reward -1/+1) with NVFP4 + AQN.
  resume  resumes the nvfp4 run from its global_step_10 checkpoint and trains to step 20. Checks: the first
          logged step is 11, the first AQN RPC is update_weights(10), and sigma/stage of steps 11..20 equal the
          uninterrupted run's.

Run from the repository root on the GPU machine (vllm/verl/ray + this project installed in /tmp/site):

    bash scripts/gpu/verl_grpo_tiny.sh                 # all phases (~15-25 min: run one phase per call instead)
    bash scripts/gpu/verl_grpo_tiny.sh nvfp4           # one phase (each < 10 min); resume needs nvfp4 first
    bash scripts/gpu/verl_grpo_tiny.sh nvfp4 resume    # several

Writes to $OUT (default ./.out/verl_grpo_tiny): tiny/{model,data} (built once), <phase>/{run.log, metrics.jsonl,
checkpoints/}, results.jsonl (one line per phase), and prints a summary table last. A failing phase is recorded and
the next one still runs. Flags: --steps, --timeout (per phase, default 560 s), --eager (skip CUDA graphs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "tiny" / "config.yaml"
PHASES = ("nvfp4", "bf16", "dapo", "resume")
AQN = {"sigma_start": 1e-2, "sigma_end": 1e-4, "num_stages": 5}

# ---------------------------------------------------------------------------------------------------------
# helpers


def log(msg: str) -> None:
    print(f"[verl_grpo_tiny] {msg}", flush=True)


def preflight() -> dict:
    """verl sees qerl through its entry point, from the installed copy."""
    code = (
        "import json, sys, verl, verl_ext, vllm_ext; "
        "print(json.dumps({'verl': verl.__version__, 'registered': verl_ext.REGISTERED, "
        "'verl_ext': verl_ext.__file__, 'vllm_ext': vllm_ext.__file__}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"cannot import verl/verl_ext/vllm_ext:\n{out.stderr[-2000:]}")
    info = json.loads(out.stdout.strip().splitlines()[-1])
    installed = Path(info["verl_ext"]).resolve().parent
    if installed != (ROOT / "verl_ext").resolve():
        import hashlib

        differ = [
            f.name
            for f in sorted((ROOT / "verl_ext").glob("*.py"))
            if not (installed / f.name).exists()
            or hashlib.sha256((installed / f.name).read_bytes()).digest() != hashlib.sha256(f.read_bytes()).digest()
        ]
        if differ:
            log(f"WARNING: installed verl_ext ({installed}) differs from this checkout in {differ}; reinstall the project")
    return info


def build_inputs(out: Path) -> Path:
    tiny = out / "tiny"
    if not (tiny / "model" / "config.json").exists() or not (tiny / "data" / "train.parquet").exists():
        subprocess.run([sys.executable, str(ROOT / "examples" / "tiny" / "make_tiny.py"), str(tiny)], check=True)
    return tiny


def expected_setting(g: int, total: int):
    from qerl_plugin.aqn import AQNConfig, AQNSchedule

    return AQNSchedule(AQNConfig(total_steps=total, **AQN)).setting(g)


_STEP = re.compile(r"step:(\d+) - (.*)$")
_AQN_RPC = re.compile(r"\[qerl\] AQN after update_weights\((\w+)\): stage (\d+) sigma ([0-9.eE+-]+)")
_SYNC = re.compile(r"\[qerl\] adapter sync: (\d+) tensors, (\d+) LoRA modules")
_NOISE_SET = re.compile(r"\[qerl\] vLLM noise set: (.*)$", re.M)


def parse_console(text: str) -> dict[int, dict]:
    steps: dict[int, dict] = {}
    for line in text.splitlines():
        m = _STEP.search(line)
        if not m:
            continue
        fields = {}
        for part in m.group(2).split(" - "):
            if ":" not in part:
                continue
            k, v = part.split(":", 1)
            try:
                fields[k.strip()] = float(v)
            except ValueError:
                fields[k.strip()] = v.strip()
        steps.setdefault(int(m.group(1)), {}).update(fields)
    return steps


def read_metrics(path: Path, console: str) -> dict[int, dict]:
    steps: dict[int, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            steps.setdefault(int(rec["step"]), {}).update(rec.get("data", {}))
    if not steps:
        steps = parse_console(console)
    return {s: d for s, d in steps.items() if any(str(k).startswith("actor/") for k in d)}  # training steps only


EXTRA_OVERRIDES: list[str] = []  # --override, appended to every phase's command line


def run_verl(name: str, out: Path, tiny: Path, overrides: list[str], timeout: int, eager: bool) -> tuple[int, str, dict]:
    phase = out / name
    phase.mkdir(parents=True, exist_ok=True)
    metrics = phase / "metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    env = {
        **os.environ,
        "QERL_TINY_DIR": str(tiny),
        "VERL_FILE_LOGGER_PATH": str(metrics),
        "RAY_DEDUP_LOGS": "0",
        "PYTHONUNBUFFERED": "1",
        "HYDRA_FULL_ERROR": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [
        sys.executable, "-m", "verl.trainer.main_ppo",
        "--config-path", str(CONFIG.parent), "--config-name", CONFIG.stem,
        "trainer.logger=[console,file]",
        f"trainer.default_local_dir={phase / 'checkpoints'}",
        f"trainer.experiment_name=tiny-{name}",
        *(["actor_rollout_ref.rollout.enforce_eager=true"] if eager else []),
        *overrides,
        *EXTRA_OVERRIDES,
    ]  # fmt: skip
    log(f"{name}: {' '.join(cmd)}")
    t0 = time.time()
    with open(phase / "run.log", "w") as fh:
        try:
            proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=ROOT)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = 124
    text = (phase / "run.log").read_text(errors="replace")
    info = {"rc": rc, "seconds": round(time.time() - t0, 1)}
    if rc != 0:
        tail = "\n".join(text.splitlines()[-40:])
        log(f"{name}: exit {rc}; last lines:\n{tail}")
    return rc, text, {**info, "steps": read_metrics(metrics, text)}


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def check_training(res: dict, first: int, last: int) -> list[str]:
    problems = []
    steps = res["steps"]
    missing = [s for s in range(first, last + 1) if s not in steps]
    if missing:
        problems.append(f"steps not logged: {missing[:10]}")
    for s, d in sorted(steps.items()):
        for key in ("actor/pg_loss", "actor/grad_norm"):
            if key in d and not finite(d[key]):
                problems.append(f"step {s}: {key}={d[key]}")
    return problems


def check_aqn(text: str, steps: dict, total: int, first_sync: int, last_sync: int) -> tuple[list[str], dict]:
    problems = []
    rpcs = [(m.group(1), int(m.group(2)), float(m.group(3))) for m in _AQN_RPC.finditer(text)]
    expected_rpcs = list(range(first_sync, last_sync + 1))
    got = [int(g) for g, _, _ in rpcs if g != "None"]
    if got != expected_rpcs:
        problems.append(f"AQN RPCs after update_weights({got[:3]}...{got[-3:]}), expected {first_sync}..{last_sync}")
    for g, stage, sigma in rpcs:
        if g == "None":
            continue
        e = expected_setting(int(g), total)
        if stage != e.stage or not math.isclose(sigma, e.sigma, rel_tol=1e-3, abs_tol=1e-12):
            problems.append(f"update_weights({g}): stage {stage} sigma {sigma}, expected stage {e.stage} sigma {e.sigma:.3e}")
    for s, d in steps.items():
        e = expected_setting(s - 1, total)
        if "qerl/aqn_sigma" not in d:
            problems.append(f"step {s}: qerl/aqn_sigma not logged")
        elif not math.isclose(float(d["qerl/aqn_sigma"]), e.sigma, rel_tol=1e-9, abs_tol=1e-15):
            problems.append(f"step {s}: qerl/aqn_sigma {d['qerl/aqn_sigma']} != {e.sigma}")
    syncs = [(int(a), int(b)) for a, b in _SYNC.findall(text)]
    noise_sets = _NOISE_SET.findall(text)
    if len(syncs) != len(expected_rpcs):
        problems.append(f"{len(syncs)} adapter syncs logged, expected {len(expected_rpcs)} (one per weight sync)")
    if len(noise_sets) < len(expected_rpcs):
        problems.append(f"vLLM confirmed {len(noise_sets)} noise sets, expected {len(expected_rpcs)}")
    stats = {
        "aqn_rpcs": len(rpcs),
        "adapter_syncs": len(syncs),
        "adapter_tensors": syncs[0][0] if syncs else None,
        "vllm_noise_sets": len(noise_sets),
        "sigma_by_step": {s: d.get("qerl/aqn_sigma") for s, d in sorted(steps.items())},
    }
    return problems, stats


def summarize_steps(steps: dict) -> dict:
    def mean(key):
        vals = [d[key] for d in steps.values() if finite(d.get(key))]
        return round(sum(vals) / len(vals), 6) if vals else None

    return {
        k.split("/", 1)[-1]: mean(k)
        for k in (
            "actor/pg_loss", "actor/entropy", "critic/score/mean", "rollout_corr/kl", "training/rollout_probs_diff_mean",
            "timing_s/gen", "timing_s/update_weights", "timing_s/update_actor", "timing_s/step",
        )
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# phases


def phase_nvfp4(out, tiny, args):
    steps = args.steps
    rc, text, res = run_verl(
        "nvfp4", out, tiny, [f"trainer.total_training_steps={steps}", f"trainer.save_freq={steps // 2}"], args.timeout, args.eager
    )
    problems = [] if rc == 0 else [f"exit code {rc}"]
    problems += check_training(res, 1, steps)
    p, stats = check_aqn(text, res["steps"], steps, 0, steps)
    return problems + p, {**stats, **summarize_steps(res["steps"]), "seconds": res["seconds"]}


def phase_bf16(out, tiny, args):
    steps = args.steps
    rc, text, res = run_verl(
        "bf16",
        out,
        tiny,
        [
            f"trainer.total_training_steps={steps}",
            "actor_rollout_ref.rollout.quantization=null",
            "actor_rollout_ref.rollout.custom.qerl.aqn.enable=false",
        ],
        args.timeout,
        args.eager,
    )
    problems = [] if rc == 0 else [f"exit code {rc}"]
    problems += check_training(res, 1, steps)
    if _AQN_RPC.search(text):
        problems.append("AQN RPCs in a run with AQN off")
    return problems, {**summarize_steps(res["steps"]), "seconds": res["seconds"]}


def phase_dapo(out, tiny, args):
    steps = 4
    rc, text, res = run_verl(
        "dapo",
        out,
        tiny,
        [
            f"trainer.total_training_steps={steps}",
            f"actor_rollout_ref.rollout.custom.qerl.aqn.total_steps={args.steps}",  # a run of args.steps, cut at 4
            "actor_rollout_ref.actor.loss_agg_mode=token-mean",
            "actor_rollout_ref.actor.clip_ratio_low=0.2",
            "actor_rollout_ref.actor.clip_ratio_high=0.28",
            "actor_rollout_ref.actor.use_kl_loss=false",
            "+reward.custom_reward_function.reward_kwargs.incorrect_reward=-1.0",
        ],
        args.timeout,
        args.eager,
    )
    problems = [] if rc == 0 else [f"exit code {rc}"]
    problems += check_training(res, 1, steps)
    scores = [d.get("critic/score/mean") for d in res["steps"].values() if finite(d.get("critic/score/mean"))]
    if scores and min(scores) >= 0:
        problems.append(f"DAPO reward should be -1/+1, mean scores {scores}")
    p, stats = check_aqn(text, res["steps"], args.steps, 0, steps)
    return problems + p, {**stats, **summarize_steps(res["steps"]), "seconds": res["seconds"]}


def phase_resume(out, tiny, args):
    steps, mid = args.steps, args.steps // 2
    ckpt = out / "nvfp4" / "checkpoints" / f"global_step_{mid}"
    if not ckpt.is_dir():
        return [f"no checkpoint {ckpt}: run the nvfp4 phase first"], {}
    rc, text, res = run_verl(
        "resume",
        out,
        tiny,
        [
            f"trainer.total_training_steps={steps}",
            "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={ckpt}",
            "trainer.save_freq=-1",
        ],
        args.timeout,
        args.eager,
    )
    problems = [] if rc == 0 else [f"exit code {rc}"]
    logged = sorted(res["steps"])
    if logged and logged[0] != mid + 1:
        problems.append(f"resumed run logged step {logged[0]} first, expected {mid + 1}")
    problems += check_training(res, mid + 1, steps)
    p, stats = check_aqn(text, res["steps"], steps, mid, steps)
    problems += p
    full = read_metrics(out / "nvfp4" / "metrics.jsonl", (out / "nvfp4" / "run.log").read_text(errors="replace"))
    for s in range(mid + 1, steps + 1):
        a, b = full.get(s, {}).get("qerl/aqn_sigma"), res["steps"].get(s, {}).get("qerl/aqn_sigma")
        if a is None or b is None or a != b:
            problems.append(f"step {s}: sigma {b} after resume, {a} uninterrupted")
    return problems, {**stats, **summarize_steps(res["steps"]), "seconds": res["seconds"], "first_step": logged[0] if logged else None}


# ---------------------------------------------------------------------------------------------------------
# main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phases", nargs="*", default=list(PHASES), help=f"any of {', '.join(PHASES)} (default: all)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".out")) / "verl_grpo_tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--timeout", type=int, default=560, help="seconds per phase")
    p.add_argument("--eager", action="store_true", help="vLLM enforce_eager (faster start, slower LoRA decode)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra verl override for every phase (e.g. a smaller rollout.gpu_memory_utilization when "
                        "several runs share the GPU); repeatable")
    args = p.parse_args()
    EXTRA_OVERRIDES.extend(args.override)
    bad = [x for x in args.phases if x not in PHASES]
    if bad:
        p.error(f"unknown phase(s) {bad}; choose from {', '.join(PHASES)}")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)

    info = preflight()
    log(f"verl {info['verl']}, qerl registered: {info['registered']}")
    tiny = build_inputs(out)
    results = []
    for name in args.phases:
        t0 = time.time()
        try:
            problems, stats = globals()[f"phase_{name}"](out, tiny, args)
        except Exception as e:  # a broken phase must not stop the others
            problems, stats = [f"{type(e).__name__}: {e}"], {}
        rec = {"phase": name, "ok": not problems, "problems": problems, "wall_s": round(time.time() - t0, 1), **stats}
        results.append(rec)
        with open(out / "results.jsonl", "a") as fh:
            fh.write(json.dumps(rec, default=str) + "\n")

    print("\n" + "=" * 100)
    print(f"{'phase':8} {'ok':4} {'wall_s':>7} {'syncs':>6} {'aqn':>4} {'pg_loss':>9} {'entropy':>8} {'score':>7} {'kl':>9} {'gen_s':>6} {'sync_s':>7}")
    for r in results:
        print(
            f"{r['phase']:8} {str(r['ok']):4} {r['wall_s']:>7} {str(r.get('adapter_syncs', '-')):>6} {str(r.get('aqn_rpcs', '-')):>4} "
            f"{str(r.get('pg_loss')):>9.9} {str(r.get('entropy')):>8.8} {str(r.get('score/mean')):>7.7} "
            f"{str(r.get('kl')):>9.9} {str(r.get('gen')):>6.6} {str(r.get('update_weights')):>7.7}"
        )
        for prob in r["problems"][:8]:
            print(f"    ! {prob}")
    print(f"results: {out / 'results.jsonl'}; logs: {out}/<phase>/run.log")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
