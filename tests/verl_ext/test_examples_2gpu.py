"""The 2-GPU example configs: copies of the 1-GPU ones that differ only in their marked lines, and pass
``qerl train --check``; why SmolLM2's keeps rollout tensor parallelism at 1 (vLLM's own check)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from helpers import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
TP = "actor_rollout_ref.rollout.tensor_model_parallel_size"
EXPECTED = {  # the keys each 2-GPU config changes, with their (1-GPU, 2-GPU) values
    "tiny": {
        "trainer.n_gpus_per_node": (1, 2),
        TP: (1, 2),
        "trainer.experiment_name": ("tiny-grpo-nvfp4-aqn", "tiny-grpo-nvfp4-aqn-2gpu"),
    },
    "smollm2": {
        "trainer.n_gpus_per_node": (1, 2),
        "trainer.experiment_name": ("smollm2-demo-nvfp4-aqn", "smollm2-demo-nvfp4-aqn-2gpu"),
    },
}


def _flat(node, prefix=""):
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def _raw(path: Path) -> dict:
    return _flat(OmegaConf.to_container(OmegaConf.load(path), resolve=False))


@pytest.mark.parametrize("example", sorted(EXPECTED))
def test_the_2gpu_config_is_the_1gpu_one_but_for_its_marked_lines(example):
    one, two = _raw(ROOT / "examples" / example / "config.yaml"), _raw(ROOT / "examples" / example / "config-2gpu.yaml")
    assert sorted(one) == sorted(two)
    assert {k: (one[k], two[k]) for k in one if one[k] != two[k]} == EXPECTED[example]
    marked = [line for line in (ROOT / "examples" / example / "config-2gpu.yaml").read_text().splitlines()
              if "# 2 GPUs" in line and not line.lstrip().startswith("#")]
    leaves = {k.rsplit(".", 1)[-1] for k in EXPECTED[example]}
    assert {line.split(":", 1)[0].strip() for line in marked} >= leaves
    assert two["trainer.n_gpus_per_node"] % two[TP] == 0 and two["actor_rollout_ref.rollout.quantization"] == "nvfp4"
    assert two["actor_rollout_ref.rollout.custom.qerl.aqn.enable"] is True


def _qerl_check(config: str, env: dict, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qerl_plugin.cli", "train", config, "--check", *overrides],
        capture_output=True, text=True, env={**os.environ, **env}, timeout=300, cwd=ROOT,
    )


def _smollm2_standin(path: Path) -> Path:
    """SmolLM2-135M's architecture with its head counts (9 heads, 3 KV heads, tied embeddings), shrunk."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=144, intermediate_size=256, num_hidden_layers=1, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=16, tie_word_embeddings=True, max_position_embeddings=256)
    make_tiny_model(path / "bf16", cfg, LlamaForCausalLM)  # tokenizer included
    return path


@pytest.fixture(scope="module")
def example_dirs(tmp_path_factory) -> dict[str, dict[str, str]]:
    tiny = tmp_path_factory.mktemp("tiny2")
    subprocess.run([sys.executable, str(ROOT / "examples/tiny/make_tiny.py"), str(tiny), "--n-train", "16", "--n-test", "4"],
                   check=True, capture_output=True)
    smol = _smollm2_standin(tmp_path_factory.mktemp("smollm2"))
    return {"tiny": {"QERL_TINY_DIR": str(tiny)}, "smollm2": {"QERL_SMOLLM2_DIR": str(smol)}}


@pytest.mark.parametrize("example", sorted(EXPECTED))
def test_qerl_train_check_passes(example, example_dirs):
    out = _qerl_check(f"examples/{example}/config-2gpu.yaml", example_dirs[example])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "config OK" in out.stdout and "quantization   nvfp4" in out.stdout and "AQN            exponential" in out.stdout


def test_vllm_splits_the_tiny_model_over_two_ranks_but_not_smollm2(example_dirs):
    """vLLM's own check, which ``--check`` does not run: SmolLM2's 9 heads do not divide by 2."""
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig, ParallelConfig

    tiny = ModelConfig(model=str(Path(example_dirs["tiny"]["QERL_TINY_DIR"]) / "model"), dtype="bfloat16")
    tiny.verify_with_parallel_config(ParallelConfig(tensor_parallel_size=2))
    smol = ModelConfig(model=str(Path(example_dirs["smollm2"]["QERL_SMOLLM2_DIR"]) / "bf16"), dtype="bfloat16")
    with pytest.raises(ValueError, match=r"attention heads \(9\) must be divisible by tensor parallel size \(2\)"):
        smol.verify_with_parallel_config(ParallelConfig(tensor_parallel_size=2))
