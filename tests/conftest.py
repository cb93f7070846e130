"""Shared fixtures. Model builders live in ``tests/helpers.py``: ``from helpers import make_tiny_qwen2``.

Import it as ``helpers``, not ``tests.helpers``: verl 0.9.1 (and transferqueue) install a top-level
``tests`` package into site-packages, which shadows this directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent
if str(_TESTS) not in sys.path:  # so that ``import helpers`` works under any pytest import mode
    sys.path.insert(0, str(_TESTS))

from helpers import make_tiny_qwen2  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Skip ``@pytest.mark.gpu`` tests, with the reason, when there is no CUDA device."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """A tiny bf16 Qwen2 checkpoint (one safetensors file, tokenizer included). Read-only: copy to modify."""
    return make_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2") / "model")


@pytest.fixture(scope="session")
def tiny_qwen2_nvfp4_dir(tiny_qwen2_dir, tmp_path_factory) -> Path:
    """``qerl quantize`` of ``tiny_qwen2_dir`` (NVFP4A16, compressed-tensors). Read-only: copy to modify."""
    from qerl_plugin.quantize import quantize_checkpoint

    dst = tmp_path_factory.mktemp("tiny_qwen2_nvfp4") / "model"
    return quantize_checkpoint(tiny_qwen2_dir, dst, progress=False, log=lambda m: None).dst


@pytest.fixture(scope="session")
def tiny_qwen2_sharded_dir(tmp_path_factory) -> Path:
    """The same weights as ``tiny_qwen2_dir`` saved in ~6 kB shards (q/k/v land in different files)."""
    return make_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_sharded") / "model", max_shard_size="6KB")
