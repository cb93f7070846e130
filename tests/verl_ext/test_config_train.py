"""``qerl train``: the command it runs, ``--check`` through the real ``qerl`` CLI, and the example run scripts."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from verl_ext import train

ROOT = Path(__file__).resolve().parents[2]


def test_command_is_verls_main_ppo_with_hydra_config_path():
    cmd = train.command(ROOT / "examples/grpo_gsm8k/config/qwen2.5-7b.yaml", ["trainer.total_training_steps=3"], "py")
    assert cmd == [
        "py",
        "-m",
        "verl.trainer.main_ppo",
        "--config-path",
        str(ROOT / "examples/grpo_gsm8k/config"),
        "--config-name",
        "qwen2.5-7b",
        "trainer.total_training_steps=3",
    ]


def _qerl(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "qerl_plugin.cli", "train", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
        cwd=ROOT,
    )


def test_cli_dry_run_and_missing_file():
    out = _qerl("examples/tiny/config.yaml", "trainer.total_training_steps=5", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "-m verl.trainer.main_ppo --config-path" in out.stdout and "--config-name config trainer.total_training_steps=5" in out.stdout
    bad = _qerl("examples/nope.yaml")
    assert bad.returncode != 0 and "examples/nope.yaml: no such file" in (bad.stdout + bad.stderr)


def test_cli_check_validates_and_reports_errors(tmp_path):
    spec_dir = tmp_path / "tiny"
    subprocess.run([sys.executable, str(ROOT / "examples/tiny/make_tiny.py"), str(spec_dir), "--n-train", "16", "--n-test", "4"], check=True, capture_output=True)
    env = {"QERL_TINY_DIR": str(spec_dir)}
    ok = _qerl("examples/tiny/config.yaml", "--check", env=env)
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    assert "config OK" in ok.stdout and "quantization   nvfp4 (bf16 checkpoint)" in ok.stdout
    bad = _qerl("examples/tiny/config.yaml", "--check", "actor_rollout_ref.model.lora_rank=0", env=env)
    assert bad.returncode == 1
    assert "actor_rollout_ref.model.lora_rank=0" in bad.stderr + bad.stdout


@pytest.fixture
def fake_python(tmp_path):
    """An executable that records its arguments instead of training."""
    rec = tmp_path / "args.json"
    exe = tmp_path / "py"
    exe.write_text(f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(rec)!r}, 'w'))\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe, rec


@pytest.mark.parametrize("script, cfg", [("grpo_gsm8k/run_grpo.sh", "grpo_gsm8k"), ("dapo_math/run_dapo.sh", "dapo_math")])
def test_run_scripts_build_the_right_overrides(fake_python, script, cfg, tmp_path):
    exe, rec = fake_python
    env = {**os.environ, "PYTHON": str(exe), "MODEL_SIZE": "14b", "PRECISION": "bf16", "DATA_DIR": "/d", "ATTN": "sdpa"}
    subprocess.run(["bash", str(ROOT / "examples" / script), "trainer.total_training_steps=2"], check=True, env=env, capture_output=True)
    args = json.loads(rec.read_text())
    assert args[:2] == ["-m", "verl_ext.train"]
    assert args[2] == str(ROOT / "examples" / cfg / "config" / "qwen2.5-14b.yaml")
    assert "data.train_files=/d/train.parquet" in args
    assert "actor_rollout_ref.rollout.quantization=null" in args and "actor_rollout_ref.actor.optim.lr=5e-6" in args
    assert "+actor_rollout_ref.model.override_config.attn_implementation=sdpa" in args
    assert args[-1] == "trainer.total_training_steps=2"
    bad = subprocess.run(["bash", str(ROOT / "examples" / script)], env={**env, "PRECISION": "fp8"}, capture_output=True, text=True)
    assert bad.returncode == 2 and "PRECISION must be nvfp4 or bf16" in bad.stderr
