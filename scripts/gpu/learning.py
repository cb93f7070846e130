#!/usr/bin/env python3
"""GPU: the learning study on SmolLM2-135M-Instruct, several verl runs side by side on one GPU.

Each run is unmodified ``python -m verl.trainer.main_ppo`` on ``examples/smollm2/config.yaml`` (the demo's
config) with one arm's overrides and one seed, started in its own process session so that it outlives the
device call that started it; later calls on the same machine watch it and pack its metrics.

Arms (same data, steps and hyper-parameters; only the precision of the base and AQN differ):

  bf16    LoRA on the BF16 base (no quantization, no AQN)
  nvfp4   LoRA on the NVFP4 base (vLLM Marlin rollout, NVFP4 actor), no AQN
  aqn     LoRA on the NVFP4 base with Adaptive Quantization Noise (the demo's setting)

A seed sets the data order (``data.seed``), vLLM's sampling seed and the AQN noise seed; the same seed gives
every arm the same prompts in the same order.

    python scripts/gpu/learning.py launch --runs aqn:0 --work /tmp/learn            # the demo alone
    python scripts/gpu/learning.py launch --runs bf16:1,nvfp4:1,aqn:1 --stagger 20 \\
        --override actor_rollout_ref.rollout.gpu_memory_utilization=0.06
    python scripts/gpu/learning.py wait --work /tmp/learn --timeout 500              # status every 30 s
    python scripts/gpu/learning.py pack --work /tmp/learn --out "$OUT"                # metrics + logs, no weights
    python scripts/gpu/learning.py timing --work /tmp/learn --max-median 6            # step-time breakdown

The model and data come from ``examples/smollm2/prepare.py`` (``--data-dir``, default /tmp/qerl_smollm2).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "smollm2" / "config.yaml"
AQN_KEY = "actor_rollout_ref.rollout.custom.qerl.aqn"
ARMS: dict[str, list[str]] = {
    "bf16": ["actor_rollout_ref.rollout.quantization=null", f"{AQN_KEY}.enable=false"],
    "nvfp4": ["actor_rollout_ref.rollout.quantization=nvfp4", f"{AQN_KEY}.enable=false"],
    "aqn": ["actor_rollout_ref.rollout.quantization=nvfp4", f"{AQN_KEY}.enable=true"],
}
# Ray's CPU count stays the host's: verl 0.9.1's transfer queue alone reserves 10 logical CPUs (TaskRunner, controller,
# 8 storage units), and with ray_init.num_cpus=6 every run waited forever for them (2026-11-24, docs/learning.md).
# Several runs on one GPU: the same algorithm and hyper-parameters, smaller memory (micro-batches by token count,
# gradient checkpointing, a small vLLM reservation) and fewer helper processes per run. Only speed and memory
# differ from the demo's settings, not the arithmetic of a step.
# vLLM sizes its KV cache by profiling free GPU memory at start-up and aborts when another process frees memory
# meanwhile ("Error in memory profiling", as when runs start side by side); a fixed KV cache
# (2 GiB: 256 sequences x 192 tokens of SmolLM2 need ~1.1 GiB) skips that.
SIDE_BY_SIDE = "+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes=2147483648"
# verl puts the rollout engine to sleep between steps; vLLM's Worker.sleep then asserts that the GPU's free memory did
# not shrink, a device-wide reading that another run's allocation in between breaks ("Memory usage increased after
# sleeping": 2 of 8 runs side by side on 2026-11-24). Runs sharing a GPU keep their engine awake instead
# (free_cache_engine=false; SmolLM2's weights and 2 GiB cache stay resident, the arithmetic is the same).
NO_SLEEP = "actor_rollout_ref.rollout.free_cache_engine=false"
LEAN: list[str] = [
    SIDE_BY_SIDE,
    NO_SLEEP,
    "actor_rollout_ref.model.enable_gradient_checkpointing=true",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=8192",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=8192",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.05",
    "actor_rollout_ref.rollout.max_num_batched_tokens=8192",
    "actor_rollout_ref.rollout.agent.num_workers=1",
    "reward.num_workers=1",
    "+ray_kwargs.ray_init.include_dashboard=false",
]
# Host memory of one run (driver, TaskRunner, transfer queue, actor, vLLM, agent-loop and reward workers), read
# off the H100 machine: 17.7 GiB in use with one run, 52.6 GiB with three (2026-11-23/24). Launching more runs than
# the free memory holds gets them killed together; launch refuses that up front.
HOST_GIB_PER_RUN = 17.0
VAL_KEY = "val-core/qerl/synthetic_arithmetic/acc/mean@1"
REWARD_KEY = "critic/score/mean"


def log(msg: str) -> None:
    print(f"[learning {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_runs(text: str) -> list[tuple[str, int]]:
    runs = []
    for item in text.split(","):
        arm, _, seed = item.strip().partition(":")
        if arm not in ARMS or not seed.isdigit():
            raise SystemExit(f"--runs: {item!r} is not ARM:SEED with ARM in {', '.join(ARMS)} (e.g. aqn:0)")
        runs.append((arm, int(seed)))
    return runs


def run_name(arm: str, seed: int, tag: str = "") -> str:
    return f"{arm}-s{seed}" + (f"-{tag}" if tag else "")


def command(arm: str, seed: int, run_dir: Path, overrides: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "verl.trainer.main_ppo",
        "--config-path", str(CONFIG.parent), "--config-name", CONFIG.stem,
        "trainer.logger=[console,file]",
        f"trainer.experiment_name={run_dir.name}",
        f"trainer.default_local_dir={run_dir / 'checkpoints'}",
        f"data.seed={seed}",
        f"actor_rollout_ref.rollout.seed={seed}",
        f"{AQN_KEY}.seed={seed}",
        *ARMS[arm],
        *overrides,
    ]  # fmt: skip


def launch(args: argparse.Namespace) -> int:
    work = args.work.resolve()
    runs = parse_runs(args.runs)
    tag = args.tag
    if tag and not re.fullmatch(r"[A-Za-z0-9._+-]+", tag):
        raise SystemExit(f"--tag {tag!r}: use letters, digits and . _ + - only (it becomes part of a folder name)")
    if args.after:
        name, _, step = args.after.partition(":")
        while (after := run_status(work / name))["step"] < int(step):
            if not after["alive"]:
                log(f"{name} is not running (see {work / name / 'run.log'}); nothing started")
                return 1
            time.sleep(5)
    new = [(a, s) for a, s in runs if not _running(work / run_name(a, s, tag))]
    free = host_available_gib()
    need = len(new) * args.host_gib_per_run
    if free is not None and need > free:
        log(f"{len(new)} new runs need ~{need:.0f} GiB of host memory ({args.host_gib_per_run:g} GiB each), "
            f"{free:.0f} GiB is available: nothing started. Start at most {int(free // args.host_gib_per_run)} now "
            "and the rest once they end, or set --host-gib-per-run if yours need less")
        return 1
    for i, (arm, seed) in enumerate(runs):
        run_dir = work / run_name(arm, seed, tag)
        if _running(run_dir):
            log(f"{run_dir.name} is already running; not started again")
            continue
        run_dir.mkdir(parents=True, exist_ok=True)
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists():
            metrics.unlink()
        cmd = command(arm, seed, run_dir, (LEAN if args.lean else []) + args.override)
        env = {
            **os.environ,
            "QERL_SMOLLM2_DIR": str(args.data_dir),
            "VERL_FILE_LOGGER_PATH": str(metrics),
            "PYTHONUNBUFFERED": "1",
            "HYDRA_FULL_ERROR": "1",
            "RAY_DEDUP_LOGS": "0",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "RAY_prestart_worker_first_driver": "0",  # no idle Ray workers per core: several clusters share the host
        }
        (run_dir / "cmd.json").write_text(json.dumps({"cmd": cmd, "started": time.time()}, indent=1))
        with open(run_dir / "run.log", "w") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        (run_dir / "pid").write_text(str(proc.pid))
        log(f"started {run_dir.name} (pid {proc.pid}): {' '.join(cmd[3:])}")
        if i + 1 < len(runs):
            time.sleep(args.stagger)
    return 0


def _running(run_dir: Path) -> bool:
    return (run_dir / "pid").exists() and _alive(int((run_dir / "pid").read_text()))


def _meminfo_gib() -> dict[str, float]:
    """/proc/meminfo in GiB ({} where there is no such file)."""
    try:
        with open("/proc/meminfo") as fh:
            return {l.split(":")[0]: int(l.split()[1]) / 2**20 for l in fh}
    except (OSError, ValueError, IndexError):
        return {}


def host_available_gib() -> float | None:
    """MemAvailable in GiB (None where /proc/meminfo does not say)."""
    return _meminfo_gib().get("MemAvailable")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie child of this process counts as finished
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except OSError:
        return False


def read_metrics(path: Path) -> dict[int, dict]:
    steps: dict[int, dict] = {}
    if not path.exists():
        return steps
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
            steps.setdefault(int(rec["step"]), {}).update(rec.get("data", {}))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return steps


def _last(steps: dict[int, dict], key: str):
    for s in sorted(steps, reverse=True):
        v = steps[s].get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            return s, v
    return None, None


_ERROR_LINE = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): (.+?)\s*$")


def failure_reason(log_text: str) -> str | None:
    """The first ``SomeError: message`` line of a failed run's log (the root cause; Ray and Hydra re-raise it
    further down), with its line number, or None."""
    for number, line in enumerate(log_text.splitlines(), 1):
        m = _ERROR_LINE.search(line)
        if m and "Warning" not in m.group(1):
            return f"{m.group(1)}: {m.group(2)[:160]} (run.log line {number})"
    return None


def run_status(run_dir: Path) -> dict:
    steps = read_metrics(run_dir / "metrics.jsonl")
    pid = int((run_dir / "pid").read_text()) if (run_dir / "pid").exists() else None
    started = json.loads((run_dir / "cmd.json").read_text())["started"] if (run_dir / "cmd.json").exists() else None
    train_steps = [s for s, d in steps.items() if "timing_s/step" in d]
    step_times = [steps[s]["timing_s/step"] for s in sorted(train_steps)[1:]]  # the first step compiles
    val_step, val = _last(steps, VAL_KEY)
    first_val = next((steps[s][VAL_KEY] for s in sorted(steps) if VAL_KEY in steps[s]), None)
    log_text = (run_dir / "run.log").read_text(errors="replace") if (run_dir / "run.log").exists() else ""
    failed = any(m in log_text for m in ("Traceback (most recent call last)", "Error executing job"))
    return {
        "run": run_dir.name,
        "alive": bool(pid and _alive(pid)),
        "failed": failed,
        "reason": failure_reason(log_text) if failed else None,
        "step": max(train_steps) if train_steps else 0,
        "reward": _last(steps, REWARD_KEY)[1],
        "val_first": first_val,
        "val": val,
        "val_step": val_step,
        "step_s_median": sorted(step_times)[len(step_times) // 2] if step_times else None,
        "wall_s": round(time.time() - started) if started else None,
    }


def _fmt(v, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def status(args: argparse.Namespace) -> list[dict]:
    only = set(getattr(args, "only", None) or [])
    rows = [run_status(d) for d in sorted(args.work.resolve().iterdir())
            if (d / "cmd.json").exists() and (not only or d.name in only)]
    width = max([10] + [len(r["run"]) for r in rows])
    print(f"{'run':{width}} {'state':7} {'step':>4} {'reward':>7} {'val0':>6} {'val':>6} {'@':>4} {'step_s':>7} {'wall_s':>7}")
    for r in rows:
        state = "FAILED" if r["failed"] and not r["alive"] else ("running" if r["alive"] else "done")
        print(
            f"{r['run']:{width}} {state:7} {r['step']:>4} {_fmt(r['reward'], '7.3f')} {_fmt(r['val_first'], '6.3f')} "
            f"{_fmt(r['val'], '6.3f')} {_fmt(r['val_step'], '4d')} {_fmt(r['step_s_median'], '7.2f')} {_fmt(r['wall_s'], '7d')}",
            flush=True,
        )
    for r in rows:
        if r["failed"] and not r["alive"]:
            print(f"{r['run']} failed: {r['reason'] or 'no error line found'}", flush=True)
    return rows


def machine_line() -> str:
    """Host memory in use and the GPU's memory in use (nvidia-smi), for watching several runs at once."""
    parts = []
    info = _meminfo_gib()
    if "MemTotal" in info and "MemAvailable" in info:
        parts.append(f"host {info['MemTotal'] - info['MemAvailable']:.1f}/{info['MemTotal']:.0f} GiB")
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total,utilization.gpu", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout.split(",")
        parts.append(f"gpu {int(out[0]) / 1024:.1f}/{int(out[1]) / 1024:.0f} GiB, {out[2].strip()} % busy")
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        pass
    return "; ".join(parts)


