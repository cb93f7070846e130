"""``qerl eval``: the pass@k estimator, the per-example JSONL and summary, the hf backend on a tiny random
model (left padding, NVFP4 weights, PEFT adapters) and every bad input it refuses before loading a model."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import chat_tokenizer, make_tiny_qwen2, read_safetensors_dir
from qerl_plugin import nvfp4
from qerl_plugin.cli import main
from qerl_plugin.evaluate import EvalConfig, choose_backend, encode_prompts, load_tokenizer, run_eval, summary_path
from qerl_plugin.evaluate_hf import HFBackend, load_model
from qerl_plugin.evaluate_inputs import AdapterInfo, EvalError, Example, check_adapter_fits, inspect_adapter, inspect_model, read_examples
from qerl_plugin.evaluate_metrics import Completion, Scored, pass_at_k, report_ks, summarize

DS = "qerl/synthetic_arithmetic"


# ----------------------------------------------------------------------------------------------------
# Fixtures


def _chat_model(path: Path, **overrides) -> Path:
    """Tiny random Qwen2 with a byte-level tokenizer that has a chat template (258 ids)."""
    make_tiny_qwen2(path, tokenizer=False, vocab_size=320, **overrides)
    chat_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return _chat_model(tmp_path_factory.mktemp("eval") / "bf16")


@pytest.fixture(scope="module")
def nvfp4_model(chat_model, tmp_path_factory) -> Path:
    from qerl_plugin.quantize import quantize_checkpoint

    return quantize_checkpoint(chat_model, tmp_path_factory.mktemp("eval") / "nvfp4", progress=False).dst


def _peft_adapter(base: Path, out: Path, r: int = 8) -> Path:
    """A PEFT LoRA adapter for ``base`` with random A and B (so it changes the outputs)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], init_lora_weights=False)
    get_peft_model(model, cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapter(chat_model, tmp_path_factory) -> Path:
    return _peft_adapter(chat_model, tmp_path_factory.mktemp("eval") / "adapter")


def _rows(n: int = 3) -> list[dict]:
    from verl_ext.data import make_row

    return [make_row(f"What is {i} + {i}?", str(2 * i), data_source=DS, split="test", index=i) for i in range(n)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from verl_ext.data import write_parquet

    return write_parquet(_rows(), tmp_path_factory.mktemp("eval") / "test.parquet")


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class ScriptedBackend:
    """Returns fixed responses: ``greedy[i]`` and ``samples[i]`` (a list of n) for prompt i."""

    name = "scripted"

    def __init__(self, greedy: list[str], samples: list[list[str]] | None = None):
        self.greedy, self.samples, self.calls = greedy, samples, []

    def describe(self) -> str:
        return "scripted"

    def generate(self, prompts, *, n, temperature, max_new_tokens, eos_ids, pad_id, seed=0, desc=""):
        self.calls.append(dict(prompts=prompts, n=n, temperature=temperature, eos_ids=eos_ids))
        texts = [[g] for g in self.greedy] if temperature == 0 else self.samples
        return [[Completion(t, num_tokens=len(t), truncated=t.endswith("...")) for t in row] for row in texts]

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------------------------------
# pass@k


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_brute_force_over_all_subsets(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(outcomes, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
            assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_large_n_and_bad_arguments():
    assert pass_at_k(200, 1, 1) == pytest.approx(1 / 200)
    assert pass_at_k(200, 10, 100) == pytest.approx(1 - math.comb(190, 100) / math.comb(200, 100))
    for bad in ((4, 5, 1), (4, 1, 0), (4, 1, 5)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_reported_ks():
    assert report_ks(1) == [1]
    assert report_ks(8) == [1, 2, 4, 8]
    assert report_ks(6) == [1, 2, 4, 6]
    assert report_ks(16) == [1, 2, 4, 8, 16]


def test_summary_by_data_source():
    def s(ok: bool) -> Scored:
        return Scored(Completion("x", 1, False), score=float(ok), correct=ok, pred="")

    greedy = [s(True), s(False), s(False)]
    samples = [[s(True), s(False)], [s(False), s(False)], [s(True), s(True)]]
    out = summarize(["a", "b", "b"], greedy, samples)
    assert out["greedy"]["pass@1"] == pytest.approx(1 / 3)
    assert out["sampled"]["pass@k"] == {"1": pytest.approx(0.5), "2": pytest.approx(2 / 3)}
    assert out["by_data_source"]["a"]["sampled"]["pass@k"]["2"] == 1.0
    assert out["by_data_source"]["b"]["greedy"]["pass@1"] == 0.0 and out["by_data_source"]["b"]["num_examples"] == 2


# ----------------------------------------------------------------------------------------------------
# The run: JSONL and summary


def test_jsonl_and_summary_with_the_project_reward(chat_model, tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [{**r, "extra_info": r["extra_info"]} for r in _rows(2)])  # ground truths 0, 2
    backend = ScriptedBackend(
        greedy=["#### 0", "#### 5"],
        samples=[["#### 0", "#### 3", "the answer is 0", "no idea..."], ["#### 1", "#### 2", "#### 3", "#### 4"]],
    )
    out = tmp_path / "res" / "results.jsonl"
    cfg = EvalConfig(model=str(chat_model), data=str(data), n=4, out=str(out), progress=False, max_new_tokens=64)
    summary = run_eval(cfg, backend=backend, log=lambda _: None)

    assert [(c["n"], c["temperature"]) for c in backend.calls] == [(1, 0.0), (4, 1.0)]
    tok = load_tokenizer(inspect_model(chat_model))
    text = tok.decode(backend.calls[0]["prompts"][1])
    assert text == "<|im_start|>user\nWhat is 1 + 1? " + _rows(2)[1]["prompt"][0]["content"].split("? ", 1)[1] + "<|im_end|>\n<|im_start|>assistant\n"
    assert backend.calls[0]["eos_ids"] == [tok.convert_tokens_to_ids("<|im_end|>")]

    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2
    r0 = records[0]
    assert r0["row"] == 0 and r0["data_source"] == DS and r0["ground_truth"] == "0"
    assert r0["prompt"] == _rows(2)[0]["prompt"]
    assert r0["greedy"] == {"response": "#### 0", "pred": "0", "score": 1.0, "correct": True, "num_tokens": 6, "truncated": False}
    assert [x["response"] for x in r0["samples"]] == ["#### 0", "#### 3", "the answer is 0", "no idea..."]
    assert [x["correct"] for x in r0["samples"]] == [True, False, True, False]
    assert [x["pred"] for x in r0["samples"]] == ["0", "3", "0", ""]
    assert r0["samples"][3]["truncated"] is True
    assert r0["num_correct"] == 2
    assert r0["pass@k"] == {"1": 0.5, "2": pytest.approx(5 / 6), "4": 1.0}
    r1 = records[1]
    assert r1["greedy"]["correct"] is False and r1["greedy"]["pred"] == "5"
    assert r1["num_correct"] == 1 and r1["pass@k"] == {"1": 0.25, "2": 0.5, "4": 1.0}

    assert summary["greedy"]["pass@1"] == 0.5
    assert summary["sampled"]["pass@k"] == {"1": 0.375, "2": pytest.approx((5 / 6 + 0.5) / 2), "4": 1.0}
    assert summary["sampled"]["truncated"] == 1 / 8
    on_disk = json.loads(summary_path(out).read_text())
    assert summary_path(out).name == "results.summary.json"
    assert on_disk["sampled"] == summary["sampled"] and on_disk["config"]["backend"] == "scripted"
    assert on_disk["config"]["reward"] == "verl_ext.reward:compute_score" and on_disk["config"]["sample_temperature"] == 1.0


def test_custom_reward_and_sampled_pass1_at_a_temperature(chat_model, tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text("def contains(ds, sol, gt, extra=None):\n    return float(gt in sol)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = _jsonl(tmp_path / "d.jsonl", _rows(2))
    backend = ScriptedBackend(greedy=["0", "x"], samples=[["a0"], ["b"]])
    cfg = EvalConfig(model=str(chat_model), data=str(data), temperature=0.7, reward="my_reward:contains", out=str(tmp_path / "o.jsonl"), progress=False)
    summary = run_eval(cfg, backend=backend, log=lambda _: None)
    assert backend.calls[1]["temperature"] == 0.7 and backend.calls[1]["n"] == 1
    assert summary["greedy"]["pass@1"] == 0.5 and summary["sampled"]["pass@k"] == {"1": 0.5}
    first = json.loads((tmp_path / "o.jsonl").read_text().splitlines()[0])
    assert first["greedy"]["pred"] == "" and first["greedy"]["score"] == 1.0


def test_greedy_only_by_default(chat_model, tmp_path):
    backend = ScriptedBackend(greedy=["#### 0", "#### 2", "#### 9"])
    summary = run_eval(
        EvalConfig(model=str(chat_model), data=str(_jsonl(tmp_path / "d.jsonl", _rows(3))), out=str(tmp_path / "o.jsonl"), progress=False),
        backend=backend,
        log=lambda _: None,
    )
    assert len(backend.calls) == 1 and "sampled" not in summary and summary["greedy"]["pass@1"] == pytest.approx(2 / 3)
    assert "samples" not in json.loads((tmp_path / "o.jsonl").read_text().splitlines()[0])


# ----------------------------------------------------------------------------------------------------
# hf backend on a tiny random model


def test_cli_hf_end_to_end(chat_model, data, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    argv = ["eval", str(chat_model), "--data", str(data), "--backend", "hf", "--n", "3", "--max-new-tokens", "5", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "greedy pass@1" in printed and "pass@2 (n=3, T=1)" in printed and "pass@3 (n=3, T=1)" in printed
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 3 and all(len(r["samples"]) == 3 for r in records)
    assert all(0 < s["num_tokens"] <= 5 for r in records for s in r["samples"] + [r["greedy"]])
    summary = json.loads(summary_path(out).read_text())
    assert summary["config"]["backend"] == "hf" and summary["num_examples"] == 3
    # a second run does not overwrite the results unless asked
    assert main(argv) == 1
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert main([*argv, "--overwrite", "--limit", "1"]) == 0
    assert len(out.read_text().splitlines()) == 1


def test_left_padded_batches_match_one_prompt_at_a_time(chat_model):
    info = inspect_model(chat_model)
    tok = load_tokenizer(info)
    examples = [Example(i, DS, [{"role": "user", "content": "x" * (3 * i + 1)}], "0") for i in range(4)]
    prompts = encode_prompts(tok, examples)
    assert len({len(p) for p in prompts}) == 4
    kw = dict(n=1, temperature=0.0, max_new_tokens=6, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
    batched = HFBackend(info, tok, dtype="float32", batch_size=4, progress=False).generate(prompts, **kw)
    single = HFBackend(info, tok, dtype="float32", batch_size=1, progress=False).generate(prompts, **kw)
    assert batched == single


def test_generation_config_defaults_do_not_apply(chat_model, tmp_path):
    """Only --temperature etc. decide decoding, as with vLLM's explicit SamplingParams."""
    import shutil

    tuned = tmp_path / "with_defaults"
    shutil.copytree(chat_model, tuned)
    (tuned / "generation_config.json").write_text(json.dumps({"repetition_penalty": 5.0, "top_k": 1, "do_sample": True}))
    info, tok = inspect_model(chat_model), load_tokenizer(inspect_model(chat_model))
    prompts = encode_prompts(tok, [Example(0, DS, [{"role": "user", "content": "abcabc"}], "0")])
    kw = dict(n=1, temperature=0.0, max_new_tokens=12, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
    plain = HFBackend(info, tok, progress=False).generate(prompts, **kw)
    assert HFBackend(inspect_model(tuned), tok, progress=False).generate(prompts, **kw) == plain


def test_nvfp4_checkpoint_weights_are_the_codec_dequantization(chat_model, nvfp4_model):
    info = inspect_model(nvfp4_model)
    assert info.quantization == "nvfp4a16" and len(info.nvfp4_modules) == 14
    model = load_model(info)
    stored = read_safetensors_dir(nvfp4_model)
    for module in info.nvfp4_modules:
        want = nvfp4.dequantize(
            stored[f"{module}.weight_packed"], stored[f"{module}.weight_scale"], stored[f"{module}.weight_global_scale"], dtype=torch.bfloat16
        )
        assert torch.equal(model.get_parameter(f"{module}.weight"), want), module
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.1.input_layernorm.weight"):
        assert torch.equal(model.get_parameter(name), stored[name]), name

    # --quantization nvfp4 on the BF16 checkpoint: the same weights, bit for bit (q/k/v, gate/up share a scale)
    online = load_model(inspect_model(chat_model), quantization="nvfp4").state_dict()
    offline = model.state_dict()
    assert online.keys() == offline.keys() and all(torch.equal(online[k], offline[k]) for k in offline)
    bf16 = load_model(inspect_model(chat_model)).state_dict()
    changed = {k for k in bf16 if not torch.equal(bf16[k], offline[k])}
    assert changed == {f"{m}.weight" for m in info.nvfp4_modules}


def test_peft_adapter_changes_the_outputs_unmerged(chat_model, nvfp4_model, adapter, data, tmp_path):
    from peft import PeftModel

    info = inspect_model(nvfp4_model)
    tok = load_tokenizer(info)
    ids = torch.tensor([encode_prompts(tok, read_examples(data, 1))[0]])
    base = HFBackend(info, tok, progress=False).model
    tuned = HFBackend(info, tok, adapter=inspect_adapter(adapter), progress=False).model
    assert isinstance(tuned, PeftModel)
    with torch.no_grad():
        diff = (tuned(ids).logits.float() - base(ids).logits.float()).abs().max().item()
    assert diff > 1e-2
    # unmerged: the base weights under the adapter are still the NVFP4 dequantization
    q = "model.layers.0.self_attn.q_proj"
    assert torch.equal(tuned.get_submodule(f"base_model.model.{q}").base_layer.weight, base.get_parameter(f"{q}.weight"))

    out = tmp_path / "a.jsonl"
    argv = ["eval", str(nvfp4_model), "--adapter", str(adapter), "--data", str(data), "--backend", "hf", "--max-new-tokens", "4", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    cfg = json.loads(summary_path(out).read_text())["config"]
    assert cfg["adapter"] == str(adapter.resolve()) and cfg["model_quantization"] == "nvfp4a16"


# ----------------------------------------------------------------------------------------------------
# Bad input, refused before any model is loaded


@pytest.fixture
def no_backend(monkeypatch):
    """Fails the test if a backend would be built (the inputs must be refused first)."""
    import qerl_plugin.evaluate as ev

    def refuse(*a, **k):
        raise AssertionError("a backend was built")

    monkeypatch.setattr(ev, "make_backend", refuse)


def test_adapter_for_another_base_is_refused_naming_the_module(chat_model, data, tmp_path, no_backend, capsys):
    other = _chat_model(tmp_path / "other", intermediate_size=96)
    wrong = _peft_adapter(other, tmp_path / "wrong_adapter")
    with pytest.raises(EvalError) as e:
        run_eval(EvalConfig(model=str(chat_model), data=str(data), adapter=str(wrong), out=str(tmp_path / "o.jsonl")))
    msg = str(e.value)
    assert "made for base" in msg and "model.layers.0.mlp.down_proj is [64, 128]" in msg and "lora_A is [8, 96]" in msg
    assert str(wrong.resolve()) in msg
    argv = ["eval", str(chat_model), "--data", str(data), "--adapter", str(wrong), "--out", str(tmp_path / "o.jsonl")]
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "model.layers.0.mlp.down_proj" in err


def test_adapter_for_a_module_the_base_lacks(chat_model, adapter, data, tmp_path, no_backend):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "deeper"
    shutil.copytree(adapter, bad)
    tensors = load_file(bad / "adapter_model.safetensors")
    tensors = {k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()}
    save_file(tensors, bad / "adapter_model.safetensors")
    with pytest.raises(EvalError, match=r"LoRA weights for module model\.layers\.7\.\S+, which MODEL .* does not have"):
        run_eval(EvalConfig(model=str(chat_model), data=str(data), adapter=str(bad), out=str(tmp_path / "o.jsonl")))


def test_embedding_lora_shapes(chat_model, tmp_path):
    """lora_embedding_A is [r, vocab] and lora_embedding_B [dim, r] for an embedding [vocab, dim]."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(chat_model)
    get_peft_model(model, LoraConfig(r=4, target_modules=["embed_tokens", "o_proj"])).save_pretrained(tmp_path / "emb")
    good = inspect_adapter(tmp_path / "emb")
    assert good.shapes["model.embed_tokens.lora_embedding_A"] == (4, 320)
    info = inspect_model(chat_model)
    check_adapter_fits(good, info)
    bad = AdapterInfo(good.path, good.config, {**good.shapes, "model.embed_tokens.lora_embedding_A": (4, 999)}, good.rank)
    with pytest.raises(EvalError, match=r"module model\.embed_tokens is \[320, 64\] .* lora_embedding_A is \[4, 999\]"):
        check_adapter_fits(bad, info)


def test_not_an_adapter(chat_model, data, tmp_path, no_backend):
    for path, match in (
        (tmp_path / "none", "no such directory"),
        (chat_model, "no adapter_config.json"),
    ):
        with pytest.raises(EvalError, match=match):
            run_eval(EvalConfig(model=str(chat_model), data=str(data), adapter=str(path), out=str(tmp_path / "o.jsonl")))


def test_bad_data_files(chat_model, tmp_path, no_backend):
    def run(data) -> None:
        run_eval(EvalConfig(model=str(chat_model), data=str(data), out=str(tmp_path / "o.jsonl")))

    with pytest.raises(FileNotFoundError, match=r"--data .*missing\.parquet: no such file"):
        run(tmp_path / "missing.parquet")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "1"}]), tmp_path / "raw.parquet")
    with pytest.raises(EvalError, match=r"raw\.parquet: missing column\(s\) \['data_source', 'prompt', 'reward_model'\].*'question'"):
        run(tmp_path / "raw.parquet")
    rows = _rows(2)
    del rows[1]["reward_model"]["ground_truth"]
    with pytest.raises(EvalError, match=r"d\.jsonl row 1: missing \['reward_model\.ground_truth'\]"):
        run(_jsonl(tmp_path / "d.jsonl", rows))
    (tmp_path / "x.jsonl").write_text("not json\n")
    with pytest.raises(EvalError, match=r"x\.jsonl: not valid JSON lines"):
        run(tmp_path / "x.jsonl")
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(EvalError, match=r"e\.jsonl: no rows"):
        run(tmp_path / "e.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(EvalError, match=r"unsupported file type '\.csv'"):
        run(tmp_path / "d.csv")


def test_model_not_a_checkpoint(tmp_path, data, adapter, no_backend):
    def run(model) -> None:
        run_eval(EvalConfig(model=str(model), data=str(data), out=str(tmp_path / "o.jsonl")))

    with pytest.raises(EvalError, match=r"MODEL .*nowhere: no such directory; MODEL must be a local checkpoint directory"):
        run(tmp_path / "nowhere")
    (tmp_path / "f").write_text("x")
    with pytest.raises(EvalError, match="is a file"):
        run(tmp_path / "f")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EvalError, match=r"empty: no config\.json"):
        run(tmp_path / "empty")
    with pytest.raises(EvalError, match=r"is a LoRA adapter; pass its base model as MODEL and the adapter with --adapter"):
        run(adapter)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text("{}")
    with pytest.raises(EvalError, match=r"cfg: no \*\.safetensors weights"):
        run(tmp_path / "cfg")


def test_tokenizer_without_chat_template(tmp_path, data, no_backend):
    plain = make_tiny_qwen2(tmp_path / "plain")  # helpers.tiny_tokenizer: no chat template
    with pytest.raises(EvalError, match=r"plain: its tokenizer has no chat template; add the model's template"):
        run_eval(EvalConfig(model=str(plain), data=str(data), out=str(tmp_path / "o.jsonl")))


def test_bad_options(chat_model, data, tmp_path, no_backend, capsys):
    base = ["eval", str(chat_model), "--data", str(data), "--out", str(tmp_path / "o.jsonl")]
    with pytest.raises(SystemExit) as e:
        main([*base, "--n", "0"])
    assert e.value.code == 2 and "argument --n: must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(EvalError, match="--n 0: the number of samples per prompt must be at least 1"):
        run_eval(EvalConfig(model=str(chat_model), data=str(data), n=0))
    with pytest.raises(EvalError, match="sampling at temperature 0 repeats the greedy answer"):
        run_eval(EvalConfig(model=str(chat_model), data=str(data), n=4, temperature=0.0))
    with pytest.raises(SystemExit) as e:
        main([*base, "--max-num-seqs", "0"])
    assert e.value.code == 2 and "argument --max-num-seqs: must be at least 1, got 0" in capsys.readouterr().err
    assert main([*base, "--reward", "no_such_module:fn"]) == 1
    assert "--reward 'no_such_module:fn' cannot be resolved" in capsys.readouterr().err
    assert main([*base, "--reward", "verl_ext.reward"]) == 1
    assert "expected MODULE:FUNCTION" in capsys.readouterr().err


class _RecordingBackend:
    """Stands in for VLLMBackend (no GPU here): keeps the keywords make_backend hands it."""

    def __init__(self, info, tokenizer, **kwargs):
        self.kwargs = kwargs


def test_vllm_backend_gets_the_engine_options(monkeypatch, chat_model):
    import argparse

    import qerl_plugin.evaluate as ev

    monkeypatch.setitem(ev.BACKENDS, "vllm", (__name__, "_RecordingBackend"))
    cfg = EvalConfig(model=str(chat_model), data="unused", max_num_seqs=1, max_model_len=256, seed=5, max_lora_rank=16)
    got = ev.make_backend("vllm", inspect_model(chat_model), None, None, cfg).kwargs
    assert got["max_num_seqs"] == 1 and got["max_model_len"] == 256 and got["seed"] == 5 and got["max_lora_rank"] == 16
    parser = argparse.ArgumentParser()
    ev.add_arguments(parser)
    assert parser.parse_args(["m", "--data", "d", "--max-num-seqs", "1"]).max_num_seqs == 1


def test_backend_choice_and_no_vllm_or_verl_import(monkeypatch):
    import qerl_plugin.evaluate as ev

    monkeypatch.setattr(ev, "_cuda_available", lambda: False)
    assert choose_backend("auto") == "hf"
    monkeypatch.setattr(ev, "_cuda_available", lambda: True)
    monkeypatch.setattr(ev, "_vllm_imports", lambda: True)
    assert choose_backend("auto") == "vllm"
    monkeypatch.setattr(ev, "_vllm_imports", lambda: False)
    assert choose_backend("auto") == "hf"
    assert choose_backend("hf") == "hf" and choose_backend("vllm") == "vllm"
    code = (
        "import sys, qerl_plugin.evaluate, qerl_plugin.evaluate_hf;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'verl', 'verl_ext', 'vllm_ext')];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    src = Path(ev.__file__).read_text() + Path(ev.__file__).with_name("evaluate_hf.py").read_text()
    assert "import vllm" not in src and "from vllm" not in src and "import verl" not in src and "from verl" not in src
