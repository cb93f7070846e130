"""Fixtures shared by the ``qerl quantize`` tests (test_source, test_plan, test_shards, test_quantize,
test_quantize_cli): the tiny Qwen2's NVFP4 checkpoint, and helpers to run, copy, edit and refuse."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import pytest
from safetensors.torch import load_file, save_file

from helpers import file_hashes


def _run_qerl(*args) -> int:
    """``qerl quantize ARGS --quiet`` through the CLI's entry point; returns the exit code."""
    from qerl_plugin.cli import main

    return main(["quantize", *map(str, args), "--quiet"])


@pytest.fixture(scope="session")
def run_qerl() -> Callable[..., int]:
    return _run_qerl


@pytest.fixture(scope="session")
def quantized(tiny_qwen2_nvfp4_dir) -> Path:
    """``qerl quantize`` of ``tiny_qwen2_dir`` with the defaults (tests/conftest.py's ``tiny_qwen2_nvfp4_dir``;
    test_quantize_cli checks that the command writes the same). Read-only: copy to modify."""
    return tiny_qwen2_nvfp4_dir


@pytest.fixture(scope="session")
def copy_model() -> Callable[..., Path]:
    """``copy_model(src, tmp_path, name="src")``: a copy of the model directory ``src`` to modify."""

    def copy(src: Path, tmp_path: Path, name: str = "src") -> Path:
        dst = tmp_path / name
        shutil.copytree(src, dst)
        return dst

    return copy


@pytest.fixture(scope="session")
def edit_tensor() -> Callable[..., None]:
    """``edit_tensor(path, name, fn)``: replace tensor ``name`` of the safetensors file by ``fn(copy)``."""

    def edit(path: Path, name: str, fn) -> None:
        tensors = load_file(str(path))
        tensors[name] = fn(tensors[name].clone())
        save_file(tensors, str(path), metadata={"format": "pt"})

    return edit


@pytest.fixture(scope="session")
def assert_refused() -> Callable[..., None]:
    """``assert_refused(src, tmp_path, match, **kwargs)``: ``quantize_checkpoint(src, tmp_path / "dst",
    **kwargs)`` raises QuantizeError matching ``match``, writes no DST, leaves no temporary directory
    and does not touch SRC."""
    from qerl_plugin.quantize import QuantizeError, quantize_checkpoint

    def refused(src: Path, tmp_path: Path, match: str, **kwargs) -> None:
        dst = tmp_path / "dst"
        before = file_hashes(src)
        with pytest.raises(QuantizeError, match=match):
            quantize_checkpoint(src, dst, progress=False, **kwargs)
        assert not dst.exists(), "DST written despite the error"
        assert not [p for p in tmp_path.iterdir() if "qerl" in p.name], "temporary directory left behind"
        assert file_hashes(src) == before

    return refused
