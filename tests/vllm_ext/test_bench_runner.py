"""``vllm_ext.bench.runner``: the engine plan and the child processes (each fails here: there is no GPU)."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("vllm")

from helpers import make_tiny_qwen2  # noqa: E402

from vllm_ext import bench  # noqa: E402
from vllm_ext.bench import runner  # noqa: E402


def test_plan_stock_loads_the_given_nvfp4_checkpoint(tmp_path, rollout_args):
    """With --nvfp4-model, ours and vLLM's stock NVFP4A16 path (and humming) load that checkpoint's real weights;
    BF16 stays on dummy weights of the shape."""
    from qerl_plugin.format import quantization_config_dict
    from vllm_ext.bench.shapes import shape_config

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({**shape_config("1.5B"),
                                                  "quantization_config": quantization_config_dict(ignore=["lm_head"])}))
    args = rollout_args("--shape", "1.5B", "--nvfp4-model", str(ckpt), "--configs",
                        "bf16-lora,nvfp4-lora,stock-nvfp4-lora,humming-nvfp4-lora", "--variants", "punica-lora",
                        "--out", str(tmp_path), "--work", str(tmp_path))
    runs, skipped = runner.plan(args, tmp_path)
    by = {r.key: r.spec["engine"] for r in runs}
    assert not skipped
    stock, ours, humming = (by[f"{c}@punica-lora"] for c in ("stock-nvfp4-lora", "nvfp4-lora", "humming-nvfp4-lora"))
    assert stock["model"] == ours["model"] == humming["model"] == str(ckpt.resolve())
    assert stock["load_format"] == ours["load_format"] == "auto" and "quantization" not in stock
    assert ours["quantization"] == "nvfp4" and humming["quantization"] == "humming"
    assert stock["additional_config"] == {"qerl_lora": "punica"}
    assert by["bf16-lora@punica-lora"]["load_format"] == "dummy"
    # a real BF16 checkpoint without --nvfp4-model: stock is skipped too, asking for `qerl quantize` output
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    (bf16 / "config.json").write_text(json.dumps(shape_config("1.5B")))
    args = rollout_args("--model", str(bf16), "--configs", "nvfp4,stock-nvfp4", "--out", str(tmp_path),
                        "--work", str(tmp_path))
    runs, skipped = runner.plan(args, tmp_path)
    assert [r.key for r in runs] == ["nvfp4@default"] and runs[0].spec["engine"]["load_format"] == "auto"
    assert [s["reason"] for s in skipped] == [
        "stock-nvfp4 needs --nvfp4-model: an NVFP4A16 checkpoint of the same model (`qerl quantize` output)"]


def test_plan_runs_only_the_pairs_asked_for(tmp_path, rollout_args):
    """--runs picks config@variant pairs from the grid, in the grid's order; a pair outside it is an error that lists
    the grid."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    from qerl_plugin.format import quantization_config_dict
    from vllm_ext.bench.shapes import shape_config

    (ckpt / "config.json").write_text(json.dumps({**shape_config("1.5B"),
                                                  "quantization_config": quantization_config_dict(ignore=["lm_head"])}))
    common = ("--shape", "1.5B", "--nvfp4-model", str(ckpt), "--configs", "nvfp4-lora,stock-nvfp4-lora,bf16-lora",
              "--variants", "default,punica-lora", "--out", str(tmp_path), "--work", str(tmp_path))
    pairs = "bf16-lora@punica-lora,nvfp4-lora@default,stock-nvfp4-lora@punica-lora,nvfp4-lora@punica-lora"
    runs, skipped = runner.plan(rollout_args(*common, "--runs", pairs), tmp_path)
    assert [r.key for r in runs] == ["nvfp4-lora@default", "nvfp4-lora@punica-lora", "stock-nvfp4-lora@punica-lora",
                                     "bf16-lora@punica-lora"]
    assert not skipped
    assert "qerl_lora" not in runs[0].spec["engine"].get("additional_config", {})  # ours as shipped: the default mode (overlap)
    assert runs[2].spec["engine"]["additional_config"] == {"qerl_lora": "punica"}
    with pytest.raises(ValueError, match=r"--runs bf16@default: not a config@variant .*'bf16-lora@default'"):
        runner.plan(rollout_args(*common, "--runs", "bf16@default"), tmp_path)


