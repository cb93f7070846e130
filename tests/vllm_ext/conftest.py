"""Fixtures shared by the vllm_ext tests: the bench's rollout arguments."""

from __future__ import annotations

import argparse
from typing import Callable

import pytest


@pytest.fixture(scope="session")
def rollout_args() -> Callable[..., argparse.Namespace]:
    """``rollout_args("--shape", "7B", ...)``: ``qerl bench rollout`` options parsed by the bench's own parser."""
    from vllm_ext import bench

    def parse(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        return parser.parse_args(["rollout", *argv])

    return parse