def wait(args: argparse.Namespace) -> int:
    deadline = time.time() + args.timeout
    while True:
        rows = status(args)
        log(machine_line())
        if not any(r["alive"] for r in rows):
            log("no run is alive")
            return 0
        if time.time() + args.every > deadline:
            log("wait timed out; runs continue in the background")
            return 0
        time.sleep(args.every)


def stop(args: argparse.Namespace) -> int:
    for d in sorted(args.work.resolve().iterdir()):
        if _running(d):
            pid = int((d / "pid").read_text())
            os.killpg(pid, signal.SIGTERM)  # the run's own process group (started with start_new_session)
            log(f"stopped {d.name} (process group {pid})")
    return 0


TIMING_KEYS = ("timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor", "timing_s/update_weights",
               "timing_s/step", "response_length/mean")


def timing_rows(work: Path, first: int = 2, only: list[str] | None = None) -> list[dict]:
    """Per run: median, min and max of each of TIMING_KEYS over training steps >= ``first`` (the first compiles)."""
    rows = []
    for d in sorted(work.iterdir()):
        if not (d / "cmd.json").exists() or (only and d.name not in only):
            continue
        steps = read_metrics(d / "metrics.jsonl")
        used = [s for s in sorted(steps) if s >= first and "timing_s/step" in steps[s]]
        row = {"run": d.name, "steps": len(used), "from": first}
        for key in TIMING_KEYS:
            vals = [v for s in used if isinstance(v := steps[s].get(key), (int, float))]
            if vals:
                row[key] = {"median": round(statistics.median(vals), 3), "min": round(min(vals), 3), "max": round(max(vals), 3)}
        rows.append(row)
    return rows