def test_plan_engine_arguments(tmp_path, rollout_args):
    args = rollout_args("--shape", "1.5B", "--configs", "bf16-lora,nvfp4-lora,nvfp4-lora-aqn,stock-nvfp4,humming-nvfp4-lora",
                        "--variants", "default,no-fp32-reduce,dual-stream+specialize", "--batches", "1,8",
                        "--out", str(tmp_path), "--work", str(tmp_path))
    runs, skipped = runner.plan(args, tmp_path)
    by = {r.key: r for r in runs}
    base = by["bf16-lora@default"].spec["engine"]
    assert base["load_format"] == "dummy" and "quantization" not in base and base["enforce_eager"] is False
    assert (base["enable_lora"], base["max_loras"], base["max_lora_rank"]) == (True, 1, 32)
    assert base["compilation_config"] == {"cudagraph_capture_sizes": [1, 8]} and base["max_num_seqs"] == 8
    assert by["nvfp4-lora@default"].spec["engine"]["quantization"] == "nvfp4"
    aqn = by["nvfp4-lora-aqn@default"].spec
    assert aqn["engine"]["additional_config"] == {"qerl_aqn": True} and aqn["aqn_sigma"] == 1e-2
    assert aqn["engine"]["worker_extension_cls"] == "vllm_ext.worker_extension.QerlWorkerExtension"
    # on random weights the stock and humming paths are skipped (vLLM's dummy loader would give them random FP8
    # scale bytes, NaN among them), naming the fix
    why = {(s["config"], s["variant"]): s["reason"] for s in skipped}
    for name in ("stock-nvfp4@default", "humming-nvfp4-lora@default", "stock-nvfp4@no-fp32-reduce"):
        assert name not in by
    assert "--nvfp4-model" in why[("stock-nvfp4", "default")] and "NaN" in why[("humming-nvfp4-lora", "default")]
    assert by["nvfp4-lora@no-fp32-reduce"].spec["engine"]["additional_config"] == {"qerl_nvfp4": {"fp32_reduce": False}}
    combo = by["bf16-lora@dual-stream+specialize"]
    # log file names keep to [A-Za-z0-9._-] (the device tool drops other names) and stay distinct
    assert combo.file_stem == "bf16-lora--dual-stream_specialize"
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", r.file_stem) for r in runs)
    assert len({r.file_stem for r in runs}) == len(runs)
    assert combo.env["VLLM_LORA_ENABLE_DUAL_STREAM"] == "1" and combo.spec["engine"]["specialize_active_lora"] is True
    assert combo.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert {(s["config"], s["variant"]) for s in skipped} == {
        ("bf16-lora", "no-fp32-reduce"), ("stock-nvfp4", "no-fp32-reduce"), ("stock-nvfp4", "dual-stream+specialize"),
        ("humming-nvfp4-lora", "no-fp32-reduce"), ("stock-nvfp4", "default"), ("humming-nvfp4-lora", "default"),
        ("humming-nvfp4-lora", "dual-stream+specialize")}
    with pytest.raises(ValueError, match="unknown variant 'dual-strem'"):
        runner.plan(rollout_args("--variants", "dual-strem", "--work", str(tmp_path), "--dry-run"), tmp_path)
    with pytest.raises(ValueError, match=r"unknown config\(s\) \['fp8'\]"):
        runner.plan(rollout_args("--configs", "fp8", "--work", str(tmp_path)), tmp_path)
    assert by["nvfp4-lora@default"].spec["profile_tokens"] == 0
    runs, _ = runner.plan(rollout_args("--configs", "nvfp4", "--profile-tokens", "64", "--work", str(tmp_path)), tmp_path)
    assert runs[0].spec["profile_tokens"] == 64
    with pytest.raises(ValueError, match="--profile-tokens 2: give 0 \\(off\\) or 3..4096"):
        runner.plan(rollout_args("--configs", "nvfp4", "--profile-tokens", "2", "--work", str(tmp_path)), tmp_path)


