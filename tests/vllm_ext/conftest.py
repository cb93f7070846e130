"""Fixtures shared by the vllm_ext tests: the bench's rollout arguments, and a current vLLM config and an
attention backend for building ``nvfp4`` layers and models on CPU. Puts this folder on ``sys.path`` so that
tests can ``from nvfp4_layers import ...`` (the layer and model helpers)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import pytest

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))


@pytest.fixture(scope="session")
def rollout_args() -> Callable[..., argparse.Namespace]:
    """``rollout_args("--shape", "7B", ...)``: ``qerl bench rollout`` options parsed by the bench's own parser."""
    from vllm_ext import bench

    def parse(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        return parser.parse_args(["rollout", *argv])

    return parse


@pytest.fixture(scope="module")
def cpu_config():
    """A current vLLM config for building layers, with vLLM's single-rank process groups (gloo) up."""
    import torch
    from nvfp4_layers import free_port
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(cfg):
        if not torch.distributed.is_initialized():
            init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
                local_rank=0,
                backend="gloo",
            )
        if not model_parallel_is_initialized():
            initialize_model_parallel(1, 1)
    return cfg


@pytest.fixture
def cpu_attention(monkeypatch):
    """vLLM's unspecified CPU platform has no attention backend; name vLLM's CPU one so models can be built."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(
        type(current_platform),
        "get_attn_backend_cls",
        classmethod(lambda cls, *a, **k: "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"),
    )
