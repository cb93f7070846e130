"""``qerl quantize`` as a command: the console script, errors as one line, --debug, a missing DST."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qerl_plugin.cli import main
from helpers import file_hashes, read_safetensors_dir


def _qerl_exe() -> str:
    exe = Path(sys.executable).parent / "qerl"
    return str(exe) if exe.exists() else shutil.which("qerl") or pytest.skip("the qerl console script is not installed")


def test_console_script_end_to_end(tiny_qwen2_dir, quantized, tmp_path):
    dst = tmp_path / "via_script"
    r = subprocess.run([_qerl_exe(), "quantize", str(tiny_qwen2_dir), str(dst)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and "14 Linear weights in NVFP4" in r.stdout
    a, b = read_safetensors_dir(dst), read_safetensors_dir(quantized)
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    bad = subprocess.run([_qerl_exe(), "quantize", str(tmp_path / "nowhere"), str(tmp_path / "x")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qerl quantize: error: SRC") and "Traceback" not in bad.stderr


def test_defaults_write_the_shared_checkpoint_and_leave_src_alone(tiny_qwen2_dir, quantized, tmp_path, run_qerl):
    """The command with its defaults writes, file for file, the checkpoint the other tests use (``quantized``)."""
    before = file_hashes(tiny_qwen2_dir)
    assert run_qerl(tiny_qwen2_dir, tmp_path / "nvfp4") == 0
    assert file_hashes(tiny_qwen2_dir) == before, "SRC was modified"
    assert file_hashes(tmp_path / "nvfp4") == file_hashes(quantized)


def test_debug_shows_the_traceback(tmp_path, capsys):
    assert main(["quantize", str(tmp_path / "nowhere"), str(tmp_path / "x"), "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "QuantizeError" in err


def test_missing_dst_without_dry_run(tiny_qwen2_dir, capsys):
    assert main(["quantize", str(tiny_qwen2_dir)]) == 1
    assert "DST is missing" in capsys.readouterr().err
