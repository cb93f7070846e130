"""``qerl quantize`` writes the same NVFP4 bytes as llmcompressor's ``oneshot`` with the NVFP4A16 scheme.

llmcompressor 0.14.0.1 cannot be installed next to our stack (it pins compressed-tensors 0.19.0,
transformers 5.15-5.17), so it runs in its own venv, given by ``QERL_LLMC_PYTHON``::

    scripts/llmcompressor_equivalence/setup_venv.sh /tmp/llmc-venv
    QERL_LLMC_PYTHON=/tmp/llmc-venv/bin/python python -m pytest tests/qerl_plugin/test_llmcompressor_equivalence.py

Without it the llmcompressor comparison is skipped; the comparer's own tests and the CLI-vs-codec check
still run. See docs/llmcompressor-equivalence.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts" / "llmcompressor_equivalence"
LLMC_ENV = "QERL_LLMC_PYTHON"
SKIP_REASON = (
    f"{LLMC_ENV} is not set: create the llmcompressor venv with "
    "`scripts/llmcompressor_equivalence/setup_venv.sh VENV` and set "
    f"{LLMC_ENV}=VENV/bin/python to compare against llmcompressor 0.14.0.1"
)
# (name, build_tiny_model kwargs): the planted edge cases in bf16 in one file, and in fp16 over 5 shards
CASES = {
    "bf16": dict(seed=0, dtype="bfloat16"),
    "fp16-sharded": dict(seed=3, dtype="float16", max_shard_size="200KB"),
}
NUM_LINEAR = 14  # 2 layers x (q, k, v, o, gate, up, down)


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"llmc_equivalence_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses need the module registered
    spec.loader.exec_module(module)
    return module


compare = _load_script("compare")
tiny_model = _load_script("tiny_model")
codec_reference = _load_script("codec_reference")


def _qerl_quantize(src: Path, dst: Path) -> None:
    """``qerl quantize SRC DST`` through the CLI's entry point (the function the ``qerl`` script calls)."""
    from qerl_plugin.cli import main

    rc = main(["quantize", str(src), str(dst), "--quiet"])
    assert rc == 0, f"qerl quantize {src} {dst} exited with {rc}"


