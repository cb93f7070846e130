"""scripts/plot_speed.py: the speed figure's numbers come from the committed raw GPU results and equal what
docs/benchmarks.md quotes from them; a missing file is an error that names it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("plot_speed", ROOT / "scripts" / "plot_speed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_numbers_are_the_documented_ones():
    data = _script().figure_data()
    # §4v call 2: ours as shipped (overlap, LoRA kernel v3) vs BF16 + LoRA on punica, and NVFP4 without LoRA
    assert data["decode_vs_bf16_lora"]["nvfp4-lora@default"] == {"1": 1.914, "8": 1.768, "64": 1.301}
    assert data["decode_vs_bf16_lora"]["nvfp4@default"] == {"1": 2.196, "8": 2.057, "64": 1.45}
    assert data["decode_tok_s"]["bf16-lora@punica-lora"] == {"1": 124.09, "8": 1028.36, "64": 7151.5}
    # §4aa: both arms at once on two H100s of one host, 1.216x at 2048 (30.603 vs 25.160 s, rollout 1.408x); §4ab: back
    # to back on one H100, 1.175x at 512 (9.464 vs 8.054 s, rollout 1.376x); each with a verdict
    step = data["grpo_step"]
    assert (step["2048"]["bf16"]["step"], step["2048"]["nvfp4"]["step"]) == (30.603, 25.16)
    assert (step["512"]["bf16"]["step"], step["512"]["nvfp4"]["step"]) == (9.464, 8.054)
    assert (step["2048"]["ratio"], step["2048"]["rollout_ratio"]) == (1.216, 1.408)
    assert (step["512"]["ratio"], step["512"]["rollout_ratio"]) == (1.175, 1.376)
    assert step["512"]["bf16"]["response"] == 512 and step["512"]["verdict"].startswith("NVFP4 faster")
    assert data["vs_lora"]["ours"]["7B end to end"] == 1.216
    # §7: the paper's vs-LoRA figures and ours; §4k lease 3: 32B b1 2.22x
    assert data["vs_lora"]["paper"] == {"7B rollout": 1.275, "7B end to end": 1.2, "32B rollout (r32)": 1.682}
    assert data["vs_lora"]["ours"]["32B rollout (r32)"] == 2.221
    # §4l lease 1: against NF4 + LoRA (vLLM's bitsandbytes loader), the same run; the paper's 7B rollout: QeRL and LoRA over QLoRA 1.54x / 1.20x
    assert data["vs_qlora"]["ours"]["nvfp4-lora@default"] == {"1": 1.565, "8": 2.963, "64": 2.391}
    assert data["vs_qlora"]["ours"]["bf16-lora@punica-lora"] == {"1": 0.922, "8": 1.844, "64": 1.988}
    assert data["vs_qlora"]["paper_7b_rollout"] == {"QeRL": 1.536, "LoRA": 1.205}
    # §4u call 1: the actor at 16 384 tokens, tokens/s over BF16's in each order, and the step peaks
    actor = data["actor_7b_16k"]
    assert actor["nvfp4+keep2"]["ratios"] == [1.009, 1.017] and actor["nvfp4+keep2"]["peak_GiB"] == 44.961
    assert actor["nvfp4"]["ratios"] == [0.993, 0.998] and actor["bf16"]["peak_GiB"] == 45.728
    assert actor["bf16+keep2"]["ratios"] == [1.013, 1.024]


def test_writes_the_png_and_the_numbers(tmp_path):
    pytest.importorskip("matplotlib")
    out, numbers = tmp_path / "speed.png", tmp_path / "speed.json"
    assert _script().main(["--out", str(out), "--json", str(numbers)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert json.loads(numbers.read_text())["grpo_step"]["2048"]["nvfp4"]["response"] == 2048


def test_a_missing_raw_file_is_named(tmp_path, monkeypatch, capsys):
    mod = _script()
    monkeypatch.setattr(mod, "DECODE_7B", tmp_path / "nowhere.json")
    assert mod.main(["--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "nowhere.json: not found" in err and not (tmp_path / "x.png").exists()
