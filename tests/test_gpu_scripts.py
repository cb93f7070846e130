"""The GPU scripts' CPU-side logic: the entropy-sweep verdict, and that every `session.sh` step the docs name exists.

The scripts themselves run on the H100 (docs/benchmarks.md, docs/verl-h100.md); what is checked here is what
decides their verdicts and what a reader would type from the docs.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "scripts" / "gpu"


@pytest.fixture(scope="module")
def check_aqn_vllm():
    """The script as a module, imported without leaving its os.environ defaults (VLLM_* switches meant for its
    own GPU process) or scripts/gpu on sys.path behind for the rest of the test session."""
    env, path = dict(os.environ), list(sys.path)
    sys.path.insert(0, str(GPU))
    try:
        return importlib.import_module("check_aqn_vllm")
    finally:
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path


def _sweep(means_ses):
    return [{"sigma": s, "mean": m, "se": se, "top1_changed_frac": 0.0} for s, (m, se) in means_ses.items()]


def test_entropy_verdict_passes_a_rising_sweep_with_a_flat_step(check_aqn_vllm):
    # the float32 sweep measured on the H100 (second session)
    ok, detail = check_aqn_vllm.entropy_verdict(_sweep({
        0.0: (0.5708205636511734, 0.0), 1e-4: (0.5708208336212515, 2.99e-8),
        1e-3: (0.5708208934942253, 8.10e-8), 1e-2: (0.5708355626813281, 3.33e-7)}))
    assert ok
    assert [s["verdict"] for s in detail["steps"]] == ["up", "flat", "up"]
    assert detail["strictly_increasing_means"]


def test_entropy_verdict_fails_a_dip_beyond_two_se(check_aqn_vllm):
    # the bf16 sweep measured on the H100: 1e-4 sits 4 SE below sigma = 0
    ok, detail = check_aqn_vllm.entropy_verdict(_sweep({
        0.0: (0.570807, 0.0), 1e-4: (0.5707861, 4.7e-6), 1e-3: (0.5707840, 5.6e-6), 1e-2: (0.5708696, 1.2e-5)}))
    assert not ok
    assert detail["steps"][0]["verdict"] == "down"


def test_entropy_verdict_needs_the_largest_sigma_up(check_aqn_vllm):
    ok, _ = check_aqn_vllm.entropy_verdict(_sweep({0.0: (1.0, 0.0), 1e-2: (1.0 + 1e-9, 1e-6)}))
    assert not ok


def test_entropy_verdict_sorts_by_sigma(check_aqn_vllm):
    ok, detail = check_aqn_vllm.entropy_verdict(_sweep({1e-2: (2.0, 0.01), 0.0: (1.0, 0.0)}))
    assert ok and detail["steps"][0]["from"] == 0.0


def _session_steps() -> set[str]:
    text = (GPU / "session.sh").read_text()
    return set(re.findall(r"^\s+([a-z0-9_]+)\)", text, flags=re.M))


@pytest.mark.parametrize("doc", ["docs/benchmarks.md", "docs/verl-h100.md", "README.md"])
def test_every_session_step_named_in_the_docs_exists(doc):
    steps = _session_steps()
    assert {"install", "aqn", "entropy32", "bench32b", "verl_resume8a", "verl_resume8b"} <= steps
    text = (ROOT / doc).read_text()
    named = set()
    for line in re.findall(r"session\.sh ([a-z0-9_ ]+)", text):  # `bash scripts/gpu/session.sh a b`
        named.update(line.split())
    for group in re.findall(r"\b[Ss]teps? ((?:`[a-z0-9_]+`(?:,? and |, | then |\s*))+)", text):  # Step `a`, Steps `a`, `b`
        named.update(re.findall(r"`([a-z0-9_]+)`", group))
    missing = sorted(named - steps)
    assert not missing, f"{doc} names session.sh steps that scripts/gpu/session.sh does not have: {missing}"
