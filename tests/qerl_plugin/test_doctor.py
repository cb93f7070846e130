"""``qerl doctor`` on this machine (CPU, vLLM and verl installed): real imports, one probe per module."""

from __future__ import annotations

import json

import pytest
import torch

from qerl_plugin import doctor
from qerl_plugin.cli import main


@pytest.fixture(scope="module")
def probe() -> dict:
    return doctor.run_probe()


@pytest.fixture(scope="module")
def json_report(probe) -> dict:
    data = doctor.report(probe=probe)
    json.dumps(data)  # plain data
    return data


def test_cli_json_output_parses(capsys, monkeypatch, probe):
    monkeypatch.setattr(doctor, "run_probe", lambda *a, **k: probe)  # reuse this module's real probe (15-30 s each)
    rc = main(["doctor", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert set(data["jobs"]) == {"quantize", "rollout", "train", "serve"}
    assert rc == data["exit_code"] == (0 if data["jobs"]["quantize"]["ready"] else 1)


def test_quantize_is_ready_here(json_report):
    q = json_report["jobs"]["quantize"]
    assert q["ready"], q["missing"]
    assert json_report["exit_code"] == 0


def test_versions_and_pins_are_reported(json_report):
    from importlib.metadata import version

    checks = json_report["checks"]
    for dist, pin in doctor.PINS.items():
        assert checks[dist]["ok"]
        assert checks[dist]["detail"].startswith(version(dist)) and f"(pin {pin})" in checks[dist]["detail"]
        assert bool(checks[dist]["warnings"]) == (version(dist).split("+")[0] != pin)
    assert checks["python"]["ok"]


def test_both_entry_points_are_found_and_load(json_report):
    checks = json_report["checks"]
    assert checks["vllm entry point"]["ok"] and checks["vllm entry point"]["detail"] == "-> vllm_ext:register"
    assert checks["verl entry point"]["ok"] and checks["verl entry point"]["detail"] == "-> verl_ext"
    assert checks["vllm import"]["ok"], checks["vllm import"]
    assert checks["verl import"]["ok"], checks["verl import"]
    assert checks["vllm plugin loads"]["ok"], checks["vllm plugin loads"]
    assert checks["verl plugin loads"]["ok"], checks["verl plugin loads"]
    assert "verl's loader picked it up" in checks["verl plugin loads"]["detail"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-machine verdict")
def test_gpu_jobs_are_not_ready_without_cuda(json_report, capsys, monkeypatch, probe):
    for job in ("rollout", "train", "serve"):
        s = json_report["jobs"][job]
        assert not s["ready"]
        assert any(m.startswith("CUDA GPU:") for m in s["missing"]), s["missing"]
        assert not any(m.startswith("GPU capability") for m in s["missing"])  # said once, as "CUDA GPU"
        assert any("NVIDIA GPU" in f for f in s["fixes"])
    monkeypatch.setattr(doctor, "run_probe", lambda *a, **k: probe)
    assert main(["doctor", "--job", "rollout"]) == 1
    out = capsys.readouterr().out
    assert "rollout   NOT READY" in out and "missing: CUDA GPU" in out and "train" not in out.split("jobs")[1]
    assert main(["doctor", "--job", "quantize"]) == 0


def test_marlin_op_check_matches_torch_ops(json_report):
    """The report agrees with vLLM's compiled ops in this environment (absent in a CPU-only vLLM install)."""
    pytest.importorskip("vllm")
    import importlib

    have = False
    for lib in doctor.VLLM_OPS_LIBS:
        try:
            importlib.import_module(lib)
        except ImportError:
            continue
        have = all(hasattr(torch.ops._C, n) for n in doctor.MARLIN_OPS)
        break
    assert json_report["checks"]["Marlin FP4 op"]["ok"] == have


def test_failed_probe_blocks_gpu_jobs_but_not_quantize():
    data = doctor.report(["rollout", "quantize"], probe={"error": "importing vLLM/verl took more than 1 s"})
    assert data["jobs"]["quantize"]["ready"]
    assert not data["jobs"]["rollout"]["ready"]
    assert any("vllm import: not checked: importing vLLM/verl took more than 1 s" == m for m in data["jobs"]["rollout"]["missing"])
    assert data["exit_code"] == 1
    text = doctor.format_report(data)
    assert "quantize  ready" in text and "rollout   NOT READY" in text


def test_probe_reports_a_broken_plugin(monkeypatch):
    """An entry point that fails to import is reported with its error (verl itself would hide it at DEBUG)."""
    probe = {"vllm": {"ok": True, "version": "0.24.0"}, "marlin": {"ok": True, "ops": {}, "fp4_marlin_supported": True},
             "vllm_plugin": {"ok": False, "error": "ImportError: cannot import name 'x'"},
             "verl": {"ok": True, "version": "0.9.1"}, "verl_plugin": {"ok": True, "loaded_by_verl": False}}  # fmt: skip
    data = doctor.report(["train"], probe=probe)
    assert "vllm plugin loads: ImportError: cannot import name 'x'" in data["jobs"]["train"]["missing"]
    assert any("verl did not import verl_ext" in w for w in data["jobs"]["train"]["warnings"])
