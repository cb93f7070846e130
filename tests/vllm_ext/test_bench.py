"""``vllm_ext.bench``: the ``qerl bench rollout|kernels`` CLI (arguments, dispatch) on CPU."""

from __future__ import annotations

import argparse
import json

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from vllm_ext import bench  # noqa: E402


def test_cli_dry_run_through_qerl(tmp_path, capsys):
    from qerl_plugin.cli import main

    code = main(["bench", "rollout", "--shape", "0.5B", "--configs", "bf16,nvfp4", "--out", str(tmp_path / "out"),
                 "--work", str(tmp_path), "--dry-run"])
    assert code == 0
    cfg = json.loads((tmp_path / "models" / "qwen2.5-0.5b" / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (896, 4864, 24)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["tie_word_embeddings"]) == (14, 2, True)
    out = capsys.readouterr().out
    assert "bf16@default" in out and "nvfp4@default" in out


def test_kernels_subcommand_parses_and_needs_a_gpu(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["kernels", "--shape", "32B", "--batches", "1,4", "--out", str(tmp_path)])
    assert (args.shape, args.batches, args.lora_rank) == ("32B", [1, 4], 32)
    if not torch.cuda.is_available():
        assert bench.run(args) == 1
        assert "needs a CUDA GPU" in capsys.readouterr().err
