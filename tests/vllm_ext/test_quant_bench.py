"""``qerl bench rollout`` on CPU: its plan, the adapter and kernel configs it writes, its report, failures.

The GPU measurements themselves run on the GPU machine (scripts/gpu/bench_rollout.py); here the parts that
can be checked without one are checked against the real consumers (PEFT, vLLM's LoRA config readers).
"""

from __future__ import annotations

import argparse
import json
import re

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from helpers import make_tiny_qwen2  # noqa: E402

from vllm_ext import bench  # noqa: E402


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(["rollout", *argv])


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


def test_plan_engine_arguments(tmp_path):
    args = _args("--shape", "1.5B", "--configs", "bf16-lora,nvfp4-lora,nvfp4-lora-aqn,stock-nvfp4,humming-nvfp4-lora",
                 "--variants", "default,no-fp32-reduce,dual-stream+specialize", "--batches", "1,8",
                 "--out", str(tmp_path), "--work", str(tmp_path))
    runs, skipped = bench.plan(args, tmp_path)
    by = {r.key: r for r in runs}
    base = by["bf16-lora@default"].spec["engine"]
    assert base["load_format"] == "dummy" and "quantization" not in base and base["enforce_eager"] is False
    assert (base["enable_lora"], base["max_loras"], base["max_lora_rank"]) == (True, 1, 32)
    assert base["compilation_config"] == {"cudagraph_capture_sizes": [1, 8]} and base["max_num_seqs"] == 8
    assert by["nvfp4-lora@default"].spec["engine"]["quantization"] == "nvfp4"
    aqn = by["nvfp4-lora-aqn@default"].spec
    assert aqn["engine"]["additional_config"] == {"qerl_aqn": True} and aqn["aqn_sigma"] == 1e-2
    assert aqn["engine"]["worker_extension_cls"] == "vllm_ext.worker_extension.QerlWorkerExtension"
    stock = by["stock-nvfp4@default"].spec["engine"]
    assert "quantization" not in stock and stock["load_format"] == "dummy"
    qcfg = json.loads((tmp_path / "models" / "qwen2.5-1.5b-nvfp4a16" / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors" and qcfg["format"] == "nvfp4-pack-quantized"
    humming = by["humming-nvfp4-lora@default"].spec["engine"]
    assert humming["quantization"] == "humming" and humming["model"] == stock["model"] != base["model"]
    assert by["nvfp4-lora@no-fp32-reduce"].spec["engine"]["additional_config"] == {"qerl_nvfp4": {"fp32_reduce": False}}
    combo = by["bf16-lora@dual-stream+specialize"]
    assert combo.env["VLLM_LORA_ENABLE_DUAL_STREAM"] == "1" and combo.spec["engine"]["specialize_active_lora"] is True
    assert combo.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert {(s["config"], s["variant"]) for s in skipped} == {
        ("bf16-lora", "no-fp32-reduce"), ("stock-nvfp4", "no-fp32-reduce"), ("stock-nvfp4", "dual-stream+specialize"),
        ("humming-nvfp4-lora", "no-fp32-reduce")}
    with pytest.raises(ValueError, match="unknown variant 'dual-strem'"):
        bench.plan(_args("--variants", "dual-strem", "--work", str(tmp_path), "--dry-run"), tmp_path)
    with pytest.raises(ValueError, match=r"unknown config\(s\) \['fp8'\]"):
        bench.plan(_args("--configs", "fp8", "--work", str(tmp_path)), tmp_path)


def test_adapter_loads_into_peft_with_matching_shapes(tmp_path):
    """The dummy adapter is a real PEFT adapter: PEFT loads it into the HF model (shape-checked), B != 0."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    src = make_tiny_qwen2(tmp_path / "tiny", tokenizer=False)
    adapter = bench.write_adapter(src, 8, tmp_path / "adapter")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(src), adapter)
    loaded = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(loaded) == 2 * 7 * 2  # A and B for 7 projections x 2 layers
    assert all(float(p.abs().max()) > 0 for n, p in loaded.items() if "lora_B" in n)
    assert model.peft_config["default"].r == 8 and sorted(model.peft_config["default"].target_modules) == sorted(bench.LORA_TARGETS)

    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_local_dir(str(adapter), max_position_embeddings=256)
    assert helper.r == 8 and helper.lora_alpha == 16
    assert bench.write_adapter(src, 8, tmp_path / "adapter") == adapter  # reused, not rewritten


def test_lora_kernel_configs_are_what_vllm_reads(tmp_path, monkeypatch):
    from vllm.lora.ops.triton_ops import utils as lora_utils

    dims = bench.model_dims(bench.write_shape("7B", tmp_path))
    bench.write_lora_kernel_configs(tmp_path / "cfg", "NVIDIA H100 80GB HBM3", dims, 32, [1, 8, 64], 1)
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(tmp_path / "cfg"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "NVIDIA H100 80GB HBM3")
    lora_utils.load_lora_op_config.cache_clear()
    if hasattr(lora_utils.get_lora_op_configs, "cache_clear"):
        lora_utils.get_lora_op_configs.cache_clear()
    try:
        shrink = lora_utils.get_lora_op_configs("shrink", max_loras=2, batch=1, hidden_size=3584, rank=32, num_slices=3)
        assert (shrink["block_n"], shrink["block_k"], shrink["split_k"]) == (32, 128, 7)
        assert 3584 % (shrink["block_k"] * shrink["split_k"]) == 0  # EVEN_K: no masked loads
        expand = lora_utils.get_lora_op_configs("expand", max_loras=2, batch=8, hidden_size=18944, rank=32,
                                                num_slices=2, add_inputs=True)
        assert (expand["block_k"], expand["block_n"]) == (32, 128)
        prefill = lora_utils.get_lora_op_configs("shrink", max_loras=2, batch=16384, hidden_size=3584, rank=32,
                                                 num_slices=1)
        assert prefill["split_k"] == 8  # large m keeps vLLM's defaults
    finally:
        lora_utils.load_lora_op_config.cache_clear()
        if hasattr(lora_utils.get_lora_op_configs, "cache_clear"):
            lora_utils.get_lora_op_configs.cache_clear()


def _res(config, variant, toks, ok=True):
    return {"config": config, "variant": variant, "ok": ok, "startup_s": 60.0,
            "batches": {str(b): {"decode_tok_s": t} for b, t in toks.items()},
            "memory": {"weights_bytes": 5.5 * 2**30, "kv_cache_bytes": 50 * 2**30, "lora_buffers_bytes": 2**28}}


def test_summary_ratios_overhead_and_targets():
    results = [
        _res("bf16-lora", "default", {1: 100.0, 8: 800.0, 64: 6000.0}),
        _res("nvfp4", "default", {1: 280.0, 8: 2000.0, 64: 8000.0}),
        _res("nvfp4-lora", "default", {1: 260.0, 8: 1600.0, 64: 7200.0}),
        _res("nvfp4-lora", "dual-stream", {1: 270.0, 8: 1800.0, 64: 7000.0}),  # no bf16-lora@dual-stream: default base
        {"config": "nvfp4-lora-aqn", "variant": "default", "ok": False, "error": "AQN hook unavailable: ..."},
    ]
    args = _args("--shape", "7B")
    summary = bench.summarize(results, args)
    row = summary["rows"]["nvfp4-lora@default"]
    assert row["vs_bf16_lora"] == {"1": 2.6, "8": 2.0, "64": 1.2}
    assert row["lora_overhead"] == {"1": round(1 - 260 / 280, 3), "8": 0.2, "64": 0.1}
    assert summary["rows"]["nvfp4-lora@dual-stream"]["vs_bf16_lora"]["1"] == 2.7
    checks = {(c["run"], c["what"]): c["pass"] for c in summary["checks"]}
    assert checks[("nvfp4-lora@default", "7B b1 vs bf16-lora")] is True
    assert checks[("nvfp4-lora@default", "7B b8 vs bf16-lora")] is False
    assert checks[("nvfp4-lora@default", "LoRA overhead b64")] is True
    table = bench.format_table(results, summary, [1, 8, 64])
    assert re.search(r"nvfp4-lora-aqn@default +FAILED: AQN hook unavailable", table)
    assert "PASS nvfp4-lora@default 7B b1 vs bf16-lora: 2.6" in table and "5.50" in table


def test_failed_engine_is_reported_and_the_run_goes_on(tmp_path, capsys):
    """No GPU here: each engine fails in its own process; the bench records why and still writes its report."""
    src = make_tiny_qwen2(tmp_path / "tiny")
    args = _args("--model", str(src), "--configs", "bf16,nvfp4", "--batches", "1", "--new-tokens", "4",
                 "--prompt-len", "8", "--timeout", "200", "--out", str(tmp_path / "out"), "--work", str(tmp_path))
    assert bench.run(args) == 1
    report = json.loads((tmp_path / "out" / "bench_rollout.json").read_text())
    assert [r["config"] for r in report["results"]] == ["bf16", "nvfp4"]
    for r in report["results"]:
        assert r["ok"] is False and r["error"] and r["log_tail"], r
    lines = (tmp_path / "out" / "bench_rollout.jsonl").read_text().splitlines()
    assert len(lines) == 2
    assert re.search(r"bf16@default +FAILED", capsys.readouterr().out)


def test_kernels_subcommand_parses_and_needs_a_gpu(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["kernels", "--shape", "32B", "--batches", "1,4", "--out", str(tmp_path)])
    assert (args.shape, args.batches, args.lora_rank) == ("32B", [1, 4], 32)
    if not torch.cuda.is_available():
        assert bench.run(args) == 1
        assert "needs a CUDA GPU" in capsys.readouterr().err
