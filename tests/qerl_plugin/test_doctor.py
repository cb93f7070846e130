"""``qerl doctor`` on this machine (CPU, vLLM and verl installed): real imports, one probe per module."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

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


def _vllm_package() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    return Path(spec.origin).parent


def _marlin_fp4_ops(pkg: Path) -> list[str]:
    """The compiled ops vLLM's Marlin FP4 path calls, read from the installed vLLM's own source.

    ``marlin_utils_fp4.py`` calls ``ops.<name>(...)`` and ``_custom_ops.py`` forwards each to ``torch.ops._C.<name>``.
    """
    fp4 = (pkg / "model_executor/layers/quantization/utils/marlin_utils_fp4.py").read_text()
    custom_ops = (pkg / "_custom_ops.py").read_text()
    names = sorted(set(re.findall(r"\bops\.(\w*marlin\w*)\(", fp4)))
    assert names, "vLLM's marlin_utils_fp4.py no longer calls any ops.*marlin* function"
    for name in names:
        assert f"torch.ops._C.{name}(" in custom_ops, f"vllm._custom_ops.{name} no longer calls torch.ops._C.{name}"
    return names


def _compiled_libraries(pkg: Path) -> dict[str, Path]:
    """Every compiled extension module shipped at the top of the installed vllm package, by module name."""
    libs = {}
    for path in sorted(pkg.iterdir()):
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:  # most specific first: ".abi3.so" before ".so"
            if path.name.endswith(suffix):
                libs["vllm." + path.name[: -len(suffix)]] = path
                break
    return libs


def _registers(data: bytes, op: str) -> bool:
    """The binary holds the op's schema ``op(...`` as TORCH_LIBRARY's ``ops.def`` writes it (``moe_wna16_marlin_gemm(``
    does not count for ``marlin_gemm``)."""
    needle = op.encode() + b"("
    i = data.find(needle)
    while i != -1:
        if i == 0 or not (chr(data[i - 1]).isalnum() or data[i - 1] == ord("_")):
            return True
        i = data.find(needle, i + 1)
    return False


_LOAD_LIBS = """
import importlib, json, sys
import torch
ops = json.loads(sys.argv[1])
out = {}
for lib in sys.argv[2:]:
    try:
        importlib.import_module(lib)
    except Exception as exc:
        out[lib] = {"error": type(exc).__name__ + ": " + str(exc)}
    else:
        out[lib] = {"ops": {n: hasattr(torch.ops._C, n) for n in ops}}
print(json.dumps(out))
"""


def test_marlin_op_check_matches_the_installed_vllm(json_report):
    """The Marlin check against the installed vLLM itself, not against doctor's constants.

    The ops come from vLLM's Marlin FP4 source, the libraries from the files in the vllm package whose binaries
    register those ops, and whether they load from a fresh interpreter. (A test built from doctor's own library
    list would agree with a doctor that imports the wrong library: vLLM 0.24's CUDA wheel registers
    ``torch.ops._C`` from ``vllm._C_stable_libtorch`` and ships no ``vllm._C``.)
    """
    pkg = _vllm_package()
    ops = _marlin_fp4_ops(pkg)
    defining = []
    for lib, path in _compiled_libraries(pkg).items():
        data = path.read_bytes()
        if all(_registers(data, op) for op in ops):
            defining.append(lib)
    check = json_report["checks"]["Marlin FP4 op"]
    if not defining:  # e.g. a CPU build of vLLM: nothing to load, the check must say missing
        assert not check["ok"], check
        return
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_LIBS, json.dumps(ops), *defining],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    have = any("ops" in r and all(r["ops"].values()) for r in loaded.values())
    assert check["ok"] == have, (check, loaded)
    if not have:  # doctor must have tried the library that holds the op and say why it did not load
        for lib, r in loaded.items():
            if "error" in r:
                assert lib in check["detail"], (lib, r["error"], check["detail"])


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
