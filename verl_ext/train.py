"""``qerl train CONFIG.yaml [OVERRIDES ...]``: run verl's PPO trainer on a qerl YAML.

What it runs is exactly ``python -m verl.trainer.main_ppo --config-path <dir of CONFIG> --config-name <stem>
[OVERRIDES ...]`` -- unmodified verl; qerl's behaviour comes from the ``verl.plugins`` entry point that
verl loads in every process. The YAML extends verl's own ``ppo_trainer`` config (``defaults: [ppo_trainer,
_self_]`` with ``hydra.searchpath: [pkg://verl.trainer.config]``), so any verl key can be set in it or on
the command line, with verl's Hydra syntax (``key=value``; ``+key=value`` for a key the config lacks).

    qerl train examples/grpo_gsm8k/config/qwen2.5-7b.yaml               # train
    qerl train examples/grpo_gsm8k/config/qwen2.5-7b.yaml --check       # validate only (CPU, seconds)
    qerl train examples/tiny/config.yaml trainer.total_training_steps=5 --dry-run   # print the command

``--check`` composes the config the way ``main_ppo`` does, runs qerl's checks (the error names the key and
the fix) and verl's own ``validate_config`` and dataclass conversions, and prints what the run will do.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

HELP = "run QeRL training (verl GRPO/DAPO with NVFP4 + LoRA + AQN)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="a verl YAML that extends ppo_trainer (see examples/)")
    parser.add_argument(
        "overrides",
        nargs=argparse.REMAINDER,
        help="Hydra overrides passed to verl, e.g. trainer.total_training_steps=10 data.train_files=/data/train.parquet "
        "(qerl's own flags may appear among them)",
    )
    parser.add_argument("--check", action="store_true", help="validate the config (qerl's and verl's checks) and exit")
    parser.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    parser.add_argument("--python", default=sys.executable, help="the Python that has verl installed (default: this one)")


def command(config: str | os.PathLike, overrides: list[str], python: str = sys.executable) -> list[str]:
    path = Path(config).expanduser().resolve()
    return [
        python,
        "-m",
        "verl.trainer.main_ppo",
        "--config-path",
        str(path.parent),
        "--config-name",
        path.stem,
        *overrides,
    ]


def _summary(cfg, settings, notes) -> str:
    from verl_ext.config import get, hints

    lines = [
        f"model          {get(cfg, 'actor_rollout_ref.model.path')}",
        f"quantization   {settings.quantization or 'none (BF16)'}"
        + (f" ({settings.model_quant} checkpoint)" if settings.nvfp4 else ""),
        f"LoRA           rank {get(cfg, 'actor_rollout_ref.model.lora_rank')} alpha {get(cfg, 'actor_rollout_ref.model.lora_alpha')}",
        f"algorithm      {get(cfg, 'algorithm.adv_estimator')}, loss_agg {get(cfg, 'actor_rollout_ref.actor.loss_agg_mode')}, "
        f"lr {get(cfg, 'actor_rollout_ref.actor.optim.lr')}",
        f"batch          {get(cfg, 'data.train_batch_size')} prompts x n={get(cfg, 'actor_rollout_ref.rollout.n')}, "
        f"lengths {get(cfg, 'data.max_prompt_length')}+{get(cfg, 'data.max_response_length')}",
    ]
    if settings.aqn_enabled:
        a = settings.aqn
        lines.append(
            f"AQN            {a.schedule} {a.sigma_start:g} -> {a.sigma_end:g}, {a.num_stages} stages, seed {a.seed}, "
            f"resample per {a.resample}{', also on the actor' if settings.aqn_apply_to_actor else ''}"
        )
    else:
        lines.append("AQN            off")
    lines += [f"normalised     {n}" for n in notes]
    lines += [f"hint           {h}" for h in hints(cfg, settings)]
    return "\n".join(lines)


def _split_flags(args: argparse.Namespace) -> list[str]:
    """Take qerl's flags out of the overrides (argparse leaves anything after the first override there)."""
    rest, items = [], list(args.overrides or [])
    while items:
        item = items.pop(0)
        if item in ("--check", "--dry-run"):
            setattr(args, item[2:].replace("-", "_"), True)
        elif item == "--python" and items:
            args.python = items.pop(0)
        elif item.startswith("--python="):
            args.python = item.split("=", 1)[1]
        else:
            rest.append(item)
    return rest


def run(args: argparse.Namespace) -> int:
    config = Path(args.config).expanduser()
    if not config.is_file():
        raise FileNotFoundError(f"{args.config}: no such file; pass a YAML such as examples/tiny/config.yaml")
    overrides = _split_flags(args)
    if args.check:
        from verl_ext.config import check

        cfg, settings, notes = check(config, overrides)
        print(_summary(cfg, settings, notes))
        print("config OK")
        return 0
    cmd = command(config, overrides, args.python)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    print("+ " + shlex.join(cmd), flush=True)
    return subprocess.call(cmd)


def main(argv: list[str] | None = None) -> int:  # python -m verl_ext.train ...
    parser = argparse.ArgumentParser(prog="qerl train", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