def timing(args: argparse.Namespace) -> int:
    """The step-time breakdown of each run; with --max-median S, exit 3 unless every run has a median step <= S."""
    rows = timing_rows(args.work.resolve(), args.first, args.only)
    if not rows:
        log(f"no runs in {args.work}")
        return 2
    short = [k.split("/")[-1] if k.startswith("timing") else "response_length" for k in TIMING_KEYS]
    width = max([10] + [len(r["run"]) for r in rows])
    print(f"{'run':{width}} {'steps':>5} " + " ".join(f"{k:>20}" for k in short) + "   (median [min-max], steps >= "
          f"{args.first})")
    for r in rows:
        cells = [f"{r[k]['median']:.2f} [{r[k]['min']:.2f}-{r[k]['max']:.2f}]" if k in r else "-" for k in TIMING_KEYS]
        print(f"{r['run']:{width}} {r['steps']:>5} " + " ".join(f"{c:>20}" for c in cells), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.max_median is not None:
        over = [r["run"] for r in rows if "timing_s/step" not in r or r["timing_s/step"]["median"] > args.max_median]
        if over:
            log(f"median step over {args.max_median:g} s (or no steps): {', '.join(over)}")
            return 3
        log(f"every run's median step is <= {args.max_median:g} s")
    return 0


def pack(args: argparse.Namespace) -> int:
    """Metrics, logs and the run summaries into one tarball under --out (no checkpoints or weights)."""
    work = args.work.resolve()
    rows = [run_status(d) for d in sorted(work.iterdir()) if (d / "cmd.json").exists()]
    (work / "summary.json").write_text(json.dumps(rows, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / f"{args.name}.tar.gz"
    with tarfile.open(target, "w:gz") as tar:
        tar.add(work / "summary.json", arcname=f"{args.name}/summary.json")
        for d in sorted(work.iterdir()):
            for f in ("metrics.jsonl", "run.log", "cmd.json"):
                if (d / f).is_file():
                    tar.add(d / f, arcname=f"{args.name}/{d.name}/{f}")
    log(f"packed {len(rows)} runs into {target} ({target.stat().st_size / 2**20:.1f} MiB)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("launch", "status", "wait", "stop", "pack", "timing"):
        s = sub.add_parser(name)
        s.add_argument("--work", type=Path, default=Path("/tmp/qerl-learn"), help="one folder per run")
        if name == "launch":
            s.add_argument("--runs", required=True, help="ARM:SEED,... with ARM in " + ", ".join(ARMS))
            s.add_argument("--data-dir", type=Path, default=Path("/tmp/qerl_smollm2"),
                           help="examples/smollm2/prepare.py's output (bf16/, data/)")
            s.add_argument("--stagger", type=float, default=20.0, help="seconds between starts (vLLM sizes its "
                           "KV cache from the free memory it sees; a start next to another one's profiling run misjudges it)")
            s.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="verl override, repeatable")
            s.add_argument("--tag", default="", help="suffix of the run names (aqn-s0-TAG): runs of one arm and seed "
                           "with different --override values side by side in one --work folder")
            s.add_argument("--lean", action="store_true", help="memory-lean settings for several runs on one GPU (LEAN)")
            s.add_argument("--after", metavar="RUN:STEP", help="start only once RUN has logged STEP training steps")
            s.add_argument("--host-gib-per-run", type=float, default=HOST_GIB_PER_RUN, metavar="GIB",
                           help="host memory one run takes; launch refuses more new runs than MemAvailable holds")
        if name == "wait":
            s.add_argument("--timeout", type=float, default=540, help="give up waiting after this many seconds")
            s.add_argument("--every", type=float, default=30, help="seconds between status tables")
            s.add_argument("--only", action="append", metavar="RUN", help="wait for these runs only (e.g. aqn-s0)")
        if name == "timing":
            s.add_argument("--first", type=int, default=2, help="first training step counted (step 1 compiles)")
            s.add_argument("--only", action="append", metavar="RUN", help="these runs only (e.g. aqn-s0-big)")
            s.add_argument("--max-median", type=float, metavar="S", help="exit 3 unless every run's median step <= S")
            s.add_argument("--json", type=Path, help="also write the table as JSON here")
        if name == "pack":
            s.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".out")))
            s.add_argument("--name", default="learning")
    args = p.parse_args(argv)
    if args.cmd == "status":
        status(args)
        return 0
    return {"launch": launch, "wait": wait, "stop": stop, "pack": pack, "timing": timing}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