def test_failed_engine_is_reported_and_the_run_goes_on(tmp_path, capsys, rollout_args):
    """No GPU here: each engine fails in its own process; the bench records why and still writes its report."""
    src = make_tiny_qwen2(tmp_path / "tiny")
    args = rollout_args("--model", str(src), "--configs", "bf16,nvfp4", "--batches", "1", "--new-tokens", "4",
                        "--prompt-len", "8", "--timeout", "200", "--out", str(tmp_path / "out"), "--work", str(tmp_path))
    assert bench.run(args) == 1
    report = json.loads((tmp_path / "out" / "bench_rollout.json").read_text())
    assert [r["config"] for r in report["results"]] == ["bf16", "nvfp4"]
    for r in report["results"]:
        assert r["ok"] is False and r["error"] and r["log_tail"], r
    lines = (tmp_path / "out" / "bench_rollout.jsonl").read_text().splitlines()
    assert len(lines) == 2
    assert re.search(r"bf16@default +FAILED", capsys.readouterr().out)


def test_each_engine_records_its_gpus_clocks(tmp_path, capsys, rollout_args, monkeypatch):
    """With nvidia-smi there (a stand-in here, answering as §4x's slowed H100 did: 382 MHz of 1 980, SW thermal
    slowdown), each engine's result carries the summary of the samples taken while it ran, the problem line, and the
    progress line says it; the samples are in logs/<run>.smi.csv. --clock-interval 0 samples nothing; a negative one
    is refused, naming the option."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text('#!/bin/sh\necho "40000, 382, 1980, 87, 0x0000000000000020"\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    src = make_tiny_qwen2(tmp_path / "tiny")
    base = ("--model", str(src), "--configs", "bf16", "--batches", "1", "--new-tokens", "4", "--prompt-len", "8",
            "--timeout", "200", "--work", str(tmp_path))
    assert bench.run(rollout_args(*base, "--out", str(tmp_path / "out"), "--clock-interval", "0.05")) == 1
    (res,) = json.loads((tmp_path / "out" / "bench_rollout.json").read_text())["results"]
    clocks = res["gpu_clocks"]
    assert clocks["busy"] >= 1 and clocks["sm_mhz_median"] == 382 and clocks["slowed"] is True
    assert res["gpu_problem"].startswith("GPU slowed itself down in 100% of busy samples (SW thermal slowdown 100%")
    assert (tmp_path / "out" / "logs" / "bf16--default.smi.csv").read_text().splitlines()[0].endswith(
        ",40000,382,1980,87,0x20")
    assert "GPU slowed itself down" in capsys.readouterr().out
    assert bench.run(rollout_args(*base, "--out", str(tmp_path / "off"), "--clock-interval", "0")) == 1
    (res,) = json.loads((tmp_path / "off" / "bench_rollout.json").read_text())["results"]
    assert "gpu_clocks" not in res and not (tmp_path / "off" / "logs" / "bf16--default.smi.csv").exists()
    with pytest.raises(ValueError, match="--clock-interval -1.0: give seconds between GPU samples, or 0 for none"):
        runner.plan(rollout_args(*base, "--clock-interval", "-1"), tmp_path)


def test_plan_nf4_needs_real_bf16_files_and_bitsandbytes(tmp_path, rollout_args, monkeypatch):
    """QLoRA's base (nf4-*) goes through vLLM's bitsandbytes loader, which quantizes real BF16 files while loading:
    on random weights it needs --bf16-model, and the bitsandbytes package; each missing piece is named."""
    import importlib.util

    from vllm_ext.bench.shapes import shape_config

    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    (bf16 / "config.json").write_text(json.dumps(shape_config("1.5B")))
    common = ("--shape", "1.5B", "--configs", "nf4-lora,bf16-lora", "--variants", "punica-lora", "--out", str(tmp_path),
              "--work", str(tmp_path))
    runs, skipped = runner.plan(rollout_args(*common), tmp_path)
    assert [r.key for r in runs] == ["bf16-lora@punica-lora"]
    assert skipped[0]["config"] == "nf4-lora" and skipped[0]["reason"].startswith("nf4-lora needs --bf16-model")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real_find_spec(name, *a))
    runs, skipped = runner.plan(rollout_args(*common, "--bf16-model", str(bf16)), tmp_path)
    assert [r.key for r in runs] == ["bf16-lora@punica-lora"]
    assert "needs the bitsandbytes package" in skipped[0]["reason"] and "session.sh bnb" in skipped[0]["reason"]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "bitsandbytes" else real_find_spec(name, *a))
    runs, skipped = runner.plan(rollout_args(*common, "--bf16-model", str(bf16)), tmp_path)
    assert not skipped
    engine = {r.key: r.spec["engine"] for r in runs}["nf4-lora@punica-lora"]
    assert engine["model"] == str(bf16.resolve())
    assert engine["quantization"] == engine["load_format"] == "bitsandbytes"
    assert engine["enable_lora"] and engine["additional_config"] == {"qerl_lora": "punica"}
    assert {r.key: r.spec["engine"] for r in runs}["bf16-lora@punica-lora"]["load_format"] == "dummy"
    runs, skipped = runner.plan(rollout_args(*common, "--bf16-model", str(tmp_path / "nowhere")), tmp_path)
    assert "has no config.json" in skipped[0]["reason"]


def _session_bench_args(step: str) -> list[str]:
    """The bench options a session.sh step passes in BENCH_ARGS, its ``${VAR:-default}`` at their defaults."""
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "session.sh").read_text()
    body = re.search(rf"^\s+{step}\)(.*?);;", text, flags=re.M | re.S).group(1)
    argv = re.search(r'BENCH_ARGS="(.*?)"', body, flags=re.S).group(1).replace("\\\n", "")
    return shlex.split(re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", argv))


def test_session_bench_small_plans_the_five_engines_of_4af(tmp_path, rollout_args):
    """session.sh's bench_small (docs/benchmarks.md §4af), its BENCH_ARGS read from the script with the defaults of its
    variables: the five engines in order, decode_gemv small in the two engines of that variant and nowhere else."""
    runs, _ = runner.plan(rollout_args(*_session_bench_args("bench_small"), "--out", str(tmp_path), "--work",
                                       str(tmp_path)), tmp_path)
    assert [r.key for r in runs] == ["nvfp4-lora@default", "nvfp4@decode-gemv-small", "nvfp4-lora@decode-gemv-small",
                                     "nvfp4-lora@decode-gemv", "bf16-lora@punica-lora"]
    nvfp4 = {r.key: r.spec["engine"].get("additional_config", {}).get("qerl_nvfp4") for r in runs}
    assert nvfp4 == {"nvfp4-lora@default": None, "nvfp4@decode-gemv-small": {"decode_gemv": "small"},
                     "nvfp4-lora@decode-gemv-small": {"decode_gemv": "small"},
                     "nvfp4-lora@decode-gemv": {"decode_gemv": True}, "bf16-lora@punica-lora": None}
    assert runs[0].spec["batches"] == [1, 8, 64] and runs[0].spec["repeats"] == 3


def test_session_bench_host8_profiles_the_three_modes_at_b8(tmp_path, rollout_args):
    """session.sh's bench_host8: §4af's b8 diagnostic, off / small / all with LoRA in that order, then the default's
    LoRA mode again under its explicit name (the order's own effect), profiled."""
    runs, _ = runner.plan(rollout_args(*_session_bench_args("bench_host8"), "--out", str(tmp_path), "--work",
                                       str(tmp_path)), tmp_path)
    assert [r.key for r in runs] == ["nvfp4-lora@default", "nvfp4-lora@decode-gemv-small", "nvfp4-lora@decode-gemv",
                                     "nvfp4-lora@overlap-lora"]
    overlap = runs[3].spec["engine"]["additional_config"]
    assert overlap.get("qerl_lora") == "overlap" and not (overlap.get("qerl_nvfp4") or {}).get("decode_gemv")
    assert all(r.spec["batches"] == [8] and r.spec["profile_tokens"] == 64 for r in runs)


def test_session_bench_split_compares_the_add_in_the_op_with_the_split_default(tmp_path, rollout_args):
    """session.sh's bench_split (§4ag call set B, as it ran): the overlap mode with the add inside the op
    (QERL_LORA_SPLIT_ADD=0) against the default of then, and NVFP4 without LoRA for the overhead, b1/b8/b64."""
    runs, _ = runner.plan(rollout_args(*_session_bench_args("bench_split"), "--out", str(tmp_path), "--work",
                                       str(tmp_path)), tmp_path)
    assert sorted(r.key for r in runs) == ["nvfp4-lora@default", "nvfp4-lora@overlap-add-in-op", "nvfp4@default"]
    env = {r.key: r.env for r in runs}
    assert env["nvfp4-lora@overlap-add-in-op"].get("QERL_LORA_SPLIT_ADD") == "0"
    assert "QERL_LORA_SPLIT_ADD" not in env["nvfp4-lora@default"]
    assert all(r.spec["batches"] == [1, 8, 64] and r.spec["repeats"] == 3 and r.spec["profile_tokens"] == 64
               for r in runs)


def test_session_bench_split2_runs_the_two_lora_engines_split_first(tmp_path, rollout_args):
    runs, _ = runner.plan(rollout_args(*_session_bench_args("bench_split2"), "--out", str(tmp_path), "--work",
                                       str(tmp_path)), tmp_path)
    assert [r.key for r in runs] == ["nvfp4-lora@lora-split-add", "nvfp4-lora@overlap-add-in-op"]
    assert runs[0].env.get("QERL_LORA_SPLIT_ADD") == "1" and runs[1].env.get("QERL_LORA_SPLIT_ADD") == "0"


def test_session_bench_shipped_plans_off_shared_all_of_4ak(tmp_path, rollout_args):
    """session.sh's bench_shipped (§4ak): with LoRA, decode_gemv off (named: the default on Hopper is shared since
    §4al), decode_gemv shared, decode_gemv all; b1/b8/b64."""
    runs, _ = runner.plan(rollout_args(*_session_bench_args("bench_shipped"), "--out", str(tmp_path), "--work",
                                       str(tmp_path)), tmp_path)
    assert [r.key for r in runs] == ["nvfp4-lora@decode-gemv-off", "nvfp4-lora@decode-gemv-shared",
                                     "nvfp4-lora@decode-gemv"]
    nvfp4 = [r.spec["engine"].get("additional_config", {}).get("qerl_nvfp4") for r in runs]
    assert nvfp4 == [{"decode_gemv": "off"}, {"decode_gemv": "shared"}, {"decode_gemv": True}]
    assert all(r.spec["batches"] == [1, 8, 64] and r.spec["repeats"] == 3 for r in runs)


def test_session_bench_32b_shared_plans_the_32b_batch_1_target_of_4am(tmp_path, rollout_args):
    """session.sh's bench_32b_shared (§4am): 32B at batch 1, ours with decode_gemv off and shared, BF16 + punica LoRA,
    all on random weights; the ratio the 32B target names comes from one run."""
    runs, _ = runner.plan(rollout_args(*_session_bench_args("bench_32b_shared"), "--out", str(tmp_path), "--work",
                                       str(tmp_path)), tmp_path)
    assert [r.key for r in runs] == ["nvfp4-lora@decode-gemv-off", "nvfp4-lora@decode-gemv-shared",
                                     "bf16-lora@punica-lora"]
    nvfp4 = [r.spec["engine"].get("additional_config", {}).get("qerl_nvfp4") for r in runs]
    assert nvfp4 == [{"decode_gemv": "off"}, {"decode_gemv": "shared"}, None]
    assert all(r.spec["engine"]["load_format"] == "dummy" for r in runs)
    assert all(r.spec["batches"] == [1] and r.spec["repeats"] == 3 for r in runs)


def test_session_bench_table_shared_plans_the_issues_table_with_shared_as_a_row(tmp_path, rollout_args):
    """session.sh's bench_table_shared (§4ak): the issue's rows (ours, stock NVFP4A16 + punica, BF16 + punica) with
    ours in both decode_gemv modes, off and shared (each also without LoRA, for the overhead), named on every GPU; the
    NVFP4 rows load the checkpoint, BF16 stays on dummy weights."""
    from qerl_plugin.format import quantization_config_dict
    from vllm_ext.bench.shapes import shape_config

    argv = _session_bench_args("bench_table_shared")
    ckpt = tmp_path / "ckpt_7b_nvfp4"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({**shape_config("7B"),
                                                  "quantization_config": quantization_config_dict(ignore=["lm_head"])}))
    argv = [str(ckpt) if a == "$work/ckpt_7b_nvfp4" else a for a in argv]
    runs, skipped = runner.plan(rollout_args(*argv, "--out", str(tmp_path), "--work", str(tmp_path)), tmp_path)
    assert not skipped
    assert [r.key for r in runs] == ["nvfp4-lora@decode-gemv-off", "nvfp4@decode-gemv-off",
                                     "nvfp4-lora@decode-gemv-shared", "nvfp4@decode-gemv-shared",
                                     "stock-nvfp4-lora@punica-lora", "bf16-lora@punica-lora"]  # by variant
    engine = {r.key: r.spec["engine"] for r in runs}
    for key in list(engine)[:4]:
        assert engine[key]["additional_config"]["qerl_nvfp4"] == {"decode_gemv": key.split("-")[-1]}
    assert {engine[k]["model"] for k in list(engine)[:4]} == {str(ckpt.resolve())}  # the four NVFP4 rows
    assert engine["bf16-lora@punica-lora"]["load_format"] == "dummy"
    assert all(r.spec["batches"] == [1, 8, 64] and r.spec["repeats"] == 3 for r in runs)