def _start_llmcompressor(python: str, src: Path, dst: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": ""}
    return subprocess.Popen(
        [python, str(SCRIPTS / "run_llmcompressor.py"), str(src), str(dst)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=str(dst.parent),
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Per case: the source model and its quantizations by the CLI, the codec and (if set up) llmcompressor.

    llmcompressor runs in a subprocess while qerl quantizes in this one.
    """
    root = tmp_path_factory.mktemp("llmc_equivalence")
    llmc_python = os.environ.get(LLMC_ENV)
    out: dict[str, dict] = {}
    procs = {}
    for case, kwargs in CASES.items():
        src = tiny_model.build_tiny_model(root / case / "src", **kwargs)
        out[case] = {"src": src, "llmc": None, "llmc_error": None}
        if llmc_python:
            if not os.access(llmc_python, os.X_OK):
                out[case]["llmc_error"] = (
                    f"{LLMC_ENV}={llmc_python} is not an executable python; point it at VENV/bin/python of "
                    "a venv made by scripts/llmcompressor_equivalence/setup_venv.sh VENV"
                )
            else:
                procs[case] = _start_llmcompressor(llmc_python, src, root / case / "llmc")
    for case in CASES:
        src = out[case]["src"]
        _qerl_quantize(src, root / case / "qerl")
        out[case]["qerl"] = root / case / "qerl"
        assert codec_reference.main([str(src), str(root / case / "codec")]) == 0
        out[case]["codec"] = root / case / "codec"
    for case, proc in procs.items():
        try:
            log, _ = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            log, _ = proc.communicate()
            log = "timed out after 600 s\n" + log
        if proc.returncode == 0:
            out[case]["llmc"] = root / case / "llmc"
            out[case]["llmc_log"] = log
        else:
            out[case]["llmc_error"] = f"run_llmcompressor.py exited with {proc.returncode}:\n{log[-4000:]}"
    return out


# ---------------------------------------------------------------------------------------------------------
# the comparison itself


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_qerl_quantize_matches_llmcompressor(runs, case):
    if not os.environ.get(LLMC_ENV):
        pytest.skip(SKIP_REASON)
    run = runs[case]
    if run["llmc_error"]:
        pytest.fail(run["llmc_error"])
    report = compare.compare_checkpoints(run["qerl"], run["llmc"])
    print(report.table())
    assert len(report.modules) == NUM_LINEAR, report.table()
    assert report.others, "no unquantized tensors were compared"
    assert report.ok, "qerl quantize and llmcompressor differ:\n" + report.table()
    # the only config differences allowed are ones vLLM never reads (e.g. the writer's version)
    assert {d.key.rsplit(".", 1)[-1] for d in report.config} <= compare.COSMETIC_QCONFIG_KEYS | {
        "transformers_version"
    }, report.table()
    versions = json.loads((run["llmc"] / "llmcompressor_versions.json").read_text())
    print("llmcompressor side:", versions)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_llmcompressor_config_loads_with_our_compressed_tensors(runs, case):
    """vLLM validates quantization_config with our compressed-tensors (0.17); 0.19's output must pass."""
    if not os.environ.get(LLMC_ENV):
        pytest.skip(SKIP_REASON)
    run = runs[case]
    if run["llmc_error"]:
        pytest.fail(run["llmc_error"])
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStrategy

    qc = json.loads((run["llmc"] / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    (group,) = parsed.config_groups.values()
    assert parsed.format == "nvfp4-pack-quantized" and parsed.ignore == ["lm_head"]
    assert group.input_activations is None  # A16: vLLM picks CompressedTensorsW4A4Fp4(use_a16=True)
    w = group.weights
    assert (w.num_bits, w.type, w.strategy, w.group_size, w.symmetric) == (
        4,
        "float",
        QuantizationStrategy.TENSOR_GROUP,
        16,
        True,
    )


def test_cli_matches_codec_reference(runs):
    """The CLI writes exactly what the codec computes layer by layer (q/k/v and gate/up fused)."""
    for case, run in runs.items():
        report = compare.compare_checkpoints(run["qerl"], run["codec"])
        assert not report.tensor_failures, f"{case}:\n" + report.table()
        assert len(report.modules) == NUM_LINEAR


def test_tiny_model_plants_the_edge_cases(runs):
    """The source model really holds the outlier, zero groups, -0.0, ties, saturation, the all-zero layer."""
    from qerl_plugin import nvfp4

    w = load_file(str(runs["bf16"]["src"] / "model.safetensors"))
    out = load_file(str(runs["bf16"]["codec"] / "model.safetensors"))
    q = w["model.layers.0.self_attn.q_proj.weight"]
    k = w["model.layers.0.self_attn.k_proj.weight"]
    o = w["model.layers.0.self_attn.o_proj.weight"]
    assert k.abs().max().item() == 8.0 and q.abs().max() < 1
    assert q[1, :16].abs().max() == 0
    assert torch.signbit(q[7, :16]).all() and (q[7, :16] == 0).all()
    scale = out["model.layers.0.self_attn.q_proj.weight_scale"].float()
    assert scale[1, 0] == scale[5, 2] == scale[7, 0] == 0.125  # zero / underflowing FP8 scales replaced
    assert 0 < scale[4, 1] < 2**-6  # subnormal FP8 scale
    up = "model.layers.0.mlp.up_proj"
    assert out[f"{up}.weight_scale"][7, 0].float() == 448  # computed 451.5, clamped
    assert (out[f"{up}.weight_packed"][7, 3] >> 4) == 7  # column 7 saturates at E2M1 6
    assert torch.equal(out[f"{up}.weight_global_scale"], out["model.layers.0.mlp.gate_proj.weight_global_scale"])
    assert torch.all(w["model.layers.1.mlp.down_proj.weight"] == 0)
    gs = nvfp4.global_scale(o)
    assert gs.item() == 448 / tiny_model.TIE_C  # so that every planted tie lands exactly on a midpoint
    step = nvfp4.group_scales(o, gs)[2, 1] / gs
    ratios = (o[2, 16:32].float() / step).abs()
    assert set(ratios.tolist()) >= {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0}


def test_tiny_model_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        tiny_model.build_tiny_model(tmp_path / "a", dtype="int8")
    with pytest.raises(ValueError, match="multiple of 64"):
        tiny_model.build_tiny_model(tmp_path / "b", hidden_size=100)
    src = tiny_model.build_tiny_model(tmp_path / "c")
    with pytest.raises(FileExistsError, match="already holds a checkpoint"):
        tiny_model.build_tiny_model(src)


# ---------------------------------------------------------------------------------------------------------
# the comparer finds every kind of difference


def _mutated_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    (f,) = sorted(dst.glob("*.safetensors"))
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})
    return dst


def test_compare_reports_identical_copy_as_ok(runs, tmp_path):
    codec = runs["bf16"]["codec"]
    copy = shutil.copytree(codec, tmp_path / "copy")
    report = compare.compare_checkpoints(codec, copy)
    assert report.ok and not report.config and len(report.modules) == NUM_LINEAR
    assert "RESULT: IDENTICAL" in report.table()
    assert compare.main([str(codec), str(copy)]) == 0


def test_compare_flags_tensor_differences(runs, tmp_path):
    codec = runs["bf16"]["codec"]
    q = "model.layers.0.self_attn.q_proj"

    def edit(t):
        t[f"{q}.weight_packed"][3, 2] ^= 0x10  # one code in the high nibble: column 5
        s = t[f"{q}.weight_scale"].view(torch.uint8)
        s[0, 1] += 1  # next FP8 value up
        t["model.layers.1.mlp.up_proj.weight_global_scale"] *= 2
        t["model.norm.weight"] = t["model.norm.weight"].float()
        del t["model.layers.0.input_layernorm.weight"]

    other = _mutated_copy(codec, tmp_path / "mutated", edit)
    report = compare.compare_checkpoints(codec, other)
    assert not report.ok
    verdicts = report.modules[q]
    assert verdicts["weight_packed"].startswith("1/")
    assert "first [3,5]" in verdicts["weight_packed"] and "group 0" in verdicts["weight_packed"]
    assert verdicts["weight_scale"].startswith("1/") and "first [0, 1]" in verdicts["weight_scale"]
    assert verdicts["weight_global_scale"] == "equal"
    assert report.modules["model.layers.1.mlp.up_proj"]["weight_global_scale"].startswith("1/1 values differ")
    assert report.others["model.norm.weight"] == "dtype torch.bfloat16 vs torch.float32"
    assert report.others["model.layers.0.input_layernorm.weight"] == "missing in B"
    table = report.table()
    assert "RESULT: DIFFERENT" in table and f"{q}.weight_packed" in table
    assert compare.main([str(codec), str(other)]) == 1


def test_compare_classifies_config_differences(runs, tmp_path):
    codec = runs["bf16"]["codec"]
    other = shutil.copytree(codec, tmp_path / "cfg")
    cfg = json.loads((other / "config.json").read_text())
    cfg["quantization_config"]["version"] = "9.9.9"
    cfg["quantization_config"]["sparsity_config"] = {}
    cfg["transformers_version"] = "0.0.1"
    (other / "config.json").write_text(json.dumps(cfg))
    report = compare.compare_checkpoints(codec, other)
    assert report.ok and {d.kind for d in report.config} == {"cosmetic"} and len(report.config) == 3

    group = next(iter(cfg["quantization_config"]["config_groups"].values()))
    group["weights"]["group_size"] = 32
    cfg["quantization_config"]["ignore"] = ["lm_head", "model.layers.0.mlp.down_proj"]
    (other / "config.json").write_text(json.dumps(cfg))
    report = compare.compare_checkpoints(codec, other)
    assert not report.ok
    keys = {d.key for d in report.config_failures}
    assert keys == {"quantization_config.config_groups.Linear.weights.group_size", "quantization_config.ignore"}


def test_compare_rejects_a_directory_without_checkpoint(runs, tmp_path, capsys):
    assert compare.main([str(runs["bf16"]["codec"]), str(tmp_path)]) == 2
    assert "holds no *.safetensors files" in capsys.readouterr().err