def test_session_bench_shared_plans_the_five_engines_of_4ah(tmp_path, rollout_args):
    """session.sh's bench_shared (§4ah), engines in the order of the variants: with LoRA off (the default), NVFP4
    without LoRA, the split add, decode_gemv shared (Marlin's own tensors), decode_gemv all (the copy); b1/b8/b64."""
    runs, _ = runner.plan(rollout_args(*_session_bench_args("bench_shared"), "--out", str(tmp_path), "--work",
                                       str(tmp_path)), tmp_path)
    assert [r.key for r in runs] == ["nvfp4-lora@default", "nvfp4@default", "nvfp4-lora@lora-split-add",
                                     "nvfp4-lora@decode-gemv-shared", "nvfp4-lora@decode-gemv"]
    nvfp4 = {r.key: r.spec["engine"].get("additional_config", {}).get("qerl_nvfp4") for r in runs}
    assert nvfp4["nvfp4-lora@decode-gemv-shared"] == {"decode_gemv": "shared"}
    assert nvfp4["nvfp4-lora@decode-gemv"] == {"decode_gemv": True} and nvfp4["nvfp4-lora@default"] is None
    assert runs[2].env.get("QERL_LORA_SPLIT_ADD") == "1"
    assert all(r.spec["batches"] == [1, 8, 64] and r.spec["repeats"] == 3 for r in runs)


def test_inherited_qerl_variables_are_recorded_apart_from_the_variants():
    """A qerl variable the bench inherits (a session step's tiles file) is recorded with the result; one the variant
    sets is already in its env, and other variables are not qerl's."""
    environ = {"QERL_MARLIN_ROW_TILES": "/tmp/t.json", "QERL_LORA_SPLIT_ADD": "1", "PATH": "/bin", "XQERL_Y": "1"}
    assert runner.inherited_env(environ, {"QERL_LORA_SPLIT_ADD": "0"}) == {"QERL_MARLIN_ROW_TILES": "/tmp/t.json"}
    assert runner.inherited_env({"PATH": "/bin"}, {}) == {}
